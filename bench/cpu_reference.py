"""The bench without GPUs: epcomm's CPU reference backend (gloo) on small random data, checked against
brute-force expectations computed here (each rank rebuilds every rank's inputs from their seeds), and
timed with the host clock. A wrong round trip fails the case, so `python -m bench` exits non-zero.

Normal mode: layout -> dispatch -> combine, then a cached-handle dispatch.
Low-latency mode: dispatch (BF16 and FP8) -> identity experts -> weighted combine.
Internode normal mode: the normal-mode round trip with every rank its own node
(EPCOMM_NUM_LOCAL_RANKS=1 while its Buffer is built): per-node counts, the 10-tuple handle.
"""
from __future__ import annotations

from typing import List

import torch

import epcomm

from .harness import (BenchContext, Case, Record, buffer_bytes, gbps, low_latency_combine_bytes,
                      low_latency_dispatch_bytes, normal_bytes)
from .layout import expected_layout

NORMAL = dict(N=96, H=256, K=4, E=8)
LOW_LATENCY = dict(N=48, T=64, H=256, K=4, E=8)
MASKED = 0.1          # fraction of top-k entries set to -1, as the contract allows


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _record(name: str, setting: dict, timing, nbytes: int = 0) -> Record:
    return Record(name, setting, us=timing.mean_us,
                  logical_gbps=gbps(nbytes, timing.mean_us) if nbytes else None,
                  extra=timing.summary())


# ---------------------------------------------------------------------------------------------
# Normal mode
# ---------------------------------------------------------------------------------------------
def _normal(ctx: BenchContext, internode: bool = False) -> List[Record]:
    """internode: every rank its own node (EPCOMM_NUM_LOCAL_RANKS=1 while the Buffer is built), so
    the layout's per-node counts, the 10-tuple handle and the per-node combine order apply."""
    N, H, K, E = NORMAL["N"], NORMAL["H"], NORMAL["K"], NORMAL["E"]
    R, rank, local_experts = ctx.world_size, ctx.rank, NORMAL["E"] // ctx.world_size
    inputs = [ctx.inputs(N, H, E, K, seed=3, rank=r, masked_fraction=MASKED) for r in range(R)]
    mine = inputs[rank]
    configs = [epcomm.Buffer.get_dispatch_config(R), epcomm.Buffer.get_combine_config(R)]
    buffer = ctx.internode_buffer(configs, H, K) if internode else ctx.normal_buffer(hidden=H)
    label = "CPU internode " if internode else "CPU "

    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(mine.topk_idx, E)
    want_rank, want_expert, want_in_rank = expected_layout(mine.topk_idx, E, R)
    # One rank per node: the per-node counts are the per-rank ones (intranode: None).
    ctx.check(torch.equal(per_rank, want_rank) and torch.equal(per_expert, want_expert)
              and torch.equal(in_rank, want_in_rank)
              and (torch.equal(per_node, want_rank) if internode else per_node is None),
              "layout differs from the brute-force counts")

    layout_args = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                       is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(mine.x, **layout_args)

    # Expected rows: by source rank ascending, each source's tokens for this rank in token order.
    rows = [expected_layout(inp.topk_idx, E, R)[2][:, rank].nonzero()[:, 0] for inp in inputs]
    want_x = torch.cat([inp.x[r] for inp, r in zip(inputs, rows)])
    want_idx = torch.cat([inp.topk_idx[r] for inp, r in zip(inputs, rows)]) - rank * local_experts
    mine_mask = (want_idx >= 0) & (want_idx < local_experts)
    want_idx = torch.where(mine_mask, want_idx, -1)
    want_w = torch.where(mine_mask, torch.cat([inp.topk_weights[r] for inp, r in zip(inputs, rows)]), 0.0)
    want_counts = [int((want_idx == e).sum()) for e in range(local_experts)]
    # recv_src_idx: intranode handle[3]; internode handle[7] = (source rank, source token) per row.
    src_ok = torch.equal((handle[7][:, 1] if internode else handle[3]).long(), torch.cat(rows))
    if internode:
        sources = torch.repeat_interleave(torch.arange(R), torch.tensor([len(r) for r in rows]))
        src_ok &= torch.equal(handle[7][:, 0].long(), sources)
    ctx.check(torch.equal(recv_x, want_x), "dispatch: received rows differ from the senders' rows")
    ctx.check(src_ok, "dispatch: the handle's source ranks / tokens (recv_src_idx) are wrong")
    ctx.check(torch.equal(recv_idx.long(), want_idx) and torch.equal(recv_w, want_w),
              "dispatch: received top-k ids / weights are wrong")
    ctx.check(list(per_expert_list) == want_counts, "dispatch: num_recv_tokens_per_expert_list is wrong")

    combined_x, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    reached = want_in_rank.sum(1, keepdim=True)
    ctx.check(torch.equal(combined_x, (mine.x.float() * reached).to(torch.bfloat16)),
              "combine(dispatch(x)) != x * ranks reached")
    ctx.check(torch.allclose(combined_w, mine.topk_weights), "combine: summed top-k weights != weights")
    cached_x = buffer.dispatch(mine.x, handle=handle)[0]
    ctx.check(torch.equal(cached_x, recv_x), "cached-handle dispatch differs from the first dispatch")

    setting = dict(NORMAL, R=R, masked_fraction=MASKED, recv_rows=recv_x.shape[0],
                   **(dict(local_ranks=1, **buffer_bytes(buffer)) if internode else {}))
    nbytes = normal_bytes(recv_x.shape[0], H)
    return [
        _record(f"{label}layout", setting,
                ctx.time_stats(lambda: buffer.get_dispatch_layout(mine.topk_idx, E), align=False)),
        _record(f"{label}dispatch bf16", setting,
                ctx.time_stats(lambda: buffer.dispatch(mine.x, **layout_args)), nbytes),
        _record(f"{label}dispatch bf16 (cached handle)", setting,
                ctx.time_stats(lambda: buffer.dispatch(mine.x, handle=handle)), nbytes),
        _record(f"{label}combine bf16", setting,
                ctx.time_stats(lambda: buffer.combine(recv_x, handle, topk_weights=recv_w)), nbytes),
    ]


# ---------------------------------------------------------------------------------------------
# Low-latency mode
# ---------------------------------------------------------------------------------------------
def _dequantize(recv) -> torch.Tensor:
    """BF16 rows of a dispatch result: as is, or FP8 rows times their per-128-channel scales."""
    if isinstance(recv, tuple):
        values, scales = recv
        return (values.float() * scales.float().repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    return recv


def _low_latency(ctx: BenchContext) -> List[Record]:
    N, T, H, K, E = (LOW_LATENCY[k] for k in ("N", "T", "H", "K", "E"))
    R, rank, local_experts = ctx.world_size, ctx.rank, LOW_LATENCY["E"] // ctx.world_size
    inputs = [ctx.inputs(N, H, E, K, seed=5, rank=r, masked_fraction=MASKED) for r in range(R)]
    mine = inputs[rank]
    buffer = ctx.low_latency_buffer(T, H, E)
    setting = dict(LOW_LATENCY, R=R, masked_fraction=MASKED)
    messages = int((mine.topk_idx >= 0).sum())
    records = []
    for use_fp8 in (False, True):
        recv, recv_count, handle, _, _ = buffer.low_latency_dispatch(mine.x, mine.topk_idx, T, E,
                                                                     use_fp8=use_fp8)
        src_info, layout_range = handle[0], handle[1]
        rows = _dequantize(recv)
        worst, counts_ok, tokens_ok = 0.0, True, True
        for e in range(local_experts):
            expert = rank * local_experts + e
            senders = [(inp.topk_idx == expert).any(1).nonzero()[:, 0] for inp in inputs]
            counts_ok &= int(recv_count[e]) == sum(len(t) for t in senders)
            for s, tokens in enumerate(senders):
                begin, count = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
                got = src_info[e, begin:begin + count].long()
                tokens_ok &= count == len(tokens) and torch.equal(got, tokens)
                if count and tokens_ok:
                    worst = max(worst, _rel_error(rows[e, begin:begin + count], inputs[s].x[tokens]))
        dtype = "fp8" if use_fp8 else "bf16"
        ctx.check(counts_ok and tokens_ok, f"low-latency dispatch {dtype}: recv_count / layout / src_info wrong")
        ctx.check(worst <= (0.07 if use_fp8 else 0.0),
                  f"low-latency dispatch {dtype}: rows differ from the source tokens (rel. error {worst:.3g})")

        combined, _, _ = buffer.low_latency_combine(rows, mine.topk_idx, mine.topk_weights, handle)
        want = mine.x.float() * mine.topk_weights.sum(1, keepdim=True)
        error = _rel_error(combined, want)
        ctx.check(error <= (0.07 if use_fp8 else 1e-2),
                  f"low-latency combine after {dtype} dispatch: rel. error {error:.3g} vs x * sum(weights)")

        timing = ctx.time_stats(lambda: buffer.low_latency_dispatch(mine.x, mine.topk_idx, T, E,
                                                                    use_fp8=use_fp8))
        records.append(_record(f"CPU low-latency dispatch {dtype}", dict(setting, messages=messages),
                               timing, low_latency_dispatch_bytes(messages, H, use_fp8)))
        records[-1].extra["rel_error_rows"] = worst
    # Combine from a fresh dispatch: the timing loop above cycled through the buffer sets.
    recv, _, handle, _, _ = buffer.low_latency_dispatch(mine.x, mine.topk_idx, T, E, use_fp8=False)
    timing = ctx.time_stats(lambda: buffer.low_latency_combine(recv, mine.topk_idx, mine.topk_weights,
                                                               handle))
    records.append(_record("CPU low-latency combine bf16", dict(setting, messages=messages), timing,
                           low_latency_combine_bytes(messages, H)))
    return records


def cases(ctx: BenchContext):
    yield Case("CPU normal mode round trip", _normal, dict(NORMAL))
    yield Case("CPU low-latency round trip", _low_latency, dict(LOW_LATENCY))
    yield Case("CPU internode round trip", lambda c: _normal(c, internode=True), dict(NORMAL, local_ranks=1))
