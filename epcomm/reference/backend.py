"""ReferenceBackend: the whole Buffer API on CPU tensors over a gloo group.

Every operation gathers the inputs of all ranks (exchange.py, bounded by EPCOMM_TIMEOUT_S) and computes this
rank's result with the oracle functions, so the backend and the oracle of the GPU tests are one
definition. Calls are collective: every rank of the group makes the same calls in the same order.
Everything is synchronous; there are no streams, so the GPU-only knobs (config, events) are
accepted and have no effect.

num_local_ranks (ranks of one "node"): the GPU backend's rule (epcomm.runtime.topology: the ranks of
one host, cut by EPCOMM_NUM_LOCAL_RANKS), with options["num_local_ranks"] in place of the variable
where given (tests). With fewer local ranks than ranks the internode semantics apply: layout returns num_tokens_per_rdma_rank and dispatch the 10-tuple
handle (see handles.py for both handle layouts).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .. import env
from ..backend import Backend, DispatchResult
from ..errors import BufferUnusable, PeerTimeout
from ..runtime.topology import host_key, resolve_local_ranks
from . import handles, oracle
from .exchange import Exchange
from .low_latency import LowLatencyState


def _num_local_ranks(group, options: dict, num_ranks: int) -> int:
    """Collective: every rank's host and forced count, resolved as the GPU backend does. A bad
    count on one rank is gathered first, so every rank raises (no rank is left waiting)."""
    forced, error = options.get("num_local_ranks"), None
    try:
        if forced is not None:
            forced = int(forced)
            if forced < 1 or num_ranks % forced:
                raise ValueError(f"num_local_ranks ({forced}) must divide the number of ranks ({num_ranks})")
        else:
            forced = env.num_local_ranks()
    except ValueError as e:
        forced, error = None, e
    facts = [None] * num_ranks
    dist.all_gather_object(facts, (host_key(), forced, None if error is None else str(error)), group=group)
    if error is not None:
        raise error
    failed = [f"rank {r}: {f[2]}" for r, f in enumerate(facts) if f[2]]
    if failed:
        raise ValueError("ranks per node refused on other ranks: " + "; ".join(failed))
    return resolve_local_ranks([f[0] for f in facts], [f[1] for f in facts])


class ReferenceBackend(Backend):
    def __init__(self, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                 options: Optional[dict] = None):
        self.options = dict(options or {})
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.exchange = Exchange(group, env.timeout_s())
        self.device = torch.device("cpu")
        self.low_latency_mode = low_latency_mode
        local_error, self.num_local_ranks = None, None
        try:
            self.num_local_ranks = _num_local_ranks(group, self.options, self.num_ranks)
        except ValueError as e:
            local_error = e
        enable_shrink = bool(self.options.get("enable_shrink", False))
        self.exchange.agree("Buffer", (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                                       ("low_latency_mode", bool(low_latency_mode)),
                                       ("num_local_ranks (EPCOMM_NUM_LOCAL_RANKS)", self.num_local_ranks),
                                       ("enable_shrink", enable_shrink)), local_error)
        if local_error is not None:
            raise local_error
        # Plain host memory stands in for the NVLink / RDMA buffers (get_local_buffer_tensor),
        # allocated by the first view of it: most Buffers never ask, and sizes are GPU-scale.
        self._buffer_sizes = {False: num_nvl_bytes, True: num_rdma_bytes}
        self._buffers = {}
        self._ll = LowLatencyState(self, enable_shrink)

    @property
    def is_internode(self) -> bool:
        return self.num_local_ranks < self.num_ranks

    def collective(self, op: str, facts, compute):
        """compute() (its gathers and the oracle) framed by the agree / settle rounds of exchange.py:
        a mismatch in `facts` or an error on any rank raises on every rank, state unchanged."""
        self.exchange.agree(op, facts)
        try:
            result = compute()
        except (PeerTimeout, BufferUnusable):
            raise
        except Exception as e:
            self.exchange.settle(op, e)
        self.exchange.settle(op, None)
        return result

    def _gather(self, tensor, op, what):
        return self.exchange.gather_optional(tensor, op, what)

    # ---- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        return oracle.layout(topk_idx, num_experts, self.num_ranks, self.num_local_ranks)

    def dispatch(self, x, x_scales, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                 is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                 expert_alignment, num_worst_tokens, config) -> DispatchResult:
        op = "Buffer.dispatch"
        facts = [("cached (handle given)", handle is not None), ("hidden", x.shape[1]),
                 ("x dtype", str(x.dtype))]
        if handle is not None:
            routing = handles.view(handle, self.rank)
            return self.collective(op, facts, lambda: self._cached_dispatch(op, x, x_scales, routing))
        if is_token_in_rank is None:
            raise ValueError("dispatch without a handle needs is_token_in_rank "
                             "(from get_dispatch_layout)")
        if topk_idx is not None and num_tokens_per_expert is None:
            raise ValueError("dispatch with topk_idx needs num_tokens_per_expert "
                             "(from get_dispatch_layout)")
        facts += [("num_experts", None if num_tokens_per_expert is None else num_tokens_per_expert.numel()),
                  ("topk_idx given", topk_idx is not None),
                  ("num_topk", None if topk_idx is None else topk_idx.shape[1]),
                  ("topk_idx dtype", None if topk_idx is None else str(topk_idx.dtype)),
                  ("expert_alignment", expert_alignment),
                  ("num_worst_tokens > 0", num_worst_tokens > 0)]

        def compute():
            gather = lambda t, what: self._gather(t, op, what)  # noqa: E731
            per_expert = gather(None if num_tokens_per_expert is None
                                else num_tokens_per_expert.reshape(1, -1), "num_tokens_per_expert")
            return oracle.dispatch(
                gather(x, "x"), gather(x_scales, "x_scales"), gather(topk_idx, "topk_idx"),
                gather(topk_weights, "topk_weights"), gather(is_token_in_rank, "is_token_in_rank"),
                None if num_tokens_per_expert is None else num_tokens_per_expert.numel(),
                self.rank, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                num_tokens_per_experts=None if per_expert is None else [t[0] for t in per_expert])

        result = self.collective(op, facts, compute)
        prefix, recv_src_idx = result["rank_prefix_matrix"], result["recv_src_idx"]
        if self.is_internode:
            handle = handles.build_internode(prefix, recv_src_idx, is_token_in_rank, self.rank,
                                             self.num_local_ranks)
        else:
            handle = handles.build_intranode(prefix, recv_src_idx, is_token_in_rank, self.rank)
        return DispatchResult(result["recv_x"], result["recv_x_scales"], result["recv_topk_idx"],
                              result["recv_topk_weights"],
                              result["num_recv_tokens_per_expert_list"], handle)

    def _cached_dispatch(self, op, x, x_scales, routing) -> DispatchResult:
        """Same routing as the handle's dispatch, new data: only recv_x (and scales) are filled."""
        result = oracle.dispatch(self._gather(x, op, "x"), self._gather(x_scales, op, "x_scales"),
                                 None, None,
                                 self._gather(routing.is_token_in_rank, op, "is_token_in_rank"),
                                 None, self.rank)
        delivered = result["recv_x"].shape[0]
        if delivered != routing.num_valid_rows or delivered > routing.num_rows:
            raise ValueError(f"{op}: the handle is not consistent: its counts give rank {self.rank} "
                             f"{routing.num_valid_rows} rows ({routing.num_rows} with padding), the "
                             f"is_token_in_rank of every rank delivers {delivered}")
        pad = routing.num_rows - delivered
        recv_x, scales = result["recv_x"], result["recv_x_scales"]
        if pad:
            recv_x = torch.cat([recv_x, recv_x.new_zeros(pad, *recv_x.shape[1:])])
            scales = None if scales is None else torch.cat([scales, scales.new_zeros(pad, *scales.shape[1:])])
        return DispatchResult(recv_x, scales, None, None, None, None)

    def combine(self, x, handle, topk_weights, bias, config):
        op = "Buffer.combine"
        routing = handles.view(handle, self.rank)
        valid = routing.num_valid_rows
        if x.shape[0] < valid:
            raise ValueError(f"combine: x has {x.shape[0]} rows, the handle received {valid}")
        facts = (("hidden", x.shape[1]), ("topk_weights given", topk_weights is not None),
                 ("num_topk", None if topk_weights is None else topk_weights.shape[1]))

        def compute():
            # padding rows (num_worst_tokens) carry nothing back, so they are not sent
            xs = self._gather(x[:valid], op, "x")
            weights = self._gather(None if topk_weights is None else topk_weights[:valid], op,
                                   "topk_weights")
            in_rank = self._gather(routing.is_token_in_rank, op, "is_token_in_rank")
            return oracle.combine(xs, in_rank, self.rank, weights, bias,
                                  num_local_ranks=self.num_local_ranks if self.is_internode else 1)

        return self.collective(op, facts, compute)

    # ---- low-latency mode (low_latency.py) ------------------------------------------------
    def low_latency_dispatch(self, *args, **kwargs):
        return self._ll.dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self._ll.combine(*args, **kwargs)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self._ll.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

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
        memory = self._buffer(bool(use_rdma_buffer))
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

    def _buffer(self, rdma: bool) -> bytearray:
        memory = self._buffers.get(rdma)
        if memory is None:
            size = self._buffer_sizes[rdma]
            try:
                memory = self._buffers[rdma] = bytearray(size)
            except MemoryError:
                name = "num_rdma_bytes" if rdma else "num_nvl_bytes"
                raise MemoryError(f"get_local_buffer_tensor: the CPU backend cannot allocate the "
                                  f"{name}={size} bytes of host memory this view needs") from None
        return memory

    def check_errors(self):
        """CPU calls fail by raising at once; after a peer timeout the Buffer stays unusable."""
        self.exchange.require_usable("Buffer")

    def recover(self, timeout_s):
        """The CPU backend's failed calls leave it usable, except a peer timeout: a gloo wait that
        ran out may stay posted, and a later message of that peer would land in it. So this only
        meets the other ranks (within timeout_s, None = EPCOMM_TIMEOUT_S), or says the Buffer
        cannot recover."""
        if self.exchange.broken is not None:
            raise BufferUnusable(f"Buffer.recover: the CPU backend cannot recover from "
                                 f"{self.exchange.broken}: gloo may still hold the receive that timed "
                                 f"out; build a new process group and Buffer") from self.exchange.broken
        bound, self.exchange.timeout_s = self.exchange.timeout_s, timeout_s or self.exchange.timeout_s
        try:
            self.exchange.agree("Buffer.recover", ())
        finally:
            self.exchange.timeout_s = bound

    def destroy(self):
        self._buffers = {}
        self._buffer_sizes = {False: 0, True: 0}
        self._ll.release()
        # No reference to the process group outlives the Buffer's destroy(): a gloo group that
        # destroy_process_group() leaves alive is torn down at interpreter exit instead, where its
        # worker threads can abort the process.
        self.group = self.exchange.group = None
