"""Collectives of the CPU backend: gather every rank's tensor over a gloo group.

Tensors travel as raw bytes (uint8), so any dtype (bf16, fp8, bool, int64) goes through gloo, and
each rank may hold a different number of rows: rows are padded to the largest count, sizes travel
first. Every rank of the group must make the same sequence of calls.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist


def all_gather_rows(group, tensor: torch.Tensor, what: str = "tensor") -> List[torch.Tensor]:
    """Every rank's `tensor` [rows, *trailing], as a list indexed by rank. Ranks may differ in
    rows; dtype and trailing shape must agree (checked through the row size in bytes)."""
    world = dist.get_world_size(group)
    rows, trailing = tensor.shape[0], tuple(tensor.shape[1:])
    row_bytes = math.prod(trailing) * tensor.element_size()
    header = torch.tensor([rows, row_bytes], dtype=torch.int64, device=tensor.device)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    counts = [int(h[0]) for h in headers]
    if any(int(h[1]) != row_bytes for h in headers):
        sizes = [int(h[1]) for h in headers]
        raise ValueError(f"ranks disagree on the row size of {what}: {sizes} bytes per row")
    if row_bytes == 0:
        return [torch.empty((c, *trailing), dtype=tensor.dtype, device=tensor.device)
                for c in counts]
    send = torch.zeros(max(max(counts), 1), row_bytes, dtype=torch.uint8, device=tensor.device)
    send[:rows] = tensor.contiguous().view(torch.uint8).reshape(rows, row_bytes)
    received = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(received, send, group=group)
    return [r[:c].contiguous().view(tensor.dtype).reshape(c, *trailing)
            for r, c in zip(received, counts)]


def all_gather_optional(group, tensor: Optional[torch.Tensor], what: str = "tensor"
                        ) -> Optional[List[torch.Tensor]]:
    """all_gather_rows, or None when the tensor is absent (it must be absent on every rank)."""
    return None if tensor is None else all_gather_rows(group, tensor, what)
