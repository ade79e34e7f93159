"""Low-latency mode of the CPU backend.

Dispatch gathers x and topk_idx of every rank and packs this rank's experts with
oracle.low_latency_dispatch (rows past recv_count: zero data and scales, src_info -1). Combine
sends only the valid rows of each expert buffer (with their expert / source / token ids) and
reduces with oracle.ll_combine_rows. Each call returns fresh tensors, so results stay valid
after later calls (the GPU keeps at most two); the combine input buffers of
get_next_low_latency_combine_buffer do alternate between two sets, as on the GPU.

Everything happens during the call: a hook (return_recv_hook=True) has nothing left to do, and
the wait-cost statistics (dispatch_wait_recv_cost_stats, combine_wait_recv_cost_stats) are
accepted and left unchanged (nothing is waited for, i.e. 0 is added).

Masking (enable_shrink): each rank's mask buffer is its own, as on the GPU; a call gathers all of
them and a link s <-> d is dead when either side masks the other. The CPU backend never masks a
rank by itself (a gloo collective has no per-peer timeout); use low_latency_update_mask_buffer.
"""
from __future__ import annotations

import torch

from ..backend import LowLatencyDispatchResult, LowLatencyHandle
from . import oracle
from .oracle import CPU


def _received_already():
    """The recv hook: the CPU dispatch / combine completed inside the call."""


class LowLatencyState:
    def __init__(self, backend, enable_shrink: bool):
        self.backend = backend
        self.enable_shrink = enable_shrink
        self.mask = torch.zeros(backend.num_ranks, dtype=torch.int32, device=CPU)
        self.buffer_index = 0              # which of the two buffer sets the next call uses
        self.combine_buffers = [None, None]

    def _gather(self, tensor, op, what):
        return self.backend.exchange.gather_rows(tensor, op, what)

    def _rank_masks(self, op):
        if not self.enable_shrink:
            return None
        return [m[0] for m in self._gather(self.mask.reshape(1, -1), op, "mask buffer")]

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                 round_scale, use_ue8m0, return_recv_hook) -> LowLatencyDispatchResult:
        backend, op = self.backend, "Buffer.low_latency_dispatch"
        facts = (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                 ("hidden", x.shape[1]), ("num_experts", num_experts), ("num_topk", topk_idx.shape[1]),
                 ("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0))
        result = backend.collective(op, facts, lambda: oracle.low_latency_dispatch(
            self._gather(x, op, "x"), self._gather(topk_idx, op, "topk_idx"),
            num_max_dispatch_tokens_per_rank, num_experts, backend.rank, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=use_ue8m0, rank_masks=self._rank_masks(op)))
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += result["recv_count"].to(
                cumulative_local_expert_recv_stats.dtype)
        self.buffer_index ^= 1
        handle = LowLatencyHandle(result["src_info"], result["layout_range"],
                                  num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        return LowLatencyDispatchResult(result["recv_x"], result["recv_x_scales"],
                                        result["recv_count"], handle,
                                        _received_already if return_recv_hook else None)

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, return_recv_hook,
                out, combine_wait_recv_cost_stats):
        if use_logfmt:
            raise NotImplementedError("low_latency_combine(use_logfmt=True): the LogFMT "
                                      "compressed payload is not implemented by the CPU "
                                      "reference backend")
        backend, op = self.backend, "Buffer.low_latency_combine"
        src_info, layout_range, tokens_per_rank, hidden, num_experts = handle
        source = self.next_combine_buffer(handle) if zero_copy else x
        facts = (("num_max_dispatch_tokens_per_rank (of the handle)", tokens_per_rank),
                 ("hidden", hidden), ("num_experts (of the handle)", num_experts),
                 ("num_topk", topk_idx.shape[1]))

        def compute():
            meta, data = oracle.ll_valid_rows(source, src_info, layout_range)
            metas, datas = self._gather(meta, op, "combine row ids"), self._gather(data, op, "x")
            return oracle.ll_combine_rows(list(zip(metas, datas)), topk_idx, topk_weights,
                                          backend.rank, num_experts, self._rank_masks(op))

        combined = backend.collective(op, facts, compute)
        if out is not None:
            out.copy_(combined)
            combined = out
        self.buffer_index ^= 1
        return combined, (_received_already if return_recv_hook else None)

    def next_combine_buffer(self, handle) -> torch.Tensor:
        """The bf16 [E_l, R*T, H] buffer the next combine reads with zero_copy=True."""
        _, _, tokens_per_rank, hidden, num_experts = handle
        ranks = self.backend.num_ranks
        shape = (num_experts // ranks, ranks * tokens_per_rank, hidden)
        buffer = self.combine_buffers[self.buffer_index]
        if buffer is None or tuple(buffer.shape) != shape:
            buffer = torch.zeros(shape, dtype=torch.bfloat16, device=CPU)
            self.combine_buffers[self.buffer_index] = buffer
        return buffer

    def clean(self, tokens_per_rank, hidden, num_experts):
        """Zero both buffer sets; collective, like the GPU's (it barriers the group)."""
        facts = (("num_max_dispatch_tokens_per_rank", tokens_per_rank), ("hidden", hidden),
                 ("num_experts", num_experts))
        self.backend.collective("Buffer.clean_low_latency_buffer", facts, lambda: None)
        for buffer in self.combine_buffers:
            if buffer is not None:
                buffer.zero_()

    # ---- masking (enable_shrink) -------------------------------------------------------------
    def _require_shrink(self, what: str):
        if not self.enable_shrink:
            raise RuntimeError(f"{what} needs a Buffer built with enable_shrink=True")

    def update_mask(self, rank_to_mask: int, mask: bool):
        self._require_shrink("low_latency_update_mask_buffer")
        if not 0 <= rank_to_mask < self.backend.num_ranks:
            raise ValueError(f"rank_to_mask must lie in [0, {self.backend.num_ranks}), "
                             f"got {rank_to_mask}")
        self.mask[rank_to_mask] = 1 if mask else 0

    def query_mask(self, mask_status: torch.Tensor):
        self._require_shrink("low_latency_query_mask_buffer")
        mask_status.copy_(self.mask)

    def clean_mask(self):
        self._require_shrink("low_latency_clean_mask_buffer")
        self.mask.zero_()

    def release(self):
        self.combine_buffers = [None, None]
