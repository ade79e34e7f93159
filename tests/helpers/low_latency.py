"""What the low-latency GPU test files share (test_low_latency_gpu.py, test_fast_path_gpu.py): the
cases, every rank's inputs, the Buffers the tests share (POOL, destroyed at each module's end by
tests/gpu/conftest.py), and one dispatch + combine checked against epcomm.reference.oracle on
all-gathered inputs: rows, scales, counts, handles bit for bit; the combine bit for bit against
oracle.ll_combine_rows and, as DeepEP checks it, by calc_diff against sum_k w_k * x."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import pytest
import torch

from tests import topology
from tests.helpers.gpu import BufferPool, calc_diff

RANKS = topology.world_size()   # the session's rank count


def experts_for(nominal: int) -> int:
    """An expert count near `nominal` that the session's rank count divides."""
    return topology.experts(nominal, RANKS)


TARGET = dict(T=128, H=7168, E=experts_for(288), K=8)


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    E: int
    K: int
    N: Tuple[int, ...]           # tokens per rank (cycled over ranks)
    fp8: bool = True
    round_scale: bool = False
    ue8m0: bool = False
    masked: float = 0.1          # fraction of top-k entries set to -1

    def tokens(self, rank: int) -> int:
        return self.N[rank % len(self.N)]

    def __str__(self) -> str:
        kind = "bf16" if not self.fp8 else "ue8m0" if self.ue8m0 else "fp8-pow2" if self.round_scale else "fp8"
        return f"{kind}-T{self.T}-H{self.H}-E{self.E}-K{self.K}-N{'/'.join(map(str, self.N))}"


FP8_TARGET = Case(128, 7168, experts_for(288), 8, (128, 97))
CASES = [
    FP8_TARGET,
    replace(FP8_TARGET, round_scale=True),
    replace(FP8_TARGET, round_scale=True, ue8m0=True),
    replace(FP8_TARGET, fp8=False),
    Case(64, 2176, experts_for(64), 16, (64, 0)),             # H in no whitelist, K=16, one rank sends nothing
    Case(64, 1032, experts_for(64), 16, (50, 64), fp8=False), # BF16 H % 128 != 0
    Case(512, 2048, experts_for(64), 8, (512, 301)),          # several tokens per block
    Case(32, 256, RANKS, 1, (32, 17), masked=0.0),      # one expert per rank, top-1
    Case(64, 1024, experts_for(64), 32, (64, 40)),            # K = MAX_TOPK: a full combine record
]
SMALL = Case(64, 1024, experts_for(16), 4, (64, 40))
ALL_SHAPES = [TARGET] + [dict(T=c.T, H=c.H, E=c.E) for c in CASES]


# ---- inputs, buffers, comparisons ----------------------------------------------------------------
def case_inputs(case: Case, rank: int, seed: int):
    """Rank `rank`'s (x [N, H] bf16, topk_idx [N, K] int64, topk_weights [N, K] f32) on the CPU."""
    n = case.tokens(rank)
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(n, case.H, generator=gen).to(torch.bfloat16)
    scores = torch.rand(n, case.E, generator=gen)
    topk_idx = torch.topk(scores, case.K, dim=-1).indices
    if case.masked:
        topk_idx = topk_idx.masked_fill(torch.rand(n, case.K, generator=gen) < case.masked, -1)
    weights = torch.rand(n, case.K, generator=gen) + 0.1
    return x, topk_idx, weights


def gather(obj):
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def expert_scale(experts: torch.Tensor) -> torch.Tensor:
    """What the fake expert multiplies its rows by: powers of two, exact in bf16."""
    return torch.pow(2.0, (experts % 3).float())


POOL = BufferPool()


def shared_buffer(dist_env, shapes=(TARGET,), env: Optional[dict] = None, **flags):
    """A Buffer with these flags, big enough for every (T, H, E) in `shapes`, shared by tests."""
    import epcomm
    key = (tuple(sorted(flags.items())), tuple(sorted((env or {}).items())))

    def build():
        size = max(epcomm.Buffer.get_low_latency_rdma_size_hint(s["T"], s["H"], dist_env.world_size, s["E"])
                   for s in shapes)
        with pytest.MonkeyPatch.context() as patch:
            for name, value in (env or {}).items():
                patch.setenv(name, str(value))
            return epcomm.Buffer(dist_env.group, num_rdma_bytes=size, low_latency_mode=True,
                                 explicitly_destroy=True, **flags)
    return POOL.get(key, build)


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = (got != want).nonzero()
    if len(bad) == 0:
        return "equal"
    i = tuple(bad[0].tolist())
    return f"{len(bad)} elements differ, first at {i}: got {got[i].item()}, want {want[i].item()}"


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view, so NaNs and signed zeros compare by bits."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def say(*lines) -> None:
    sys.__stderr__.write("\n".join(f"[test_low_latency rank {os.environ.get('RANK')}] {l}" for l in lines) + "\n")
    sys.__stderr__.flush()


# ---- one dispatch + combine, checked ------------------------------------------------------------
def check_dispatch(case: Case, rank: int, num_ranks: int, inputs, got, rank_masks=None):
    """-> (problems, oracle result). inputs: all ranks' CPU inputs; got: (recv_x, scales, count, handle, cum)."""
    from epcomm.reference import oracle
    recv_x, scales, count, handle, cumulative = got
    want = oracle.low_latency_dispatch([i[0] for i in inputs], [i[1] for i in inputs], case.T, case.E, rank,
                                       case.fp8, case.round_scale, case.ue8m0, rank_masks)
    problems = []
    e_l = case.E // num_ranks
    # recv_count is the global count of each local expert in the all-gathered top-k
    alive = oracle.link_alive(rank_masks, num_ranks)
    global_count = torch.zeros(e_l, dtype=torch.int32)
    for s, (_, topk, _) in enumerate(inputs):
        if alive[s, rank]:
            for e in range(e_l):
                global_count[e] += int((topk == rank * e_l + e).sum())
    if not torch.equal(count.cpu(), global_count) or not torch.equal(count.cpu(), want["recv_count"]):
        problems.append(f"recv_count {count.tolist()} != global count {global_count.tolist()}")
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    if not torch.equal(layout_range, want["layout_range"]):
        problems.append(f"layout_range: {first_mismatch(layout_range, want['layout_range'])}")
    if handle[2:] != (case.T, case.H, case.E):
        problems.append(f"handle tail {handle[2:]} != {(case.T, case.H, case.E)}")
    if cumulative is not None and not torch.equal(cumulative.cpu(), want["recv_count"]):
        problems.append(f"cumulative_local_expert_recv_stats {cumulative.tolist()} != {want['recv_count'].tolist()}")
    recv_x, scales = recv_x.cpu(), scales.cpu() if scales is not None else None
    for e in range(e_l):
        n = int(want["recv_count"][e])
        for what, g, w in (("rows", recv_x, want["recv_x"]), ("src_info", src_info, want["src_info"]),
                           ("scales", scales, want["recv_x_scales"])):
            if w is None and g is None:
                continue
            if (g is None) != (w is None) or not torch.equal(bits(g[e, :n]), bits(w[e, :n])):
                problems.append(f"local expert {e} ({n} rows) {what}: "
                                f"{first_mismatch(bits(g[e, :n]), bits(w[e, :n])) if g is not None else 'missing'}")
                break
        if len(problems) > 6:
            break
    return problems, want


def combine_input(case: Case, rank: int, num_ranks: int, recv_x, scales, count) -> torch.Tensor:
    """The fake experts' output: dispatched rows (dequantised) times 2^(expert % 3); NaN in the
    rows past recv_count, so a kernel that reads one is caught."""
    e_l, slots = case.E // num_ranks, num_ranks * case.T
    if case.fp8:
        rows = recv_x.float().view(e_l, slots, case.H // 128, 128)
        if case.ue8m0:
            from epcomm.reference.oracle import unpack_ue8m0
            scales = unpack_ue8m0(scales, case.H // 128)
        rows = (rows * scales.float()[..., None]).view(e_l, slots, case.H)
    else:
        rows = recv_x.float()
    experts = torch.arange(e_l, device=rows.device) + rank * e_l
    rows = rows * expert_scale(experts)[:, None, None]
    valid = torch.arange(slots, device=rows.device)[None, :] < count[:, None]
    return torch.where(valid[..., None], rows, torch.nan).to(torch.bfloat16)


def check_combine(case: Case, rank: int, inputs, x_c, handle, combined, rank_masks=None):
    from epcomm.reference import oracle
    problems = []
    rows = gather(oracle.ll_valid_rows(x_c.cpu(), handle[0].cpu(), handle[1].cpu()))
    x, topk_idx, weights = inputs[rank]
    want = oracle.ll_combine_rows(rows, topk_idx, weights, rank, case.E, rank_masks)
    got = combined.cpu()
    if not torch.equal(bits(got), bits(want)):
        problems.append(f"combine vs oracle.ll_combine_rows: {first_mismatch(got.float(), want.float())}")
    # DeepEP's check: against the original x, weighted by the experts that were reached
    alive = oracle.link_alive(rank_masks, len(inputs))[rank]
    e_l = case.E // len(inputs)
    used = (topk_idx >= 0) & alive[topk_idx.clamp_min(0) // e_l]
    factor = (weights.double() * expert_scale(topk_idx.clamp_min(0)).double() * used).sum(1)
    diff = calc_diff(got, x.double() * factor[:, None])
    bound = 9e-4 if case.fp8 else 1e-5
    if not diff < bound:
        problems.append(f"calc_diff(combined, sum_k w_k * x) = {diff:.3g} >= {bound}")
    return problems


def checked_round_trip(dist_env, buf, case: Case, seed: int = 0, mode: str = "sync", zero_copy: bool = False,
         use_out: bool = False, rank_masks=None, clean: bool = True):
    """One checked dispatch + combine; -> list of problems on this rank."""
    rank, num_ranks, dev = dist_env.rank, dist_env.world_size, dist_env.device
    if clean:
        buf.clean_low_latency_buffer(case.T, case.H, case.E)
    inputs = gather(case_inputs(case, rank, seed))
    x, topk_idx, weights = (t.to(dev) for t in inputs[rank])
    e_l = case.E // num_ranks
    cumulative = torch.zeros(e_l, dtype=torch.int32, device=dev)
    waits = [torch.zeros(num_ranks, dtype=torch.int64, device=dev) for _ in range(2)]
    hook_kw = dict(return_recv_hook=mode == "hook", async_finish=mode == "async")
    recv, count, handle, event, hook = buf.low_latency_dispatch(
        x, topk_idx, case.T, case.E, cumulative, waits[0], use_fp8=case.fp8, round_scale=case.round_scale,
        use_ue8m0=case.ue8m0, **hook_kw)
    problems = []
    if (hook is not None) != (mode == "hook"):
        problems.append(f"dispatch returned hook={hook!r} in mode {mode}")
    if hook is not None:
        hook()
    if mode == "async":
        event.current_stream_wait()
    torch.cuda.synchronize()
    recv_x, scales = recv if case.fp8 else (recv, None)
    p, _ = check_dispatch(case, rank, num_ranks, inputs, (recv_x, scales, count, handle, cumulative), rank_masks)
    problems += [f"dispatch: {m}" for m in p]

    x_c = combine_input(case, rank, num_ranks, recv_x, scales, count)
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(handle).copy_(x_c)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=dev) if use_out else None
    combined, event, hook = buf.low_latency_combine(x_c, topk_idx, weights, handle, zero_copy=zero_copy, out=out,
                                                    combine_wait_recv_cost_stats=waits[1], **hook_kw)
    if hook is not None:
        hook()
    if mode == "async":
        event.current_stream_wait()
    torch.cuda.synchronize()
    if use_out and combined is not out:
        problems.append("low_latency_combine(out=...) did not return `out` itself")
    problems += [f"combine: {m}" for m in check_combine(case, rank, inputs, x_c, handle, combined, rank_masks)]
    for name, w in zip(("dispatch", "combine"), waits):
        if (w < 0).any():
            problems.append(f"{name}_wait_recv_cost_stats has negative entries: {w.tolist()}")
    return problems


def verdict(dist_env, problems, what) -> None:
    if problems:
        say(f"{what}: FAILED", *problems)
    assert dist_env.all_ok(not problems), f"rank {dist_env.rank} {what}: " + "; ".join(problems[:8])
