"""`Buffer`: DeepEP V1's public API. Each call validates its arguments (epcomm.validate), runs the
backend in the stream order of epcomm.streams and builds DeepEP's return tuples, handing tensors
back in the caller's framework (torch, or CuPy / any DLPack producer, zero-copy).

The host side of a call is on the critical path (MoE layers issue dispatch/combine back to back),
so the common case, a synchronous call with the default stream arguments, adds no torch op, no
event and no stream switch to what the backend does: validation with cheap attribute reads, the
backend call, the result tuple. Only async_finish / previous_event take the comm-stream path."""
from __future__ import annotations

import types
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import env, validate
from .config import (BUFFER_ALIGNMENT_BYTES, Config, align_buffer_bytes,
                     recommended)
from .errors import BufferUnusable, EpcommError
from .event import EventOverlap
from .ops import low_latency_layout
from .streams import AsyncScope, new_comm_stream, wait_previous
from .validate import Call

Tensor = torch.Tensor
FP8Pair = Tuple[torch.Tensor, torch.Tensor]


def _make_backend(group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool, options: dict):
    """EPCOMM_BACKEND: cpu / gpu, or auto: the CPU reference for a gloo-only group, else the GPU."""
    choice = env.backend()
    if choice == "auto":
        name = str(dist.get_backend(group))
        choice = "cpu" if "gloo" in name and "nccl" not in name else "gpu"
    if choice == "cpu":
        from .reference import ReferenceBackend as backend_class
    elif not torch.cuda.is_available():
        raise RuntimeError(f"Buffer: the GPU backend (EPCOMM_BACKEND={env.backend()}, group backend "
                           f"{dist.get_backend(group)}) needs CUDA, and torch.cuda.is_available() is False; "
                           f"use a gloo group or EPCOMM_BACKEND=cpu for the CPU reference backend")
    else:
        from .gpu import GpuBackend as backend_class
    return backend_class(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, options)


# Calls that exchange data with every rank (the CPU backend frames them in exchange.py's rounds).
_COLLECTIVE_METHODS = ("dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
                       "clean_low_latency_buffer", "recover")


# What low-latency calls check across ranks, in the order of their argument-set keys.
_LL_DISPATCH_ARGUMENTS = ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "num_topk", "use_fp8",
                          "round_scale", "use_ue8m0")
_LL_COMBINE_ARGUMENTS = ("num_max_dispatch_tokens_per_rank (of the handle)", "hidden (of the handle)",
                         "num_experts (of the handle)", "num_topk", "use_logfmt")


def _rejection_reaches_peers(method):
    """A Buffer method whose rejection of this rank's input, raised before the backend joined the
    call's exchange, is told to the peers waiting there (they raise PeerFailed, not a timeout)."""
    op = f"Buffer.{method.__name__}"

    def call(self, *args, **kwargs):
        exchange = self._exchange
        joined = exchange.calls_joined
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            if exchange.calls_joined == joined and self._backend is not None:
                try:
                    exchange.reject(op, e)
                except EpcommError:   # the peers are gone: this rank's own error says more
                    pass
            raise
    return call


def _synchronised(method):
    """EPCOMM_SYNC_CALLS: the call, then a device synchronisation and the failure check, so a
    failed wait raises at the call that made it (a returned hook does the same when called)."""
    def call(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        self.check_errors(synchronize=True)
        return result
    return call


class BufferRuntime:
    """The queries of DeepEP's `Buffer.runtime` that user code calls (None after `destroy()`)."""

    def __init__(self, backend, comm_stream) -> None:
        self._rank, self._num_ranks, self._num_local_ranks = backend.rank, backend.num_ranks, backend.num_local_ranks
        self._device, self._comm_stream = backend.device, comm_stream

    def is_available(self) -> bool:
        return True

    def is_internode_available(self) -> bool:
        return self._num_ranks > self._num_local_ranks

    def get_num_rdma_ranks(self) -> int:
        return self._num_ranks // self._num_local_ranks

    def get_rdma_rank(self) -> int:
        return self._rank // self._num_local_ranks

    def get_root_rdma_rank(self, global_: bool) -> int:
        return self._rank % self._num_local_ranks if global_ else 0

    def get_local_device_id(self) -> int:
        return -1 if self._device.index is None else self._device.index

    def get_comm_stream(self):
        return self._comm_stream


class Buffer:
    """Expert-parallel communication buffers of one rank: high-throughput intranode / internode
    dispatch and combine (normal mode) and low-latency dispatch and combine.

    Attributes: num_sms (class attribute, SMs of normal-mode kernels), rank, group_size, group,
    num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy, enable_shrink, runtime.
    Shapes below: N local tokens, H hidden, K top-k, E experts, R ranks, E_l = E / R,
    T = num_max_dispatch_tokens_per_rank, M received rows.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[object] = None) -> None:
        """Collective over `group`: every rank builds its Buffer with the same arguments.

        Arguments:
            group: the torch.distributed ProcessGroup of the EP ranks (bootstrap exchanges only).
            num_nvl_bytes: bytes of the buffer shared with NVLink peers (normal mode), multiple of 128.
            num_rdma_bytes: bytes of the symmetric buffer (internode and low-latency), multiple of 128.
            low_latency_mode: enable low-latency calls (needs num_rdma_bytes from
                get_low_latency_rdma_size_hint).
            num_qps_per_rank: RDMA queue pairs per peer (kept for the RDMA transport).
            allow_nvlink_for_low_latency_mode: low-latency traffic may use NVLink peers.
            allow_mnnvl: allow multi-node NVLink: internode mode writes ranks of other nodes whose
                buffers this GPU maps in place (NVLink stores) instead of through NVSHMEM puts.
            use_fabric: allocate with the fabric API (the symmetric heap chooses its own handles).
            explicitly_destroy: the user calls destroy(); otherwise resources are released at exit.
            enable_shrink: enable the low-latency rank-masking calls.
            comm: an mpi4py communicator instead of group: not supported (NotImplementedError).
        """
        c = Call("Buffer", torch.device("cpu"), 1)
        if comm is not None:
            raise NotImplementedError("Buffer: comm (an mpi4py communicator) is not supported; pass a "
                                      "torch.distributed ProcessGroup as group")
        if not isinstance(group, dist.ProcessGroup):
            raise c.error("group", f"must be a torch.distributed ProcessGroup, got {type(group).__name__}",
                          TypeError)
        sizes = {}
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            sizes[name] = c.integer(name, value, minimum=0)
            if sizes[name] % BUFFER_ALIGNMENT_BYTES:
                raise c.error(name, f"must be a multiple of {BUFFER_ALIGNMENT_BYTES}, got {sizes[name]}")
        low_latency_mode = c.flag("low_latency_mode", low_latency_mode)
        if low_latency_mode and sizes["num_rdma_bytes"] == 0:
            raise c.error("num_rdma_bytes", "must be > 0 with low_latency_mode=True (see "
                                            "Buffer.get_low_latency_rdma_size_hint), got 0")
        options = {
            "num_qps_per_rank": c.integer("num_qps_per_rank", num_qps_per_rank, minimum=1 if low_latency_mode else 0),
            "allow_nvlink_for_low_latency_mode": c.flag("allow_nvlink_for_low_latency_mode",
                                                        allow_nvlink_for_low_latency_mode),
            "allow_mnnvl": c.flag("allow_mnnvl", allow_mnnvl),
            "use_fabric": c.flag("use_fabric", use_fabric),
            "explicitly_destroy": c.flag("explicitly_destroy", explicitly_destroy),
            "enable_shrink": c.flag("enable_shrink", enable_shrink),
        }
        self.rank, self.group_size, self.group = group.rank(), group.size(), group
        self.num_nvl_bytes, self.num_rdma_bytes = sizes["num_nvl_bytes"], sizes["num_rdma_bytes"]
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy, self.enable_shrink = options["explicitly_destroy"], options["enable_shrink"]
        self._backend = _make_backend(group, self.num_nvl_bytes, self.num_rdma_bytes, low_latency_mode, options)
        self._device = self._backend.device
        self._check_values = self._device.type == "cpu"   # see epcomm.validate
        self._internode = self._backend.num_ranks > self._backend.num_local_ranks
        self._comm = new_comm_stream(self._device)
        self._comm_stream = None if self._comm is None else self._comm.stream
        self._low_latency_checked = False   # the mode check passed (see _low_latency)
        self._low_latency_fits = set()   # (T, H, E) whose layout fits num_rdma_bytes
        self._low_latency_agreed = set()   # argument sets checked across ranks (_agreed_low_latency)
        self._intranode_fits = set()     # shapes of intranode calls that fit num_nvl_bytes
        self._handle_owner = object()   # marks the handles this Buffer returns (validate.Handle)
        # The fast path (see _remember): per call kind, validated signature -> runner.
        self._fast_path = not self._check_values
        self._ll_dispatch_runs, self._ll_combine_runs, self._dispatch_runs, self._combine_runs = {}, {}, {}, {}
        self._normal_mode_problem = (
            "needs a Buffer with num_nvl_bytes > 0 (see Config.get_nvl_buffer_size_hint), this one has 0"
            if self.num_nvl_bytes == 0 else
            "internode mode needs a Buffer with num_rdma_bytes > 0 (see Config.get_rdma_buffer_size_hint)"
            if self._internode and self.num_rdma_bytes == 0 else None)
        # Without explicitly_destroy the backend releases itself at exit: a release from the
        # garbage collector could run at a different point on each rank, and it is collective.
        self.runtime = BufferRuntime(self._backend, self._comm_stream)
        # A backend with host exchanges (the CPU one) must hear of a rank's rejected input; the GPU
        # backend's peers time out instead, and its calls keep the plain methods (no wrapper cost).
        self._exchange = getattr(self._backend, "exchange", None)
        if self._exchange is not None:
            self._fast_path = False   # its calls exchange with the peers on every call anyway
            for name in _COLLECTIVE_METHODS:
                setattr(self, name, types.MethodType(_rejection_reaches_peers(getattr(Buffer, name)), self))
        self._sync_calls = self._device.type == "cuda" and env.sync_calls()
        if self._sync_calls:
            for name in _COLLECTIVE_METHODS + ("get_dispatch_layout",):
                setattr(self, name, types.MethodType(_synchronised(getattr(Buffer, name)), self))

    def __repr__(self) -> str:
        state = "destroyed" if self._backend is None else type(self._backend).__name__
        return (f"Buffer(rank={self.rank}, group_size={self.group_size}, num_nvl_bytes={self.num_nvl_bytes}, "
                f"num_rdma_bytes={self.num_rdma_bytes}, low_latency_mode={self.low_latency_mode}, {state})")

    # ---- helpers -------------------------------------------------------------------------------
    def _begin(self, op: str) -> Call:
        """op: the full name ("Buffer.dispatch"), as every message starts with it."""
        backend = self._backend
        if backend is None:
            raise BufferUnusable(f"{op}: the Buffer was destroyed")
        backend.check_errors()
        return Call(op, self._device, self.group_size, self._check_values)

    def check_errors(self, synchronize: bool = False) -> None:
        """Raise the failure a call of this Buffer recorded: PeerTimeout (a wait on a peer ran past
        EPCOMM_TIMEOUT_S; op, rank, peer and phase named) or DeviceCheckFailed, the first time it is
        seen, BufferUnusable afterwards. GPU calls record failures as their kernels run, so this sees
        the calls whose kernels have finished: synchronize=True (or synchronising the device first)
        covers every call issued so far. Every Buffer method checks the same way when it starts."""
        backend = self._backend
        if backend is None:
            raise BufferUnusable("Buffer.check_errors: the Buffer was destroyed")
        if synchronize and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        backend.check_errors()

    def _checked_hook(self, hook: Optional[Callable]) -> Optional[Callable]:
        """A recv hook that checks the Buffer's failure record like a call (and, with
        EPCOMM_SYNC_CALLS, synchronises and checks after receiving)."""
        if hook is None:
            return None
        backend, sync = self._backend, self._sync_calls

        def checked_hook():
            backend.check_errors()
            hook()
            if sync:
                self.check_errors(synchronize=True)
        return checked_hook

    def _require_normal_mode(self, c: Call) -> None:
        if self._normal_mode_problem is not None:
            raise ValueError(f"{c.op}: {self._normal_mode_problem}")

    def _low_latency(self, c: Call, shape: Optional[Tuple[int, int, int]] = None) -> None:
        """Check the Buffer's mode (and its capacity for (T, H, E))."""
        if not self._low_latency_checked:
            c.require(self.low_latency_mode, "needs a Buffer built with low_latency_mode=True")
            self._low_latency_checked = True
        if shape is not None and shape not in self._low_latency_fits:
            need = int(low_latency_layout.rdma_size_hint(shape[0], shape[1], self.group_size, shape[2]))
            c.require(need <= self.num_rdma_bytes,
                      f"num_max_dispatch_tokens_per_rank={shape[0]}, hidden={shape[1]}, num_experts={shape[2]} "
                      f"need num_rdma_bytes >= {need} (Buffer.get_low_latency_rdma_size_hint), this Buffer "
                      f"has {self.num_rdma_bytes}")
            self._low_latency_fits.add(shape)

    def _agreed_low_latency(self, c: Call, names: Tuple[str, ...], key: tuple) -> None:
        """First call with the argument set `key` (its first three: T, H, E): on the GPU, every rank
        must hold the same set (epcomm.agreement: a bounded meeting that names a rank that does not
        come; checked before the capacity, so a mismatch raises alike everywhere); the CPU backend
        checks every call in its exchange. An enable_shrink Buffer skips the check: its calls must
        complete without a peer that stopped responding (masked), and the meeting would wait for
        that peer."""
        if self._exchange is None and self._device.type == "cuda" and not self.enable_shrink:
            from .agreement import agree   # host-only (the store), so also inside a graph capture
            agree(self._backend.agreement, c.op, names, key, env.timeout_s())
        self._low_latency(c, key[:3])
        self._low_latency_agreed.add(key)

    def _returned_handle(self, c: Call, handle: tuple, num_tokens: Optional[int] = None):
        """A backend's handle as the caller gets it: marked as this Buffer's (validate.Handle), or
        converted to the caller's framework (then checked in full when it comes back)."""
        if c.framework is None or c.framework == "torch":
            return validate.owned_handle(handle, self._handle_owner, num_tokens)
        return c.output(handle)

    # The fast path: a call whose arguments have the signature (validate.*_signature: shapes, dtypes,
    # devices, flags) of an earlier call that passed every check and ran skips the checks, and the
    # backend's runner for that signature launches it (the plan resolved, Params prefilled, the
    # launch bound), or the backend method when the backend has no runner for it. Only synchronous
    # calls with the default stream arguments take it, only on device Buffers (a CPU Buffer checks
    # values on every call), and the Buffer's state is still checked on every call (check_errors).
    _RUNNER_LIMIT = 256   # signatures kept per call kind (token counts vary from call to call)

    def _remember(self, runners: dict, signature, make_runner: Optional[Callable], general: Callable) -> None:
        run = make_runner() if make_runner else None
        if len(runners) >= self._RUNNER_LIMIT:
            runners.clear()
        runners[signature] = general if run is None else run

    def _forget_fast_paths(self) -> None:
        """Drop every remembered signature: for anything that replaces the backend's plans or
        buffers (the runners hold Params copies pointing into them)."""
        for runners in (self._ll_dispatch_runs, self._ll_combine_runs, self._dispatch_runs, self._combine_runs):
            runners.clear()

    def _run(self, c: Call, run: Callable, args: tuple, previous_event=None, async_finish=False,
             allocate_on_comm_stream=False):
        """run(*args) in the stream order the stream arguments ask for (epcomm.streams) -> (its
        result, the call's EventOverlap). The default arguments, the common case, run it in place
        with nothing around it; async_finish runs it on the comm stream, where AsyncScope.finish keeps
        the tensors of args and of the result safe from the other stream's allocator."""
        if previous_event is None and async_finish is False and allocate_on_comm_stream is False:
            return run(*args), EventOverlap()
        previous_event, async_finish, _ = validate.stream_args(c, previous_event, async_finish,
                                                               allocate_on_comm_stream)
        if not async_finish:
            wait_previous(previous_event)
            return run(*args), EventOverlap()
        with AsyncScope(self._comm, previous_event, self._backend.check_errors) as scope:
            result = run(*args)
            return result, scope.finish(args, result)

    def _shrink(self, c: Call) -> None:
        self._low_latency(c)
        c.require(self.enable_shrink, "needs a Buffer built with enable_shrink=True")

    # ---- class-level API -----------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs of normal-mode kernels (even, > 0) used by the recommended configs."""
        c = Call("Buffer.set_num_sms", torch.device("cpu"), 1)
        new_num_sms = c.integer("new_num_sms", new_num_sms, minimum=2)
        if new_num_sms % 2:
            raise c.error("new_num_sms", f"must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Always True: kernels are compiled at first use for the GPU at hand, so an SM90 GPU always
        gets the SM90 feature set (and SM80 GPUs get every mode as well)."""
        return True

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap recorded on `torch.cuda.current_stream()` (event None without CUDA)."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch Config for num_ranks ranks with Buffer.num_sms SMs (any num_ranks >= 1)."""
        return recommended("dispatch", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine Config for num_ranks ranks with Buffer.num_sms SMs (any num_ranks >= 1)."""
        return recommended("combine", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of num_rdma_bytes low-latency calls need for (T, H, R, E) (sized for BF16), a multiple
        of 128 so that it can be passed to Buffer as it is."""
        c = Call("Buffer.get_low_latency_rdma_size_hint", torch.device("cpu"), 1)
        c.num_ranks = c.integer("num_ranks", num_ranks, minimum=1)
        t, h, e = validate.ll_shape(c, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return align_buffer_bytes(int(low_latency_layout.rdma_size_hint(t, h, c.num_ranks, e)))

    # ---- buffer memory and lifetime ------------------------------------------------------------
    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The communication stream (None on the CPU backend)."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A zero-copy view of this rank's NVLink buffer (or RDMA buffer with use_rdma_buffer) of `dtype`,
        starting `offset` bytes in: shaped `size` if given, else 1-D over the rest of the buffer."""
        c = self._begin("Buffer.get_local_buffer_tensor")
        if not isinstance(dtype, torch.dtype):
            raise c.error("dtype", f"must be a torch.dtype, got {type(dtype).__name__}", TypeError)
        offset = c.integer("offset", offset, minimum=0)
        use_rdma_buffer = c.flag("use_rdma_buffer", use_rdma_buffer)
        name, nbytes = (("num_rdma_bytes", self.num_rdma_bytes) if use_rdma_buffer
                        else ("num_nvl_bytes", self.num_nvl_bytes))
        c.require(nbytes > 0, f"the Buffer has {name}=0, so there is no such buffer to view")
        if offset % dtype.itemsize or offset > nbytes:
            raise c.error("offset", f"must be a multiple of {dtype.itemsize} (the size of {dtype}) within the "
                                    f"{nbytes}-byte buffer, got {offset}")
        if size is not None:
            if not isinstance(size, (tuple, list)):
                raise c.error("size", f"must be None or a torch.Size, got {type(size).__name__}", TypeError)
            size = torch.Size([c.integer("size", s, minimum=0) for s in size])
            if size.numel() * dtype.itemsize > nbytes - offset:
                raise c.error("size", f"{list(size)} of {dtype} needs {size.numel() * dtype.itemsize} bytes, "
                                      f"only {nbytes - offset} remain after offset {offset}")
        return self._backend.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def destroy(self) -> None:
        """Release the buffers (collective). Only for a Buffer built with explicitly_destroy=True."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy: only a Buffer built with explicitly_destroy=True is destroyed "
                               "by hand; this one is released at exit")
        if self._backend is None:
            raise BufferUnusable("Buffer.destroy: the Buffer was already destroyed")
        # The failure of an earlier call raises here too, once the device has finished its kernels
        # (they are bounded by EPCOMM_TIMEOUT_S); the backend then releases what it safely can.
        failure = None
        try:
            self.check_errors(synchronize=True)
        except BufferUnusable:
            pass   # already raised by an earlier call
        except EpcommError as e:
            failure = e
        self._forget_fast_paths()
        backend, self._backend, self.runtime = self._backend, None, None
        backend.destroy()
        self.group = None   # see ReferenceBackend.destroy: nothing here keeps the process group alive
        if failure is not None:
            raise failure

    def recover(self, timeout_s: Optional[float] = None) -> None:
        """Collective: make the Buffer usable again after a failed call whose peers are all alive
        (a PeerTimeout, a DeviceCheckFailed, a rank that rejected its input). Every rank calls it,
        the ranks whose own calls succeeded too, after catching the error. Outputs of the failed
        calls stay poisoned, and their events and recv hooks must not be used after recover().

        GPU: each rank waits for its kernels (all bounded), the ranks meet through the
        torch.distributed store, and every rank clears its signalling state to that of a new
        Buffer. timeout_s bounds the meeting (default twice EPCOMM_TIMEOUT_S: a rank that joined
        the failed call late is still waiting out its own bound when the first ones arrive); a rank
        that does not come raises PeerTimeout naming it, on every rank, and the Buffer stays
        unusable. CPU: its failed calls leave it usable, except after a PeerTimeout, which gloo
        cannot recover from (BufferUnusable: build a new group and Buffer)."""
        c = Call("Buffer.recover", torch.device("cpu"), 1)
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
                raise c.error("timeout_s", f"must be a number of seconds, got {type(timeout_s).__name__}",
                              TypeError)
            if not 0 < timeout_s < float("inf"):
                raise c.error("timeout_s", f"must be > 0 and finite, got {timeout_s}")
        if self._backend is None:
            raise BufferUnusable("Buffer.recover: the Buffer was destroyed")
        # Recovery resets the backend's buffer and low-latency state the runners were built over.
        self._forget_fast_paths()
        self._backend.recover(None if timeout_s is None else float(timeout_s))

    # ---- normal mode ---------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """Count what each rank and expert receives.

        Arguments:
            topk_idx: [N, K] epcomm.topk_idx_t (int64), expert ids, -1 = none.
            num_experts: E, divisible by R.
            previous_event: the call's kernels start after it (with async_finish: instead of after the
                current stream's work; without: as well as after it, see epcomm/streams.py).
            async_finish: run on the comm stream and return at once with an event; False: the call is
                ordered in the current stream (its later work starts after the call's kernels).
            allocate_on_comm_stream: outputs belong to the comm stream (needs previous_event, async_finish).
        Returns: num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R / ranks per node] int32 or
            None intranode, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event.
        """
        c = self._begin("Buffer.get_dispatch_layout")
        topk_idx, num_experts = validate.layout_args(c, topk_idx, num_experts)
        outputs, event = self._run(c, self._backend.get_dispatch_layout, (topk_idx, num_experts),
                                   previous_event, async_finish, allocate_on_comm_stream)
        return (*c.output(tuple(outputs)), event)

    def dispatch(self, x: Union[Tensor, FP8Pair], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[Tensor] = None, num_tokens_per_rdma_rank: Optional[Tensor] = None,
                 is_token_in_rank: Optional[Tensor] = None, num_tokens_per_expert: Optional[Tensor] = None,
                 topk_idx: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[Union[Tensor, FP8Pair], Optional[Tensor], Optional[Tensor], Optional[List[int]],
                            Optional[Tuple], EventOverlap]:
        """Send each token to the ranks of its experts.

        Arguments:
            x: [N, H] bfloat16 (H % 8 == 0), or (x [N, H] float8_e4m3fn, scales [N, H / 128] float32, any
                strides) with H % 128 == 0.
            handle: a previous dispatch's handle: cached mode, same routing, layout arguments unused.
            num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [R / ranks per node] int32 (internode),
            is_token_in_rank [N, R] bool, num_tokens_per_expert [E] int32: from get_dispatch_layout.
            topk_idx: [N, K] topk_idx_t, -1 = none; topk_weights: [N, K] float32 (both or neither).
            expert_alignment: round each per-expert count up to a multiple of this (>= 1).
            num_worst_tokens: > 0: receive exactly this many rows, no host synchronisation.
            config: Config, default get_dispatch_config(R); previous_event, async_finish,
            allocate_on_comm_stream: as in get_dispatch_layout.
        Returns: recv_x ([M, H] bfloat16 or the FP8 pair), recv_topk_idx [M, K] (local expert ids, -1
            elsewhere), recv_topk_weights [M, K] float32, num_recv_tokens_per_expert_list (E_l ints),
            handle, event. Cached mode returns (recv_x, None, None, None, None, event).
        """
        signature = None
        if (handle is not None and self._fast_path and not self._internode and previous_event is None
                and async_finish is False and allocate_on_comm_stream is False):
            signature = validate.cached_dispatch_signature(x, handle, topk_idx, topk_weights, expert_alignment,
                                                           num_worst_tokens, config, self._handle_owner, Buffer.num_sms)
            run = self._dispatch_runs.get(signature)
            if run is not None:
                self._backend.check_errors()
                if type(x) is Tensor:
                    return run(x, None, handle).recv_x, None, None, None, None, EventOverlap()
                r = run(x[0], x[1], handle)
                return (r.recv_x, r.recv_x_scales), None, None, None, None, EventOverlap()
        c = self._begin("Buffer.dispatch")
        self._require_normal_mode(c)
        args = validate.dispatch_args(c, self._internode, self._backend.num_local_ranks, x, handle,
                                      num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                      num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                      num_worst_tokens, self._handle_owner)
        if args[2] is not None and not validate.is_owned(handle, self._handle_owner):
            validate.handle_routing(c, args[2], self._internode, self.rank, self._backend.num_local_ranks)
        if not self._internode:
            validate.intranode_fits(c, self.num_nvl_bytes, args, False, self._intranode_fits)
        if type(config) is not Config:
            config = c.config("config", config, None) or self.get_dispatch_config(self.group_size)
        r, event = self._run(c, self._run_dispatch, (c, args, config), previous_event, async_finish,
                             allocate_on_comm_stream)
        _, x_scales, handle = args[:3]
        recv_x = r.recv_x if x_scales is None else (r.recv_x, r.recv_x_scales)
        if handle is not None:   # cached mode
            if signature is not None:
                backend, x_data = self._backend, args[0]
                self._remember(self._dispatch_runs, signature,
                               getattr(backend, "dispatch_runner", None) and
                               (lambda: backend.dispatch_runner(x_data, x_scales, handle, config)),
                               lambda x, x_scales, handle: backend.dispatch(x, x_scales, handle, *args[3:], config))
            return c.output(recv_x), None, None, None, None, event
        return (*c.output((recv_x, r.recv_topk_idx, r.recv_topk_weights)), r.num_recv_tokens_per_expert_list,
                self._returned_handle(c, r.handle), event)

    def _run_dispatch(self, c: Call, args: tuple, config: Config):
        try:
            return self._backend.dispatch(*args, config)
        except (MemoryError, RuntimeError) as e:   # the allocator's message names bytes, not the cause
            if args[10] and "allocate" in str(e):
                raise MemoryError(f"{c.op}: num_worst_tokens={args[10]} received rows of hidden="
                                  f"{args[0].shape[1]} do not fit in memory ({e})") from e
            raise

    def combine(self, x: Tensor, handle: Tuple, topk_weights: Optional[Tensor] = None,
                bias: Union[None, Tensor, Tuple[Tensor, Tensor]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """Send rows back to their tokens' ranks and sum them (unweighted, fp32 accumulation).

        Arguments:
            x: [M, H] bfloat16 in dispatch's row order; handle: the dispatch's handle.
            topk_weights: [M, K] float32, summed per token like x.
            bias: [N, H] bfloat16, or a 2-tuple of them (either None), added to the result.
            config: Config, default get_combine_config(R); stream arguments as in get_dispatch_layout.
        Returns: combined_x [N, H] bfloat16, combined_topk_weights [N, K] float32 or None, event.
        """
        signature = None
        if (self._fast_path and not self._internode and previous_event is None and async_finish is False
                and allocate_on_comm_stream is False):
            signature = validate.combine_signature(x, handle, topk_weights, bias, config, self._handle_owner,
                                                   Buffer.num_sms)
            run = self._combine_runs.get(signature)
            if run is not None:
                self._backend.check_errors()
                if bias is None:
                    combined = run(x, handle, topk_weights, None, None)
                elif type(bias) is Tensor:
                    combined = run(x, handle, topk_weights, bias, None)
                else:
                    combined = run(x, handle, topk_weights, bias[0], bias[1])
                return combined[0], combined[1], EventOverlap()
        c = self._begin("Buffer.combine")
        self._require_normal_mode(c)
        x, handle, topk_weights, bias = validate.combine_args(c, self._internode, x, handle, topk_weights, bias,
                                                              self._handle_owner)
        if not validate.is_owned(handle, self._handle_owner):
            validate.handle_routing(c, handle, self._internode, self.rank, self._backend.num_local_ranks)
        if not self._internode:
            validate.intranode_fits(c, self.num_nvl_bytes, (x, handle, topk_weights, bias), True,
                                    self._intranode_fits)
        if type(config) is not Config:
            config = c.config("config", config, None) or self.get_combine_config(self.group_size)
        combined, event = self._run(c, self._backend.combine, (x, handle, topk_weights, bias, config),
                                    previous_event, async_finish, allocate_on_comm_stream)
        if signature is not None:
            backend, x_data, weights = self._backend, x, topk_weights
            self._remember(self._combine_runs, signature,
                           getattr(backend, "combine_runner", None) and
                           (lambda: backend.combine_runner(x_data, handle, weights, bias, config)),
                           lambda x, handle, weights, bias0, bias1: backend.combine(x, handle, weights, (bias0, bias1),
                                                                                    config))
        return (*c.output(tuple(combined)), event)

    def _require_internode(self, op: str) -> None:
        if self._backend is None:
            raise BufferUnusable(f"{op}: the Buffer was destroyed")
        if not self._internode:
            raise ValueError(f"{op}: this Buffer's {self.group_size} ranks are one NVLink domain "
                             f"(runtime.get_num_rdma_ranks() == 1): use Buffer.dispatch / "
                             f"Buffer.combine, which pick the intranode kernels")

    def internode_dispatch(self, x: Union[Tensor, FP8Pair], handle: Optional[Tuple] = None,
                           num_tokens_per_rank: Optional[Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[Tensor] = None,
                           is_token_in_rank: Optional[Tensor] = None,
                           num_tokens_per_expert: Optional[Tensor] = None,
                           topk_idx: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0,
                           config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                           async_finish: bool = False, allocate_on_comm_stream: bool = False
                           ) -> Tuple[Union[Tensor, FP8Pair], Optional[Tensor], Optional[Tensor],
                                      Optional[List[int]], Optional[Tuple], EventOverlap]:
        """`dispatch` on a Buffer whose group spans several NVLink domains (what `dispatch` runs
        there); the same arguments and returns, the handle is the internode 10-tuple. On a
        single-domain Buffer it raises ValueError."""
        self._require_internode("Buffer.internode_dispatch")
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                             num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: Tensor, handle: Tuple, topk_weights: Optional[Tensor] = None,
                          bias: Union[None, Tensor, Tuple[Tensor, Tensor]] = None,
                          config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False
                          ) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """`combine` on a Buffer whose group spans several NVLink domains (what `combine` runs there);
        the same arguments and returns. On a single-domain Buffer it raises ValueError."""
        self._require_internode("Buffer.internode_combine")
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # ---- low-latency mode ----------------------------------------------------------------------
    # Synchronous and hook calls run on the current stream (nothing to order, lowest latency);
    # async calls run on the comm stream after the current stream, like normal-mode calls.
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset the low-latency signalling state for (T, H, E), e.g. after normal-mode calls used the memory."""
        c = self._begin("Buffer.clean_low_latency_buffer")
        shape = validate.ll_shape(c, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._low_latency(c, shape)
        self._backend.clean_low_latency_buffer(*shape)

    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Union[Tensor, FP8Pair], Tensor, Tuple, EventOverlap, Optional[Callable]]:
        """Send each token to its experts' ranks, packed per local expert (at most 2 results alive).

        Arguments:
            x: [N, H] bfloat16, N <= T; H % 8 == 0 (BF16), % 128 (FP8), % 512 (UE8M0).
            topk_idx: [N, K] topk_idx_t, -1 = none. T: identical on every rank. num_experts: E.
            cumulative_local_expert_recv_stats: [E_l] int32, incremented by the received counts.
            dispatch_wait_recv_cost_stats: [R] int64, accumulates wait time per source rank.
            use_fp8 / round_scale / use_ue8m0: FP8 e4m3 with per-128-channel scales, power-of-two scales,
                packed UE8M0 exponents (needs round_scale).
            async_finish: return an event instead of waiting; return_recv_hook: only send, return a
                hook that receives (exclusive with async_finish).
        Returns: recv_x ([E_l, R*T, H] bfloat16, or (fp8 [E_l, R*T, H], scales [E_l, R*T, H/128] float32
            or [E_l, R*T, H/512] int32, column-major in the last two dims)), recv_count [E_l] int32,
            handle (src_info, layout_range, T, H, E), event, hook (or None).
        """
        signature = None
        if async_finish is False and return_recv_hook is False and self._fast_path:
            signature = validate.ll_dispatch_signature(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                       cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                                       use_fp8, round_scale, use_ue8m0)
            run = self._ll_dispatch_runs.get(signature)
            if run is not None:
                self._backend.check_errors()
                r = run(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
                return ((r.recv_x, r.recv_x_scales) if use_fp8 else r.recv_x), r.recv_count, \
                    validate.owned_handle(r.handle, self._handle_owner, x.shape[0]), EventOverlap(), None
        c = self._begin("Buffer.low_latency_dispatch")
        if async_finish is not False or return_recv_hook is not False:
            async_finish, return_recv_hook = validate.exclusive_hook(c, async_finish, return_recv_hook)
        if not self._low_latency_checked:
            self._low_latency(c)
        args = validate.ll_dispatch_args(c, low_latency_layout.MAX_TOPK, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                         num_experts, cumulative_local_expert_recv_stats,
                                         dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0)
        x, _, num_max_tokens, num_experts, _, _, use_fp8, round_scale, use_ue8m0 = args[:9]
        key = (num_max_tokens, x.shape[1], num_experts, args[1].shape[1], use_fp8, round_scale, use_ue8m0)
        if key not in self._low_latency_agreed:
            self._agreed_low_latency(c, _LL_DISPATCH_ARGUMENTS, key)
        r, event = self._run(c, self._backend.low_latency_dispatch, (*args, return_recv_hook),
                             async_finish=async_finish)
        if signature is not None and key in self._low_latency_agreed:   # not agreed yet under graph capture
            backend, x_data, index = self._backend, args[0], args[1]
            self._remember(self._ll_dispatch_runs, signature,
                           getattr(backend, "low_latency_dispatch_runner", None) and
                           (lambda: backend.low_latency_dispatch_runner(x_data, index, key[0], key[2], *key[4:])),
                           lambda x, topk_idx, cumulative, wait: backend.low_latency_dispatch(
                               x, topk_idx, key[0], key[2], cumulative, wait, *key[4:], False))
        recv_x = (r.recv_x, r.recv_x_scales) if use_fp8 else r.recv_x
        hook = r.hook if r.hook is None else self._checked_hook(r.hook)
        return (*c.output((recv_x, r.recv_count)), self._returned_handle(c, r.handle, x.shape[0]), event, hook)

    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: Tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[Tensor] = None
                            ) -> Tuple[Tensor, EventOverlap, Optional[Callable]]:
        """Send expert outputs back and reduce them with the top-k weights (fp32 accumulation).

        Arguments:
            x: [E_l, R*T, H] bfloat16 in low_latency_dispatch's layout.
            topk_idx: [N, K] topk_idx_t and topk_weights: [N, K] float32 of the dispatched tokens.
            handle: low_latency_dispatch's handle. use_logfmt: compressed payload.
            zero_copy: x was already written into get_next_low_latency_combine_buffer(handle).
            out: optional [N, H] bfloat16 destination. combine_wait_recv_cost_stats: [R] int64.
            async_finish / return_recv_hook: as in low_latency_dispatch.
        Returns: combined_x [N, H] bfloat16, event, hook (or None).
        """
        signature = None
        if async_finish is False and return_recv_hook is False and self._fast_path:
            signature = validate.ll_combine_signature(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out,
                                                      combine_wait_recv_cost_stats, self._handle_owner)
            run = self._ll_combine_runs.get(signature)
            if run is not None:
                self._backend.check_errors()
                return run(x, topk_idx, topk_weights, handle, zero_copy, out, combine_wait_recv_cost_stats), \
                    EventOverlap(), None
        c = self._begin("Buffer.low_latency_combine")
        if async_finish is not False or return_recv_hook is not False:
            async_finish, return_recv_hook = validate.exclusive_hook(c, async_finish, return_recv_hook)
        if not self._low_latency_checked:
            self._low_latency(c)
        args = validate.ll_combine_args(c, low_latency_layout.MAX_TOPK, x, topk_idx, topk_weights, handle, use_logfmt,
                                        zero_copy, out, combine_wait_recv_cost_stats, self._handle_owner)
        if isinstance(handle, validate.Handle) and handle.num_tokens not in (None, args[1].shape[0]):
            raise c.error("topk_idx", f"must have the {handle.num_tokens} rows of the low_latency_dispatch that "
                                      f"made the handle, got {args[1].shape[0]}")
        key = (*args[3][2:], args[1].shape[1], args[4])
        if key not in self._low_latency_agreed:
            self._agreed_low_latency(c, _LL_COMBINE_ARGUMENTS, key)
        x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out_t, wait_stats = args
        (combined_x, hook), event = self._run(
            c, self._backend.low_latency_combine,
            (x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, return_recv_hook, out_t, wait_stats),
            async_finish=async_finish)
        if hook is not None:
            hook = self._checked_hook(hook)
        elif signature is not None and key in self._low_latency_agreed:
            backend = self._backend
            self._remember(self._ll_combine_runs, signature,
                           getattr(backend, "low_latency_combine_runner", None) and not use_logfmt and
                           (lambda: backend.low_latency_combine_runner(topk_idx, handle)),
                           lambda x, topk_idx, topk_weights, handle, zero_copy, out, wait: backend.low_latency_combine(
                               x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, False, out, wait)[0])
        # Hand the caller's own `out` object back, as DeepEP returns `out` itself.
        result = out if out is not None and combined_x is out_t else c.output(combined_x)
        return result, event, hook

    def get_next_low_latency_combine_buffer(self, handle: Tuple) -> Tensor:
        """The [E_l, R*T, H] bfloat16 view the next low_latency_combine(zero_copy=True) sends from."""
        c = self._begin("Buffer.get_next_low_latency_combine_buffer")
        handle = validate.ll_handle(c, handle, self._handle_owner)
        self._low_latency(c, handle[2:])   # (T, H, E)
        return c.output(self._backend.get_next_low_latency_combine_buffer(handle))

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask a rank for low-latency calls; needs enable_shrink."""
        c = self._begin("Buffer.low_latency_update_mask_buffer")
        self._shrink(c)
        rank_to_mask = c.integer("rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            raise c.error("rank_to_mask", f"must be a rank in [0, {self.group_size}), got {rank_to_mask}")
        self._backend.low_latency_update_mask_buffer(rank_to_mask, c.flag("mask", mask))

    def low_latency_query_mask_buffer(self, mask_status: Tensor) -> None:
        """Write each rank's mask state (1 masked, 0 not) into mask_status [R] int32; needs enable_shrink."""
        c = self._begin("Buffer.low_latency_query_mask_buffer")
        self._shrink(c)
        mask_status = c.tensor("mask_status", mask_status, validate.I32, (self.group_size,), "[num_ranks]")
        self._backend.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank; needs enable_shrink."""
        c = self._begin("Buffer.low_latency_clean_mask_buffer")
        self._shrink(c)
        self._backend.low_latency_clean_mask_buffer()

