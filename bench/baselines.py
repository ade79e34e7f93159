"""Same-run baselines of targets.md: copy bandwidths, NCCL all_to_all_single on the MoE traffic, and
MoE dispatch / combine written the way users write them with torch + NCCL.

Other case modules compare with these by name: `Record(baseline=torch_moe_name("dispatch", ...))`.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .harness import BenchContext, Case, Record, gbps, normal_bytes, time_stats

HIDDEN = 7168
NUM_TOPK = 8
NORMAL_SETTING = dict(N=4096, H=HIDDEN, K=NUM_TOPK, E=256)          # targets.md normal mode
LOW_LATENCY_SETTING = dict(N=128, H=HIDDEN, K=NUM_TOPK, E=288)      # targets.md low-latency mode

P2P_COPY_NAME = "P2P copy to the next GPU (torch copy_, 512 MiB)"
DEVICE_COPY_NAME = "device copy on one GPU (torch copy_, 1 GiB, read+write)"


def nccl_a2a_name(tokens: int, hidden: int = HIDDEN) -> str:
    return f"NCCL all_to_all_single bf16 {tokens}x{hidden} per rank pair"


def torch_moe_name(op: str, N: int, H: int, K: int, E: int) -> str:
    """op: dispatch, combine or dispatch+combine."""
    return f"torch+NCCL {op} N={N} H={H} K={K} E={E}"


# ---------------------------------------------------------------------------------------------
# Copies: measured in one short-lived process before the ranks start (see bench/__main__.py), so
# that no rank process holds a context on another GPU.
# ---------------------------------------------------------------------------------------------
def _time_copy(dst: torch.Tensor, src: torch.Tensor, warmup: int, iters: int) -> dict:
    """torch copies between devices run on the source device's current stream and synchronise both
    devices' streams, so events on the source stream bracket the copy."""
    with torch.cuda.device(src.device):
        timing = time_stats(lambda: dst.copy_(src), warmup, iters, flush_l2=False,
                            device=src.device)
    torch.cuda.synchronize(dst.device)
    if not torch.equal(dst[:4096].cpu(), src[:4096].cpu()) or not torch.equal(dst[-4096:].cpu(),
                                                                              src[-4096:].cpu()):
        raise AssertionError(f"copy {src.device} -> {dst.device} produced wrong data")
    return timing.summary()


def copy_probe(quick: bool) -> List[List[Record]]:
    """Per GPU i: a device-to-device copy on i, and a P2P copy from i to (i+1) % n (n >= 2)."""
    warmup, iters = (2, 5) if quick else (5, 20)
    count = torch.cuda.device_count()
    per_gpu: List[List[Record]] = []
    for i in range(count):
        gen = torch.Generator(device=f"cuda:{i}").manual_seed(i)
        src = torch.randint(-2**31, 2**31 - 1, (2**30 // 4,), dtype=torch.int32, device=f"cuda:{i}",
                            generator=gen)
        stats = _time_copy(torch.empty_like(src), src, warmup, iters)
        per_gpu.append([Record(DEVICE_COPY_NAME, {"bytes": 2**30, "gpu": i}, us=stats["mean_us"],
                               logical_gbps=gbps(2 * 2**30, stats["mean_us"]), extra=stats,
                               module="copy")])
        del src
        if count < 2:
            per_gpu[i].append(Record(P2P_COPY_NAME, status="skipped: needs 2 GPUs", module="copy"))
            continue
        peer = (i + 1) % count
        src = torch.randint(-2**31, 2**31 - 1, (2**29 // 4,), dtype=torch.int32, device=f"cuda:{i}",
                            generator=gen)
        dst = torch.empty(src.shape, dtype=src.dtype, device=f"cuda:{peer}")
        stats = _time_copy(dst, src, warmup, iters)
        figure = gbps(2**29, stats["mean_us"])
        per_gpu[i].append(Record(P2P_COPY_NAME, {"bytes": 2**29, "src": i, "dst": peer},
                                 us=stats["mean_us"], logical_gbps=figure, nvlink_gbps=figure,
                                 extra=stats, module="copy"))
        del src, dst
        torch.cuda.empty_cache()
    return per_gpu


def copy_probe_main(queue, quick: bool) -> None:
    """Entry of the probe process: puts the per-GPU records, or the error text, on `queue`."""
    import traceback
    try:
        queue.put(copy_probe(quick))
    except BaseException:
        queue.put(traceback.format_exc())


# ---------------------------------------------------------------------------------------------
# NCCL all_to_all_single on the MoE traffic
# ---------------------------------------------------------------------------------------------
def _nccl_a2a(ctx: BenchContext, tokens: int, hidden: int) -> Record:
    world = ctx.world_size

    def rank_input(rank: int) -> torch.Tensor:
        gen = torch.Generator(device=ctx.device).manual_seed(1234 + rank)
        return torch.randn(world * tokens, hidden, generator=gen, device=ctx.device,
                           dtype=torch.float32).to(torch.bfloat16)

    send = rank_input(ctx.rank)
    recv = torch.empty_like(send)

    def fn():
        dist.all_to_all_single(recv, send, group=ctx.group)
    fn()
    rows = slice(ctx.rank * tokens, (ctx.rank + 1) * tokens)
    ok = all(torch.equal(recv[s * tokens:(s + 1) * tokens], rank_input(s)[rows]) for s in range(world))
    ctx.check(ok, "all_to_all_single delivered wrong rows")
    timing = ctx.time_stats(fn, hide_host=True)
    row_bytes = hidden * 2
    return Record(nccl_a2a_name(tokens, hidden), {"tokens_per_pair": tokens, "H": hidden},
                  us=timing.mean_us, logical_gbps=gbps(world * tokens * row_bytes, timing.mean_us),
                  nvlink_gbps=gbps((world - 1) * tokens * row_bytes, timing.mean_us),
                  extra=timing.summary())


# ---------------------------------------------------------------------------------------------
# MoE dispatch / combine as users write them with torch + NCCL
# ---------------------------------------------------------------------------------------------
class TorchMoE:
    """Dispatch: destinations from the router's top-k, index_select of the rows for each destination
    rank (grouped by rank, token order kept), a count exchange read back on the host, then
    all_to_all_single of the rows, their top-k ids (made local) and weights. Combine:
    all_to_all_single of the expert outputs back, then an fp32 index_add into the token rows
    (unweighted, as epcomm's combine)."""

    def __init__(self, ctx: BenchContext, N: int, H: int, K: int, E: int):
        self.ctx, self.N, self.H, self.E = ctx, N, H, E
        self.experts_per_rank = E // ctx.world_size
        inputs = ctx.inputs(N, H, E, K, seed=7)
        self.x, self.topk_idx, self.topk_weights = inputs.x, inputs.topk_idx, inputs.topk_weights

    def _a2a(self, out_rows: int, tensor: torch.Tensor, out_splits, in_splits) -> torch.Tensor:
        out = tensor.new_empty((out_rows,) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor, out_splits, in_splits, group=self.ctx.group)
        return out

    def dispatch(self):
        world, rank = self.ctx.world_size, self.ctx.rank
        dest = torch.where(self.topk_idx >= 0, self.topk_idx // self.experts_per_rank, world)
        in_rank = torch.zeros(self.N, world + 1, dtype=torch.bool, device=self.x.device)
        in_rank.scatter_(1, dest, True)
        in_rank = in_rank[:, :world]
        send_counts = in_rank.sum(0)
        token_ids = in_rank.t().nonzero()[:, 1]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ctx.group)
        sends, recvs = torch.stack([send_counts, recv_counts]).tolist()
        rows = sum(recvs)
        recv_x = self._a2a(rows, self.x.index_select(0, token_ids), recvs, sends)
        recv_idx = self._a2a(rows, self.topk_idx.index_select(0, token_ids), recvs, sends)
        recv_w = self._a2a(rows, self.topk_weights.index_select(0, token_ids), recvs, sends)
        local = recv_idx - rank * self.experts_per_rank
        mine = (recv_idx >= 0) & (local < self.experts_per_rank) & (local >= 0)
        recv_idx = torch.where(mine, local, -1)
        recv_w = torch.where(mine, recv_w, 0.0)
        return recv_x, recv_idx, recv_w, (token_ids, sends, recvs)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        token_ids, sends, recvs = state
        back = self._a2a(sum(sends), y, sends, recvs)
        out = torch.zeros(self.N, self.H, dtype=torch.float32, device=y.device)
        out.index_add_(0, token_ids, back.float())
        return out.to(torch.bfloat16)

    def round_trip(self) -> torch.Tensor:
        recv_x, _, _, state = self.dispatch()
        return self.combine(recv_x, state)

    def reached(self) -> torch.Tensor:
        """Ranks each token goes to, [N] (a token counts once per rank)."""
        world = self.ctx.world_size
        dest = torch.where(self.topk_idx >= 0, self.topk_idx // self.experts_per_rank, world)
        in_rank = torch.zeros(self.N, world + 1, dtype=torch.bool, device=self.x.device)
        return in_rank.scatter_(1, dest, True)[:, :world].sum(1)


def _torch_moe(ctx: BenchContext, setting: dict) -> List[Record]:
    moe = TorchMoE(ctx, **setting)
    recv_x, _, _, state = moe.dispatch()
    combined = moe.combine(recv_x, state)
    expected = (moe.x.float() * moe.reached()[:, None]).to(torch.bfloat16)
    ctx.check(torch.equal(combined, expected), "torch+NCCL combine(dispatch(x)) != x * ranks reached")
    rows = recv_x.shape[0]
    remote_rows = rows - state[2][ctx.rank]
    logical, remote = normal_bytes(rows, setting["H"]), normal_bytes(remote_rows, setting["H"])
    shape = dict(setting, recv_rows=rows)
    records = []
    for op, fn in (("dispatch", moe.dispatch), ("combine", lambda: moe.combine(recv_x, state)),
                   ("dispatch+combine", moe.round_trip)):
        timing = ctx.time_stats(fn, hide_host=True)
        records.append(Record(torch_moe_name(op, **setting), shape, us=timing.mean_us,
                              logical_gbps=gbps(logical, timing.mean_us) if "+" not in op else None,
                              nvlink_gbps=gbps(remote, timing.mean_us) if "+" not in op else None,
                              extra=timing.summary()))
    return records


def cases(ctx: BenchContext):
    for tokens in (NORMAL_SETTING["N"], LOW_LATENCY_SETTING["N"]):
        yield Case(nccl_a2a_name(tokens), lambda c, t=tokens: _nccl_a2a(c, t, HIDDEN),
                   {"tokens_per_pair": tokens, "H": HIDDEN})
    for setting in (NORMAL_SETTING, LOW_LATENCY_SETTING):
        if setting["E"] % ctx.world_size:
            continue
        yield Case(torch_moe_name("dispatch/combine", **setting),
                   lambda c, s=setting: _torch_moe(c, s), dict(setting))
