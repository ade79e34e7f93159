"""ReferenceBackend: the whole Buffer API on CPU tensors over a gloo group.

Every operation gathers the inputs of all ranks (exchange.all_gather_rows) and computes this
rank's result with the oracle functions, so the backend and the oracle of the GPU tests are one
definition. Calls are collective: every rank of the group makes the same calls in the same order.
Everything is synchronous; there are no streams, so the GPU-only knobs (config, events) are
accepted and have no effect.

num_local_ranks (ranks of one "node"): options["num_local_ranks"], else EPCOMM_NUM_LOCAL_RANKS, else
the LOCAL_WORLD_SIZE of torchrun (capped at the group size), else the whole group. With fewer local ranks than ranks the
internode semantics apply: layout returns num_tokens_per_rdma_rank and dispatch the 10-tuple
handle (see handles.py for both handle layouts).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.distributed as dist

from .. import env
from ..backend import Backend, DispatchResult
from . import handles, oracle
from .exchange import all_gather_optional
from .low_latency import LowLatencyState


def _num_local_ranks(options: dict, num_ranks: int) -> int:
    value = options.get("num_local_ranks")
    if value is None:
        value = env.num_local_ranks()
    if value is None:
        # torchrun's own variable (not an epcomm knob): ranks per node
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        value = min(int(local_world), num_ranks) if local_world else num_ranks
    value = int(value)
    if value < 1 or num_ranks % value:
        raise ValueError(f"num_local_ranks ({value}) must divide the number of ranks ({num_ranks})")
    return value


class ReferenceBackend(Backend):
    def __init__(self, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                 options: Optional[dict] = None):
        self.options = dict(options or {})
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_local_ranks = _num_local_ranks(self.options, self.num_ranks)
        self.device = torch.device("cpu")
        self.low_latency_mode = low_latency_mode
        # Plain host memory stands in for the NVLink / RDMA buffers (get_local_buffer_tensor).
        self._buffers = {False: bytearray(num_nvl_bytes), True: bytearray(num_rdma_bytes)}
        self._ll = LowLatencyState(self, bool(self.options.get("enable_shrink", False)))

    @property
    def is_internode(self) -> bool:
        return self.num_local_ranks < self.num_ranks

    def _gather(self, tensor, what):
        return all_gather_optional(self.group, tensor, what)

    # ---- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        return oracle.layout(topk_idx, num_experts, self.num_ranks, self.num_local_ranks)

    def dispatch(self, x, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                 is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                 expert_alignment, num_worst_tokens, config) -> DispatchResult:
        if handle is not None:
            return self._cached_dispatch(x, x_scales, handle)
        if is_token_in_rank is None:
            raise ValueError("dispatch without a handle needs is_token_in_rank "
                             "(from get_dispatch_layout)")
        if topk_idx is not None and num_tokens_per_expert is None:
            raise ValueError("dispatch with topk_idx needs num_tokens_per_expert "
                             "(from get_dispatch_layout)")
        per_expert = self._gather(None if num_tokens_per_expert is None
                                  else num_tokens_per_expert.reshape(1, -1), "num_tokens_per_expert")
        result = oracle.dispatch(
            self._gather(x, "x"), self._gather(x_scales, "x_scales"),
            self._gather(topk_idx, "topk_idx"), self._gather(topk_weights, "topk_weights"),
            self._gather(is_token_in_rank, "is_token_in_rank"),
            None if num_tokens_per_expert is None else num_tokens_per_expert.numel(),
            self.rank, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
            num_tokens_per_experts=None if per_expert is None else [t[0] for t in per_expert])
        prefix, recv_src_idx = result["rank_prefix_matrix"], result["recv_src_idx"]
        if self.is_internode:
            handle = handles.build_internode(prefix, recv_src_idx, is_token_in_rank, self.rank,
                                             self.num_local_ranks)
        else:
            handle = handles.build_intranode(prefix, recv_src_idx, is_token_in_rank, self.rank)
        return DispatchResult(result["recv_x"], result["recv_x_scales"], result["recv_topk_idx"],
                              result["recv_topk_weights"],
                              result["num_recv_tokens_per_expert_list"], handle)

    def _cached_dispatch(self, x, x_scales, handle) -> DispatchResult:
        """Same routing as the handle's dispatch, new data: only recv_x (and scales) are filled."""
        routing = handles.view(handle, self.rank)
        result = oracle.dispatch(self._gather(x, "x"), self._gather(x_scales, "x_scales"), None,
                                 None, self._gather(routing.is_token_in_rank, "is_token_in_rank"),
                                 None, self.rank, num_worst_tokens=routing.num_rows)
        if result["recv_x"].shape[0] != routing.num_rows:
            raise ValueError(f"cached dispatch: the handle has {routing.num_rows} rows but its "
                             f"routing delivers {result['recv_x'].shape[0]} to rank {self.rank}")
        return DispatchResult(result["recv_x"], result["recv_x_scales"], None, None, None, None)

    def combine(self, x, handle, topk_weights, bias, config):
        routing = handles.view(handle, self.rank)
        valid = routing.num_valid_rows
        if x.shape[0] < valid:
            raise ValueError(f"combine: x has {x.shape[0]} rows, the handle received {valid}")
        # padding rows (num_worst_tokens) carry nothing back, so they are not sent
        xs = self._gather(x[:valid], "x")
        weights = self._gather(None if topk_weights is None else topk_weights[:valid],
                               "topk_weights")
        return oracle.combine(xs, self._gather(routing.is_token_in_rank, "is_token_in_rank"),
                              self.rank, weights, bias,
                              num_local_ranks=self.num_local_ranks if self.is_internode else 1)

    # ---- low-latency mode (low_latency.py) ------------------------------------------------
    def low_latency_dispatch(self, *args, **kwargs):
        return self._ll.dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self._ll.combine(*args, **kwargs)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self._ll.clean()

    def get_next_low_latency_combine_buffer(self, handle):
        return self._ll.next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask):
        self._ll.update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        self._ll.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self):
        self._ll.clean_mask()

    # ---- buffer memory -----------------------------------------------------------------------
    def get_local_buffer_tensor(self, dtype, size, offset, use_rdma_buffer):
        """A zero-copy view of this rank's host buffer (num_rdma_bytes or num_nvl_bytes),
        starting at byte `offset`: 1-D over the rest of the buffer, or shaped `size`."""
        memory = self._buffers[bool(use_rdma_buffer)]
        element = dtype.itemsize
        if offset < 0 or offset % element or offset > len(memory):
            raise ValueError(f"get_local_buffer_tensor: offset {offset} must be a multiple of "
                             f"{element} within the {len(memory)}-byte buffer")
        count = (len(memory) - offset) // element
        raw = (torch.frombuffer(memory, dtype=torch.uint8) if len(memory)
               else torch.empty(0, dtype=torch.uint8, device="cpu"))
        tensor = raw[offset:offset + count * element].view(dtype)
        if size is None:
            return tensor
        needed = math.prod(size)
        if needed > count:
            raise ValueError(f"get_local_buffer_tensor: size {tuple(size)} needs {needed} "
                             f"elements, {count} fit after offset {offset}")
        return tensor[:needed].view(size)

    def check_errors(self):
        """Nothing to report: CPU calls fail by raising at once."""

    def destroy(self):
        self._buffers = {False: bytearray(0), True: bytearray(0)}
        self._ll.release()
