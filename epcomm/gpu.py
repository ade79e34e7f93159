"""GPU backend: owns the per-Buffer device state (NVSHMEM world, symmetric buffers, peer tables,
error record) and hands each operation to its module under epcomm.ops.

State the ops modules may use (and nothing else of this class):
  rank, num_ranks, num_local_ranks, device (torch.device), device_index, arch (runtime.arch.Arch)
  nvl   : runtime.symmetric.SymmetricBuffer of num_nvl_bytes, or None
  rdma  : runtime.symmetric.SymmetricBuffer of num_rdma_bytes, or None
  status: runtime.status.StatusRecord (host-mapped ErrorRecord; .device_ptr, .check())
  timeout_ns, group, nvshmem (runtime.nvshmem.Nvshmem), options (the Buffer constructor flags)
"""
from __future__ import annotations

from typing import Optional

import torch

from .backend import Backend


class GpuBackend(Backend):
    def __init__(self, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                 options: dict):
        raise NotImplementedError("GpuBackend construction (runtime helper fills this in)")

    # ---- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        from .ops import layout
        return layout.get_dispatch_layout(topk_idx, num_experts, self.num_ranks, self.num_local_ranks)

    def _normal_mode(self):
        if self.num_ranks > self.num_local_ranks:
            from .ops import internode
            return internode
        from .ops import intranode
        return intranode

    def dispatch(self, *args, **kwargs):
        return self._normal_mode().dispatch(self, *args, **kwargs)

    def combine(self, *args, **kwargs):
        return self._normal_mode().combine(self, *args, **kwargs)

    # ---- low-latency mode --------------------------------------------------------------------
    def _low_latency(self):
        if self._ll is None:
            from .ops.low_latency import LowLatency
            self._ll = LowLatency(self)
        return self._ll

    def low_latency_dispatch(self, *args, **kwargs):
        return self._low_latency().dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self._low_latency().combine(*args, **kwargs)

    def clean_low_latency_buffer(self, *args):
        return self._low_latency().clean_buffer(*args)

    def get_next_low_latency_combine_buffer(self, handle):
        return self._low_latency().next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask):
        return self._low_latency().update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        return self._low_latency().query_mask(mask_status)

    def low_latency_clean_mask_buffer(self):
        return self._low_latency().clean_mask()
