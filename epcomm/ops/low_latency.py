"""Low-latency dispatch / combine on the GPU: one kernel each (cuda_src/low_latency.cu; protocol in
cuda_src/README.md), launched once per call, or twice with return_recv_hook (send part now,
receive part in the hook). Buffer layout: epcomm/ops/low_latency_layout.py.

The host path per call, kept to the minimum: the backend's lookup of the kernel and its cached Params
(one per buffer set, every call-independent field filled once), the outputs (the previous call's
on this set when nothing refers to them any more, see _Outputs; otherwise one torch allocation each:
5 for FP8 dispatch with the scales created column-major by empty_strided, 1 for combine, none with
`out=`), the per-call pointer fields, one launch (two with the hook). No host synchronisation, no
device-side bookkeeping launched from here: every call can be captured in a CUDA graph and replayed.
"""
from __future__ import annotations

import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import env
from ..backend import LowLatencyDispatchResult, LowLatencyHandle
from ..runtime import cuda_decls
from ..runtime.compiler import KernelSource
from ._common import INDEX_TYPES, backend_kernel, current_stream, plan_for, ptr
from .trace import TraceRows, trace_defines
from .low_latency_layout import MAX_TOPK, THREADS, Layout, dispatch_smem_bytes


_DECLS = cuda_decls.header("low_latency_protocol.cuh")
SEND, RECV = _DECLS.constant("kSend"), _DECLS.constant("kRecv")   # Params.phases bits
# ErrorRecord.phase names: the comments of the kernels' DispatchPhase / CombinePhase.
DISPATCH_PHASES = _DECLS.enum_comments("DispatchPhase")
COMBINE_PHASES = _DECLS.enum_comments("CombinePhase")
DispatchParams = _DECLS.struct("DispatchParams")
CombineParams = _DECLS.struct("CombineParams")


# ---- kernel specialisations --------------------------------------------------------------------
def dispatch_source(hidden: int, num_topk: int, num_ranks: int, num_experts: int, num_max_tokens: int,
                    use_fp8: bool, round_scale: bool, use_ue8m0: bool, index_dtype=torch.int64,
                    trace: bool = False) -> KernelSource:
    b = lambda v: "true" if v else "false"
    kernel = (f"epcomm::ll::dispatch_kernel<{hidden}, {num_topk}, {num_ranks}, {num_experts}, {num_max_tokens}, "
              f"{b(use_fp8)}, {b(use_fp8 and round_scale)}, {b(use_fp8 and use_ue8m0)}, "
              f"{INDEX_TYPES[index_dtype]}, {THREADS}>")
    return KernelSource("low_latency.cu", (kernel,), trace_defines(trace), uses_nvshmem=True)


def combine_source(hidden: int, num_topk: int, num_ranks: int, num_experts: int, num_max_tokens: int,
                   index_dtype=torch.int64, trace: bool = False) -> KernelSource:
    kernel = (f"epcomm::ll::combine_kernel<{hidden}, {num_topk}, {num_ranks}, {num_experts}, {num_max_tokens}, "
              f"{INDEX_TYPES[index_dtype]}, {THREADS}>")
    return KernelSource("low_latency.cu", (kernel,), trace_defines(trace), uses_nvshmem=True)


# ---- profiling builds (EPCOMM_LL_TRACE=1, or set_tracing) ------------------------------------
# Kernels built with -DEPCOMM_TRACE stamp %globaltimer per (block, warp) at the phase ends named
# here (cuda_src/low_latency_protocol.cuh, TraceSlot); last_trace() returns the latest launch's.
# The environment is read once, at import (ops/trace.py); set_tracing switches.
TRACE_SLOTS = _DECLS.enum_names("TraceSlot", "kTr")
TRACE_MEANING = {"dispatch": {"send_a": "messages sent", "send_b": "lists sent",
                              "recv_ready": "first pair's lists ready", "aux_a": "first message's stores issued",
                              "aux_b": "first message's release store done", "aux_c": "a list scanned",
                              "count": "messages sent by the warp"},
                 "combine": {"send_a": "records sent", "send_c": "items done",
                             "recv_ready": "first token's partials ready", "aux_a": "group's first item ready",
                             "aux_b": "group's first sum stored", "aux_c": "last flush started",
                             "count": "items the group sent"}}
_TRACE = TraceRows(THREADS // 32, len(TRACE_SLOTS), on=env.ll_trace())
last_trace = _TRACE.last   # [blocks, warps, len(TRACE_SLOTS)] of the latest traced launch
set_tracing = _TRACE.set_on   # bench/low_latency_trace.py


def tracing() -> bool:
    """Whether the next calls use the profiling builds."""
    return _TRACE.on


def representative_sources() -> List[KernelSource]:
    """For `python -m epcomm.jit --precompile`, in one unit: the targets.md setting (FP8 dispatch,
    BF16 combine, 2 ranks), power-of-two / UE8M0 scales on 8 ranks, BF16 dispatch with int32 indices,
    a full top-k (MAX_TOPK) combine with int32 indices on 4 ranks."""
    kernels = (dispatch_source(7168, 8, 2, 288, 128, True, False, False).kernels
               + combine_source(7168, 8, 2, 288, 128).kernels
               + dispatch_source(4096, 8, 8, 256, 256, True, True, True).kernels
               + dispatch_source(2048, 16, 4, 64, 64, False, False, False, torch.int32).kernels
               + combine_source(1024, MAX_TOPK, 4, 64, 64, torch.int32).kernels)
    return [KernelSource("low_latency.cu", kernels, uses_nvshmem=True)]


_use_count = getattr(torch._C, "_storage_Use_Count", None)   # a StorageImpl's reference count


class _Outputs:
    """The outputs of a plan's last call on one buffer set, handed out again by its next call on
    that set once nothing outside refers to them: each torch allocation costs several microseconds
    of host time, a large share of a low-latency call. As safe as the caching allocator's own
    reuse: the tensors go back only to the stream they were made on (stream order puts the new
    kernel after every use queued there), and only when neither a tensor object (Python reference
    count) nor any view of its storage nor its storage object (storage use count, the storage
    object's reference count) is left outside this pool. Never used
    during CUDA-graph capture (capture allocates from the graph's pool) nor for hook calls (the
    receive may run on another stream). The memory stays held while pooled, as a cached block."""

    __slots__ = ("stream", "tensors", "poison", "_storages", "_refs")

    def __init__(self):
        # poison: the fill launch of these outputs (ops/poison.py), False until a fast path made it
        self.stream, self.tensors, self.poison, self._storages, self._refs = None, None, False, (), ()

    def take(self, stream: int) -> Optional[tuple]:
        tensors = self.tensors
        if tensors is None or stream != self.stream:
            return None
        for t in tensors:
            # references: the pool's tuple, `t` and getrefcount's argument
            if t is not None and sys.getrefcount(t) != 3:
                return None
        # Each tensor's UntypedStorage, held by the pool: torch keeps one Python object per storage,
        # so a caller's untyped_storage() is this object and shows in its reference count (compared
        # with the count `keep` saw, taken by the same loop). Holders of the StorageImpl: its tensor
        # and that object (which keeps the address valid); a view or a detached alias adds one, a
        # tensor moved elsewhere with set_ leaves one: either way the set is not handed out.
        refs, i = self._refs, 0
        for storage in self._storages:
            if sys.getrefcount(storage) != refs[i] or _use_count(storage._cdata) != 2:
                return None
            i += 1
        return tensors

    def keep(self, stream: int, tensors: tuple, poison=False) -> None:
        if _use_count is None:   # a torch without the storage use count: never handed out again
            return
        storages = tuple([t.untyped_storage() for t in tensors if t is not None])
        refs = []
        for storage in storages:
            refs.append(sys.getrefcount(storage))
        self.stream, self.tensors, self.poison, self._storages, self._refs = stream, tensors, poison, storages, refs


class DispatchSpec(NamedTuple):
    """A low-latency dispatch plan's key (the Buffer fixes ranks, RDMA buffer and feature set)."""
    num_max_tokens: int          # T
    hidden: int
    num_experts: int
    num_topk: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    index_dtype: torch.dtype
    trace: bool


class CombineSpec(NamedTuple):
    num_max_tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    index_dtype: torch.dtype
    trace: bool


class _Plan:
    """A loaded kernel, its launch shape, one Params and one output pool per buffer set (set-fixed
    fields filled) and what the per-call path needs, computed once."""
    __slots__ = ("kernel", "smem", "params", "signal_shape", "hidden", "trace", "outputs")

    def __init__(self, kernel, smem: int, params, signal_shape, hidden: int, trace: bool):
        self.kernel, self.smem, self.params, self.signal_shape = kernel, smem, params, signal_shape
        self.hidden, self.trace = hidden, trace
        self.outputs = (_Outputs(), _Outputs())


class _DispatchPlan(_Plan):
    """Adds the shapes of the outputs; `scales`: (shape, strides, dtype) or None for BF16."""
    __slots__ = ("x_shape", "x_dtype", "scales", "src_info_shape", "layout_shape", "count_shape")


class _CombinePlan(_Plan):
    __slots__ = ("zero_copy_x",)   # per buffer set: the send buffer a zero-copy combine reads


# torch's raw capture query where the build has it (its Python wrapper adds a frame per call)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


# ---- the per-Buffer state -----------------------------------------------------------------------
class LowLatency:
    """Low-latency mode of one GpuBackend (`gb`): see epcomm/gpu.py for the state used."""

    def __init__(self, gb):
        from ..runtime.status import register_op
        if gb.rdma is None:
            raise ValueError("low-latency mode needs num_rdma_bytes > 0 (Buffer.get_low_latency_rdma_size_hint)")
        self.gb = gb
        self.rank, self.num_ranks = gb.rank, gb.num_ranks
        self.dispatch_op = register_op("low_latency_dispatch", DISPATCH_PHASES)
        self.combine_op = register_op("low_latency_combine", COMBINE_PHASES)
        use_nvlink = bool(gb.options.get("allow_nvlink_for_low_latency_mode", True))
        self.use_nvlink = int(use_nvlink)
        # Puts are needed as soon as one other rank is not written directly.
        self.needs_puts = any(r != self.rank and not (use_nvlink and gb.rdma.peer_ptrs[r])
                              for r in range(self.num_ranks))
        self.enable_shrink = int(bool(gb.options.get("enable_shrink", False)))
        self.next_set = 0                 # buffer set of the next call (both kinds alternate)
        self.signal_shape: Optional[Tuple[int, int]] = None   # (T, E) the signals are laid out for
        self._combine_views: Dict[tuple, torch.Tensor] = {}
        self._grid, self._block = (gb.arch.num_sms, 1, 1), (THREADS, 1, 1)
        self._device_index = gb.device_index
        any_layout = Layout(1, 8, self.num_ranks, self.num_ranks)   # the control region ignores (T, H, E)
        self._mask = gb.rdma.view(torch.int32, (self.num_ranks,), any_layout.mask)

    # ---- shared plumbing -----------------------------------------------------------------------
    def _layout(self, T: int, H: int, E: int) -> Layout:
        layout = Layout(T, H, self.num_ranks, E)
        if layout.total_bytes > self.gb.rdma.nbytes:
            raise ValueError(f"low-latency mode with T={T}, H={H}, E={E} needs {layout.total_bytes} bytes of "
                             f"RDMA buffer (Buffer.get_low_latency_rdma_size_hint), this Buffer has "
                             f"{self.gb.rdma.nbytes}")
        return layout

    def _check_signals(self, shape: Tuple[int, int], H: int) -> None:
        """The signals are laid out for one (T, E) at a time; the first call fixes it."""
        if self.signal_shape == shape:
            return
        if self.signal_shape is not None:
            T, E = shape
            raise ValueError(
                f"low-latency calls switched from (num_max_dispatch_tokens_per_rank, num_experts) = "
                f"{self.signal_shape} to {shape}: the signalling state moves with them; call "
                f"clean_low_latency_buffer({T}, {H}, {E}) on every rank first")
        self.signal_shape = shape

    def _fill_shared(self, params, layout: Layout, buffer_set: int, op: int) -> None:
        gb, base = self.gb, self.gb.rdma.ptr
        params.heap, params.peer_bases = base, gb.rdma.peer_table.data_ptr()
        params.acks, params.epochs = base + layout.acks(buffer_set), base + layout.epochs(buffer_set)
        params.tickets = base + layout.tickets(buffer_set)
        params.mask, params.failed, params.err = base + layout.mask, base + layout.failed, gb.status.device_ptr
        params.wait_notes = base + layout.wait_notes
        params.rank, params.op = self.rank, op
        params.use_nvlink, params.enable_shrink = self.use_nvlink, self.enable_shrink
        params.timeout_ns = gb.timeout_ns

    def _set_for_call(self, plan: _Plan) -> int:
        """This call's buffer set (its Params has the set-fixed fields already)."""
        if plan.signal_shape != self.signal_shape:
            self._check_signals(plan.signal_shape, plan.hidden)
        buffer_set, self.next_set = self.next_set, self.next_set ^ 1
        return buffer_set

    def _launch(self, plan: _Plan, params, stream: Optional[int] = None) -> None:
        stream = current_stream(self._device_index) if stream is None else stream
        plan.kernel.launch(self._grid, self._block, params, stream, smem=plan.smem)

    def _hooked(self, plan: _Plan, params, keep_alive: tuple):
        """Launch the send part now; return the hook that launches the receive part (on the stream
        current when it is called). The hook holds the outputs until the receive part is queued."""
        params.phases = SEND
        self._launch(plan, params)
        recv = type(params).from_buffer_copy(params)
        recv.phases = RECV
        held = list(keep_alive)

        def hook():
            self._launch(plan, recv)
            held.clear()
        return hook

    def _kernel(self, src: KernelSource):
        return backend_kernel(self.gb, src)

    # ---- dispatch ----------------------------------------------------------------------------
    def _dispatch_plan(self, gb, spec: DispatchSpec) -> _DispatchPlan:
        T, H, E, K, fp8, round_scale, ue8m0, index_dtype, trace = spec
        layout, R = self._layout(T, H, E), self.num_ranks
        kernel = self._kernel(dispatch_source(H, K, R, E, T, fp8, round_scale, ue8m0, index_dtype, trace))
        smem = dispatch_smem_bytes(H, K, fp8)
        kernel.set_max_dynamic_smem(smem)
        params = tuple(self._dispatch_params(layout, buffer_set) for buffer_set in (0, 1))
        E_l, slots = E // R, R * T
        scales = None
        if fp8:   # [E_l, R*T, S] stored column-major in the last two dims (as [E_l, S, R*T]), as DeepEP
            S = H // 512 if ue8m0 else H // 128
            scales = ((E_l, slots, S), (S * slots, 1, slots), torch.int32 if ue8m0 else torch.float32)
        plan = _DispatchPlan(kernel, smem, params, (T, E), H, trace)
        plan.x_shape, plan.x_dtype = (E_l, slots, H), torch.float8_e4m3fn if fp8 else torch.bfloat16
        plan.scales, plan.src_info_shape = scales, (E_l, slots)
        plan.layout_shape, plan.count_shape = (E_l, R), (E_l,)
        return plan

    def _dispatch_params(self, layout: Layout, buffer_set: int) -> DispatchParams:
        params, base = DispatchParams(), self.gb.rdma.ptr
        self._fill_shared(params, layout, buffer_set, self.dispatch_op)
        params.token_tags, params.list_tags = base + layout.token_tags(buffer_set), base + layout.list_tags(buffer_set)
        params.lists, params.messages = base + layout.lists(buffer_set), base + layout.recv(buffer_set)
        params.message_stage, params.list_stage = base + layout.send(buffer_set), base + layout.list_stage(buffer_set)
        params.stage_for_puts = int(self.needs_puts)
        return params

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                 use_ue8m0, return_recv_hook) -> LowLatencyDispatchResult:
        T, E = num_max_dispatch_tokens_per_rank, num_experts
        N, H = x.shape
        key = (T, H, E, topk_idx.shape[1], use_fp8, use_fp8 and round_scale, use_fp8 and use_ue8m0,
               topk_idx.dtype, _TRACE.on)
        plan = plan_for(self.gb, DispatchSpec, key, self._dispatch_plan)
        buffer_set = self._set_for_call(plan)
        params, stream = plan.params[buffer_set], current_stream(self._device_index)
        pool = None if return_recv_hook or _capturing() else plan.outputs[buffer_set]
        outputs = pool.take(stream) if pool is not None else None
        if outputs is None:
            device = x.device
            scales = None
            if plan.scales is not None:
                scales = torch.empty_strided(plan.scales[0], plan.scales[1], dtype=plan.scales[2], device=device)
            outputs = (torch.empty(plan.x_shape, dtype=plan.x_dtype, device=device), scales,
                       torch.empty(plan.src_info_shape, dtype=torch.int32, device=device),
                       torch.empty(plan.layout_shape, dtype=torch.int64, device=device),
                       torch.empty(plan.count_shape, dtype=torch.int32, device=device))
            if pool is not None:
                pool.keep(stream, outputs)
        recv_x, scales, src_info, layout_range, recv_count = outputs
        del outputs
        params.x, params.topk_idx, params.num_tokens = x.data_ptr(), topk_idx.data_ptr(), N
        params.recv_x, params.recv_scales = recv_x.data_ptr(), ptr(scales)
        params.recv_src_info, params.recv_layout_range = src_info.data_ptr(), layout_range.data_ptr()
        params.recv_count = recv_count.data_ptr()
        params.cumulative_recv_stats = ptr(cumulative_local_expert_recv_stats)
        params.wait_recv_cost_stats = ptr(dispatch_wait_recv_cost_stats)
        params.trace = _TRACE.zeroed(self._device_index, self._grid[0]) if plan.trace else 0
        hook = None
        if return_recv_hook:
            hook = self._hooked(plan, params, (recv_x, scales, src_info, layout_range, recv_count,
                                          cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats))
        else:
            params.phases = SEND | RECV
            self._launch(plan, params, stream)
        return LowLatencyDispatchResult(recv_x, scales, recv_count,
                                        LowLatencyHandle(src_info, layout_range, T, H, E), hook)

    # ---- combine -----------------------------------------------------------------------------
    def _combine_plan(self, gb, spec: CombineSpec) -> _CombinePlan:
        T, H, E, K, index_dtype, trace = spec
        layout = self._layout(T, H, E)
        kernel = self._kernel(combine_source(H, K, self.num_ranks, E, T, index_dtype, trace))
        params = tuple(self._combine_params(layout, buffer_set) for buffer_set in (0, 1))
        send = tuple(self.gb.rdma.ptr + layout.send(buffer_set) for buffer_set in (0, 1))   # the zero-copy buffers
        plan = _CombinePlan(kernel, 0, params, (T, E), H, trace)
        plan.zero_copy_x = send
        return plan

    def _combine_params(self, layout: Layout, buffer_set: int) -> CombineParams:
        params, base = CombineParams(), self.gb.rdma.ptr
        self._fill_shared(params, layout, buffer_set, self.combine_op)
        params.record_tags = base + layout.record_tags(buffer_set)
        params.partial_tags = base + layout.partial_tags(buffer_set)
        params.records, params.partials = base + layout.records(buffer_set), base + layout.recv(buffer_set)
        params.record_stage = base + layout.record_stage(buffer_set)
        params.partial_stage = base + layout.partial_stage(buffer_set)
        return params

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, return_recv_hook, out,
                combine_wait_recv_cost_stats):
        if use_logfmt:
            raise NotImplementedError("low_latency_combine(use_logfmt=True): the LogFMT compressed combine "
                                      "payload is not implemented; use BF16 (use_logfmt=False)")
        src_info, layout_range, T, H, E = handle
        N, K = topk_idx.shape
        plan = plan_for(self.gb, CombineSpec, (T, H, E, K, topk_idx.dtype, _TRACE.on), self._combine_plan)
        buffer_set = self._set_for_call(plan)
        params, stream = plan.params[buffer_set], current_stream(self._device_index)
        if out is None:
            pool = None if return_recv_hook or _capturing() else plan.outputs[buffer_set]
            pooled = pool.take(stream) if pool is not None else None
            if pooled is not None and pooled[0].shape[0] == N:
                out = pooled[0]
            else:
                out = torch.empty((N, H), dtype=torch.bfloat16, device=topk_idx.device)
                if pool is not None:
                    pool.keep(stream, (out,))
            del pooled
        # zero_copy: the data is in this set's send buffer (get_next_low_latency_combine_buffer).
        params.x = plan.zero_copy_x[buffer_set] if zero_copy else x.data_ptr()
        params.src_info, params.layout_range = src_info.data_ptr(), layout_range.data_ptr()
        params.topk_idx, params.topk_weights = topk_idx.data_ptr(), topk_weights.data_ptr()
        params.out, params.num_tokens = out.data_ptr(), N
        params.wait_recv_cost_stats = ptr(combine_wait_recv_cost_stats)
        params.trace = _TRACE.zeroed(self._device_index, self._grid[0]) if plan.trace else 0
        if return_recv_hook:
            return out, self._hooked(plan, params, (out, topk_idx, topk_weights, combine_wait_recv_cost_stats))
        params.phases = SEND | RECV
        self._launch(plan, params, stream)
        return out, None

    def next_combine_buffer(self, handle) -> torch.Tensor:
        _, _, T, H, E = handle
        key = (T, H, E, self.next_set)
        view = self._combine_views.get(key)
        if view is None:
            layout = self._layout(T, H, E)
            view = self._combine_views[key] = self.gb.rdma.view(
                torch.bfloat16, (E // self.num_ranks, self.num_ranks * T, H), layout.send(self.next_set))
        return view

    # ---- per-signature fast paths ---------------------------------------------------------------
    # Buffer validates a call's signature (shapes, dtypes, flags) once and then calls the runner
    # made here for it: the plan resolved, its Params copied with every field the signature fixes
    # set, the launches bound; a call sets the pointers, takes its outputs and launches. `poison`
    # (ops/poison.py) fills the outputs after a failed wait; `general` is the backend's method,
    # taken while a profiling build is switched on (set_tracing), which the runner does not cover
    # (none is made while it is on: the Buffer then calls the method itself).
    def _runner_plan(self, spec_type, key, build):
        plan = plan_for(self.gb, spec_type, key, build)
        params = tuple(type(p).from_buffer_copy(p) for p in plan.params)
        for p in params:
            p.trace, p.phases = 0, SEND | RECV
        launches = tuple(plan.kernel.launcher(self._grid, self._block, p, plan.smem) for p in params)
        return plan, params, launches

    def dispatch_runner(self, N, H, K, index_dtype, T, E, use_fp8, round_scale, use_ue8m0, poison, general):
        """run(x, topk_idx, cumulative_stats, wait_stats) -> LowLatencyDispatchResult (no hook);
        None while tracing."""
        if _TRACE.on:
            return None
        key = (T, H, E, K, use_fp8, use_fp8 and round_scale, use_fp8 and use_ue8m0, index_dtype, False)
        plan, params, launches = self._runner_plan(DispatchSpec, key, self._dispatch_plan)
        for p in params:
            p.num_tokens = N
        device, device_index, outputs_of = self.gb.device, self._device_index, plan.outputs
        x_shape, x_dtype, scales, info_shape = plan.x_shape, plan.x_dtype, plan.scales, plan.src_info_shape
        layout_shape, count_shape, signal_shape = plan.layout_shape, plan.count_shape, plan.signal_shape
        empty, i32, i64, new_tuple = torch.empty, torch.int32, torch.int64, tuple.__new__

        def run(x, topk_idx, cumulative, wait_stats):
            if _TRACE.on:
                return general(x, topk_idx, T, E, cumulative, wait_stats, use_fp8, round_scale, use_ue8m0, False)
            if signal_shape != self.signal_shape:
                self._check_signals(signal_shape, H)
            buffer_set = self.next_set
            self.next_set = buffer_set ^ 1
            stream = current_stream(device_index)
            pool = None if _capturing() else outputs_of[buffer_set]
            outputs = pool.take(stream) if pool is not None else None
            if outputs is None:
                s = None if scales is None else torch.empty_strided(scales[0], scales[1], dtype=scales[2], device=device)
                outputs = (empty(x_shape, dtype=x_dtype, device=device), s, empty(info_shape, dtype=i32, device=device),
                           empty(layout_shape, dtype=i64, device=device), empty(count_shape, dtype=i32, device=device))
                fill = poison.prepared(outputs[0], s, outputs[4])
                if pool is not None:
                    pool.keep(stream, outputs, fill)
            else:
                fill = pool.poison
                if fill is False:
                    fill = pool.poison = poison.prepared(outputs[0], outputs[1], outputs[4])
            recv_x, s, src_info, layout_range, recv_count = outputs
            del outputs
            p = params[buffer_set]
            p.x, p.topk_idx, p.recv_x = x.data_ptr(), topk_idx.data_ptr(), recv_x.data_ptr()
            p.recv_scales = 0 if s is None else s.data_ptr()
            p.recv_src_info, p.recv_layout_range = src_info.data_ptr(), layout_range.data_ptr()
            p.recv_count = recv_count.data_ptr()
            p.cumulative_recv_stats = 0 if cumulative is None else cumulative.data_ptr()
            p.wait_recv_cost_stats = 0 if wait_stats is None else wait_stats.data_ptr()
            launches[buffer_set](stream)
            if fill is not None:
                fill(stream)
            # tuple.__new__: the NamedTuples' own constructors are Python frames
            return new_tuple(LowLatencyDispatchResult, (recv_x, s, recv_count, new_tuple(
                LowLatencyHandle, (src_info, layout_range, T, H, E)), None))
        return run

    def combine_runner(self, N, K, index_dtype, T, H, E, poison, general):
        """run(x, topk_idx, topk_weights, handle, zero_copy, out, wait_stats) -> combined_x (no hook);
        None while tracing."""
        if _TRACE.on:
            return None
        plan, params, launches = self._runner_plan(CombineSpec, (T, H, E, K, index_dtype, False), self._combine_plan)
        for p in params:
            p.num_tokens = N
        device, device_index, outputs_of = self.gb.device, self._device_index, plan.outputs
        signal_shape, zero_copy_x, bf16 = plan.signal_shape, plan.zero_copy_x, torch.bfloat16

        def run(x, topk_idx, topk_weights, handle, zero_copy, out, wait_stats):
            if _TRACE.on:
                return general(x, topk_idx, topk_weights, handle, False, zero_copy, False, out, wait_stats)[0]
            if signal_shape != self.signal_shape:
                self._check_signals(signal_shape, H)
            buffer_set = self.next_set
            self.next_set = buffer_set ^ 1
            stream = current_stream(device_index)
            fill = None
            if out is None:
                pool = None if _capturing() else outputs_of[buffer_set]
                pooled = pool.take(stream) if pool is not None else None
                if pooled is not None and pooled[0].shape[0] == N:
                    out, fill = pooled[0], pool.poison
                    if fill is False:
                        fill = pool.poison = poison.prepared(out)
                else:
                    out = torch.empty((N, H), dtype=bf16, device=device)
                    fill = poison.prepared(out)
                    if pool is not None:
                        pool.keep(stream, (out,), fill)
                del pooled
            else:
                fill = poison.prepared(out)
            p = params[buffer_set]
            p.x = zero_copy_x[buffer_set] if zero_copy else x.data_ptr()
            p.src_info, p.layout_range = handle[0].data_ptr(), handle[1].data_ptr()
            p.topk_idx, p.topk_weights, p.out = topk_idx.data_ptr(), topk_weights.data_ptr(), out.data_ptr()
            p.wait_recv_cost_stats = 0 if wait_stats is None else wait_stats.data_ptr()
            launches[buffer_set](stream)
            if fill is not None:
                fill(stream)
            return out
        return run

    # ---- maintenance -------------------------------------------------------------------------
    def clean_buffer(self, T: int, H: int, E: int) -> None:
        """Collective: reset the call counters, acknowledgements, tags and the kernels' failure flag
        for (T, H, E) on every rank (the mask is kept; a recorded failure still makes the Buffer
        unusable through the host record; each kernel clears the wait notes itself). Synchronises
        the GPU and all ranks; not for CUDA graphs."""
        layout = self._layout(T, H, E)
        self.gb.nvshmem.barrier_all()   # no rank still runs a low-latency kernel
        self.gb.rdma.view(torch.uint8, (layout.mask,), 0).zero_()
        self.gb.rdma.view(torch.uint8, (layout.signals_end - layout.control_bytes,), layout.control_bytes).zero_()
        self.gb.nvshmem.barrier_all()   # every rank is clean before any rank sends again
        self.next_set, self.signal_shape = 0, (T, E)

    def mask_state(self) -> torch.Tensor:
        return self._mask.clone()

    def restart(self, mask: torch.Tensor) -> None:
        """After every rank zeroed its whole RDMA buffer (GpuBackend.recover): both buffer sets
        count calls from zero again, any (T, E) may come next, the mask is put back."""
        self._mask.copy_(mask)
        self.next_set, self.signal_shape = 0, None

    def update_mask(self, rank: int, mask: bool) -> None:
        self._mask[rank] = int(bool(mask))

    def query_mask(self, mask_status: torch.Tensor) -> None:
        mask_status.copy_(self._mask)

    def clean_mask(self) -> None:
        self._mask.zero_()
