"""Intranode dispatch / combine (Buffer.dispatch / Buffer.combine, ranks in one NVLink domain).

Figures (targets.md): dispatch is timed as a cached-handle call (same routing, the fresh call's
host read of the counts stays out), combine as a whole call; CUDA events around the call, L2
flushed, ranks aligned, averaged. Logical bytes = every received row (own rows included), NVLink
bytes = the rows that came from other ranks; FP8 counts e4m3 payload + one f32 scale per 128.
Each setting is checked first: the cached dispatch equals the fresh one, and combine(dispatch(x))
equals x times the ranks each token reached (calc_diff < 5e-6).

Cases: the targets.md setting (N=4096, H=7168, K=8, E=256, 24 SMs) for BF16 dispatch, FP8 dispatch
and combine, plus the fresh (exact, with host sync) and num_worst_tokens dispatch for reference;
then sweeps over N (128..16384), H (2048..8192) and SMs (8..48), BF16 dispatch and combine.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import baselines
from .harness import BenchContext, Case, Record, gbps, normal_bytes

SETTING = dict(N=4096, H=7168, K=8, E=256)
TARGET_SMS = 24
TARGET_GBPS = {"dispatch BF16": 450.0, "dispatch FP8": 330.0, "combine BF16": 400.0}
SWEEP_N = (128, 512, 1024, 2048, 4096, 8192, 16384)
SWEEP_H = (2048, 4096, 7168, 8192)
SWEEP_SMS = (8, 16, 24, 32, 48)
QUICK_N, QUICK_H, QUICK_SMS = (128, 4096), (7168,), (8, 24)


def intranode_name(op: str, N: int, H: int, K: int, E: int, sms: int) -> str:
    """op: "dispatch BF16", "dispatch FP8", "combine BF16", "dispatch BF16 fresh", ..."""
    return f"intranode {op} N={N} H={H} K={K} E={E} SMs={sms}"


def fp8_cast(x: torch.Tensor):
    """e4m3 rows and per-128-channel f32 scales (column-major storage, as DeepEP callers pass)."""
    n, h = x.shape
    blocks = x.float().view(n, h // 128, 128)
    scales = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
    data = (blocks / scales[..., None]).to(torch.float8_e4m3fn).view(n, h)
    return data, scales.t().contiguous().t()


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return 0.0 if float(denominator) == 0 else float(1 - 2 * (x * y).sum() / denominator)


def _nvl_bytes(ctx: BenchContext, max_tokens: int, hidden: int) -> int:
    """Enough for a one-shot ring of max_tokens rows per peer (and at least the size hint)."""
    import epcomm
    from epcomm.ops import intranode_plan as plan
    config = epcomm.Buffer.get_dispatch_config(ctx.world_size)
    hint = config.get_nvl_buffer_size_hint(hidden * 2, ctx.world_size)
    record = plan.dispatch_record_bytes(hidden * 2, hidden // 128, 32)
    need = plan.dispatch_staging_offset(ctx.world_size, 1024) + (ctx.world_size - 1) * max_tokens * record
    return -(-max(hint, min(need, 1 << 30)) // 128) * 128   # a smaller ring is reused, still correct


def _run(ctx: BenchContext, N: int, H: int, K: int, E: int, sms: int, ops: tuple,
         target: bool = False) -> List[Record]:
    import epcomm
    buffer = ctx.buffer(num_nvl_bytes=_nvl_bytes(ctx, max(SWEEP_N), max(SWEEP_H + (H,))))
    config = epcomm.Config(sms)
    inputs = ctx.inputs(N, H, E, K, seed=3)
    x, topk_idx, topk_weights = inputs.x, inputs.topk_idx.to(epcomm.topk_idx_t), inputs.topk_weights
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=topk_weights, config=config)

    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, **layout)
    rows = recv_x.shape[0]
    remote_rows = rows - int(in_rank[:, ctx.rank].sum())
    cached = buffer.dispatch(x, handle=handle, config=config)[0]
    combined, weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, config=config)
    reached = in_rank.sum(1, keepdim=True).float()
    diff = calc_diff(combined.float(), x.float() * reached)
    ctx.check(torch.equal(cached, recv_x) and diff < 5e-6,
              f"intranode N={N} H={H} SMs={sms}: cached == fresh dispatch and combine round trip "
              f"(calc_diff {diff:.2e})")

    setting = dict(N=N, H=H, K=K, E=E, R=ctx.world_size, sms=sms, recv_rows=rows, remote_rows=remote_rows)
    x_fp8 = fp8_cast(x) if "dispatch FP8" in ops else None
    calls = {
        "dispatch BF16": (lambda: buffer.dispatch(x, handle=handle, config=config), False),
        "dispatch FP8": (lambda: buffer.dispatch(x_fp8, handle=handle, config=config), True),
        "combine BF16": (lambda: buffer.combine(recv_x, handle, topk_weights=recv_w, config=config), False),
        "dispatch BF16 fresh": (lambda: buffer.dispatch(x, **layout), False),
        "dispatch BF16 num_worst_tokens": (lambda: buffer.dispatch(x, num_worst_tokens=N * ctx.world_size,
                                                                  **layout), False),
    }
    records = []
    for op in ops:
        fn, fp8 = calls[op]
        timing = ctx.time_stats(fn)
        us = timing.mean_us
        goal = TARGET_GBPS.get(op) if target else None
        baseline: Optional[str] = None
        if target and op.split()[0] in ("dispatch", "combine"):
            baseline = baselines.torch_moe_name(op.split()[0], N, H, K, E)
        records.append(Record(intranode_name(op, N, H, K, E, sms), setting, us=us,
                              logical_gbps=gbps(normal_bytes(rows, H, fp8), us),
                              nvlink_gbps=gbps(normal_bytes(remote_rows, H, fp8), us), sms=sms,
                              extra=timing.summary(), baseline=baseline,
                              target=("logical_gbps", ">=", goal) if goal else None))
    return records


def cases(ctx: BenchContext):
    N, H, K, E = SETTING["N"], SETTING["H"], SETTING["K"], SETTING["E"]
    if E % ctx.world_size:
        return
    target_ops = ("dispatch BF16", "dispatch FP8", "combine BF16", "dispatch BF16 fresh",
                  "dispatch BF16 num_worst_tokens")
    yield Case(intranode_name("targets", N, H, K, E, TARGET_SMS),
               lambda c: _run(c, N, H, K, E, TARGET_SMS, target_ops, target=True),
               dict(SETTING, sms=TARGET_SMS))
    sweep_ops = ("dispatch BF16", "combine BF16")
    for n in (QUICK_N if ctx.quick else SWEEP_N):
        if n != N:
            yield Case(intranode_name("sweep N", n, H, K, E, TARGET_SMS),
                       lambda c, n=n: _run(c, n, H, K, E, TARGET_SMS, sweep_ops), dict(SETTING, N=n))
    for h in (QUICK_H if ctx.quick else SWEEP_H):
        if h != H:
            yield Case(intranode_name("sweep H", N, h, K, E, TARGET_SMS),
                       lambda c, h=h: _run(c, N, h, K, E, TARGET_SMS, sweep_ops), dict(SETTING, H=h))
    for sms in (QUICK_SMS if ctx.quick else SWEEP_SMS):
        if sms != TARGET_SMS:
            yield Case(intranode_name("sweep SMs", N, H, K, E, sms),
                       lambda c, s=sms: _run(c, N, H, K, E, s, sweep_ops + ("dispatch FP8",)),
                       dict(SETTING, sms=sms))
