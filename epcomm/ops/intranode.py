"""Normal-mode intranode dispatch / combine on the GPU (cuda_src/intranode.cu; protocol in its header).

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

import weakref
from typing import Dict, List, Optional

import torch

from .. import env
from ..backend import DispatchResult
from ..runtime.compiler import KernelSource
from ..runtime.module import get_kernel
from ..runtime.status import register_op
from . import intranode_plan as plan
from ..streams import current_stream_handle as _stream
from .layout import _INDEX_TYPES
from .trace import TraceRows

DISPATCH_OP = register_op("intranode dispatch", plan.PHASES)
COMBINE_OP = register_op("intranode combine", plan.PHASES)


def nvl_size_hint(config, hidden_bytes: int, num_ranks: int) -> int:
    return plan.nvl_size_hint(config, hidden_bytes, num_ranks)


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
    return KernelSource("intranode.cu", (name,), (("EPCOMM_INTRANODE_TRACE", 1),) if trace else ())


def _kernel(gb, name: str, trace: bool):
    """The kernel for the Buffer's feature set (gb.arch: EPCOMM_ARCH as it was at construction)."""
    return get_kernel(kernel_source(name, trace), 0, gb.device_index, gb.arch.feature)


# ---- profiling mode (EPCOMM_INTRANODE_TRACE=1) -----------------------------------------------
# Kernels built with -DEPCOMM_INTRANODE_TRACE stamp %globaltimer per warp and phase into a device
# buffer (slots: intranode_plan.TRACE_SLOTS); last_trace() returns the latest launch's stamps.
# The environment is read once, at import (a read per call costs ~2.5 us); set_tracing switches.
_TRACE = TraceRows(plan.TRACE_WARPS, len(plan.TRACE_SLOTS))
_tracing_on = env.intranode_trace()


def set_tracing(on: bool) -> None:
    """Use the tracing kernel builds from the next call on (bench/intranode_trace.py)."""
    global _tracing_on
    _tracing_on = bool(on)


last_trace = _TRACE.last   # [blocks, TRACE_WARPS, len(TRACE_SLOTS)] of the latest traced launch


# ---- checks, launch geometry ------------------------------------------------------------------
def _prepare(gb, config, what: str) -> None:
    """Per-call checks. (The NVL buffer, hence the signal header, is zero from construction.)"""
    nvl = gb.nvl
    if nvl is None:
        raise ValueError(f"{what}: intranode mode needs an NVL buffer; build the Buffer with "
                         f"num_nvl_bytes > 0 (Config.get_nvl_buffer_size_hint gives a good size)")
    if config.num_sms > gb.arch.num_sms:
        raise ValueError(f"{what}: Config.num_sms={config.num_sms} exceeds the device's "
                         f"{gb.arch.num_sms} SMs")
    header = plan.header_bytes(gb.num_ranks)
    if header > nvl.nbytes:
        raise ValueError(f"{what}: num_nvl_bytes={nvl.nbytes} is smaller than the {header}-byte "
                         f"signal header of {gb.num_ranks} ranks (Config.get_nvl_buffer_size_hint)")
    if not all(nvl.peer_ptrs):
        unreachable = [r for r, ptr in enumerate(nvl.peer_ptrs) if not ptr]
        raise ValueError(f"{what}: ranks {unreachable} are not reachable over NVLink/P2P from rank "
                         f"{gb.rank}; intranode mode needs every rank in one NVLink domain")


class _Geometry:
    """What a launch needs besides the tensors, for one (NVL buffer, kernel, SMs) combination:
    checked and looked up once, then reused call after call (the host path is the whole cost of
    a small call). `params` is the kernel's Params with the fields that never change for this
    geometry already set; a call sets the rest and launches it (the launch copies the struct, so
    one object serves every call)."""
    __slots__ = ("owner", "kernel", "blocks", "send_blocks", "staging", "record", "rows", "params")

    def __init__(self, gb, nvl, kernel, split, staging: int, record: int, rows: int, params_type, op: int):
        self.owner = weakref.ref(nvl)   # keys hold id(nvl): an entry is valid for that object only
        self.kernel, self.blocks, self.send_blocks = kernel, split.blocks, split.send_blocks
        self.staging, self.record, self.rows = staging, record, rows
        self.params = params_type(peer_bases=nvl.peer_table.data_ptr(), err=gb.status.device_ptr,
                                  timeout_ns=gb.timeout_ns, staging_offset=staging, ring_rows=rows,
                                  record_bytes=record, rank=gb.rank, num_send_blocks=split.send_blocks, op=op)


_GEOMETRY: Dict[tuple, _Geometry] = {}


def _geometry(gb, config, key: tuple, build) -> _Geometry:
    nvl = gb.nvl
    geometry = _GEOMETRY.get(key) if nvl is not None else None
    if geometry is None or geometry.owner() is not nvl:
        _prepare(gb, config, key[0])
        geometry = _GEOMETRY[key] = build(nvl)
    return geometry


def _dispatch_geometry(gb, config, row_bytes: int, num_scales: int, num_topk: int,
                       index_type: str, num_local_experts: int, fresh: bool, trace: bool) -> _Geometry:
    num_ranks, num_sms = gb.num_ranks, config.num_sms
    key = ("dispatch", id(gb.nvl), num_sms, gb.arch.feature, row_bytes,
           num_scales, num_topk, index_type, num_local_experts, fresh, trace)

    def build(nvl):
        staging = plan.dispatch_staging_offset(num_ranks, num_local_experts) if fresh else \
            plan.combine_staging_offset(num_ranks)
        record = plan.dispatch_record_bytes(row_bytes, num_scales, num_topk)
        rows = plan.ring_rows(nvl.nbytes, staging, record, num_ranks, "dispatch")
        name = plan.dispatch_kernel(num_ranks, row_bytes, num_scales, index_type, fresh)
        return _Geometry(gb, nvl, _kernel(gb, name, trace), plan.dispatch_split(num_sms, num_ranks),
                         staging, record, rows, plan.DispatchParams, DISPATCH_OP)
    return _geometry(gb, config, key, build)


def _combine_geometry(gb, config, row_bytes: int, num_topk: int, trace: bool) -> _Geometry:
    num_ranks, num_sms = gb.num_ranks, config.num_sms
    key = ("combine", id(gb.nvl), num_sms, gb.arch.feature, row_bytes,
           num_topk, trace)

    def build(nvl):
        staging = plan.combine_staging_offset(num_ranks)
        record = plan.combine_record_bytes(row_bytes, num_topk)
        rows = plan.ring_rows(nvl.nbytes, staging, record, num_ranks, "combine")
        return _Geometry(gb, nvl, _kernel(gb, plan.combine_kernel(num_ranks, row_bytes), trace),
                         plan.combine_split(num_sms, num_ranks), staging, record, rows, plan.CombineParams,
                         COMBINE_OP)
    return _geometry(gb, config, key, build)


def _aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """16-byte aligned rows for vector accesses (a view at an odd offset is copied)."""
    return t if t is None or t.data_ptr() % 16 == 0 else t.clone()


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _host_ints(gb, ints: torch.Tensor) -> List[int]:
    """The values of a device int32 tensor once the stream got there (a GPU failure recorded by
    then raises first: PeerTimeout / DeviceCheckFailed)."""
    # Named: frameworks set a CUDA default device, and only CPU tensors can be pinned.
    pinned = torch.empty(ints.shape, dtype=torch.int32, device="cpu", pin_memory=True)
    pinned.copy_(ints, non_blocking=True)   # queued on gb.device's current stream
    torch.cuda.current_stream(gb.device_index).synchronize()
    gb.check_errors()
    return pinned.tolist()


def _launch(gb, kernel, grid: int, threads: int, params) -> None:
    kernel.launch((grid, 1, 1), (threads, 1, 1), params, _stream(gb.device_index))


# ---- dispatch --------------------------------------------------------------------------------
def dispatch(gb, x, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
             num_worst_tokens, config) -> DispatchResult:
    """Backend.dispatch for ranks in one NVLink domain (arguments validated by Buffer)."""
    what = "dispatch"
    num_ranks, device, trace = gb.num_ranks, gb.device, _tracing_on
    x = _aligned(x)
    num_tokens, hidden = x.shape
    row_bytes = hidden * x.element_size()
    num_scales = 0 if x_scales is None else x_scales.shape[1]
    fresh = handle is None

    if fresh:
        topk_idx, topk_weights = _aligned(topk_idx), _aligned(topk_weights)
        if num_worst_tokens == 0 and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what}: an exact-size dispatch reads the received counts on the host, "
                               f"which a CUDA graph cannot capture; pass num_worst_tokens > 0 (or a "
                               f"cached handle) under capture")
        chunks = plan.num_chunks(config.num_sms, num_ranks)
        num_local_experts = num_tokens_per_expert.shape[0] // num_ranks
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        index_type = _INDEX_TYPES[topk_idx.dtype] if topk_idx is not None else "int"
        # Checks (ValueError) before anything is launched.
        geometry = _dispatch_geometry(gb, config, row_bytes, num_scales, num_topk, index_type,
                                      num_local_experts, True, trace)
        rank_prefix, channel_prefix, recv_channel_prefix, send_head, info = _notify(
            gb, is_token_in_rank, num_tokens_per_expert, chunks, num_local_experts, trace)
        expert_counts: List[int] = []
        if num_worst_tokens > 0:
            num_out_rows = num_worst_tokens
        else:
            num_out_rows, expert_counts = _read_counts(gb, info, chunks, num_local_experts,
                                                       expert_alignment, geometry, what)
    else:
        rank_prefix, channel_prefix, recv_channel_prefix, recv_src, is_token_in_rank, send_head = handle
        chunks = channel_prefix.shape[1] - 1
        num_local_experts, num_topk, index_type = 0, 0, "int"
        topk_idx = topk_weights = None
        num_out_rows = recv_src.shape[0]   # exact M, or num_worst_tokens of the fresh call
        geometry = _dispatch_geometry(gb, config, row_bytes, num_scales, 0, "int", 0, False, trace)

    recv_x = torch.empty((num_out_rows, hidden), dtype=x.dtype, device=device)
    recv_scales = None if x_scales is None else \
        torch.empty((num_out_rows, num_scales), dtype=torch.float32, device=device)
    recv_topk_idx = recv_topk_weights = recv_src_idx = None
    if fresh:
        recv_src_idx = torch.empty((num_out_rows,), dtype=torch.int32, device=device)
        if num_topk:
            recv_topk_idx = torch.empty((num_out_rows, num_topk), dtype=topk_idx.dtype, device=device)
            recv_topk_weights = torch.empty((num_out_rows, num_topk), dtype=torch.float32, device=device)

    p = geometry.params
    p.x, p.x_scales, p.topk_idx, p.topk_weights = _ptr(x), _ptr(x_scales), _ptr(topk_idx), _ptr(topk_weights)
    p.rank_prefix, p.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
    p.recv_channel_prefix, p.send_head = recv_channel_prefix.data_ptr(), _ptr(send_head)
    p.recv_x, p.recv_x_scales, p.recv_src_idx = _ptr(recv_x), _ptr(recv_scales), _ptr(recv_src_idx)
    p.recv_topk_idx, p.recv_topk_weights = _ptr(recv_topk_idx), _ptr(recv_topk_weights)
    p.scale_stride_token, p.scale_stride_group = x_scales.stride() if x_scales is not None else (0, 0)
    p.num_tokens, p.num_chunks, p.tokens_per_chunk = num_tokens, chunks, plan.tokens_per_chunk(num_tokens, chunks)
    p.num_topk, p.num_local_experts, p.num_out_rows = num_topk, num_local_experts, num_out_rows
    p.trace = _TRACE.zeroed(gb.device_index, geometry.blocks) if trace else 0
    _launch(gb, geometry.kernel, geometry.blocks, plan.THREADS, p)

    if not fresh:
        return DispatchResult(recv_x, recv_scales, None, None, None, None)
    new_handle = (rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank,
                  send_head)
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
        is_token_in_rank=_ptr(is_token_in_rank), num_tokens_per_expert=_ptr(num_tokens_per_expert),
        info=_ptr(info), channel_prefix=_ptr(channel_prefix),
        recv_channel_prefix=_ptr(recv_channel_prefix), send_head=_ptr(send_head),
        peer_bases=gb.nvl.peer_table.data_ptr(), err=gb.status.device_ptr, timeout_ns=gb.timeout_ns,
        notify_offset=plan.header_bytes(num_ranks), num_tokens=num_tokens, num_chunks=chunks,
        tokens_per_chunk=plan.tokens_per_chunk(num_tokens, chunks),
        num_local_experts=num_local_experts, rank=gb.rank, op=DISPATCH_OP,
        trace=_TRACE.zeroed(gb.device_index, 1) if trace else 0)
    _launch(gb, _kernel(gb, plan.notify_kernel(num_ranks), trace), 1, plan.NOTIFY_THREADS, params)
    rank_prefix = info[:num_ranks * num_ranks].view(num_ranks, num_ranks)
    return rank_prefix, channel_prefix, recv_channel_prefix, send_head, info


def _read_counts(gb, info, chunks, num_local_experts, expert_alignment, geometry, what):
    """Exact mode: wait for notify, read the counts; every rank reads the same rank_prefix_matrix
    and N max, so the checks below raise on all ranks alike. (Ranks with different Config.num_sms
    or num_experts were recorded by the notify kernel: check_errors raises that.)"""
    num_ranks = gb.num_ranks
    values = _host_ints(gb, info)
    rank_prefix = values[:num_ranks * num_ranks]
    experts = values[num_ranks * num_ranks:num_ranks * num_ranks + num_local_experts]
    max_tokens = values[-1]
    rows, record = geometry.rows, geometry.record
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
    device, trace = gb.device, _tracing_on
    rank_prefix, channel_prefix, recv_channel_prefix, _, is_token_in_rank, send_head = handle
    x, topk_weights = _aligned(x.contiguous()), _aligned(topk_weights)
    bias0, bias1 = bias
    bias0, bias1 = _aligned(bias0), _aligned(bias1)
    num_tokens, hidden = is_token_in_rank.shape[0], x.shape[1]
    chunks = channel_prefix.shape[1] - 1
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    geometry = _combine_geometry(gb, config, hidden * 2, num_topk, trace)

    combined_x = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    combined_weights = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=device) \
        if num_topk else None
    p = geometry.params
    p.x, p.topk_weights, p.bias0, p.bias1 = _ptr(x), _ptr(topk_weights), _ptr(bias0), _ptr(bias1)
    p.rank_prefix, p.channel_prefix = rank_prefix.data_ptr(), channel_prefix.data_ptr()
    p.recv_channel_prefix, p.send_head = recv_channel_prefix.data_ptr(), _ptr(send_head)
    p.combined_x, p.combined_weights = _ptr(combined_x), _ptr(combined_weights)
    p.num_tokens, p.num_chunks, p.tokens_per_chunk = num_tokens, chunks, plan.tokens_per_chunk(num_tokens, chunks)
    p.num_topk = num_topk
    p.trace = _TRACE.zeroed(gb.device_index, geometry.blocks) if trace else 0
    _launch(gb, geometry.kernel, geometry.blocks, plan.THREADS, p)
    return combined_x, combined_weights
