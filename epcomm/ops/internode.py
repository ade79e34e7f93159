"""Normal-mode internode dispatch / combine on the GPU (cuda_src/internode.cu; protocol in cuda_src/README.md).

A fresh dispatch is two launches on the current stream: `notify` (exchange counts over NVSHMEM,
build the routing tables) then the data kernel; with num_worst_tokens == 0 the host reads the
counts in between (one small D2H copy + stream sync) to size the outputs exactly; with
num_worst_tokens > 0 nothing touches the host (CUDA-graph capturable). A cached dispatch and a
combine are one launch. The data kernels stream through rings of fixed size (internode_plan): any
N on any rank fits; the rings must fit num_rdma_bytes (and combine's push FIFOs num_nvl_bytes, else
they go to the RDMA buffer too), a check of the Config and the Buffer alone, so every rank raises
alike before any launch.

Handle (10-tuple), int32 CUDA tensors except element 0 (M nodes, L ranks per node, G channels):
  0 is_token_in_rank [N, R] bool, as given
  1 rdma_channel_prefix [M, G+1]: [m][g] = tokens of channels < g this rank sends to node m ([m][G]: all)
  2 gbl_channel_prefix [R + 1]: tokens this rank sends to each rank, then the largest N of all ranks
  3 recv_rdma_channel_prefix [R, G+1]: row s = rank s's rdma_channel_prefix row for this rank's node
  4 recv_rdma_rank_prefix_sum [M]: inclusive prefix of rows received from nodes 0..n
  5 recv_gbl_channel_prefix [R, 1]: first row received from each source rank
  6 recv_gbl_rank_prefix_sum [R]: inclusive prefix of rows received from ranks 0..s (the contract's)
  7 recv_src_meta [M_out, 3]: (source rank, source token, index of the token among those its source
    sends to this node), -1 on padding rows
  8 send_rdma_head [N, M]: index of token t among this rank's tokens that go to node m, or -1
  9 send_nvl_head [N, R]: row of token t on rank r, or -1
G channels come from Config.num_sms (internode_plan.num_channels) and must be equal on every rank;
channel g of a rank holds its tokens [g * ceil(N / G), (g + 1) * ceil(N / G)).
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from .. import env
from ..backend import DispatchResult, InternodeHandle, named
from ..runtime.compiler import KernelSource
from ..runtime.status import register_op
from . import internode_plan as plan
from ._common import INDEX_TYPES, aligned, backend_kernel, host_ints, launch_1d, plan_for, ptr
from .trace import TraceRows, trace_defines

DISPATCH_OP = register_op("internode dispatch", plan.PHASES)
COMBINE_OP = register_op("internode combine", plan.PHASES)


def representative_sources() -> List[KernelSource]:
    """For --precompile: H = 7168 on 2 nodes of 1 rank (the 2-GPU test machine) and 2 nodes of 8;
    BF16 and FP8 (56 scales), both index types, fresh and cached dispatch, combine."""
    names = [plan.notify_kernel(2, 1), plan.notify_kernel(16, 8),
             plan.dispatch_kernel(2, 1, 7168 * 2, 0, "long long", True),
             plan.dispatch_kernel(2, 1, 7168, 56, "int", True),
             plan.dispatch_kernel(2, 1, 7168 * 2, 0, "int", False),
             plan.dispatch_kernel(16, 8, 7168 * 2, 0, "long long", True),
             plan.combine_kernel(2, 1, 7168 * 2), plan.combine_kernel(16, 8, 7168 * 2)]
    return [kernel_source(name) for name in names]


def kernel_source(name: str, trace: bool = False) -> KernelSource:
    """The unit that builds one internode kernel (a name from internode_plan: notify_kernel, ...)."""
    return KernelSource("internode.cu", (name,), trace_defines(trace), uses_nvshmem=True)


def _kernel(gb, name: str, trace: bool = False):
    return backend_kernel(gb, kernel_source(name, trace))


# ---- profiling builds (EPCOMM_INTERNODE_TRACE=1, or set_tracing) -----------------------------
# Data kernels built with -DEPCOMM_TRACE stamp %globaltimer per (block, warp): per role, the first
# and last chunk it completed and the count (internode_plan.TRACE_SLOTS); last_trace() returns the
# latest traced launch's rows. The notify kernel is never traced. The environment is read once, at
# import (ops/trace.py); set_tracing switches.
_TRACE = TraceRows(plan.TRACE_WARPS, len(plan.TRACE_SLOTS), on=env.internode_trace())
set_tracing = _TRACE.set_on   # bench/internode_trace.py
last_trace = _TRACE.last   # [blocks, TRACE_WARPS, len(TRACE_SLOTS)] of the latest traced launch


# ---- checks ----------------------------------------------------------------------------------
def _check_buffer(gb, config, what: str) -> None:
    rdma = gb.rdma
    if rdma is None:
        raise ValueError(f"{what}: internode mode needs an RDMA buffer; build the Buffer with "
                         f"num_rdma_bytes > 0 (Config.get_rdma_buffer_size_hint)")
    if gb.low_latency_mode:
        raise NotImplementedError(f"{what}: internode normal mode on a low_latency_mode Buffer (both "
                                  f"lay out the RDMA buffer); use a separate Buffer for each mode")
    if config.num_sms > gb.arch.num_sms:
        raise ValueError(f"{what}: Config.num_sms={config.num_sms} exceeds the device's "
                         f"{gb.arch.num_sms} SMs")
    plan.check_channels(what, config.num_sms)
    node = gb.rank // gb.num_local_ranks
    local = range(node * gb.num_local_ranks, (node + 1) * gb.num_local_ranks)
    unreachable = [r for r in local if not rdma.peer_ptrs[r]]
    if unreachable:
        raise ValueError(f"{what}: ranks {unreachable} of this node are not reachable over NVLink/P2P "
                         f"from rank {gb.rank}; a node's ranks must share an NVLink domain")


def _check_notify_fits(gb, num_local_experts: int, what: str) -> None:
    """A function of the topology, the buffer size and num_experts alone: every rank that passes the
    same num_experts raises alike (ranks that disagree are what the notify kernel catches)."""
    if num_local_experts > plan.MAX_LOCAL_EXPERTS:
        raise ValueError(f"{what}: {num_local_experts} experts per rank; internode mode supports up to "
                         f"{plan.MAX_LOCAL_EXPERTS}")
    num_nodes = gb.num_ranks // gb.num_local_ranks
    end = plan.notify_offsets(gb.num_ranks, num_nodes)[2]
    if end > gb.rdma.nbytes:
        raise ValueError(f"{what}: num_rdma_bytes={gb.rdma.nbytes} is smaller than the {end} bytes the "
                         f"count exchange of {gb.num_ranks} ranks needs (Config.get_rdma_buffer_size_hint)")


# ---- plans -------------------------------------------------------------------------------------
class PeerTableSpec(NamedTuple):
    """The [R] int64 device table of every rank's RDMA buffer as this process addresses it. The
    kernels take their own entry as `base` and hand addresses derived from it to NVSHMEM puts, which
    translate them relative to the symmetric heap: so the own entry is the heap address itself
    (buffer.ptr), whatever mapping nvshmem_ptr gives for this PE. Ranks of other nodes are null
    unless the Buffer was built with allow_mnnvl=True: then a mapped one (multi-node NVLink, or
    "nodes" on one host) is written in place instead of through a put."""


def _peer_table(gb, spec: PeerTableSpec) -> torch.Tensor:
    rdma, local, node = gb.rdma, gb.num_local_ranks, gb.rank // gb.num_local_ranks
    mnnvl = bool(gb.options.get("allow_mnnvl", False))
    bases = [address if mnnvl or r // local == node else 0 for r, address in enumerate(rdma.peer_ptrs)]
    bases[gb.rank] = rdma.ptr
    return torch.tensor(bases, dtype=torch.int64, device=gb.device)


def peer_table(gb) -> torch.Tensor:
    return plan_for(gb, PeerTableSpec, (), _peer_table)


class PushTableSpec(NamedTuple):
    """The [R] int64 device table of the buffer holding combine's push FIFOs (the NVL buffer, or
    the RDMA buffer: `in_nvl`) of this node's ranks (others null; the own entry its address)."""
    in_nvl: bool


def _push_table(gb, spec: PushTableSpec) -> torch.Tensor:
    buf, local, node = (gb.nvl if spec.in_nvl else gb.rdma), gb.num_local_ranks, gb.rank // gb.num_local_ranks
    bases = [address if r // local == node else 0 for r, address in enumerate(buf.peer_ptrs)]
    bases[gb.rank] = buf.ptr
    return torch.tensor(bases, dtype=torch.int64, device=gb.device)


def push_table(gb, in_nvl: bool) -> torch.Tensor:
    return plan_for(gb, PushTableSpec, (in_nvl,), _push_table)


class NotifySpec(NamedTuple):
    """The notify kernel depends on the Buffer alone."""


class DispatchSpec(NamedTuple):
    row_bytes: int
    num_scales: int
    num_topk: int
    index_type: str
    fresh: bool
    channels: int
    ring: int     # Config.num_max_rdma_chunked_recv_tokens
    chunk: int    # Config.num_max_rdma_chunked_send_tokens
    trace: bool = False   # the profiling build (set_tracing)


class CombineSpec(NamedTuple):
    row_bytes: int
    channels: int
    rdma_recv: int
    rdma_send: int
    nvl_recv: int
    nvl_send: int
    trace: bool = False   # the profiling build (set_tracing)


class _Plan:
    """A kernel, the buffer layout of its calls and its Params `template` with the fields fixed for
    the spec set: a call fills a copy (a ctypes copy is cheaper than building the struct, and no
    field of an earlier call can leak into it)."""
    __slots__ = ("kernel", "layout", "template")

    def __init__(self, kernel, layout, template):
        self.kernel, self.layout, self.template = kernel, layout, template

    def params(self):
        return self.template.__class__.from_buffer_copy(self.template)


def _fixed_fields(gb, op: int) -> dict:
    return dict(peer_bases=peer_table(gb).data_ptr(), err=gb.status.device_ptr, timeout_ns=gb.timeout_ns,
                rank=gb.rank, op=op)


def _notify_plan(gb, spec: NotifySpec) -> _Plan:
    num_ranks, num_local = gb.num_ranks, gb.num_local_ranks
    area, stage, _ = plan.notify_offsets(num_ranks, num_ranks // num_local)
    template = plan.NotifyParams(area_offset=area, stage_offset=stage, notify_ints=plan.notify_ints(num_ranks),
                                 **_fixed_fields(gb, DISPATCH_OP))
    return _Plan(_kernel(gb, plan.notify_kernel(num_ranks, num_local)), None, template)


def _dispatch_plan(gb, spec: DispatchSpec) -> _Plan:
    num_ranks, num_local = gb.num_ranks, gb.num_local_ranks
    record = plan.dispatch_record_bytes(spec.row_bytes, spec.num_scales, spec.num_topk, num_local)
    rings = plan.dispatch_rings(spec.ring, spec.chunk)
    layout = plan.DispatchLayout(num_ranks, num_local, record, spec.channels, rings)
    plan.check_fits("dispatch", layout.end, gb.rdma.nbytes,
                    f"{spec.channels} channels of {rings} rings of {record}-byte records")
    name = plan.dispatch_kernel(num_ranks, num_local, spec.row_bytes, spec.num_scales, spec.index_type,
                                spec.fresh)
    template = plan.DispatchParams(recv_offset=layout.recv_offset, stage_offset=layout.stage_offset,
                                   ring=rings.ring, stage=rings.stage, chunk=rings.chunk,
                                   record_bytes=record, num_channels=spec.channels,
                                   num_topk=spec.num_topk, **_fixed_fields(gb, DISPATCH_OP))
    return _Plan(_kernel(gb, name, spec.trace), layout, template)


def _combine_plan(gb, spec: CombineSpec) -> _Plan:
    num_ranks, num_local = gb.num_ranks, gb.num_local_ranks
    rings = plan.combine_rings(spec.rdma_recv, spec.rdma_send)
    pushes = plan.push_rings(spec.nvl_recv, spec.nvl_send)
    nvl_bytes = gb.nvl.nbytes if gb.nvl is not None else 0
    layout = plan.CombineLayout(num_ranks, num_local, spec.row_bytes, spec.channels, rings, pushes, nvl_bytes)
    plan.check_fits("combine", layout.end, gb.rdma.nbytes,
                    f"{spec.channels} channels of {rings} rings of {layout.partial_bytes}-byte partial sums"
                    + ("" if layout.push_in_nvl else f" and, as num_nvl_bytes={nvl_bytes} cannot hold them, "
                                                      f"{layout.fifo_bytes} bytes of push FIFOs"))
    template = plan.CombineParams(
        push_offset=layout.push_offset, partial_recv_offset=layout.partial_recv_offset,
        partial_stage_offset=layout.partial_stage_offset, push_ring=pushes.ring, push_chunk=pushes.chunk,
        push_bytes=layout.push_bytes, ring=rings.ring, stage=rings.stage, chunk=rings.chunk,
        partial_bytes=layout.partial_bytes, num_channels=spec.channels,
        push_bases=push_table(gb, layout.push_in_nvl).data_ptr(), **_fixed_fields(gb, COMBINE_OP))
    return _Plan(_kernel(gb, plan.combine_kernel(num_ranks, num_local, spec.row_bytes), spec.trace), layout,
                 template)


# ---- dispatch --------------------------------------------------------------------------------
def dispatch(gb, x, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
             num_worst_tokens, config) -> DispatchResult:
    """Backend.dispatch for ranks over several nodes (arguments validated by Buffer)."""
    what, fresh = "dispatch", handle is None
    num_ranks, device, trace = gb.num_ranks, gb.device, _TRACE.on
    _check_buffer(gb, config, what)
    if fresh and num_worst_tokens == 0 and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: an exact-size dispatch reads the received counts on the host, "
                           f"which a CUDA graph cannot capture; pass num_worst_tokens > 0 (or a "
                           f"cached handle) under capture")
    x, topk_idx, topk_weights = (aligned(t) for t in (x, topk_idx, topk_weights))   # scales: scalar loads
    (num_tokens, hidden), num_scales = x.shape, 0 if x_scales is None else x_scales.shape[1]
    row_bytes = hidden * x.element_size()

    if fresh:
        num_local_experts = num_tokens_per_expert.shape[0] // num_ranks
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        index_type = INDEX_TYPES[topk_idx.dtype] if topk_idx is not None else "int"
        channels = plan.num_channels(config.num_sms)
        planned = plan_for(gb, DispatchSpec, (row_bytes, num_scales, num_topk, index_type, True, channels,
                                              config.num_max_rdma_chunked_recv_tokens,
                                              config.num_max_rdma_chunked_send_tokens, trace), _dispatch_plan)
        _check_notify_fits(gb, num_local_experts, what)
        tables = _notify(gb, is_token_in_rank, num_tokens_per_expert, channels, num_local_experts,
                         num_topk, num_scales, row_bytes)
        expert_counts: List[int] = []
        if num_worst_tokens > 0:
            num_out_rows = num_worst_tokens
        else:
            num_out_rows, expert_counts = _read_counts(gb, tables["info"], num_local_experts, expert_alignment)
        handle = InternodeHandle(
            is_token_in_rank, tables["rdma_channel_prefix"], tables["gbl_channel_prefix"],
            tables["recv_rdma_channel_prefix"], tables["recv_rdma_rank_prefix_sum"],
            tables["recv_gbl_channel_prefix"], tables["recv_gbl_rank_prefix_sum"],
            torch.empty((num_out_rows, 3), dtype=torch.int32, device=device),
            tables["send_rdma_head"], tables["send_nvl_head"])
    else:
        handle = named(InternodeHandle, handle)
        if handle.is_token_in_rank.shape[0] != num_tokens:
            raise ValueError(f"{what}: x has {num_tokens} rows, the handle's is_token_in_rank "
                             f"{handle.is_token_in_rank.shape[0]}")
        num_local_experts, num_topk, index_type = 0, 0, "int"
        topk_idx = topk_weights = None
        num_out_rows = handle.recv_src_meta.shape[0]   # exact M, or num_worst_tokens of the fresh call
        channels = _handle_channels(gb, handle)
        planned = plan_for(gb, DispatchSpec, (row_bytes, num_scales, 0, "int", False, channels,
                                              config.num_max_rdma_chunked_recv_tokens,
                                              config.num_max_rdma_chunked_send_tokens, trace), _dispatch_plan)

    recv_x = torch.empty((num_out_rows, hidden), dtype=x.dtype, device=device)
    recv_scales = None if x_scales is None else \
        torch.empty((num_out_rows, num_scales), dtype=torch.float32, device=device)
    recv_topk_idx = recv_topk_weights = None
    if fresh and num_topk:
        recv_topk_idx = torch.empty((num_out_rows, num_topk), dtype=topk_idx.dtype, device=device)
        recv_topk_weights = torch.empty((num_out_rows, num_topk), dtype=torch.float32, device=device)

    params = planned.params()
    params.x, params.x_scales = ptr(x), ptr(x_scales)
    params.topk_idx, params.topk_weights = ptr(topk_idx), ptr(topk_weights)
    params.rdma_channel_prefix = handle.rdma_channel_prefix_matrix.data_ptr()
    params.recv_rdma_channel_prefix = handle.recv_rdma_channel_prefix_matrix.data_ptr()
    params.recv_gbl_rank_prefix_sum = handle.recv_gbl_rank_prefix_sum.data_ptr()
    params.send_rdma_head, params.send_nvl_head = ptr(handle.send_rdma_head), ptr(handle.send_nvl_head)
    params.recv_x, params.recv_x_scales = ptr(recv_x), ptr(recv_scales)
    params.recv_topk_idx, params.recv_topk_weights = ptr(recv_topk_idx), ptr(recv_topk_weights)
    params.recv_src_meta = ptr(handle.recv_src_meta) if fresh else 0
    if x_scales is not None:
        params.scale_stride_token, params.scale_stride_group = x_scales.stride()
    params.num_tokens = num_tokens
    params.tokens_per_channel = plan.tokens_per_channel(num_tokens, channels)
    params.num_local_experts, params.num_out_rows = num_local_experts, num_out_rows
    blocks = plan.BLOCKS_PER_CHANNEL * channels
    if trace:
        params.trace = _TRACE.zeroed(gb.device_index, blocks)
    launch_1d(gb, planned.kernel, blocks, plan.THREADS, params)

    if not fresh:
        return DispatchResult(recv_x, recv_scales, None, None, None, None)
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_counts, handle)


def _handle_channels(gb, handle) -> int:
    """G of the handle's fresh dispatch: its channel prefix tables are [M, G+1] and [R, G+1]."""
    channels = handle.rdma_channel_prefix_matrix.shape[-1] - 1
    num_nodes = gb.num_ranks // gb.num_local_ranks
    shapes = (tuple(handle.rdma_channel_prefix_matrix.shape), tuple(handle.recv_rdma_channel_prefix_matrix.shape))
    if not 1 <= channels <= plan.MAX_CHANNELS or shapes != ((num_nodes, channels + 1), (gb.num_ranks, channels + 1)):
        raise ValueError(f"handle[1] / handle[3] must be [{num_nodes}, G+1] / [{gb.num_ranks}, G+1] with "
                         f"1 <= G <= {plan.MAX_CHANNELS} (the channels of the dispatch), got "
                         f"{list(shapes[0])} / {list(shapes[1])}")
    return channels


def _notify(gb, is_token_in_rank, num_tokens_per_expert, channels, num_local_experts, num_topk,
            num_scales, row_bytes) -> dict:
    """Launch the notify kernel; its output tensors by name. The token format (num_topk, num_scales,
    row_bytes: the dispatch record) is exchanged with the counts and checked equal on every rank."""
    num_ranks, num_local, device = gb.num_ranks, gb.num_local_ranks, gb.device
    num_nodes = num_ranks // num_local
    num_tokens = is_token_in_rank.shape[0]

    def ints(*shape):
        return torch.empty(shape, dtype=torch.int32, device=device)

    out = dict(info=ints(1 + num_ranks * num_ranks + num_local_experts),
               rdma_channel_prefix=ints(num_nodes, channels + 1), gbl_channel_prefix=ints(num_ranks + 1),
               recv_rdma_channel_prefix=ints(num_ranks, channels + 1),
               recv_rdma_rank_prefix_sum=ints(num_nodes), recv_gbl_channel_prefix=ints(num_ranks, 1),
               recv_gbl_rank_prefix_sum=ints(num_ranks), send_rdma_head=ints(num_tokens, num_nodes),
               send_nvl_head=ints(num_tokens, num_ranks))
    planned = plan_for(gb, NotifySpec, (), _notify_plan)
    params = planned.params()
    params.is_token_in_rank, params.num_tokens_per_expert = ptr(is_token_in_rank), ptr(num_tokens_per_expert)
    for name, tensor in out.items():
        setattr(params, name, ptr(tensor))
    params.num_tokens, params.num_channels = num_tokens, channels
    params.tokens_per_channel = plan.tokens_per_channel(num_tokens, channels)
    params.num_local_experts, params.num_topk = num_local_experts, num_topk
    params.num_scales, params.row_bytes = num_scales, row_bytes
    launch_1d(gb, planned.kernel, 1, plan.NOTIFY_THREADS, params)
    return out


def _read_counts(gb, info, num_local_experts, expert_alignment):
    """Exact mode: wait for notify, read the counts -> (rows received, per-expert counts). Ranks
    with different Config.num_sms, num_experts or token formats were recorded by the notify kernel
    (check_errors raises that)."""
    num_ranks, values = gb.num_ranks, host_ints(gb, info)
    num_recv = values[1 + (num_ranks - 1) * num_ranks + gb.rank]
    experts = values[1 + num_ranks * num_ranks:]
    align = expert_alignment
    return num_recv, [(c + align - 1) // align * align for c in experts]


# ---- combine ---------------------------------------------------------------------------------
def combine(gb, x, handle, topk_weights, bias, config):
    """Backend.combine: unweighted fp32 sum of the rows each token sent out, plus bias (local ranks
    summed per node first, then nodes ascending: epcomm.reference.oracle.combine)."""
    what = "combine"
    num_ranks, device, trace = gb.num_ranks, gb.device, _TRACE.on
    _check_buffer(gb, config, what)
    handle = named(InternodeHandle, handle)
    num_tokens, hidden = handle.is_token_in_rank.shape[0], x.shape[1]
    num_recv = handle.recv_src_meta.shape[0]
    if x.shape[0] != num_recv:
        raise ValueError(f"{what}: x has {x.shape[0]} rows, the handle's dispatch received "
                         f"{num_recv}")
    for b in bias:   # the kernel reads bias rows of every token
        if b is not None and tuple(b.shape) != (num_tokens, hidden):
            raise ValueError(f"{what}: bias must be [num_tokens, hidden] = [{num_tokens}, {hidden}] (num_tokens "
                             f"= rows of the handle's is_token_in_rank), got {list(b.shape)}")
    x, topk_weights = aligned(x.contiguous()), aligned(topk_weights)
    bias0, bias1 = (aligned(b) for b in bias)
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    channels = _handle_channels(gb, handle)
    planned = plan_for(gb, CombineSpec, (hidden * 2, channels, config.num_max_rdma_chunked_recv_tokens,
                                         config.num_max_rdma_chunked_send_tokens,
                                         config.num_max_nvl_chunked_recv_tokens,
                                         config.num_max_nvl_chunked_send_tokens, trace), _combine_plan)

    combined_x = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    combined_weights = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=device) \
        if num_topk else None
    params = planned.params()
    params.x, params.topk_weights = ptr(x), ptr(topk_weights)
    params.bias0, params.bias1 = ptr(bias0), ptr(bias1)
    params.recv_src_meta = ptr(handle.recv_src_meta)
    params.recv_gbl_rank_prefix_sum = handle.recv_gbl_rank_prefix_sum.data_ptr()
    params.recv_rdma_channel_prefix = handle.recv_rdma_channel_prefix_matrix.data_ptr()
    params.rdma_channel_prefix = handle.rdma_channel_prefix_matrix.data_ptr()
    params.send_rdma_head = ptr(handle.send_rdma_head)
    params.combined_x, params.combined_weights = ptr(combined_x), ptr(combined_weights)
    params.num_tokens, params.num_topk = num_tokens, num_topk
    params.tokens_per_channel = plan.tokens_per_channel(num_tokens, channels)
    blocks = plan.BLOCKS_PER_CHANNEL * channels
    if trace:
        params.trace = _TRACE.zeroed(gb.device_index, blocks)
    launch_1d(gb, planned.kernel, blocks, plan.THREADS, params)
    return combined_x, combined_weights
