"""The oracle (epcomm.reference.oracle) against brute-force loops written from the contract."""
import math

import pytest
import torch

from epcomm.reference import oracle


def _routing(num_tokens, num_experts, num_topk, gen, empty_rows=()):
    """Random top-k (distinct experts per token) with some -1 slots; rows in empty_rows go nowhere."""
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk]
                       for _ in range(num_tokens)]) if num_tokens else \
        torch.zeros(0, num_topk, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    for row in empty_rows:
        idx[row] = -1
    return idx


def _world(token_counts, hidden, num_experts, num_topk, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, hidden, generator=gen).bfloat16() for n in token_counts]
    idxs = [_routing(n, num_experts, num_topk, gen, empty_rows=[0] if n > 1 else [])
            for n in token_counts]
    weights = [torch.rand(n, num_topk, generator=gen) for n in token_counts]
    return xs, idxs, weights


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_ranks,num_local_ranks,num_experts", [(1, 1, 3), (4, 4, 8), (8, 2, 16)])
def test_layout_matches_loops(num_ranks, num_local_ranks, num_experts):
    gen = torch.Generator().manual_seed(num_ranks)
    idx = _routing(37, num_experts, 3, gen, empty_rows=[5])
    per_rank, per_node, per_expert, in_rank = oracle.layout(idx, num_experts, num_ranks,
                                                            num_local_ranks)
    local_experts = num_experts // num_ranks
    want_rank, want_expert = [0] * num_ranks, [0] * num_experts
    want_node = [0] * (num_ranks // num_local_ranks)
    for n in range(idx.shape[0]):
        ranks = {int(g) // local_experts for g in idx[n] if g >= 0}
        for g in idx[n]:
            if g >= 0:
                want_expert[int(g)] += 1
        for r in range(num_ranks):
            assert bool(in_rank[n, r]) == (r in ranks)
            want_rank[r] += r in ranks
        for node in {r // num_local_ranks for r in ranks}:
            want_node[node] += 1
    assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
    assert per_rank.tolist() == want_rank and per_expert.tolist() == want_expert
    if num_local_ranks == num_ranks:
        assert per_node is None
    else:
        assert per_node.tolist() == want_node


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError):
        oracle.layout(torch.zeros(2, 2, dtype=torch.int64), 6, 4, 4)
    with pytest.raises(ValueError):
        oracle.layout(torch.full((2, 2), 8), 8, 4, 4)


# ---------------------------------------------------------------------------------------------
def _expected_dispatch(xs, idxs, weights, num_experts, rank):
    """Loops: rows grouped by source ascending, source order within."""
    local_experts = num_experts // len(xs)
    rows = []
    for s, idx in enumerate(idxs):
        for n in range(idx.shape[0]):
            experts = [int(g) for g in idx[n]]
            if any(g >= 0 and g // local_experts == rank for g in experts):
                local = [g - rank * local_experts if g >= 0 and g // local_experts == rank else -1
                         for g in experts]
                w = [float(weights[s][n, k]) if local[k] >= 0 else 0.0 for k in range(len(local))]
                rows.append((s, n, local, w))
    return rows


@pytest.mark.parametrize("token_counts,expert_alignment", [([6, 0, 9], 1), ([11, 4, 1, 7], 4)])
def test_dispatch_matches_loops(token_counts, expert_alignment):
    num_ranks, num_experts, hidden = len(token_counts), 4 * len(token_counts), 256
    xs, idxs, weights = _world(token_counts, hidden, num_experts, 3, seed=len(token_counts))
    in_ranks = [oracle.layout(i, num_experts, num_ranks, num_ranks)[3] for i in idxs]
    fp8 = [oracle.fp8_cast(x) for x in xs]
    for rank in range(num_ranks):
        got = oracle.dispatch([f[0] for f in fp8], [f[1] for f in fp8], idxs, weights, in_ranks,
                              num_experts, rank, expert_alignment)
        want = _expected_dispatch(xs, idxs, weights, num_experts, rank)
        assert got["recv_x"].shape[0] == len(want)
        for row, (s, n, local, w) in enumerate(want):
            assert torch.equal(got["recv_x"][row].view(torch.uint8), fp8[s][0][n].view(torch.uint8))
            assert torch.equal(got["recv_x_scales"][row], fp8[s][1][n])
            assert int(got["recv_src_idx"][row]) == n
            assert got["recv_topk_idx"][row].tolist() == local
            assert got["recv_topk_weights"][row].tolist() == pytest.approx(w, abs=0)
        counts = [sum(loc.count(e) for _, _, loc, _ in want) for e in range(4)]
        assert got["num_recv_tokens_per_expert_list"] == [
            math.ceil(c / expert_alignment) * expert_alignment for c in counts]
        prefix = [[sum(int(any(int(g) >= 0 and int(g) // 4 == j for g in idxs[i2][n]))
                       for i2 in range(i + 1) for n in range(token_counts[i2]))
                   for j in range(num_ranks)] for i in range(num_ranks)]
        assert got["rank_prefix_matrix"].tolist() == prefix
        assert got["recv_src_idx"].dtype == got["rank_prefix_matrix"].dtype == torch.int32


def test_dispatch_worst_tokens_and_no_topk():
    num_experts, hidden = 8, 64
    xs, idxs, weights = _world([5, 3], hidden, num_experts, 2, seed=3)
    in_ranks = [oracle.layout(i, num_experts, 2, 2)[3] for i in idxs]
    exact = oracle.dispatch(xs, None, idxs, weights, in_ranks, num_experts, 1)
    m = exact["recv_x"].shape[0]
    padded = oracle.dispatch(xs, None, idxs, weights, in_ranks, num_experts, 1,
                             num_worst_tokens=m + 3)
    assert padded["recv_x"].shape[0] == m + 3 and padded["num_recv_tokens_per_expert_list"] == []
    assert torch.equal(padded["recv_x"][:m], exact["recv_x"])
    assert torch.equal(padded["recv_topk_idx"][:m], exact["recv_topk_idx"])
    assert not padded["recv_x"][m:].any() and not padded["recv_topk_weights"][m:].any()
    assert (padded["recv_topk_idx"][m:] == -1).all() and (padded["recv_src_idx"][m:] == -1).all()
    with pytest.raises(ValueError):
        oracle.dispatch(xs, None, idxs, weights, in_ranks, num_experts, 1, num_worst_tokens=1)
    plain = oracle.dispatch(xs, None, None, None, in_ranks, None, 1)
    assert torch.equal(plain["recv_x"], exact["recv_x"]) and plain["recv_topk_idx"] is None
    assert plain["num_recv_tokens_per_expert_list"] == []


def test_combine_round_trip():
    num_ranks, num_experts, hidden = 3, 6, 128
    xs, idxs, weights = _world([7, 0, 5], hidden, num_experts, 2, seed=5)
    in_ranks = [oracle.layout(i, num_experts, num_ranks, num_ranks)[3] for i in idxs]
    sent = [oracle.dispatch(xs, None, idxs, weights, in_ranks, num_experts, r)
            for r in range(num_ranks)]
    bias = torch.randn(7, hidden).bfloat16()
    for rank in range(num_ranks):
        got_x, got_w = oracle.combine([s["recv_x"] for s in sent], in_ranks, rank,
                                      [s["recv_topk_weights"] for s in sent],
                                      bias=(bias[:len(xs[rank])], None))
        reached = in_ranks[rank].sum(1, keepdim=True).float()
        want = (xs[rank].float() * reached + bias[:len(xs[rank])].float()).bfloat16()
        assert torch.equal(got_x, want)
        assert torch.equal(got_w, torch.where(idxs[rank] >= 0, weights[rank], 0.0))


# ---------------------------------------------------------------------------------------------
def _row_with_amax(amaxes, per_group=128):
    """One token whose 128-channel groups have the given amax values (and smaller values)."""
    groups = [torch.tensor([a, -a / 2, a / 4] + [0.0] * (per_group - 3)) for a in amaxes]
    return torch.cat(groups)[None].bfloat16()


def test_fp8_cast_bit_patterns():
    # amax 448: scale 1, so the e4m3 bytes are the textbook encodings of the values
    x = torch.zeros(1, 128)
    x[0, :6] = torch.tensor([448.0, 1.0, -2.0, 0.5, 0.0, -448.0])
    values, scales = oracle.fp8_cast(x.bfloat16())
    assert values.view(torch.uint8)[0, :6].tolist() == [0x7E, 0x38, 0xC0, 0x30, 0x00, 0xFE]
    assert scales.tolist() == [[1.0]]
    # DeepEP's arithmetic, pinned: values x * fl32(448 / amax) (x / (amax / 448) would give 123
    # here), stored scale amax * fl32(1 / 448)
    x = torch.zeros(1, 128)
    x[0, :2] = torch.tensor([49.0, 40.25])
    values, scales = oracle.fp8_cast(x.bfloat16())
    assert values.view(torch.uint8)[0, 1] == 124
    assert scales[0, 0] == torch.tensor(49.0) * torch.tensor(1 / 448, dtype=torch.float32)
    # plain scales: max(amax, 1e-4) / 448
    x = _row_with_amax([3.0, 0.0, 1000.0])
    _, scales = oracle.fp8_cast(x)
    for got, amax in zip(scales[0].tolist(), [3.0, 1e-4, 1000.0]):
        assert got == pytest.approx(amax / 448, rel=2 ** -22)
    # round_scale: the power of two at or above amax/448
    x = _row_with_amax([300.0, 896.0, 1000.0, 0.0, 2.0 ** 20])
    _, scales = oracle.fp8_cast(x, round_scale=True)
    assert scales[0].tolist() == [1.0, 2.0, 4.0, 2.0 ** -22, 2.0 ** 12]


def test_fp8_cast_ue8m0_packing():
    # exponents 0, 1, 2, 12 | -22: bytes 127, 128, 129, 139 | 105 (the last word half empty)
    x = _row_with_amax([300.0, 896.0, 1000.0, 2.0 ** 20, 0.0])
    _, packed = oracle.fp8_cast(torch.cat([x, x]), round_scale=True, use_ue8m0=True)
    word0 = 127 | 128 << 8 | 129 << 16 | 139 << 24
    assert packed.dtype == torch.int32 and packed.shape == (2, 2)
    assert packed[0].tolist() == [word0 - 2 ** 32, 105]
    assert oracle.unpack_ue8m0(packed, 5)[0].tolist() == [1.0, 2.0, 4.0, 2.0 ** 12, 2.0 ** -22]
    with pytest.raises(ValueError):
        oracle.fp8_cast(x, round_scale=False, use_ue8m0=True)


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_error_bound(round_scale):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(16, 512, generator=gen) * torch.rand(16, 1, generator=gen) * 100).bfloat16()
    values, scales = oracle.fp8_cast(x, round_scale=round_scale)
    back = oracle.fp8_dequant(values, scales)
    step = scales.repeat_interleave(128, 1)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal spacing 2^-9 * scale
    bound = torch.maximum(x.float().abs() * 2 ** -4, step * 2 ** -10) * (1 + 1e-6)
    assert ((back - x.float()).abs() <= bound).all()
    assert (values.float().abs() <= 448).all()


# ---------------------------------------------------------------------------------------------
def test_low_latency_packing_matches_loops():
    num_ranks, num_experts, hidden, tokens_per_rank = 3, 6, 256, 8
    xs, idxs, _ = _world([8, 0, 5], hidden, num_experts, 3, seed=11)
    local_experts = num_experts // num_ranks
    for rank in range(num_ranks):
        bf16 = oracle.low_latency_dispatch(xs, idxs, tokens_per_rank, num_experts, rank,
                                           use_fp8=False)
        fp8 = oracle.low_latency_dispatch(xs, idxs, tokens_per_rank, num_experts, rank,
                                          round_scale=True, use_ue8m0=True)
        scales = fp8["recv_x_scales"]
        assert scales.shape == (local_experts, num_ranks * tokens_per_rank, 1)
        assert scales.stride(1) == 1           # column-major: tokens contiguous
        for e in range(local_experts):
            expert = rank * local_experts + e
            want = [(s, n) for s in range(num_ranks) for n in range(idxs[s].shape[0])
                    if expert in idxs[s][n].tolist()]
            assert int(bf16["recv_count"][e]) == len(want)
            begin = 0
            for s in range(num_ranks):
                count = sum(1 for src, _ in want if src == s)
                assert int(bf16["layout_range"][e, s]) == (begin << 32) | count
                begin += count
            for row, (s, n) in enumerate(want):
                assert int(bf16["src_info"][e, row]) == n
                assert torch.equal(bf16["recv_x"][e, row], xs[s][n])
                cast_values, cast_scales = oracle.fp8_cast(xs[s][n:n + 1], True, True)
                assert torch.equal(fp8["recv_x"][e, row].view(torch.uint8),
                                   cast_values[0].view(torch.uint8))
                assert torch.equal(scales[e, row], cast_scales[0])
            assert not bf16["recv_x"][e, len(want):].any()
            assert (bf16["src_info"][e, len(want):] == -1).all()


def test_low_latency_combine_matches_loops():
    num_ranks, num_experts, hidden, tokens_per_rank = 2, 4, 128, 6
    xs, idxs, weights = _world([6, 3], hidden, num_experts, 2, seed=13)
    sent = [oracle.low_latency_dispatch(xs, idxs, tokens_per_rank, num_experts, r, use_fp8=False)
            for r in range(num_ranks)]
    # expert g outputs its input times (g + 1)
    outputs = [(s["recv_x"].float() * (torch.arange(2)[:, None, None] + 2 * r + 1)).bfloat16()
               for r, s in enumerate(sent)]
    handles = [(s["src_info"], s["layout_range"], tokens_per_rank, hidden, num_experts)
               for s in sent]
    masks = [torch.tensor([0, 1]), torch.tensor([0, 0])]   # rank 0 masks rank 1
    for rank in range(num_ranks):
        for rank_masks in (None, masks):
            got = oracle.low_latency_combine(outputs, handles, idxs[rank], weights[rank], rank,
                                             rank_masks)
            want = torch.zeros(xs[rank].shape)
            for n in range(xs[rank].shape[0]):
                for d in range(num_ranks):   # one fp32 partial per expert rank, ranks ascending
                    partial = torch.zeros(hidden)
                    for k in range(idxs[rank].shape[1]):
                        g = int(idxs[rank][n, k])
                        if g < 0 or g // 2 != d or (rank_masks is not None and d != rank):
                            continue
                        row = (xs[rank][n].float() * (g + 1)).bfloat16().float()
                        partial = partial + row * weights[rank][n, k]
                    want[n] = want[n] + partial
            assert torch.equal(got, want.bfloat16())
