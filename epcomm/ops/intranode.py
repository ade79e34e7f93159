"""Normal-mode intranode dispatch / combine on the GPU (cuda_src/intranode.cu; protocol in cuda_src/README.md).

A fresh dispatch is two launches on the current stream: `notify` (exchange counts, build the
routing tables) then the data kernel; with num_worst_tokens == 0 the host reads the counts in
between (one small D2H copy + stream sync) to size the outputs exactly; with num_worst_tokens > 0
nothing touches the host (CUDA-graph capturable). A cached dispatch and a combine are one launch.

Handle (6-tuple), all int32 CUDA tensors except element 4:
  0 rank_prefix_matrix  [R, R]: [i][j] = tokens sent to rank j by ranks 0..i
  1 channel_prefix_matrix [R, G+1]: this rank's tokens are cut into G chunks of ceil(N/G)
    consecutive tokens; [j][g] = how many of the tokens before chunk g go to rank j ([j][G] = all)
  2 recv_channel_prefix_matrix [R, G+1]: [s][g] = rank s's channel_prefix_matrix[self][g], i.e.
    where chunk g of source s starts among the rows received from s
  3 recv_src_idx [M]: the row's token index on its source rank (-1 on padding rows)
  4 is_token_in_rank [N, R] bool, as given
  5 send_head [N, R]: index of token t among this rank's tokens that go to rank j, -1 if not sent
G comes from Config.num_sms (intranode_plan.num_chunks) and must be equal on every rank.
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from .. import env
from ..backend import DispatchResult, IntranodeHandle
from ..runtime.compiler import KernelSource
from ..runtime.status import register_op
from . import intranode_plan as plan
from ._common import INDEX_TYPES, aligned, backend_kernel, host_ints, launch_1d, plan_for, ptr, current_stream
from .trace import TraceRows, trace_defines

DISPATCH_OP = register_op("intranode dispatch", plan.PHASES)
COMBINE_OP = register_op("intranode combine", plan.PHASES)


def representative_sources() -> List[KernelSource]:
    """For --precompile: H = 7168 on 2 and 8 ranks; BF16 and FP8 (56 scales), both index types,
    fresh and cached dispatch, combine."""
    names = [plan.notify_kernel(2), plan.notify_kernel(8),
             plan.dispatch_kernel(2, 7168 * 2, 0, "long long", True),
             plan.dispatch_kernel(2, 7168, 56, "int", True),
             plan.dispatch_kernel(2, 7168 * 2, 0, "int", False),
             plan.dispatch_kernel(8, 7168 * 2, 0, "long long", True),
             plan.combine_kernel(2, 7168 * 2), plan.combine_kernel(8, 7168 * 2)]
    return [kernel_source(name) for name in names]


def kernel_source(name: str, trace: bool = False) -> KernelSource:
    """The unit that builds one intranode kernel (a name from intranode_plan: notify_kernel, ...)."""
    return KernelSource("intranode.cu", (name,), trace_defines(trace))


def _kernel(gb, name: str, trace: bool):
    return backend_kernel(gb, kernel_source(name, trace))


# ---- profiling mode (EPCOMM_INTRANODE_TRACE=1) -----------------------------------------------
# Kernels built with -DEPCOMM_TRACE stamp %globaltimer per warp and phase into a device
# buffer (slots: intranode_plan.TRACE_SLOTS); last_trace() returns the latest launch's stamps.
# The environment is read once, at import (ops/trace.py); set_tracing switches.
_TRACE = TraceRows(plan.TRACE_WARPS, len(plan.TRACE_SLOTS), on=env.intranode_trace())
set_tracing = _TRACE.set_on   # bench/intranode_trace.py
last_trace = _TRACE.last   # [blocks, TRACE_WARPS, len(TRACE_SLOTS)] of the latest traced launch


# ---- checks, plans ----------------------------------------------------------------------------
def _prepare(gb, num_sms: int, what: str) -> None:
    """The checks of a new plan. (The NVL buffer, hence the signal header, is zero from construction.)"""
    nvl = gb.nvl
    if nvl is None:
        raise ValueError(f"{what}: intranode mode needs an NVL buffer; build the Buffer with "
                         f"num_nvl_bytes > 0 (Config.get_nvl_buffer_size_hint gives a good size)")
    if num_sms > gb.arch.num_sms:
        raise ValueError(f"{what}: Config.num_sms={num_sms} exceeds the device's "
                         f"{gb.arch.num_sms} SMs")
    header = plan.header_bytes(gb.num_ranks)
    if header > nvl.nbytes:
        raise ValueError(f"{what}: num_nvl_bytes={nvl.nbytes} is smaller than the {header}-byte "
                         f"signal header of {gb.num_ranks} ranks (Config.get_nvl_buffer_size_hint)")
    if not all(nvl.peer_ptrs):
        unreachable = [r for r, ptr in enumerate(nvl.peer_ptrs) if not ptr]
        raise ValueError(f"{what}: ranks {unreachable} are not reachable over NVLink/P2P from rank "
                         f"{gb.rank}; intranode mode needs every rank in one NVLink domain")


class DispatchSpec(NamedTuple):
    """An intranode dispatch plan's key (the Buffer fixes ranks, NVL buffer and feature set)."""
    num_sms: int
    row_bytes: int
    num_scales: int
    num_topk: int
    index_type: str
    num_local_experts: int
    fresh: bool
    trace: bool


class CombineSpec(NamedTuple):
    num_sms: int
    row_bytes: int
    num_topk: int
    trace: bool


class _Plan:
    """A data kernel's launch besides the tensors (the host path is the whole cost of a small
    call): `params` is the kernel's Params with the fields fixed for the spec already set; a call
    sets the rest and launches it (the launch copies the struct, so one object serves every call)."""
    __slots__ = ("kernel", "blocks", "send_blocks", "staging", "record", "rows", "params")

    def __init__(self, gb, kernel, split, staging: int, record: int, rows: int, params_type, op: int):
        self.kernel, self.blocks, self.send_blocks = kernel, split.blocks, split.send_blocks
        self.staging, self.record, self.rows = staging, record, rows
        self.params = params_type(peer_bases=gb.nvl.peer_table.data_ptr(), err=gb.status.device_ptr,
                                  timeout_ns=gb.timeout_ns, staging_offset=staging, ring_rows=rows,
                                  record_bytes=record, rank=gb.rank, num_send_blocks=split.send_blocks, op=op)


def _dispatch_plan(gb, spec: DispatchSpec) -> _Plan:
    _prepare(gb, spec.num_sms, "dispatch")
    num_ranks = gb.num_ranks
    staging = plan.dispatch_staging_offset(num_ranks, spec.num_local_experts) if spec.fresh else \
        plan.combine_staging_offset(num_ranks)
    record = plan.dispatch_record_bytes(spec.row_bytes, spec.num_scales, spec.num_topk)
    rows = plan.ring_rows(gb.nvl.nbytes, staging, record, num_ranks, "dispatch")
    name = plan.dispatch_kernel(num_ranks, spec.row_bytes, spec.num_scales, spec.index_type, spec.fresh)
    return _Plan(gb, _kernel(gb, name, spec.trace), plan.dispatch_split(spec.num_sms, num_ranks),
                 staging, record, rows, plan.DispatchParams, DISPATCH_OP)


def _combine_plan(gb, spec: CombineSpec) -> _Plan:
    _prepare(gb, spec.num_sms, "combine")
    num_ranks = gb.num_ranks
    staging = plan.combine_staging_offset(num_ranks)
    record = plan.combine_record_bytes(spec.row_bytes, spec.num_topk)
    rows = plan.ring_rows(gb.nvl.nbytes, staging, record, num_ranks, "combine")
    return _Plan(gb, _kernel(gb, plan.combine_kernel(num_ranks, spec.row_bytes), spec.trace),
                 plan.combine_split(spec.num_sms, num_ranks), staging, record, rows, plan.CombineParams,
                 COMBINE_OP)


# ---- dispatch --------------------------------------------------------------------------------
def dispatch(gb, x, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
             num_worst_tokens, config) -> DispatchResult:
    """Backend.dispatch for ranks in one NVLink domain (arguments validated by Buffer)."""
    what = "dispatch"
    num_ranks, device, trace = gb.num_ranks, gb.device, _TRACE.on
    x = aligned(x)
    num_tokens, hidden = x.shape
    row_bytes = hidden * x.element_size()
    num_scales = 0 if x_scales is None else x_scales.shape[1]
    fresh = handle is None

    if fresh:
        topk_idx, topk_weights = aligned(topk_idx), aligned(topk_weights)
        if num_worst_tokens == 0 and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what}: an exact-size dispatch reads the received counts on the host, "
                               f"which a CUDA graph cannot capture; pass num_worst_tokens > 0 (or a "
                               f"cached handle) under capture")
        chunks = plan.num_chunks(config.num_sms, num_ranks)
        num_local_experts = num_tokens_per_expert.shape[0] // num_ranks
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        index_type = INDEX_TYPES[topk_idx.dtype] if topk_idx is not None else "int"
        # Checks (ValueError) before anything is launched.
        planned = plan_for(gb, DispatchSpec, (config.num_sms, row_bytes, num_scales, num_topk, index_type,
                                              num_local_experts, True, trace), _dispatch_plan)
        rank_prefix, channel_prefix, recv_channel_prefix, send_head, info = _notify(
            gb, is_token_in_rank, num_tokens_per_expert, chunks, num_local_experts, trace)
        expert_counts: List[int] = []
        if num_worst_tokens > 0:
            num_out_rows = num_worst_tokens
        else:
            num_out_rows, expert_counts = _read_counts(gb, info, chunks, num_local_experts,
                                                       expert_alignment, planned, what)
    else:
        rank_prefix, channel_prefix, recv_channel_prefix, recv_src, is_token_in_rank, send_head = handle
        chunks = channel_prefix.shape[1] - 1
        num_local_experts, num_topk, index_type = 0, 0, "int"
        topk_idx = topk_weights = None
        num_out_rows = recv_src.shape[0]   # exact M, or num_worst_tokens of the fresh call
        planned = plan_for(gb, DispatchSpec, (config.num_sms, row_bytes, num_scales, 0, "int", 0, False, trace),
                           _dispatch_plan)

    recv_x = torch.empty((num_out_rows, hidden), dtype=x.dtype, device=device)
    recv_scales = None if x_scales is None else \
        torch.empty((num_out_rows, num_scales), dtype=torch.float32, device=device)
    recv_topk_idx = recv_topk_weights = recv_src_idx = None
    if fresh:
        recv_src_idx = torch.empty((num_out_rows,), dtype=torch.int32, device=device)
        if num_topk:
            recv_topk_idx = torch.empty((num_out_rows, num_topk), dtype=topk_idx.dtype, device=device)
            recv_topk_weights = torch.empty((num_out_rows, num_topk), dtype=torch.float32, device=device)

    params = planned.params
    params.x, params.x_scales = ptr(x), ptr(x_scales)
    params.topk_idx, params.topk_weights = ptr(topk_idx), ptr(topk_weights)
    params.rank_prefix, params.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
    params.recv_channel_prefix, params.send_head = recv_channel_prefix.data_ptr(), ptr(send_head)
    params.recv_x, params.recv_x_scales, params.recv_src_idx = ptr(recv_x), ptr(recv_scales), ptr(recv_src_idx)
    params.recv_topk_idx, params.recv_topk_weights = ptr(recv_topk_idx), ptr(recv_topk_weights)
    params.scale_stride_token, params.scale_stride_group = x_scales.stride() if x_scales is not None else (0, 0)
    params.num_tokens, params.num_chunks = num_tokens, chunks
    params.tokens_per_chunk = plan.tokens_per_chunk(num_tokens, chunks)
    params.num_topk, params.num_local_experts, params.num_out_rows = num_topk, num_local_experts, num_out_rows
    params.trace = _TRACE.zeroed(gb.device_index, planned.blocks) if trace else 0
    launch_1d(gb, planned.kernel, planned.blocks, plan.THREADS, params)

    if not fresh:
        return DispatchResult(recv_x, recv_scales, None, None, None, None)
    new_handle = IntranodeHandle(rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx,
                                 is_token_in_rank, send_head)
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_counts,
                          new_handle)


def _notify(gb, is_token_in_rank, num_tokens_per_expert, chunks, num_local_experts, trace):
    num_ranks, device = gb.num_ranks, gb.device
    num_tokens = is_token_in_rank.shape[0]
    info = torch.empty((num_ranks * num_ranks + num_local_experts + 1,), dtype=torch.int32, device=device)
    channel_prefix = torch.empty((num_ranks, chunks + 1), dtype=torch.int32, device=device)
    recv_channel_prefix = torch.empty((num_ranks, chunks + 1), dtype=torch.int32, device=device)
    send_head = torch.empty((num_tokens, num_ranks), dtype=torch.int32, device=device)
    params = plan.NotifyParams(
        is_token_in_rank=ptr(is_token_in_rank), num_tokens_per_expert=ptr(num_tokens_per_expert),
        info=ptr(info), channel_prefix=ptr(channel_prefix),
        recv_channel_prefix=ptr(recv_channel_prefix), send_head=ptr(send_head),
        peer_bases=gb.nvl.peer_table.data_ptr(), err=gb.status.device_ptr, timeout_ns=gb.timeout_ns,
        notify_offset=plan.header_bytes(num_ranks), num_tokens=num_tokens, num_chunks=chunks,
        tokens_per_chunk=plan.tokens_per_chunk(num_tokens, chunks),
        num_local_experts=num_local_experts, notify_ints=plan.notify_ints(num_ranks, num_local_experts),
        rank=gb.rank, op=DISPATCH_OP, trace=_TRACE.zeroed(gb.device_index, 1) if trace else 0)
    launch_1d(gb, _kernel(gb, plan.notify_kernel(num_ranks), trace), 1, plan.NOTIFY_THREADS, params)
    rank_prefix = info[:num_ranks * num_ranks].view(num_ranks, num_ranks)
    return rank_prefix, channel_prefix, recv_channel_prefix, send_head, info


def _read_counts(gb, info, chunks, num_local_experts, expert_alignment, planned, what):
    """Exact mode: wait for notify, read the counts; every rank reads the same rank_prefix_matrix
    and N max, so the checks below raise on all ranks alike. (Ranks with different Config.num_sms
    or num_experts were recorded by the notify kernel: check_errors raises that.)"""
    num_ranks = gb.num_ranks
    values = host_ints(gb, info)
    rank_prefix = values[:num_ranks * num_ranks]
    experts = values[num_ranks * num_ranks:num_ranks * num_ranks + num_local_experts]
    max_tokens = values[-1]
    rows, record = planned.rows, planned.record
    chunk_rows = plan.tokens_per_chunk(max_tokens, chunks)
    if num_ranks > 1 and chunk_rows > rows:
        raise ValueError(f"{what}: a chunk of up to {chunk_rows} rows ({max_tokens} tokens / {chunks} "
                         f"chunks) does not fit the {rows}-row receive ring that num_nvl_bytes="
                         f"{gb.nvl.nbytes} leaves for {num_ranks - 1} peers with {record}-byte "
                         f"records; raise num_nvl_bytes (Config.get_nvl_buffer_size_hint)")
    num_recv = rank_prefix[(num_ranks - 1) * num_ranks + gb.rank]
    align = expert_alignment
    return num_recv, [(c + align - 1) // align * align for c in experts]


# ---- combine ---------------------------------------------------------------------------------
def combine(gb, x, handle, topk_weights, bias, config):
    """Backend.combine: unweighted fp32 sum of the rows each token sent out, plus bias."""
    device, trace = gb.device, _TRACE.on
    rank_prefix, channel_prefix, recv_channel_prefix, _, is_token_in_rank, send_head = handle
    x, topk_weights = aligned(x.contiguous()), aligned(topk_weights)
    bias0, bias1 = bias
    bias0, bias1 = aligned(bias0), aligned(bias1)
    num_tokens, hidden = is_token_in_rank.shape[0], x.shape[1]
    chunks = channel_prefix.shape[1] - 1
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    planned = plan_for(gb, CombineSpec, (config.num_sms, hidden * 2, num_topk, trace), _combine_plan)

    combined_x = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    combined_weights = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=device) \
        if num_topk else None
    params = planned.params
    params.x, params.topk_weights = ptr(x), ptr(topk_weights)
    params.bias0, params.bias1 = ptr(bias0), ptr(bias1)
    params.rank_prefix, params.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
    params.recv_channel_prefix, params.send_head = recv_channel_prefix.data_ptr(), ptr(send_head)
    params.combined_x, params.combined_weights = ptr(combined_x), ptr(combined_weights)
    params.num_tokens, params.num_chunks = num_tokens, chunks
    params.tokens_per_chunk = plan.tokens_per_chunk(num_tokens, chunks)
    params.num_topk = num_topk
    params.trace = _TRACE.zeroed(gb.device_index, planned.blocks) if trace else 0
    launch_1d(gb, planned.kernel, planned.blocks, plan.THREADS, params)
    return combined_x, combined_weights


# ---- per-signature fast paths ---------------------------------------------------------------------
# Buffer validates a call's signature once and then calls the runner made here for it: the plan
# resolved, a Params copy with every field the signature fixes set, the launch bound; a call sets
# the pointers, allocates its outputs and launches, then queues the poison fill (ops/poison.py).
# `general` (the backend's method) serves the calls made while a profiling build is switched on
# (set_tracing; none is made while it is on: the Buffer then calls the method itself).
def _pointer(t):
    """t's address, realigned to 16 bytes as `aligned` does, and the tensor to keep alive."""
    address = t.data_ptr()
    if address % 16:
        t = t.clone()
        address = t.data_ptr()
    return address, t


class _Fills:
    """A runner's poison launches by output addresses (its outputs' sizes and dtypes are fixed by
    the signature, so the addresses the caching allocator hands out are the whole key)."""
    __slots__ = ("poison", "launches")
    LIMIT = 64

    def __init__(self, poison):
        self.poison, self.launches = poison, {}

    def get(self, key, *outputs):
        launch = self.launches.get(key)
        if launch is None:
            if len(self.launches) >= self.LIMIT:
                self.launches.clear()
            launch = self.launches[key] = self.poison.prepared(*outputs)   # not None: outputs have bytes
        return launch


def _runner_params(gb, planned):
    params = type(planned.params).from_buffer_copy(planned.params)
    params.trace = 0
    return params, planned.kernel.launcher((planned.blocks, 1, 1), (plan.THREADS, 1, 1), params)


def cached_dispatch_runner(gb, x, x_scales, handle, config, poison, general):
    """run(x, x_scales, handle) -> DispatchResult of a cached dispatch with this call's signature
    (shapes, dtypes, scale strides, the handle's sizes, config); None for empty inputs or outputs
    and while tracing."""
    num_tokens, hidden = x.shape
    num_out_rows, chunks = handle[3].shape[0], handle[1].shape[1] - 1
    if num_tokens == 0 or num_out_rows == 0 or _TRACE.on:
        return None
    num_scales = 0 if x_scales is None else x_scales.shape[1]
    dtype, trace, device = x.dtype, False, gb.device
    planned = plan_for(gb, DispatchSpec, (config.num_sms, hidden * x.element_size(), num_scales, 0, "int", 0, False,
                                          trace), _dispatch_plan)
    params, launch = _runner_params(gb, planned)
    params.topk_idx = params.topk_weights = params.recv_src_idx = params.recv_topk_idx = params.recv_topk_weights = 0
    params.scale_stride_token, params.scale_stride_group = x_scales.stride() if x_scales is not None else (0, 0)
    params.num_tokens, params.num_chunks = num_tokens, chunks
    params.tokens_per_chunk = plan.tokens_per_chunk(num_tokens, chunks)
    params.num_topk, params.num_local_experts, params.num_out_rows = 0, 0, num_out_rows
    x_shape, scales_shape, f32, empty = (num_out_rows, hidden), (num_out_rows, num_scales), torch.float32, torch.empty
    device_index, fills = gb.device_index, _Fills(poison)

    def run(x, x_scales, handle):
        if _TRACE.on:
            return general(x, x_scales, handle, None, None, None, None, None, None, 1, 0, config)
        params.x, x = _pointer(x)
        rank_prefix, channel_prefix, recv_channel_prefix, _, _, send_head = handle
        recv_x = empty(x_shape, dtype=dtype, device=device)
        params.recv_x = out = recv_x.data_ptr()
        if x_scales is None:
            recv_scales, out_scales = None, 0
            params.x_scales = params.recv_x_scales = 0
        else:
            recv_scales = empty(scales_shape, dtype=f32, device=device)
            params.x_scales, params.recv_x_scales = x_scales.data_ptr(), recv_scales.data_ptr()
            out_scales = params.recv_x_scales
        params.rank_prefix, params.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
        params.recv_channel_prefix, params.send_head = recv_channel_prefix.data_ptr(), send_head.data_ptr()
        stream = current_stream(device_index)
        launch(stream)
        fills.get((out, out_scales), recv_x, recv_scales)(stream)
        return DispatchResult(recv_x, recv_scales, None, None, None, None)
    return run


def combine_runner(gb, x, handle, topk_weights, bias, config, poison, general):
    """run(x, handle, topk_weights, bias0, bias1) -> (combined_x, combined_weights) of a combine with
    this call's signature; None for empty inputs or outputs."""
    num_tokens, hidden = handle[4].shape[0], x.shape[1]
    chunks = handle[1].shape[1] - 1
    if num_tokens == 0 or x.shape[0] == 0 or _TRACE.on:
        return None
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    trace, device, device_index = False, gb.device, gb.device_index
    planned = plan_for(gb, CombineSpec, (config.num_sms, hidden * 2, num_topk, trace), _combine_plan)
    params, launch = _runner_params(gb, planned)
    params.num_tokens, params.num_chunks = num_tokens, chunks
    params.tokens_per_chunk = plan.tokens_per_chunk(num_tokens, chunks)
    params.num_topk = num_topk
    x_shape, w_shape, bf16, f32, empty = (num_tokens, hidden), (num_tokens, num_topk), torch.bfloat16, torch.float32, \
        torch.empty
    fills = _Fills(poison)

    def run(x, handle, topk_weights, bias0, bias1):
        if _TRACE.on:
            return general(x, handle, topk_weights, (bias0, bias1), config)
        # realigned copies are held in locals until the launch is queued (as `aligned` callers do)
        params.x, x = _pointer(x)
        if topk_weights is None:
            params.topk_weights = 0
        else:
            params.topk_weights, topk_weights = _pointer(topk_weights)
        params.bias0, bias0 = _pointer(bias0) if bias0 is not None else (0, None)
        params.bias1, bias1 = _pointer(bias1) if bias1 is not None else (0, None)
        rank_prefix, channel_prefix, recv_channel_prefix, _, _, send_head = handle
        params.rank_prefix, params.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
        params.recv_channel_prefix, params.send_head = recv_channel_prefix.data_ptr(), send_head.data_ptr()
        combined_x = empty(x_shape, dtype=bf16, device=device)
        combined_weights = empty(w_shape, dtype=f32, device=device) if num_topk else None
        params.combined_x = out = combined_x.data_ptr()
        params.combined_weights = out_weights = 0 if combined_weights is None else combined_weights.data_ptr()
        stream = current_stream(device_index)
        launch(stream)
        fills.get((out, out_weights), combined_x, combined_weights)(stream)
        return combined_x, combined_weights
    return run
