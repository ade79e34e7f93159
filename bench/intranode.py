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

from typing import Callable, Dict, List, Optional

import torch

from . import baselines
from .harness import Attempts, BenchContext, Case, Record, gbps, normal_bytes

SETTING = dict(N=4096, H=7168, K=8, E=256)
TARGET_SMS = 24
INPUT_SEED = 3        # ctx.inputs seed of every setting (any rank can rebuild another rank's inputs)
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
    buffer = ctx.buffer(num_nvl_bytes=_nvl_bytes(ctx, max(SWEEP_N), max(SWEEP_H + (H,))))
    return run_normal(ctx, buffer, intranode_name, N, H, K, E, sms, ops,
                      goals=TARGET_GBPS if target else None, with_baseline=target)


def run_normal(ctx: BenchContext, buffer, name: Callable[..., str], N: int, H: int, K: int, E: int,
               sms: int, ops: tuple, goals: Optional[Dict[str, float]] = None, with_baseline: bool = False,
               verify: Optional[Callable[..., List[str]]] = None,
               setting: Optional[dict] = None) -> List[Record]:
    """Check, then time normal-mode `ops` on `buffer` (intranode, or internode: the layout's per-node
    counts go to the fresh dispatch as well). The check: the cached dispatch equals the fresh one and
    combine(dispatch(x)) equals x times the ranks each token reached (calc_diff < 5e-6), plus what
    `verify(x, fresh dispatch result, config)` returns (problems, empty when right). Every epcomm
    call goes through harness.Attempts, so a call that raises on one rank only fails the check (or
    the timing) on every rank instead of leaving the others in a collective. "Remote" rows (the
    nvlink_gbps figure) are the rows from other ranks: from other nodes when every rank is a node.
    `name(op, N, H, K, E, sms)` names the records; `goals` maps op -> logical GB/s target;
    `with_baseline` compares dispatch / combine with the same-run torch+NCCL MoE."""
    import epcomm
    config = epcomm.Config(sms)
    inputs = ctx.inputs(N, H, E, K, seed=INPUT_SEED)
    x, topk_idx, topk_weights = inputs.x, inputs.topk_idx.to(epcomm.topk_idx_t), inputs.topk_weights
    attempts = Attempts()

    def round_trip():
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
        layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                      is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                      topk_weights=topk_weights, config=config)
        fresh = buffer.dispatch(x, **layout)
        recv_x, _, recv_w, _, handle, _ = fresh
        cached = buffer.dispatch(x, handle=handle, config=config)[0]
        combined = buffer.combine(recv_x, handle, topk_weights=recv_w, config=config)[0]
        diff = calc_diff(combined.float(), x.float() * in_rank.sum(1, keepdim=True).float())
        problems = [] if torch.equal(cached, recv_x) else ["cached != fresh dispatch"]
        problems += [f"calc_diff {diff:.2e}"] if diff >= 5e-6 else []
        problems += verify(x, fresh, config) if verify is not None else []
        return layout, fresh, int(in_rank[:, ctx.rank].sum()), problems

    checked = attempts(round_trip)
    attempts.check(ctx, f"{name('round trip', N, H, K, E, sms)}: cached == fresh dispatch and "
                        f"combine(dispatch(x)) == x * ranks reached", checked[3] if checked else ())
    layout, (recv_x, _, recv_w, _, handle, _), own_rows, _ = checked
    rows = recv_x.shape[0]
    remote_rows = rows - own_rows
    setting = dict(N=N, H=H, K=K, E=E, R=ctx.world_size, sms=sms, recv_rows=rows, remote_rows=remote_rows,
                   **(setting or {}))
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
        timing = ctx.time_stats(attempts.wrap(fn), hide_host=True)
        attempts.check(ctx, f"{name(op, N, H, K, E, sms)}: timed calls")
        us = timing.mean_us
        goal = (goals or {}).get(op)
        baseline: Optional[str] = None
        if with_baseline and op.split()[0] in ("dispatch", "combine"):
            baseline = baselines.torch_moe_name(op.split()[0], N, H, K, E)
        records.append(Record(name(op, N, H, K, E, sms), setting, us=us,
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
