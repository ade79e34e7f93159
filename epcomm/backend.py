"""The interface between `Buffer` (validation, streams, output wrapping) and the two backends that do
the work: `epcomm.reference.ReferenceBackend` (CPU torch over a gloo group, the oracle) and
`epcomm.gpu.GpuBackend` (NVRTC kernels on the NVSHMEM heap).

Buffer calls these with arguments it has already validated and normalised:
  * tensors are torch tensors on the backend's device (CuPy inputs were converted zero-copy);
  * FP8 input arrives as (x, x_scales) with x_scales None for BF16;
  * bias arrives as a 2-tuple (b0, b1), either None;
  * no event / stream arguments: the GPU backend launches on `torch.cuda.current_stream()`, which
    Buffer has set to its communication stream, and allocates outputs on the current stream too.
Return values are plain tensors / lists / named tuples; Buffer builds the public tuples and the
EventOverlap (which holds every tensor of a result, found by walking its tuples).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch


# Handles: NamedTuples, so still the tuples DeepEP's positions index; each backend documents what
# its elements hold (epcomm/ops/intranode.py, internode.py; epcomm/reference/handles.py).
class IntranodeHandle(NamedTuple):
    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor


class InternodeHandle(NamedTuple):
    is_token_in_rank: torch.Tensor
    rdma_channel_prefix_matrix: torch.Tensor
    gbl_channel_prefix_matrix: torch.Tensor
    recv_rdma_channel_prefix_matrix: torch.Tensor
    recv_rdma_rank_prefix_sum: torch.Tensor
    recv_gbl_channel_prefix_matrix: torch.Tensor
    recv_gbl_rank_prefix_sum: torch.Tensor
    recv_src_meta: torch.Tensor
    send_rdma_head: torch.Tensor
    send_nvl_head: torch.Tensor


class LowLatencyHandle(NamedTuple):
    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


def named(handle_type, handle: tuple):
    """`handle` as a `handle_type` (a handle the caller rebuilt as a plain tuple gets its names back)."""
    return handle if isinstance(handle, handle_type) else handle_type._make(handle)


class DispatchResult(NamedTuple):
    recv_x: torch.Tensor                      # [M, H] bf16, or fp8 e4m3 when scales are given
    recv_x_scales: Optional[torch.Tensor]     # [M, H/128] float32 or None
    recv_topk_idx: Optional[torch.Tensor]     # [M, K] same dtype as topk_idx, local expert ids, -1 else
    recv_topk_weights: Optional[torch.Tensor]  # [M, K] float32, 0 where idx is -1
    num_recv_tokens_per_expert_list: Optional[List[int]]
    handle: Optional[tuple]                   # IntranodeHandle / InternodeHandle


class LowLatencyDispatchResult(NamedTuple):
    recv_x: torch.Tensor                      # [E_l, R*T, H] bf16 or fp8
    recv_x_scales: Optional[torch.Tensor]     # [E_l, R*T, H/128] f32 or [E_l, R*T, H/512] int32, col-major
    recv_count: torch.Tensor                  # [E_l] int32
    handle: tuple                             # LowLatencyHandle
    hook: Optional[object]                    # callable when return_recv_hook, else None


class Backend:
    """What both backends implement. `rank`, `num_ranks`, `num_local_ranks` (ranks in one NVLink
    domain / node) and `device` are attributes."""

    rank: int
    num_ranks: int
    num_local_ranks: int
    device: torch.device

    # ---- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """-> (num_tokens_per_rank [R] i32, num_tokens_per_rdma_rank [R/num_local_ranks] i32 or None
        when intranode, num_tokens_per_expert [E] i32, is_token_in_rank [N, R] bool)."""
        raise NotImplementedError

    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: Optional[tuple],
                 num_tokens_per_rank: Optional[torch.Tensor],
                 num_tokens_per_rdma_rank: Optional[torch.Tensor],
                 is_token_in_rank: Optional[torch.Tensor],
                 num_tokens_per_expert: Optional[torch.Tensor],
                 topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                 expert_alignment: int, num_worst_tokens: int, config) -> DispatchResult:
        """handle given = cached mode (only recv_x / recv_x_scales are filled)."""
        raise NotImplementedError

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor],
                bias: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]], config
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """-> (combined_x [N, H] bf16, combined_topk_weights [N, K] f32 or None)."""
        raise NotImplementedError

    # ---- low-latency mode --------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor],
                             use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                             return_recv_hook: bool) -> LowLatencyDispatchResult:
        raise NotImplementedError

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool, zero_copy: bool, return_recv_hook: bool,
                            out: Optional[torch.Tensor],
                            combine_wait_recv_cost_stats: Optional[torch.Tensor]
                            ) -> Tuple[torch.Tensor, Optional[object]]:
        """-> (combined_x [N, H] bf16, hook or None)."""
        raise NotImplementedError

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        raise NotImplementedError

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        raise NotImplementedError

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool) -> None:
        raise NotImplementedError

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        raise NotImplementedError

    def low_latency_clean_mask_buffer(self) -> None:
        raise NotImplementedError

    # ---- buffer memory -----------------------------------------------------------------------
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        raise NotImplementedError

    def check_errors(self) -> None:
        """Raise PeerTimeout / BufferUnusable if a kernel recorded a failure (GPU backend)."""

    def recover(self, timeout_s: Optional[float]) -> None:
        """Collective: make the Buffer usable again after a failed call whose peers are alive, or
        raise (PeerTimeout naming a rank that did not join within timeout_s, None = the backend's
        default; BufferUnusable where the backend cannot recover)."""
        raise NotImplementedError

    def destroy(self) -> None:
        pass
