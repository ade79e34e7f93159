"""Internode plan arithmetic without compiling: the size hint and capacity checks are truthful, and
the routing tables and summation order the kernels implement (re-derived here in plain Python from
their definitions in cuda_src/internode*.cu*) reproduce the oracle exactly
(tests/compile/test_internode_compile.py checks the mirrors against the C++)."""
from __future__ import annotations

import random

import pytest
import torch

from epcomm.config import Config
from epcomm.ops import internode_plan as plan
from epcomm.reference import oracle


# ---- layouts, capacity, size hint -------------------------------------------------------------
@pytest.mark.parametrize("ranks, local", [(2, 1), (4, 2), (16, 8), (24, 8)])
def test_layouts_fit_the_buffer(ranks, local):
    nbytes = 64 << 20
    for row, scales, topk in ((7168 * 2, 0, 8), (7168, 56, 32), (16, 0, 0)):
        d = plan.DispatchLayout(nbytes, ranks, local, plan.dispatch_record_bytes(row, scales, topk, local))
        nodes = ranks // local
        assert d.capacity > 0 and d.record_bytes % 16 == 0 and d.recv_offset % 256 == 0
        assert d.stage_offset + nodes * d.capacity * d.record_bytes <= nbytes
        c = plan.CombineLayout(nbytes, ranks, local, row)
        assert c.push_bytes % 16 == 0 and c.partial_bytes % 16 == 0
        assert c.partial_recv_offset + nodes * c.capacity * c.partial_bytes <= nbytes
        assert -(-c.capacity // c.chunk_records) <= plan.MAX_CHUNKS   # signal words per node


@pytest.mark.parametrize("ranks", [16, 24, 64, 12])
def test_size_hint_holds_the_hinted_tokens(ranks):
    for hidden in (2048, 7168):
        hint = Config(24).get_rdma_buffer_size_hint(hidden * 2, ranks)
        assert hint % 128 == 0
        local = plan.hint_local_ranks(ranks)
        d = plan.DispatchLayout(hint, ranks, local,
                                plan.dispatch_record_bytes(hidden * 2, hidden // 128, plan.MAX_TOPK, local))
        c = plan.CombineLayout(hint, ranks, local, hidden * 2)
        assert min(d.capacity, c.capacity) >= plan.HINT_TOKENS
        assert plan.notify_offsets(ranks, ranks // local)[2] <= hint
        # and it is not oversized: 10% fewer bytes no longer hold the hinted tokens
        smaller = int(hint * 0.9)
        assert min(plan.DispatchLayout(smaller, ranks, local, d.record_bytes).capacity,
                   plan.CombineLayout(smaller, ranks, local, hidden * 2).capacity) < plan.HINT_TOKENS


def test_capacity_check_names_the_fix():
    plan.check_capacity("dispatch", 100, 100, 1 << 20, "x")
    with pytest.raises(ValueError, match="num_rdma_bytes=1048576 holds 100.*get_rdma_buffer_size_hint"):
        plan.check_capacity("dispatch", 101, 100, 1 << 20, "x")


def test_chunking():
    assert plan.num_chunks(24) == 24 * plan.CHUNKS_PER_BLOCK
    assert plan.num_chunks(10 ** 6) == plan.MAX_CHUNKS
    assert plan.tokens_per_chunk(0, 96) == 1            # N = 0 still has a valid chunk size
    assert plan.tokens_per_chunk(4097, 96) * 96 >= 4097


# ---- the protocol, re-derived in Python ---------------------------------------------------------
def _notify_tables(is_token_in_rank, rank_prefix, rank, local, chunks):
    """notify_kernel's send_rdma_head [N, M], rdma_channel_prefix [M, G+1], send_nvl_head [N, R]."""
    n, ranks = is_token_in_rank.shape
    nodes = ranks // local
    tpc = plan.tokens_per_chunk(n, chunks)
    in_node = is_token_in_rank.view(n, nodes, local).any(-1)
    head = torch.where(in_node, in_node.long().cumsum(0) - 1, -1)
    prefix = torch.zeros(nodes, chunks + 1, dtype=torch.long)
    for g in range(chunks + 1):
        prefix[:, g] = in_node[:min(g * tpc, n)].long().sum(0)
    before = rank_prefix[rank - 1] if rank > 0 else torch.zeros(ranks, dtype=torch.long)
    nvl = torch.where(is_token_in_rank, is_token_in_rank.long().cumsum(0) - 1 + before, -1)
    return head, prefix, nvl, tpc


def _random_routing(ranks, tokens, rng):
    routing = []
    for s in range(ranks):
        n = tokens[s]
        routing.append(torch.tensor([[rng.random() < 0.4 for _ in range(ranks)] for _ in range(n)],
                                    dtype=torch.bool).view(n, ranks))
    return routing


@pytest.mark.parametrize("ranks, local, chunks", [(2, 1, 4), (4, 2, 3), (6, 2, 8), (8, 4, 1)])
def test_dispatch_placement_matches_oracle_order(ranks, local, chunks):
    """RDMA stage (records per (source, node), chunk runs contiguous) + NVLink stage (row = pos[j])
    puts every (source, token) where oracle.dispatch puts it."""
    rng = random.Random(ranks * 31 + chunks)
    tokens = [rng.choice([0, 1, 5, 33, 70]) for _ in range(ranks)]
    routing = _random_routing(ranks, tokens, rng)
    rank_prefix = oracle.rank_prefix_matrix(routing).long()
    nodes = ranks // local
    # records[(holder rank, source node)][i] = (source rank, token, pos[L])
    records = {}
    for s in range(ranks):
        head, prefix, nvl, tpc = _notify_tables(routing[s], rank_prefix, s, local, chunks)
        for m in range(nodes):
            holder = m * local + s % local
            slots = records.setdefault((holder, s // local), {})
            for t in range(tokens[s]):
                i = int(head[t, m])
                if i >= 0:
                    slots[i] = (s, t, nvl[t, m * local:(m + 1) * local].tolist())
                    g = t // tpc
                    assert prefix[m, g] <= i < prefix[m, g + 1]   # inside its chunk's run
            assert sorted(slots) == list(range(len(slots)))   # dense: one run per node
    for rank in range(ranks):
        m, j = divmod(rank, local)
        expected = oracle.dispatch([torch.arange(n)[:, None].float() for n in tokens], None, None, None,
                                   routing, None, rank)
        rows = {}
        for s in range(ranks):
            for i, (src, t, pos) in records[(m * local + s % local, s // local)].items():
                if pos[j] >= 0:
                    assert pos[j] not in rows
                    rows[pos[j]] = (src, t)
        got = [rows[r] for r in range(len(rows))]
        want = [(int(s), int(t)) for s, t in zip(
            torch.repeat_interleave(torch.arange(ranks), torch.tensor(
                [int(routing[s][:, rank].sum()) for s in range(ranks)])).tolist(),
            expected["recv_src_idx"].tolist())]
        assert got == want


@pytest.mark.parametrize("ranks, local", [(2, 1), (4, 2), (6, 3)])
def test_combine_order_matches_oracle_bitwise(ranks, local):
    """combine_kernel's fp32 order (pushed rows summed per node from 0, local ranks ascending; then
    bias0 + bias1 + node partials ascending) is oracle.combine(num_local_ranks=L), bit for bit."""
    rng = random.Random(ranks + 7 * local)
    torch.manual_seed(ranks * local)
    tokens = [rng.choice([0, 3, 17]) for _ in range(ranks)]
    routing = _random_routing(ranks, tokens, rng)
    hidden, k = 16, 3
    recv = [int(sum(routing[s][:, r].sum() for s in range(ranks))) for r in range(ranks)]
    xs = [torch.randn(m, hidden).bfloat16() * 100 for m in recv]
    ws = [torch.rand(m, k) for m in recv]
    nodes = ranks // local
    for rank in range(ranks):
        bias = (torch.randn(tokens[rank], hidden).bfloat16(), torch.randn(tokens[rank], hidden).bfloat16())
        want_x, want_w = oracle.combine(xs, routing, rank, ws, bias, num_local_ranks=local)
        acc = torch.zeros(tokens[rank], hidden) + bias[0].float() + bias[1].float()
        acc_w = torch.zeros(tokens[rank], k)
        for m in range(nodes):
            for t in range(tokens[rank]):
                ranks_there = [m * local + j for j in range(local) if routing[rank][t, m * local + j]]
                if not ranks_there:
                    continue
                partial, partial_w = torch.zeros(hidden), torch.zeros(k)
                for r in ranks_there:
                    row = sum(int(routing[s][:, r].sum()) for s in range(rank)) + \
                        int(routing[rank][:t, r].sum())
                    partial += xs[r][row].float()
                    partial_w += ws[r][row]
                acc[t] += partial
                acc_w[t] += partial_w
        assert torch.equal(acc.bfloat16().view(torch.int16), want_x.view(torch.int16))
        assert torch.equal(acc_w, want_w)


# ---- EPCOMM_NUM_LOCAL_RANKS -------------------------------------------------------------------
def test_num_local_ranks_override(monkeypatch):
    from epcomm import env
    from epcomm.runtime.topology import resolve_local_ranks
    monkeypatch.delenv("EPCOMM_NUM_LOCAL_RANKS", raising=False)
    assert env.num_local_ranks() is None
    monkeypatch.setenv("EPCOMM_NUM_LOCAL_RANKS", "2")
    assert env.num_local_ranks() == 2
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("EPCOMM_NUM_LOCAL_RANKS", bad)
        with pytest.raises(ValueError, match="EPCOMM_NUM_LOCAL_RANKS must be a positive int"):
            env.num_local_ranks()
    hosts = ["a"] * 4 + ["b"] * 4
    assert resolve_local_ranks(hosts, [None] * 8) == 4
    assert resolve_local_ranks(hosts, [2] * 8) == 2
    assert resolve_local_ranks(["a", "a"], [1, 1]) == 1        # the 2-GPU test machine as 2 nodes
    with pytest.raises(ValueError, match="equal on every rank"):
        resolve_local_ranks(hosts, [2] * 7 + [1])
    with pytest.raises(ValueError, match="must divide the 4 ranks of each host"):
        resolve_local_ranks(hosts, [3] * 8)
    with pytest.raises(ValueError, match="must divide the 4 ranks of each host"):
        resolve_local_ranks(hosts, [8] * 8)                    # a node may not span hosts
