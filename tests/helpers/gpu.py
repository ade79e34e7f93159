"""What the GPU tests of the normal modes share (intranode and internode; calc_diff for low latency
too): every rank's inputs rebuilt on every rank from (seed, rank) on the CPU, the oracle's expected
dispatch, bit-exact row comparison with the first differing row named, and the dispatch call with
an Inputs' layout."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from epcomm.reference import oracle


# ---- inputs -------------------------------------------------------------------------------------
@dataclass
class Inputs:
    x: torch.Tensor                  # [N, H] bf16 (CPU)
    x_fp8: Optional[torch.Tensor]    # e4m3 [N, H] or None
    scales: Optional[torch.Tensor]   # f32 [N, H/128] (column-major storage) or None
    topk_idx: torch.Tensor           # [N, K]
    topk_weights: torch.Tensor       # [N, K] f32
    layout: tuple                    # oracle.layout(...)


def make_inputs(seed: int, rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int,
                num_ranks: int, fp8: bool = False, index_dtype=torch.int64, route: str = "random") -> Inputs:
    """route: random (top-k of random scores, 20% of entries -1), nowhere (also half the tokens with
    no expert at all), rank0 (only rank 0's experts: every other rank receives nothing)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if route == "rank0":
        scores[:, num_experts // num_ranks:] = -1
    topk_idx = torch.topk(scores, num_topk, dim=1).indices
    masked = torch.rand(num_tokens, num_topk, generator=gen) < 0.2
    if route == "rank0":
        masked |= scores.gather(1, topk_idx) < 0
    if route == "nowhere":
        masked |= (torch.rand(num_tokens, 1, generator=gen) < 0.5).expand(-1, num_topk)
    topk_idx = topk_idx.masked_fill(masked, -1).to(index_dtype)
    topk_weights = torch.rand(num_tokens, num_topk, generator=gen).masked_fill(masked, 0.0)
    x_fp8 = scales = None
    if fp8:
        x_fp8, scales = oracle.fp8_cast(x)
        scales = scales.t().contiguous().t()   # column-major, as DeepEP users pass them
    return Inputs(x, x_fp8, scales, topk_idx, topk_weights,
                  oracle.layout(topk_idx.long(), num_experts, num_ranks, num_ranks))


# Above this many elements in the largest rank's rows, ranks on one host share their inputs.
SHARED_INPUT_ELEMENTS = 1 << 26


def all_inputs(dist_env, n_by_rank, **kw) -> List[Inputs]:
    """Every rank's make_inputs (rank r: n_by_rank[r] tokens). Every rank calls it with the same
    arguments. Large inputs of ranks on one host (tests.gpu_session: ranks sharing GPUs) are
    built once: each rank builds its own and memory-maps the others' from files, instead of
    R ranks each building all R (at N = 16384, H = 7168 one rank's inputs take ~4 s of a core)."""
    world = dist_env.world_size
    if not dist_env.shared_gpu or max(n_by_rank) * kw["hidden"] < SHARED_INPUT_ELEMENTS:
        return [make_inputs(rank=r, num_tokens=n_by_rank[r], num_ranks=world, **kw) for r in range(world)]
    return _shared_inputs(dist_env, n_by_rank, kw)


def _shared_inputs(dist_env, n_by_rank, kw) -> List[Inputs]:
    import tempfile
    folder = os.path.join(tempfile.gettempdir(), f"epcomm-test-inputs-{os.environ.get('MASTER_PORT', 'local')}")
    os.makedirs(folder, exist_ok=True)
    tag = hashlib.sha1(repr((list(n_by_rank), sorted(kw.items()))).encode()).hexdigest()[:16]
    path = lambda r: os.path.join(folder, f"{tag}-rank{r}.pt")   # noqa: E731
    mine = make_inputs(rank=dist_env.rank, num_tokens=n_by_rank[dist_env.rank], num_ranks=dist_env.world_size, **kw)
    torch.save({f.name: getattr(mine, f.name) for f in dataclasses.fields(mine)}, path(dist_env.rank) + ".tmp")
    os.replace(path(dist_env.rank) + ".tmp", path(dist_env.rank))
    dist_env.barrier()   # every rank's file is complete
    out = [mine if r == dist_env.rank else Inputs(**torch.load(path(r), mmap=True, weights_only=True))
           for r in range(dist_env.world_size)]
    dist_env.barrier()   # every rank has mapped every file: the names can go (the pages stay mapped)
    os.unlink(path(dist_env.rank))
    return out


def dev(t, device):
    return None if t is None else t.to(device)


# ---- comparison ---------------------------------------------------------------------------------
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float8_e4m3fn: torch.uint8}


def row_diff(name: str, got, want, src_idx: Optional[torch.Tensor] = None) -> str:
    """'' when bit-identical, else where the first differing row is (and which token it holds)."""
    if want is None or got is None:
        return "" if got is None and want is None else f"{name}: got {type(got).__name__}, want {type(want).__name__}"
    got = got.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if got.numel() == 0:
        return ""
    a = got.view(_BITS.get(got.dtype, got.dtype))
    b = want.view(_BITS.get(want.dtype, want.dtype))
    bad = (a != b).reshape(a.shape[0], -1).any(1) if a.dim() else (a != b).reshape(1)
    if not bool(bad.any()):
        return ""
    rows = bad.nonzero().flatten()
    r = int(rows[0])
    where = f" (token {int(src_idx[r])} of its source)" if src_idx is not None and r < len(src_idx) else ""
    return (f"{name}: {len(rows)} of {len(bad)} rows differ; first row {r}{where}: got "
            f"{got[r].flatten()[:6].tolist()} want {want[r].flatten()[:6].tolist()}")


def check(dist_env, errors: List[str], what: str) -> None:
    errors = [e for e in errors if e]
    for e in errors:
        print(f"[rank {dist_env.rank}] {what}: {e}", flush=True)
    assert dist_env.all_ok(not errors), f"rank {dist_env.rank} {what}: " + "; ".join(errors)


def expected_dispatch(inputs: List[Inputs], rank: int, num_experts: int, fp8: bool, use_topk=True,
                      alignment: int = 1, num_worst_tokens: int = 0, data: Optional[List[Inputs]] = None):
    """The oracle's dispatch of `inputs`' routing; rows (and scales) from `data` if given."""
    data = data or inputs
    xs = [i.x_fp8 if fp8 else i.x for i in data]
    return oracle.dispatch(xs, [i.scales for i in data] if fp8 else None,
                           [i.topk_idx for i in inputs] if use_topk else None,
                           [i.topk_weights for i in inputs] if use_topk else None,
                           [i.layout[3] for i in inputs], num_experts, rank, alignment, num_worst_tokens,
                           [i.layout[2] for i in inputs])


def dispatch_errors(got, want, fp8: bool, use_topk: bool = True) -> List[str]:
    """got: the public dispatch tuple; want: the oracle dict."""
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = got
    src = want["recv_src_idx"]
    errors = []
    if fp8:
        errors += [row_diff("recv_x (fp8)", recv_x[0], want["recv_x"], src),
                   row_diff("recv_x_scales", recv_x[1], want["recv_x_scales"], src)]
    else:
        errors.append(row_diff("recv_x", recv_x, want["recv_x"], src))
    if use_topk:
        errors += [row_diff("recv_topk_idx", recv_topk_idx, want["recv_topk_idx"], src),
                   row_diff("recv_topk_weights", recv_topk_weights, want["recv_topk_weights"], src)]
    if handle is not None:
        errors += [row_diff("handle[0] rank_prefix_matrix", handle[0], want["rank_prefix_matrix"]),
                   row_diff("handle[3] recv_src_idx", handle[3], src)]
        if counts != want["num_recv_tokens_per_expert_list"]:
            errors.append(f"num_recv_tokens_per_expert_list: got {counts}, want "
                          f"{want['num_recv_tokens_per_expert_list']}")
    return errors


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(1 - 2 * (x * y).sum() / denominator)


def run_dispatch(buffer, inp: Inputs, device, fp8: bool, use_topk=True, config=None, **kw):
    x = (dev(inp.x_fp8, device), dev(inp.scales, device)) if fp8 else dev(inp.x, device)
    per_rank, per_node, per_expert, in_rank = (dev(t, device) for t in inp.layout)
    return buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                           is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert,
                           topk_idx=dev(inp.topk_idx, device) if use_topk else None,
                           topk_weights=dev(inp.topk_weights, device) if use_topk else None,
                           config=config, **kw)


def combine_inputs(inputs, rank_count, num_experts, data: Optional[List[Inputs]] = None):
    """Combine inputs of every rank: its oracle recv rows (of `data`'s rows if given, routed as
    `inputs`) scaled by (rank + 1) (BF16), so each source's contribution is distinct; and the
    matching received top-k weights."""
    xs, ws = [], []
    for r in range(rank_count):
        want = expected_dispatch(inputs, r, num_experts, False, data=data)
        xs.append((want["recv_x"].float() * (r + 1)).to(torch.bfloat16))
        ws.append(want["recv_topk_weights"])
    return xs, ws


class BufferPool:
    """The Buffers the tests of one module share: built on first use per key, destroyed together
    at the module's end (a module-scoped fixture calls destroy_all)."""

    def __init__(self):
        self._buffers = {}

    def get(self, key, build):
        if key not in self._buffers:
            self._buffers[key] = build()
        return self._buffers[key]

    def forget(self, buf) -> None:
        """Stop managing `buf` (a test that tears it down itself)."""
        self._buffers = {k: b for k, b in self._buffers.items() if b is not buf}

    def destroy_all(self) -> None:
        if not self._buffers:   # also every module that made none (the fixture runs for all)
            return
        torch.cuda.synchronize()
        for buf in self._buffers.values():
            buf.destroy()
        self._buffers.clear()


def round_trip_want(inp: Inputs):
    """What combine(dispatch(x)) must give back bit for bit, without the other ranks' rows: every
    rank a token reached returns the same BF16 row, and up to 2**16 copies of a BF16 value add up
    exactly in fp32 in any order, so oracle.combine's sum is x * (ranks reached) rounded once; the
    weights come back exactly (each expert's weight is non-zero on one rank only). The sum starts
    from +0, so a token reached nowhere, or a -0 row, comes back +0 (hence the + 0.0). Checked against
    oracle.combine on the CPU (tests/models/test_topology.py)."""
    reached = inp.layout[3].sum(1, keepdim=True).float()
    return (inp.x.float() * reached + 0.0).to(torch.bfloat16), inp.topk_weights
