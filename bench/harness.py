"""What case modules use: timing, the metric definitions of targets.md, `Record` / `Case`, and the
per-rank `BenchContext`. The runner (bench/runner.py) drives the cases; see bench/__init__.py for the
case-module protocol.

Timing method (bench/NOTES.md): warm-up calls first; then, per timed call, an L2 flush (a write of a
buffer >= 2x the L2 size) and a small NCCL all-reduce that lines the ranks' streams up, both outside
the timed region; CUDA events around the call alone; the figure is the average over the calls.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

# ---------------------------------------------------------------------------------------------
# Metric definitions (targets.md "Metric definitions"); every case module uses these.
# ---------------------------------------------------------------------------------------------
FP8_BLOCK = 128


def normal_bytes(rows: int, hidden: int, fp8: bool = False) -> int:
    """Bytes of `rows` received rows in normal mode: BF16 rows * H * 2; FP8 counts the e4m3 payload
    plus one float32 scale per 128 channels, i.e. rows * H * 2 * (1 + 4/128) / 2. Combine counts the
    same bytes as its dispatch."""
    if fp8:
        return rows * hidden + rows * (hidden // FP8_BLOCK) * 4
    return rows * hidden * 2


def low_latency_dispatch_bytes(messages: int, hidden: int, fp8: bool = True) -> int:
    """Per (token, expert) message, self included: FP8 H + 4*H/128 + 16 bytes (payload, scales,
    metadata). BF16 is not defined in targets.md; counted the same way, 2*H + 16."""
    per_message = hidden + 4 * (hidden // FP8_BLOCK) + 16 if fp8 else 2 * hidden + 16
    return messages * per_message


def low_latency_combine_bytes(messages: int, hidden: int) -> int:
    """Per (token, expert) message, self included: 2*H bytes (BF16)."""
    return messages * 2 * hidden


def buffer_bytes(buffer) -> Dict[str, int]:
    """The sizes a Buffer was built with, for a record's setting: an internode record at each N
    then shows the memory the calls ran in (fixed, whatever N)."""
    return dict(num_rdma_bytes=int(buffer.num_rdma_bytes), num_nvl_bytes=int(buffer.num_nvl_bytes))


def gbps(nbytes: float, us: Optional[float]) -> Optional[float]:
    """GB/s with GB = 1e9 bytes."""
    if not us or us <= 0:
        return None
    return nbytes / us / 1e3


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Per-call times of one measurement, in microseconds."""
    times_us: List[float]
    host_hidden: bool = False   # time_stats(hide_host=True): GPU time, the host's issue time not in it

    @property
    def mean_us(self) -> float:
        return statistics.fmean(self.times_us)

    def summary(self) -> Dict[str, float]:
        t = self.times_us
        return {"mean_us": statistics.fmean(t), "median_us": statistics.median(t),
                "min_us": min(t), "max_us": max(t), "iters": len(t), "host_hidden": self.host_hidden}


_FLUSH_BUFFERS: Dict[int, torch.Tensor] = {}


def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer of at least twice the device's L2 (and >= 64 MiB); writing it evicts the L2."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FLUSH_BUFFERS:
        l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 50 << 20
        nbytes = max(2 * l2, 64 << 20)
        _FLUSH_BUFFERS[index] = torch.empty(nbytes // 4, dtype=torch.int32, device=f"cuda:{index}")
    return _FLUSH_BUFFERS[index]


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


# GPU clock cycles of the lead that time_stats(hide_host=True) queues before a call's start event
# (~0.5 ms at H100 / H200 clocks): longer than any call's host issue time.
HOST_LEAD_CYCLES = 1 << 20


def time_stats(fn: Callable[[], object], warmup: int = 5, iters: int = 20, flush_l2: bool = True,
               sync: Optional[Callable[[], None]] = None,
               device: Optional[torch.device] = None, hide_host: bool = False) -> Timing:
    """Time `fn` per call. On a GPU: CUDA events around each call on the current stream, an L2 flush
    and `sync` (e.g. a cross-rank alignment) before each call, both excluded. hide_host: the GPU
    also spins HOST_LEAD_CYCLES before the start event, so the host has queued the call's launches
    by the time the events start: the figure is the call's GPU time even where the kernels are
    shorter than the host's issue time (without it, such a call measures the host's pace). On the
    CPU: the host clock around each call (no flush)."""
    device = torch.device(device) if device is not None else _default_device()
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return Timing(times)
    flush = _l2_flush_buffer(device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize(device)
    for i in range(iters):
        if flush is not None:
            flush.fill_(i)
        if sync is not None:
            sync()
        if hide_host:
            torch.cuda._sleep(HOST_LEAD_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return Timing([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)], hide_host)


def pipelined_stats(fn: Callable[[], object], warmup: int = 5, iters: int = 20,
                    sync: Optional[Callable[[], None]] = None,
                    device: Optional[torch.device] = None) -> Timing:
    """Time `fn` per call the way DeepEP's tests/utils.py `bench` does (the method behind the
    targets.md low-latency anchors): one L2 flush and `sync` before the loop, then CUDA events
    around each call with nothing between calls, the first call dropped. The host queues call i+1
    while the GPU runs call i, so a call's figure is its GPU time whenever the host keeps ahead,
    and the host's pace per call whenever it does not. On the CPU: time_stats without the flush."""
    device = torch.device(device) if device is not None else _default_device()
    if device.type != "cuda":
        return time_stats(fn, warmup, iters, False, sync, device)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda.synchronize(device)
    _l2_flush_buffer(device).fill_(0)
    if sync is not None:
        sync()
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return Timing([s.elapsed_time(e) * 1e3 for s, e in zip(starts[1:], ends[1:])])


def host_issue_times(fn: Callable[[], object], iters: int, busy_cycles: int) -> List[float]:
    """Host time (us) to issue `fn()` while the GPU is busy with a `torch.cuda._sleep` of
    `busy_cycles` (so no launch waits on the device), one call per sleep, synchronised after each."""
    times = []
    for _ in range(iters):
        torch.cuda._sleep(busy_cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return times


def time_us(fn: Callable[[], object], warmup: int = 5, iters: int = 20, flush_l2: bool = True,
            sync: Optional[Callable[[], None]] = None, device: Optional[torch.device] = None) -> float:
    """Average microseconds per call of `fn` (see time_stats)."""
    return time_stats(fn, warmup, iters, flush_l2, sync, device).mean_us


def kernel_time_us(fn: Callable[[], object], match: str = "epcomm", warmup: int = 5,
                   iters: int = 20) -> Tuple[Optional[float], Dict[str, float]]:
    """GPU time of the kernels whose name contains `match`, per call of `fn`, from the torch
    profiler (CUPTI sees kernels launched through the driver API too). No L2 flush: the flush would
    be profiled as well. Returns (us per call or None if no kernel matched, {kernel: us per call})."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel: Dict[str, float] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or match not in event.name:
            continue
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.time_range.elapsed_us() / iters
    if not per_kernel:
        return None, {}
    return sum(per_kernel.values()), per_kernel


# ---------------------------------------------------------------------------------------------
# Records and cases
# ---------------------------------------------------------------------------------------------
@dataclass
class Record:
    """One figure of one rank. `baseline` names a record of the same run that this one is compared
    with (speedup = baseline us / this us); `target` is (metric, "<=" or ">=", value) with metric one
    of us, logical_gbps, nvlink_gbps, speedup. `status` is set by the runner: ok, not implemented,
    skipped or error (with the message)."""
    name: str
    setting: Dict[str, object] = field(default_factory=dict)
    us: Optional[float] = None
    logical_gbps: Optional[float] = None
    nvlink_gbps: Optional[float] = None
    sms: Optional[int] = None
    extra: Dict[str, object] = field(default_factory=dict)
    baseline: Optional[str] = None
    target: Optional[Tuple[str, str, float]] = None
    status: str = "ok"
    module: str = ""


@dataclass
class Case:
    """A unit of work of a case module: `run(ctx)` does it on every rank (collectively) and returns
    one Record or several. Building a Case must not touch the GPU."""
    name: str
    run: Callable[["BenchContext"], Union[Record, Iterable[Record]]]
    setting: Dict[str, object] = field(default_factory=dict)


class Skip(Exception):
    """Raised by a case that does not apply here (e.g. a P2P copy with one GPU); reported as skipped."""


class CheckFailed(AssertionError):
    """A correctness check of a case failed (on at least one rank)."""


class Attempts:
    """Calls that may raise on some ranks only (a mode that has not run on this machine yet), made so
    that every rank still makes the same collective calls: `attempts(fn)` returns fn() or, once a
    call raised on this rank, None without calling anything more; `wrap(fn)` is that as a function
    to time (the ranks' alignment calls stay paired). Then `check(ctx, what)`: collective, fails on
    every rank if a call raised on any (or `problems` were found), with the first exception's
    traceback in the message (the JSON keeps it). The peers' calls that wait on the device for
    this rank's skipped ones end at EPCOMM_TIMEOUT_S and then raise on their rank too."""

    def __init__(self):
        self.errors: List[str] = []
        self.tracebacks: List[str] = []

    def __call__(self, fn: Callable[[], object]):
        if self.errors:
            return None
        try:
            return fn()
        except Exception as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.errors.append(f"{type(exc).__name__}: {message}")
            self.tracebacks.append(traceback.format_exc())
            return None

    def wrap(self, fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: self(fn)

    def check(self, ctx: "BenchContext", what: str, problems: Iterable[str] = ()) -> None:
        problems = self.errors + list(problems)
        try:
            ctx.check(not problems, what + (f" ({'; '.join(problems)})" if problems else ""))
        except CheckFailed as exc:
            if self.tracebacks:
                raise CheckFailed(f"{exc}\n{self.tracebacks[0]}") from None
            raise


@contextlib.contextmanager
def environment(name: str, value: str):
    """os.environ[name] = value inside the block, restored (or unset again) afterwards."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
@dataclass
class MoEInputs:
    x: torch.Tensor              # [N, H] bf16, random normal
    topk_idx: torch.Tensor       # [N, K] int64, distinct experts per token, -1 where masked
    topk_weights: torch.Tensor   # [N, K] float32, softmax of the chosen scores, 0 where masked


def moe_inputs(num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int,
               device: torch.device, masked_fraction: float = 0.0) -> MoEInputs:
    """Deterministic MoE inputs for (seed, shapes): route each token to its top-k of random gate
    scores (as a model's router does); `masked_fraction` of the top-k entries become -1. Any rank
    can rebuild another rank's inputs from that rank's seed (generation happens on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    scores = torch.randn(num_tokens, num_experts, generator=gen).abs() + 1
    chosen, topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False)
    topk_weights = torch.softmax(chosen, dim=-1)
    if masked_fraction > 0:
        masked = torch.rand(num_tokens, num_topk, generator=gen) < masked_fraction
        topk_idx = topk_idx.masked_fill(masked, -1)
        topk_weights = topk_weights.masked_fill(masked, 0.0)
    return MoEInputs(x.to(device), topk_idx.to(device), topk_weights.to(device))


def low_latency_setup(buf, num_tokens: int, max_tokens: int, hidden: int, num_topk: int, num_experts: int,
                      seed: int, device: torch.device):
    """For the low-latency profiling tools: moe_inputs, the buffer cleaned for (T, H, E), one FP8
    dispatch for a handle, and a combine input of the handle's shape ([E_l, R*T, H] bf16, random).
    -> (inputs, handle, expert_out)."""
    inputs = moe_inputs(num_tokens, hidden, num_experts, num_topk, seed, device)
    buf.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    handle = buf.low_latency_dispatch(inputs.x, inputs.topk_idx, max_tokens, num_experts, use_fp8=True)[2]
    world = buf.group_size
    expert_out = torch.randn(num_experts // world, world * max_tokens, hidden, device=device, dtype=torch.bfloat16)
    return inputs, handle, expert_out


# ---------------------------------------------------------------------------------------------
# The per-rank context handed to case modules
# ---------------------------------------------------------------------------------------------
NVL_BYTES_WITHOUT_HINT = 1 << 20   # Buffer size while intranode mode (and so its size hint) is absent


class BenchContext:
    """What a case sees: rank, world_size, local_rank, device, group (NCCL on GPUs, gloo on the CPU;
    the one to give epcomm.Buffer and torch collectives), quick, results (every record gathered so
    far, by name: {"per_rank": [...], "us": {"min","avg","max"}, ...}, identical on all ranks), and
    helpers: time_us / time_stats / kernel_time_us, check, buffer, inputs, progress."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device, group,
                 object_group, quick: bool):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.group, self.object_group = device, group, object_group
        self.quick = quick
        self.results: Dict[str, dict] = {}
        self.on_progress: Optional[Callable[[str], None]] = None   # set by the runner on rank 0
        self._buffer = None
        self._buffer_key: Optional[tuple] = None
        self._align_tensor = torch.zeros(1, device=device) if device.type == "cuda" else None

    # ---- basics ------------------------------------------------------------------------------
    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def num_device_sms(self) -> Optional[int]:
        return torch.cuda.get_device_properties(self.device).multi_processor_count if self.is_gpu else None

    @property
    def warmup(self) -> int:
        return 3 if self.quick else 10

    @property
    def iters(self) -> int:
        return 10 if self.quick else 30

    def progress(self, message: str) -> None:
        """Show what the case is doing now (next to the progress bar, rank 0 only)."""
        if self.on_progress is not None:
            self.on_progress(message)

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self.object_group)

    def align(self) -> None:
        """Line the ranks up before a timed collective call: on GPUs a one-element all-reduce on the
        current stream (the host does not wait), on the CPU a barrier."""
        import torch.distributed as dist
        if self.world_size == 1:
            return
        if self._align_tensor is not None:
            dist.all_reduce(self._align_tensor, group=self.group)
        else:
            dist.barrier(group=self.object_group)

    def check(self, ok: bool, what: str) -> None:
        """Collective check: raises CheckFailed on every rank if `ok` is false on any rank, so all
        ranks leave the case together instead of one waiting in a collective."""
        import torch.distributed as dist
        flags: List[Optional[bool]] = [None] * self.world_size
        dist.all_gather_object(flags, bool(ok), group=self.object_group)
        bad = [r for r, flag in enumerate(flags) if not flag]
        if bad:
            raise CheckFailed(f"{what}: failed on rank(s) {bad}")

    # ---- timing ------------------------------------------------------------------------------
    def time_stats(self, fn: Callable[[], object], warmup: Optional[int] = None,
                   iters: Optional[int] = None, flush_l2: bool = True, align: bool = True,
                   hide_host: bool = False) -> Timing:
        """time_stats with this context's defaults; `align` lines the ranks up before each call
        (leave it on for collective calls)."""
        return time_stats(fn, self.warmup if warmup is None else warmup,
                          self.iters if iters is None else iters, flush_l2,
                          self.align if align else None, self.device, hide_host)

    def pipelined_stats(self, fn: Callable[[], object]) -> Timing:
        """pipelined_stats with this context's defaults, the ranks aligned once before the loop."""
        return pipelined_stats(fn, self.warmup, self.iters, self.align, self.device)

    def time_us(self, fn: Callable[[], object], **kwargs) -> float:
        return self.time_stats(fn, **kwargs).mean_us

    def kernel_time_us(self, fn: Callable[[], object], match: str = "epcomm",
                       iters: Optional[int] = None) -> Tuple[Optional[float], Dict[str, float]]:
        if not self.is_gpu:
            return None, {}
        return kernel_time_us(fn, match, self.warmup, self.iters if iters is None else iters)

    # ---- inputs ------------------------------------------------------------------------------
    def inputs(self, num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int = 0,
               rank: Optional[int] = None, masked_fraction: float = 0.0) -> MoEInputs:
        """This rank's (or `rank`'s) MoE inputs for `seed`, on this context's device."""
        rank = self.rank if rank is None else rank
        return moe_inputs(num_tokens, hidden, num_experts, num_topk, seed * 1000 + rank, self.device,
                          masked_fraction)

    # ---- epcomm.Buffer factory ---------------------------------------------------------------
    def buffer(self, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
               num_local_ranks: Optional[int] = None, **kwargs):
        """A live epcomm.Buffer over `group` with at least these sizes and exactly these flags. One
        Buffer is kept at a time: a request the current one cannot serve destroys it (collectively:
        every rank makes the same requests in the same order) and builds a new one.
        `num_local_ranks` sets EPCOMM_NUM_LOCAL_RANKS while the Buffer is built (ranks per "node";
        fewer than the ranks of a host make internode mode on one host), restored afterwards."""
        import epcomm
        flags = (bool(low_latency_mode), num_local_ranks, tuple(sorted(kwargs.items())))
        if self._buffer is not None:
            (have_nvl, have_rdma), have_flags = self._buffer_key
            if have_flags == flags and have_nvl >= num_nvl_bytes and have_rdma >= num_rdma_bytes:
                return self._buffer
            self.release_buffer()
        self.progress(f"creating Buffer(nvl={num_nvl_bytes}, rdma={num_rdma_bytes}, "
                      f"low_latency_mode={low_latency_mode}, local ranks={num_local_ranks or 'auto'})")
        with contextlib.nullcontext() if num_local_ranks is None else \
                environment("EPCOMM_NUM_LOCAL_RANKS", str(num_local_ranks)):
            self._buffer = epcomm.Buffer(self.group, num_nvl_bytes, num_rdma_bytes,
                                         low_latency_mode=low_latency_mode, explicitly_destroy=True,
                                         **kwargs)
        self._buffer_key = ((num_nvl_bytes, num_rdma_bytes), flags)
        return self._buffer

    def normal_buffer(self, hidden: int = 7168):
        """A Buffer sized by the Config hints for BF16 rows of `hidden` (the larger of dispatch and
        combine), as DeepEP's examples size theirs."""
        import epcomm
        hidden_bytes = hidden * 2
        try:
            nvl = max(epcomm.Buffer.get_dispatch_config(self.world_size)
                      .get_nvl_buffer_size_hint(hidden_bytes, self.world_size),
                      epcomm.Buffer.get_combine_config(self.world_size)
                      .get_nvl_buffer_size_hint(hidden_bytes, self.world_size))
        except (ImportError, NotImplementedError):
            # No intranode mode yet, so no hint: the layout alone needs no buffer memory.
            nvl = NVL_BYTES_WITHOUT_HINT
        return self.buffer(num_nvl_bytes=nvl)

    def low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        import epcomm
        rdma = epcomm.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                                            self.world_size, num_experts)
        return self.buffer(num_rdma_bytes=rdma, low_latency_mode=True,
                           num_qps_per_rank=max(1, num_experts // self.world_size))

    def internode_buffer(self, configs, hidden: int, num_topk: int, allow_mnnvl: bool = False):
        """A Buffer in internode mode with one rank per "node" (every rank its own node, so every
        transfer between ranks is an RDMA-stage one: NVSHMEM puts, over NVLink P2P on one host; with
        allow_mnnvl, stores in place), sized by the internode plan for the rings of every Config of
        `configs` with BF16 rows of `hidden` (FP8 records are smaller); any N fits."""
        from epcomm.ops.internode_plan import rdma_bytes_for
        rdma = rdma_bytes_for(configs, hidden * 2, 0, num_topk, self.world_size, 1, NVL_BYTES_WITHOUT_HINT)
        return self.buffer(num_nvl_bytes=NVL_BYTES_WITHOUT_HINT, num_rdma_bytes=rdma, num_local_ranks=1,
                           allow_mnnvl=allow_mnnvl)

    def release_buffer(self, destroy: bool = True) -> None:
        """Drop the current Buffer; destroy it (collective) unless a failed case may have left it
        unusable, in which case it is only forgotten."""
        buffer, self._buffer, self._buffer_key = self._buffer, None, None
        if buffer is not None and destroy:
            if self.is_gpu:
                torch.cuda.synchronize(self.device)
            self.barrier()
            buffer.destroy()
