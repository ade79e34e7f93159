"""ReferenceBackend on 2 and 4 gloo processes, against brute force computed from the all-gathered
inputs (dist.all_gather_object, loops; the oracle is not used here).

Starting gloo processes costs seconds (each imports torch), so each world size is ONE run that
goes through every scenario; a failure's traceback names the scenario."""
import math

import pytest
import torch
import torch.distributed as dist

from tests.conftest import run_ranks

HIDDEN, TOPK, ALIGN = 256, 3, 4


def _inputs(rank, world, num_experts, seed):
    """This rank's tokens: N differs by rank (0 on the last), token 0 goes nowhere."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    n = 0 if rank == world - 1 else 5 + 3 * rank
    x = torch.randn(n, HIDDEN, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:TOPK] for _ in range(n)]) \
        if n else torch.zeros(0, TOPK, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=gen) < 0.25] = -1
    if n:
        idx[0] = -1
    weights = torch.rand(n, TOPK, generator=gen)
    return x, idx, weights


def _all(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _backend(group, **options):
    from epcomm.reference import ReferenceBackend
    return ReferenceBackend(group, 1 << 12, 1 << 12, True, options)


# ---------------------------------------------------------------------------------------------
def _expected_rows(xs, idxs, ws, rank, local_experts):
    rows = []
    for s in range(len(xs)):
        for n in range(xs[s].shape[0]):
            ids = [int(g) for g in idxs[s][n]]
            if any(g >= 0 and g // local_experts == rank for g in ids):
                local = [g - rank * local_experts if g >= 0 and g // local_experts == rank
                         else -1 for g in ids]
                rows.append((s, n, local, [float(ws[s][n, k]) if local[k] >= 0 else 0.0
                                           for k in range(TOPK)]))
    return rows


def _check_rows(res, rows, xs, padded_to=None):
    m = len(rows)
    assert res.recv_x.shape[0] == (padded_to or m)
    for row, (s, n, local, w) in enumerate(rows):
        assert torch.equal(res.recv_x[row], xs[s][n])
        assert res.recv_topk_idx[row].tolist() == local
        assert res.recv_topk_weights[row].tolist() == w
    if padded_to:
        assert not res.recv_x[m:].any() and (res.recv_topk_idx[m:] == -1).all()
        assert not res.recv_topk_weights[m:].any()


def _normal_mode(rank, world, group, num_local_ranks):
    num_experts = 4 * world
    local_experts = num_experts // world
    backend = _backend(group, num_local_ranks=num_local_ranks)
    x, idx, w = _inputs(rank, world, num_experts, seed=1)
    xs, idxs, ws = zip(*_all((x, idx, w)))
    reach = [[{int(g) // local_experts for g in idxs[s][n] if g >= 0}
              for n in range(len(xs[s]))] for s in range(world)]

    # layout
    per_rank, per_node, per_expert, in_rank = backend.get_dispatch_layout(idx, num_experts)
    assert per_rank.tolist() == [sum(r in reach[rank][n] for n in range(len(x)))
                                 for r in range(world)]
    assert per_expert.tolist() == [int((idx == e).sum()) for e in range(num_experts)]
    assert in_rank.tolist() == [[r in reach[rank][n] for r in range(world)] for n in range(len(x))]
    if num_local_ranks == world:
        assert per_node is None
    else:
        nodes = world // num_local_ranks
        assert per_node.tolist() == [sum(any(r // num_local_ranks == node for r in reach[rank][n])
                                         for n in range(len(x))) for node in range(nodes)]

    # dispatch
    res = backend.dispatch(x, None, None, per_rank, per_node, in_rank, per_expert, idx, w, ALIGN,
                           0, None)
    rows = _expected_rows(xs, idxs, ws, rank, local_experts)
    _check_rows(res, rows, xs)
    counts = [sum(r[2].count(e) for r in rows) for e in range(local_experts)]
    assert res.num_recv_tokens_per_expert_list == [math.ceil(c / ALIGN) * ALIGN for c in counts]
    received = [sum(1 for r in rows if r[0] == s) for s in range(world)]
    handle = res.handle
    if num_local_ranks == world:
        assert len(handle) == 6
        sent = [[sum(r in reach[s][n] for n in range(len(xs[s]))) for r in range(world)]
                for s in range(world)]
        assert handle[0].tolist() == [[sum(sent[i2][j] for i2 in range(i + 1))
                                       for j in range(world)] for i in range(world)]
        assert handle[3].tolist() == [r[1] for r in rows] and torch.equal(handle[4], in_rank)
        send_head = handle[5]
    else:
        assert len(handle) == 10
        assert handle[-4].tolist() == [sum(received[:i + 1]) for i in range(world)]
        assert handle[7].tolist() == [[r[0], r[1]] for r in rows]
        send_head = handle[9]
    # where each of my tokens landed, as seen by its destination
    landed = _all({(s, n): row for row, (s, n, _, _) in enumerate(rows)})
    for n in range(len(x)):
        for r in range(world):
            assert int(send_head[n, r]) == landed[r].get((rank, n), -1)

    # combine: rank r returns its rows times (r + 1), so each source rank's share is visible
    y = (res.recv_x.float() * (rank + 1)).bfloat16()
    bias = (torch.ones(len(x), HIDDEN).bfloat16(), torch.full((len(x), HIDDEN), 0.5).bfloat16())
    got_x, got_w = backend.combine(y, handle, res.recv_topk_weights, bias, None)
    for n in range(len(x)):
        want = torch.full((HIDDEN,), 1.5)
        for r in sorted(reach[rank][n]):
            want = want + (x[n].float() * (r + 1)).bfloat16().float()
        assert torch.equal(got_x[n], want.bfloat16())
    assert torch.equal(got_w, torch.where(idx >= 0, w, 0.0))

    # num_worst_tokens: same prefix, padding, empty list; combine ignores the padding
    worst = sum(len(s) for s in xs)
    padded = backend.dispatch(x, None, None, per_rank, per_node, in_rank, per_expert, idx, w,
                              ALIGN, worst, None)
    _check_rows(padded, rows, xs, padded_to=worst)
    assert padded.num_recv_tokens_per_expert_list == []
    y_padded = torch.cat([y, torch.full((worst - len(rows), HIDDEN), 7.0).bfloat16()])
    assert torch.equal(backend.combine(y_padded, padded.handle, None, (None, None), None)[0],
                       backend.combine(y, handle, None, (None, None), None)[0])

    # cached dispatch with new FP8 data (byte moves: exact), and plain routing without top-k
    x8 = (x.float() / 4).to(torch.float8_e4m3fn)
    s8 = torch.rand(len(x), HIDDEN // 128).t().contiguous().t()   # any strides
    x8s, s8s = zip(*_all((x8.view(torch.uint8), s8)))   # fp8 does not pickle
    for h in (handle, padded.handle):
        cached = backend.dispatch(x8, s8, h, None, None, None, None, None, None, 1, 0, None)
        assert cached.recv_topk_idx is None and cached.handle is None
        assert cached.recv_x.shape[0] == (h[3] if len(h) == 6 else h[7]).shape[0]
        for row, (s, n, _, _) in enumerate(rows):
            assert torch.equal(cached.recv_x[row].view(torch.uint8), x8s[s][n])
            assert torch.equal(cached.recv_x_scales[row], s8s[s][n])
    fresh = backend.dispatch(x8, s8, None, per_rank, per_node, in_rank, per_expert, idx, w, 1,
                             0, None)
    assert torch.equal(fresh.recv_x.view(torch.uint8), cached.recv_x.view(torch.uint8)[:len(rows)])
    assert torch.equal(fresh.recv_x_scales, cached.recv_x_scales[:len(rows)])
    plain = backend.dispatch(x, None, None, per_rank, per_node, in_rank, None, None, None, 1, 0,
                             None)
    assert plain.recv_topk_idx is None and torch.equal(plain.recv_x, res.recv_x)


# ---------------------------------------------------------------------------------------------
def _brute_fp8(row):
    """One token -> (e4m3 bytes, scales): per 128 channels, x * fl32(448 / max(amax, 1e-4))."""
    groups = row.float().view(-1, 128)
    amax = torch.maximum(groups.abs().amax(1), torch.tensor(1e-4))
    values = (groups * (torch.tensor(448.0) / amax)[:, None]).clamp(-448, 448)
    return (values.to(torch.float8_e4m3fn).view(torch.uint8).flatten(),
            amax * torch.tensor(1 / 448, dtype=torch.float32))


def _low_latency(rank, world, group):
    num_experts, tokens_per_rank = 2 * world, 12
    local_experts = num_experts // world
    backend = _backend(group, enable_shrink=True)
    x, idx, w = _inputs(rank, world, num_experts, seed=2)
    xs, idxs, ws = zip(*_all((x, idx, w)))
    stats = torch.full((local_experts,), 3, dtype=torch.int32)
    wait_stats = torch.zeros(world, dtype=torch.int64)

    def expected(e, dead=()):
        g = rank * local_experts + e
        return [(s, n) for s in range(world) if (s, rank) not in dead
                for n in range(len(xs[s])) if g in idxs[s][n].tolist()]

    fp8 = backend.low_latency_dispatch(x, idx, tokens_per_rank, num_experts, stats, wait_stats,
                                       True, False, False, True)
    fp8.hook()
    bf16 = backend.low_latency_dispatch(x, idx, tokens_per_rank, num_experts, None, None, False,
                                        False, False, False)
    assert bf16.hook is None and bf16.recv_x_scales is None
    assert fp8.recv_x_scales.shape == (local_experts, world * tokens_per_rank, HIDDEN // 128)
    assert fp8.recv_x_scales.stride(1) == 1
    src_info, layout_range, t, h, e_total = bf16.handle
    assert (t, h, e_total) == (tokens_per_rank, HIDDEN, num_experts)
    for e in range(local_experts):
        want = expected(e)
        assert int(bf16.recv_count[e]) == len(want) == int(fp8.recv_count[e])
        assert int(stats[e]) == 3 + len(want)
        for s in range(world):
            begin = sum(1 for src, _ in want if src < s)
            count = sum(1 for src, _ in want if src == s)
            assert int(layout_range[e, s]) == (begin << 32) | count
        for row, (s, n) in enumerate(want):
            assert int(src_info[e, row]) == n
            assert torch.equal(bf16.recv_x[e, row], xs[s][n])
            values, scales = _brute_fp8(xs[s][n])
            assert torch.equal(fp8.recv_x[e, row].view(torch.uint8), values)
            assert torch.equal(fp8.recv_x_scales[e, row], scales)
        assert not bf16.recv_x[e, len(want):].any()
    assert not wait_stats.any()
    ue8m0 = backend.low_latency_dispatch(x, idx, tokens_per_rank, num_experts, None, None, True,
                                         True, True, False)
    assert ue8m0.recv_x_scales.dtype == torch.int32 and ue8m0.recv_x_scales.stride(1) == 1
    assert ue8m0.recv_x_scales.shape == (local_experts, world * tokens_per_rank, 1)

    # combine: expert g returns its rows times (g + 1); weighted sum over k
    experts = rank * local_experts + torch.arange(local_experts)
    y = (bf16.recv_x.float() * (experts + 1).float()[:, None, None]).bfloat16()

    def want_combine(dead_ranks=()):
        """fp32: one partial per expert rank (its slots, k ascending), the partials ranks ascending."""
        out = torch.zeros(len(x), HIDDEN)
        for n in range(len(x)):
            for d in range(world):
                partial = torch.zeros(HIDDEN)
                for k in range(TOPK):
                    g = int(idx[n, k])
                    if g >= 0 and g // local_experts == d and d not in dead_ranks:
                        partial = partial + (x[n].float() * (g + 1)).bfloat16().float() * w[n, k]
                out[n] = out[n] + partial
        return out.bfloat16()

    got, hook = backend.low_latency_combine(y, idx, w, bf16.handle, False, False, True, None,
                                            wait_stats)
    hook()
    assert torch.equal(got, want_combine())
    # zero copy: the two buffer sets alternate, each call uses the next one
    first = backend.get_next_low_latency_combine_buffer(bf16.handle)
    first.copy_(y)
    out = torch.empty(len(x), HIDDEN, dtype=torch.bfloat16)
    got, hook = backend.low_latency_combine(torch.zeros_like(y), idx, w, bf16.handle, False, True,
                                            False, out, None)
    assert got is out and hook is None and torch.equal(out, want_combine())
    second = backend.get_next_low_latency_combine_buffer(bf16.handle)
    assert second.data_ptr() != first.data_ptr()
    with pytest.raises(NotImplementedError, match="logfmt"):
        backend.low_latency_combine(y, idx, w, bf16.handle, True, False, False, None, None)

    # masking: rank 0 masks the last rank; that link carries nothing either way
    last = world - 1
    if rank == 0:
        backend.low_latency_update_mask_buffer(last, True)
    status = torch.empty(world, dtype=torch.int32)
    backend.low_latency_query_mask_buffer(status)
    assert status.tolist() == [int(rank == 0 and r == last) for r in range(world)]
    dead = {(0, last), (last, 0)}
    dead_ranks = {other for me, other in dead if me == rank}
    # a mask set after the dispatch still drops the masked experts' rows from the combine
    y_unmasked = (bf16.recv_x.float() * (experts + 1).float()[:, None, None]).bfloat16()
    got, _ = backend.low_latency_combine(y_unmasked, idx, w, bf16.handle, False, False, False,
                                         None, None)
    assert torch.equal(got, want_combine(dead_ranks))
    masked = backend.low_latency_dispatch(x, idx, tokens_per_rank, num_experts, None, None,
                                          False, False, False, False)
    for e in range(local_experts):
        want = expected(e, dead)
        assert int(masked.recv_count[e]) == len(want)
        assert [int(masked.handle[0][e, row]) for row in range(len(want))] == [n for _, n in want]
    y = (masked.recv_x.float() * (experts + 1).float()[:, None, None]).bfloat16()
    got, _ = backend.low_latency_combine(y, idx, w, masked.handle, False, False, False, None, None)
    assert torch.equal(got, want_combine(dead_ranks))
    backend.low_latency_clean_mask_buffer()
    backend.low_latency_query_mask_buffer(status)
    assert not status.any()
    backend.clean_low_latency_buffer(tokens_per_rank, HIDDEN, num_experts)
    assert not backend.get_next_low_latency_combine_buffer(bf16.handle).any()


# ---------------------------------------------------------------------------------------------
def _buffers_and_errors(rank, world, group):
    backend = _backend(group)
    whole = backend.get_local_buffer_tensor(torch.int32, None, 0, True)
    assert whole.shape == (1 << 10,)
    part = backend.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), 64, True)
    part.fill_(1.0)
    assert (whole[16:32] == 0x3F803F80).all() and not whole[:16].any() and not whole[32:].any()
    assert not backend.get_local_buffer_tensor(torch.uint8, None, 0, False).any()
    with pytest.raises(ValueError):
        backend.get_local_buffer_tensor(torch.int32, None, 2, True)
    with pytest.raises(ValueError):
        backend.get_local_buffer_tensor(torch.int32, torch.Size([1025]), 0, True)
    with pytest.raises(RuntimeError, match="enable_shrink"):
        backend.low_latency_update_mask_buffer(0, True)
    from epcomm.reference import ReferenceBackend
    with pytest.raises(ValueError, match="num_local_ranks"):
        ReferenceBackend(group, 0, 0, False, {"num_local_ranks": 3})
    assert (backend.rank, backend.num_ranks, backend.num_local_ranks) == (rank, world, world)


# ---------------------------------------------------------------------------------------------
def _every_scenario(rank, world, group):
    _normal_mode(rank, world, group, world)                # intranode: 6-tuple handle
    if world == 4:
        _normal_mode(rank, world, group, 2)                # two nodes of two: 10-tuple handle
    _low_latency(rank, world, group)
    _buffers_and_errors(rank, world, group)


@pytest.mark.parametrize("world", [2, 4])
def test_reference_backend(world):
    run_ranks(_every_scenario, world)
