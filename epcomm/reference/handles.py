"""Normal-mode handles of the CPU backend, built from the routing alone.

Intranode 6-tuple (elements 0, 3, 4 are the contract's; the others are defined here, with ONE
channel, so a "channel prefix" is a plain per-rank total):
  0 rank_prefix_matrix [R, R] i32          [i][j] = tokens sent to rank j by ranks 0..i
  1 channel_prefix_matrix [R, 1] i32       tokens this rank sends to each rank
  2 recv_channel_prefix_matrix [R, 1] i32  first received row of each source rank
  3 recv_src_idx [M] i32                   index of the row's token on its source rank (-1: padding)
  4 is_token_in_rank [N, R] bool
  5 send_head [N, R] i32                   row of token n on rank r, -1 when not sent there

Internode 10-tuple (element -4 is the contract's; names follow DeepEP, meanings as stated):
  0 is_token_in_rank [N, R] bool
  1 rdma_channel_prefix_matrix [R/L, 1] i32      tokens this rank sends to each node
  2 gbl_channel_prefix_matrix [R, 1] i32         tokens this rank sends to each rank
  3 recv_rdma_channel_prefix_matrix [R/L, 1] i32 rows received from each source node
  4 recv_rdma_rank_prefix_sum [R/L] i32          inclusive prefix of rows from nodes 0..i
  5 recv_gbl_channel_prefix_matrix [R, 1] i32    first received row of each source rank
  6 recv_gbl_rank_prefix_sum [R] i32             inclusive prefix of rows from ranks 0..i
  7 recv_src_meta [M, 2] i32                     (source rank, source token index), -1 padding
  8 send_rdma_head [N, R/L] i32                  index of token n among those sent to node i, or -1
  9 send_nvl_head [N, R] i32                     row of token n on rank r, or -1
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backend import InternodeHandle, IntranodeHandle, named
from .oracle import CPU

INTRANODE_HANDLE_LEN = 6
INTERNODE_HANDLE_LEN = 10


def _positions(selected: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """[N, C] bool -> [N, C] i32: first[c] + rank of n among the selected rows of column c, or -1."""
    running = selected.long().cumsum(0) - 1 + first.long()[None, :]
    return torch.where(selected, running, -1).int()


def send_rows(is_token_in_rank: torch.Tensor, prefix: torch.Tensor, rank: int) -> torch.Tensor:
    """[N, R] i32: the row each of this rank's tokens occupies on each destination (-1: not sent)."""
    before = prefix[rank - 1] if rank > 0 else torch.zeros_like(prefix[0])
    return _positions(is_token_in_rank, before)


def received_per_source(prefix: torch.Tensor, rank: int) -> torch.Tensor:
    """[R] i64: rows this rank receives from each source rank."""
    column = prefix[:, rank].long()
    return torch.diff(column, prepend=column.new_zeros(1))


def build_intranode(prefix, recv_src_idx, is_token_in_rank, rank) -> tuple:
    sent = is_token_in_rank.sum(0, dtype=torch.int32)
    received = received_per_source(prefix, rank)
    first_row = (received.cumsum(0) - received).int()
    return IntranodeHandle(prefix, sent[:, None].contiguous(), first_row[:, None].contiguous(), recv_src_idx,
                           is_token_in_rank, send_rows(is_token_in_rank, prefix, rank))


def build_internode(prefix, recv_src_idx, is_token_in_rank, rank, num_local_ranks) -> tuple:
    num_tokens, num_ranks = is_token_in_rank.shape
    num_nodes = num_ranks // num_local_ranks
    in_node = is_token_in_rank.view(num_tokens, num_nodes, num_local_ranks).any(-1)
    received = received_per_source(prefix, rank)
    gbl_prefix = received.cumsum(0)
    node_received = received.view(num_nodes, num_local_ranks).sum(1)
    sources = torch.repeat_interleave(
        torch.arange(num_ranks, dtype=torch.int64, device=CPU), received)
    src_meta = torch.full((len(recv_src_idx), 2), -1, dtype=torch.int32, device=CPU)
    src_meta[:len(sources), 0] = sources.int()
    src_meta[:, 1] = recv_src_idx
    return InternodeHandle(
            is_token_in_rank,
            in_node.sum(0, dtype=torch.int32)[:, None].contiguous(),
            is_token_in_rank.sum(0, dtype=torch.int32)[:, None].contiguous(),
            node_received.int()[:, None].contiguous(),
            node_received.cumsum(0).int(),
            (gbl_prefix - received).int()[:, None].contiguous(),
            gbl_prefix.int(),
            src_meta,
            _positions(in_node, torch.zeros(num_nodes, dtype=torch.int64, device=CPU)),
            send_rows(is_token_in_rank, prefix, rank))


@dataclass
class HandleView:
    """What cached dispatch and combine need from either handle."""
    is_token_in_rank: torch.Tensor
    num_rows: int        # M, including num_worst_tokens padding
    num_valid_rows: int  # rows actually received


def view(handle: tuple, rank: int) -> HandleView:
    if len(handle) == INTRANODE_HANDLE_LEN:
        intranode = named(IntranodeHandle, handle)
        return HandleView(intranode.is_token_in_rank, len(intranode.recv_src_idx),
                          int(intranode.rank_prefix_matrix[-1, rank]))
    if len(handle) == INTERNODE_HANDLE_LEN:
        internode = named(InternodeHandle, handle)
        return HandleView(internode.is_token_in_rank, len(internode.recv_src_meta),
                          int(internode.recv_gbl_rank_prefix_sum[-1]))
    raise ValueError(f"a dispatch handle is a 6-tuple (intranode) or a 10-tuple (internode), "
                     f"got a {len(handle)}-tuple")
