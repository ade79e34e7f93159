"""Dispatch layout (Buffer.get_dispatch_layout): checked exactly against a torch computation, then
timed as a whole call (CUDA events, L2 flushed) and, for the targets.md setting, as kernel time
(torch profiler). Target: <= 20 us for N=4096, K=8, E=256 (DeepEP V1: 34 us)."""
from __future__ import annotations

from typing import List

import torch

from .harness import BenchContext, Case, Record

NUM_TOPK = 8
NUM_EXPERTS = 256
TARGET = dict(N=4096, K=NUM_TOPK, E=NUM_EXPERTS)
TARGET_US = 20.0
SWEEP_FULL = (128, 512, 1024, 2048, 4096, 8192, 16384)
SWEEP_QUICK = (128, 4096)


def layout_name(N: int, K: int, E: int, what: str = "whole call") -> str:
    return f"layout N={N} K={K} E={E} ({what})"


def expected_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """(num_tokens_per_rank [R] i32, num_tokens_per_expert [E] i32, is_token_in_rank [N,R] bool)."""
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    dest = torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank = in_rank.scatter_(1, dest, True)[:, :num_ranks]
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def _layout(ctx: BenchContext, N: int, K: int, E: int) -> List[Record]:
    import epcomm
    buffer = ctx.normal_buffer()
    topk_idx = ctx.inputs(N, 8, E, K, seed=11).topk_idx.to(epcomm.topk_idx_t)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    want_rank, want_expert, want_in_rank = expected_layout(topk_idx, E, ctx.world_size)
    ctx.check(torch.equal(per_rank, want_rank) and torch.equal(per_expert, want_expert)
              and torch.equal(in_rank, want_in_rank), f"get_dispatch_layout N={N} differs from torch")

    def fn():
        buffer.get_dispatch_layout(topk_idx, E)
    setting = dict(N=N, K=K, E=E, R=ctx.world_size)
    timing = ctx.time_stats(fn, align=False)
    is_target = setting["N"] == TARGET["N"] and K == TARGET["K"] and E == TARGET["E"]
    records = [Record(layout_name(N, K, E), setting, us=timing.mean_us, extra=timing.summary(),
                      target=("us", "<=", TARGET_US) if is_target else None)]
    if is_target and ctx.is_gpu:
        kernel_us, kernels = ctx.kernel_time_us(fn, match="layout")
        if kernel_us is None:
            records[0].extra["kernel_time"] = "the profiler saw no kernel whose name contains 'layout'"
        else:
            records.append(Record(layout_name(N, K, E, "kernel time"), setting, us=kernel_us,
                                  extra={"kernels_us_per_call": kernels},
                                  target=("us", "<=", TARGET_US)))
    return records


def cases(ctx: BenchContext):
    for N in (SWEEP_QUICK if ctx.quick else SWEEP_FULL):
        yield Case(layout_name(N, NUM_TOPK, NUM_EXPERTS), lambda c, n=N: _layout(c, n, NUM_TOPK,
                                                                                NUM_EXPERTS),
                   dict(N=N, K=NUM_TOPK, E=NUM_EXPERTS))
