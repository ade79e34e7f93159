"""Low-latency dispatch / combine (Buffer.low_latency_dispatch / low_latency_combine).

Per setting: a correctness check (recv counts against the all-gathered routing, combine of the
dequantised rows against sum_k w_k * x), then
  * kernel time of each op (torch profiler kernel durations, as DeepEP's figure), with every call
    queued behind a long sleep on both ranks first, so the kernels run back to back and neither the
    host's issue time nor the other rank's host skew is counted as kernel time,
  * whole-call time of each op (CUDA events around the Python call, L2 flushed, ranks aligned),
  * dispatch + combine back to back: the target's figure in the loop DeepEP's test times its
    anchor with (pairs issued one after another, events around each, nothing between them:
    harness.pipelined_stats), each pair alone (flushed and aligned as above, so the host's issue
    time and the ranks' host skew are in it), and the pair's GPU time alone (issued while the GPU
    sleeps); the pair replayed from one CUDA graph in the pipelined loop,
  * hook mode: send and receive kernel times separately (profiler kernel durations, a sleep between
    send and hook standing in for the expert GEMM, as DeepEP's test does; the CUDA-event figures
    around each launch, which include the launch itself, are kept in `extra`),
  * host issue time of one call (Buffer call, and the backend / ops-module call alone), the GPU
    kept busy so no launch waits,
  * an NCCL all_to_all_single moving the same bytes per rank pair, in the same run.
Targets (targets.md, N=128 H=7168 K=8 E=288, FP8 dispatch / BF16 combine): dispatch <= 20 us,
combine <= 28 us kernel time, dispatch + combine whole calls <= 50 us (pipelined, as above). Sweeps around that point:
N in 1..512, H in 2048..8192, K in 4..16 (one axis at a time; each point is a new specialisation).
"""
from __future__ import annotations

import statistics
from typing import List

import torch
import torch.distributed as dist

from .baselines import torch_moe_name
from .intranode import calc_diff
from .harness import (BenchContext, Case, Record, gbps, host_issue_times, low_latency_combine_bytes,
                      low_latency_dispatch_bytes)

TARGET = dict(N=128, H=7168, K=8, E=288)
PIPELINED = "whole calls back to back, pipelined as DeepEP's test"
TARGET_US = {"dispatch": 20.0, "combine": 28.0, "dispatch+combine": 50.0}
SWEEP_N = (1, 8, 32, 128, 256, 512)
SWEEP_H = (2048, 4096, 7168, 8192)
SWEEP_K = (4, 8, 16)
BUSY_CYCLES = 400_000   # ~200 us of torch.cuda._sleep: longer than the host needs to queue a call
GAP_CYCLES = 100_000    # ~50 us between a hook's send and receive launches: the peer's data arrives
QUEUE_CYCLES_PER_CALL = 2_000_000   # ~1 ms of sleep per queued call: the host (profiled) queues them all


def _name(op: str, what: str, N: int, H: int, K: int, E: int) -> str:
    return f"low-latency {op} N={N} H={H} K={K} E={E} ({what})"


def _max_tokens(N: int) -> int:
    return max(128, N)


def _settings(quick: bool) -> List[dict]:
    if quick:
        return [dict(TARGET)]
    points = [dict(TARGET, N=n) for n in SWEEP_N] + [dict(TARGET, H=h) for h in SWEEP_H] + \
             [dict(TARGET, K=k) for k in SWEEP_K]
    unique = []
    for p in points:
        if p not in unique:
            unique.append(p)
    return unique


class _Setting:
    """Inputs, buffer and the calls of one setting."""

    def __init__(self, ctx: BenchContext, N: int, H: int, K: int, E: int, largest: dict):
        self.ctx, self.N, self.H, self.K, self.E, self.T = ctx, N, H, K, E, _max_tokens(N)
        # one Buffer sized for the largest point, so the sweep does not rebuild it
        self.buffer = ctx.low_latency_buffer(_max_tokens(largest["N"]), largest["H"], largest["E"])
        self.buffer.clean_low_latency_buffer(self.T, H, E)
        inputs = ctx.inputs(N, H, E, K, seed=7)
        self.x, self.topk_idx, self.topk_weights = inputs.x, inputs.topk_idx, inputs.topk_weights
        self.E_l = E // ctx.world_size

    def dispatch(self, **kw):
        return self.buffer.low_latency_dispatch(self.x, self.topk_idx, self.T, self.E, **kw)

    def combine(self, x, handle, **kw):
        return self.buffer.low_latency_combine(x, self.topk_idx, self.topk_weights, handle, **kw)

    def expert_input(self, recv):
        """BF16 combine input from FP8 dispatch output (dequantised), as the expert GEMM would see."""
        values, scales = recv
        rows = values.float().view(*values.shape[:2], self.H // 128, 128) * scales.float()[..., None]
        return rows.view(values.shape).to(torch.bfloat16)

    def messages(self):
        """(all messages, messages to other ranks) this rank sends, counted per (token, expert) as
        targets.md defines them, and the (token, other rank) pairs: what dispatch moves over NVLink."""
        valid = self.topk_idx >= 0
        remote = valid & (self.topk_idx // self.E_l != self.ctx.rank)
        ranks = torch.arange(self.ctx.world_size, device=self.topk_idx.device)
        reached = ((self.topk_idx[:, :, None] // self.E_l == ranks) & valid[:, :, None]).any(1)
        reached[:, self.ctx.rank] = False
        return int(valid.sum()), int(remote.sum()), int(reached.sum())

    def check(self):
        ctx = self.ctx
        recv, count, handle, _, _ = self.dispatch()
        combined, _, _ = self.combine(self.expert_input(recv), handle)
        torch.cuda.synchronize()
        everyone = [torch.empty_like(self.topk_idx) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, self.topk_idx, group=ctx.group)
        experts = torch.cat(everyone).flatten()
        local = torch.arange(self.E_l, device=experts.device) + ctx.rank * self.E_l
        want = (experts[None, :] == local[:, None]).sum(1).to(torch.int32)
        ctx.check(torch.equal(count, want), f"recv_count differs from the all-gathered routing ({self.N}, {self.H}, "
                                            f"{self.K})")
        weight = (self.topk_weights * (self.topk_idx >= 0)).sum(1, keepdim=True).double()
        diff = calc_diff(self.x.double() * weight, combined)
        ctx.check(diff < 9e-4, f"combine(dequantised dispatch) vs sum_k w_k x: calc_diff {diff:.3g} >= 9e-4")


def _event_us(ctx: BenchContext, launch, before=None, after=None) -> float:
    """Average GPU time of what `launch(state)` queues (state = before()), with the GPU kept busy
    while the host queues it; after(result) runs outside the timed region."""
    total = 0.0
    for _ in range(ctx.iters):
        ctx.align()
        state = before() if before is not None else None
        torch.cuda._sleep(BUSY_CYCLES)   # also lets the peers' data of `before` arrive
        # The sleeps end up to tens of us apart (each GPU counts its own clock): line the ranks up
        # again after them, so the timed region starts together on every rank.
        ctx.align()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = launch(state)
        end.record()
        if after is not None:
            after(result)
        torch.cuda.synchronize()
        total += start.elapsed_time(end) * 1e3
    return total / ctx.iters


def _queued_kernels(ctx: BenchContext, queue, match: str, calls: int):
    """Profiler durations (us, launch order) of the kernels named `match` that `queue()` launches,
    `calls` times, all queued behind one long sleep on every rank: they run back to back, so the
    figures hold no host time and no host skew between ranks. -> (durations, host_was_late):
    host_was_late means the GPU drained the queue before the host finished filling it. The first
    call also absorbs the difference between the ranks' sleeps (torch.cuda._sleep counts cycles of
    each GPU's own clock: ~300 us apart after 10 ms), so callers average the calls after it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ctx.align()
        torch.cuda._sleep(QUEUE_CYCLES_PER_CALL * calls)
        slept = torch.cuda.Event()
        slept.record()
        for _ in range(calls):
            queue()
        late = slept.query()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and match in e.name),
                    key=lambda e: e.time_range.start)
    return [e.time_range.elapsed_us() for e in events], late


def _after_first(durations: List[float]) -> dict:
    """Mean over the calls after the first (see _queued_kernels), the median, the first, all."""
    rest = durations[1:] or durations
    return {"mean_us": statistics.fmean(rest) if rest else None, "median_us": statistics.median(rest) if rest else None,
            "first_us": durations[0] if durations else None, "all_us": [round(d, 2) for d in durations]}


def _host_us(ctx: BenchContext, call, calls: int) -> float:
    """Median host time to issue `call()` with the GPU busy (no launch waits on the device)."""
    ctx.align()
    return statistics.median(host_issue_times(call, calls, BUSY_CYCLES))


def _nccl_same_bytes(ctx: BenchContext, per_peer_bytes: int) -> float:
    n = max(per_peer_bytes // 2, 1)
    src = torch.zeros(n * ctx.world_size, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    return ctx.time_stats(lambda: dist.all_to_all_single(dst, src, group=ctx.group)).mean_us


def _run(ctx: BenchContext, setting: dict, largest: dict) -> List[Record]:
    N, H, K, E = (setting[k] for k in ("N", "H", "K", "E"))
    s = _Setting(ctx, N, H, K, E, largest)
    for _ in range(ctx.warmup):   # compile, load, warm the allocator
        recv, _, handle, _, _ = s.dispatch()
        s.combine(s.expert_input(recv), handle)
    s.check()
    recv, _, handle, _, _ = s.dispatch()
    expert_x = s.expert_input(recv)
    messages, remote, remote_tokens = s.messages()
    shape = dict(setting, R=ctx.world_size, T=s.T, messages=messages, remote_messages=remote,
                 remote_token_sends=remote_tokens, fp8_dispatch=True)
    is_target = setting == TARGET
    sms = ctx.num_device_sms
    # Over NVLink (what the kernels move, not targets.md's logical count): dispatch one message per
    # (token, other rank); combine one fp32 partial sum per (token, other rank) plus the top-k
    # records (per top-k slot of each of the T token slots, the expert id and the weight, each in a
    # 64-bit stamped word: cuda_src/low_latency.cu) to every other rank.
    combine_nvlink = remote_tokens * 4 * H + (ctx.world_size - 1) * s.T * 16 * K
    nbytes = {"dispatch": (low_latency_dispatch_bytes(messages, H), low_latency_dispatch_bytes(remote_tokens, H)),
              "combine": (low_latency_combine_bytes(messages, H), combine_nvlink)}
    calls = {"dispatch": lambda: s.dispatch(), "combine": lambda: s.combine(expert_x, handle)}
    records = []

    def record(op, what, us, with_bytes=True, target=None, extra=None):
        logical, nvlink = nbytes.get(op, (None, None)) if with_bytes else (None, None)
        records.append(Record(_name(op, what, N, H, K, E), shape, us=us, sms=sms,
                              logical_gbps=gbps(logical, us) if logical else None,
                              nvlink_gbps=gbps(nvlink, us) if nvlink else None,
                              baseline=torch_moe_name(op, N, H, K, E) if is_target else None,
                              target=("us", "<=", TARGET_US[op]) if target and is_target else None,
                              extra=extra or {}))

    for op, fn in calls.items():
        if ctx.is_gpu:
            durations, late = _queued_kernels(ctx, fn, f"{op}_kernel", ctx.iters + 1)
            stats = _after_first(durations)
            record(op, "kernel time", stats["mean_us"], target=True,
                   extra=dict(stats, host_was_late=late, nvlink_bytes=nbytes[op][1]))
        timing = ctx.time_stats(fn)
        record(op, "whole call", timing.mean_us, extra=timing.summary())

    def round_trip():
        r, _, h, _, _ = s.dispatch()
        s.combine(expert_x, h)
    # The target's figure, measured as DeepEP's test measures its anchor (targets.md: 71.5 us):
    # pairs issued in a loop, CUDA events around each, nothing between them (harness.pipelined_stats).
    timing = ctx.pipelined_stats(round_trip)
    record("dispatch+combine", PIPELINED, timing.mean_us, with_bytes=False, target=True, extra=timing.summary())
    # Stricter: each pair alone, after an L2 flush and an aligning all-reduce, so the GPU waits for
    # the host's issue of the dispatch and for the later rank's host (rank skew) every time.
    timing = ctx.time_stats(round_trip)
    record("dispatch+combine", "whole calls back to back, each pair alone", timing.mean_us, with_bytes=False,
           extra=timing.summary())
    if not ctx.is_gpu:   # kernel, hook and host-issue figures need a GPU
        return records
    # The same two calls issued while the GPU sleeps, the ranks aligned after the sleep: CUDA events
    # then time the GPU side of the pair alone (both kernels and the gap between them), not the
    # host's issue time nor the ranks' host skew (no L2 flush here).
    record("dispatch+combine", "back to back, issued while the GPU is busy",
           _event_us(ctx, lambda _: round_trip()), with_bytes=False)

    # hook mode, profiler: send launch, ~50 us of sleep (the expert GEMM), receive launch, queued;
    # the kernels alternate send / receive. CUDA events (launch included) go to `extra`: the send
    # launch alone (its hook runs after the timed region), then the receive launch alone (its send
    # ran before, and the data arrived while the GPU was kept busy).
    run_hook = lambda hook: hook()
    for op, send in (("dispatch", lambda _: s.dispatch(return_recv_hook=True)[4]),
                     ("combine", lambda _: s.combine(expert_x, handle, return_recv_hook=True)[2])):
        def hooked(send=send):
            hook = send(None)
            torch.cuda._sleep(GAP_CYCLES)
            hook()
        durations, late = _queued_kernels(ctx, hooked, f"{op}_kernel", ctx.iters + 1)
        sends, recvs = _after_first(durations[0::2]), _after_first(durations[1::2])
        record(op, "hook send kernel", sends["mean_us"],
               extra=dict(sends, events_us_incl_launch=_event_us(ctx, send, after=run_hook), host_was_late=late))
        record(op, "hook recv kernel", recvs["mean_us"], with_bytes=False,
               extra=dict(recvs, events_us_incl_launch=_event_us(ctx, run_hook, before=lambda f=send: f(None))))

    # host issue time of one call: the whole Buffer call, and the backend (ops module + launch) alone
    backend = getattr(s.buffer, "_backend", None)
    host = {"dispatch": (calls["dispatch"], (lambda: backend.low_latency_dispatch(
                s.x, s.topk_idx, s.T, s.E, None, None, True, False, False, False)) if backend else None),
            "combine": (calls["combine"], (lambda: backend.low_latency_combine(
                expert_x, s.topk_idx, s.topk_weights, handle, False, False, False, None, None)) if backend else None)}
    for op, (buffer_call, backend_call) in host.items():
        extra = {"backend_call_us": _host_us(ctx, backend_call, ctx.iters) if backend_call else None}
        record(op, "host issue time", _host_us(ctx, buffer_call, ctx.iters), with_bytes=False, extra=extra)

    per_peer = nbytes["dispatch"][0] // ctx.world_size
    records.append(Record(f"NCCL all_to_all_single, bytes of low-latency dispatch N={N} H={H} K={K} E={E}",
                          dict(setting, per_peer_bytes=per_peer), us=_nccl_same_bytes(ctx, per_peer)))
    torch.cuda.synchronize()
    return records


def _graph_round_trip(ctx: BenchContext, setting: dict, largest: dict) -> Record:
    """dispatch + combine captured once in a CUDA graph, the replays timed in the pipelined loop of
    the target's figure: the same GPU work with no Python host path (what a decode loop built on
    graphs pays). Not the targets.md metric (that one times the Python calls); reported next to it."""
    N, H, K, E = (setting[k] for k in ("N", "H", "K", "E"))
    s = _Setting(ctx, N, H, K, E, largest)
    recv, _, handle, _, _ = s.dispatch()
    expert_x = s.expert_input(recv)

    def round_trip():
        r, _, h, _, _ = s.dispatch()
        s.combine(expert_x, h)
    for _ in range(ctx.warmup):
        round_trip()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_trip()
    timing = ctx.pipelined_stats(graph.replay)
    return Record(_name("dispatch+combine", "back to back, one CUDA graph replay", N, H, K, E),
                  dict(setting, R=ctx.world_size, T=s.T), us=timing.mean_us, sms=ctx.num_device_sms,
                  extra=timing.summary())


def cases(ctx: BenchContext):
    settings = [s for s in _settings(ctx.quick) if s["E"] % ctx.world_size == 0]
    largest = dict(N=max(s["N"] for s in settings), H=max(s["H"] for s in settings), E=TARGET["E"])
    for setting in settings:
        yield Case(_name("dispatch/combine", "all figures", **setting),
                   lambda c, st=setting: _run(c, st, largest), dict(setting))
    if ctx.is_gpu and TARGET["E"] % ctx.world_size == 0:
        yield Case(_name("dispatch+combine", "back to back, one CUDA graph replay", **TARGET),
                   lambda c: _graph_round_trip(c, dict(TARGET), largest), dict(TARGET))
