"""Cross-rank agreement on a call's collective arguments, once per argument set.

GPU low-latency kernels lay out their buffers from (T, H, E, K, the FP8 flags): ranks that differ
would read each other's rows at the wrong places and return wrong results without any wait running
out. The Buffer therefore checks a new argument set across the group once (one small all-gather on
the group's device, bounded by EPCOMM_TIMEOUT_S) and remembers it; later calls with the same set
cost one set lookup. The CPU backend agrees on every call already (reference/exchange.py).
"""
from __future__ import annotations

import datetime
from typing import Sequence, Tuple

import torch
import torch.distributed as dist

from .errors import PeerTimeout


def agree(group, device: torch.device, op: str, names: Sequence[str], values: Tuple[int, ...],
          timeout_s: float) -> None:
    """Raise ValueError on every rank if any rank holds other `values` (ints / bools) for `names`;
    PeerTimeout (peer -1: the collective cannot tell who) when a rank does not join in time."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    everyone = torch.empty(world * len(values), dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(everyone, mine, group=group, async_op=True)
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerTimeout(op, rank, -1, "agree on the arguments", timeout_s) from e
    if done is False:
        raise PeerTimeout(op, rank, -1, "agree on the arguments", timeout_s)
    table = everyone.view(world, len(values)).tolist()
    for i, name in enumerate(names):
        column = [row[i] for row in table]
        if any(v != column[0] for v in column):
            raise ValueError(f"{op}: {name} must be equal on every rank, got {column} (by rank)")
