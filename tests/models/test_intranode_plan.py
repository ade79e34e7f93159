"""Intranode plan arithmetic without compiling: the size hint is sane, and the routing tables and
ring rules that the kernels implement (re-derived here in plain Python from their definitions in
cuda_src/intranode.cu) reproduce the oracle's row order and never overwrite unconsumed rows
(tests/compile/test_intranode_compile.py checks the mirrors against the C++)."""
from __future__ import annotations

import random

import pytest
import torch

from epcomm.config import Config
from epcomm.ops import intranode_plan as plan
from epcomm.reference import oracle


def test_size_hint():
    for ranks in (1, 2, 3, 8):
        for hidden in (2048, 7168, 8192):
            for sms in (8, 24, 48):
                config = Config(sms)
                hint = plan.nvl_size_hint(config, hidden * 2, ranks)
                assert hint % 128 == 0 and hint >= plan.header_bytes(ranks)
                if ranks == 1:
                    continue
                # Every call the hint is sized for fits: BF16 or FP8 rows, any top-k up to 32,
                # up to 1024 local experts, a one-shot ring of HINT_RING_ROWS rows per peer.
                for row_bytes, scales in ((hidden * 2, 0), (hidden, hidden // 128)):
                    record = plan.dispatch_record_bytes(row_bytes, scales, 32)
                    offset = plan.dispatch_staging_offset(ranks, 1024)
                    assert plan.ring_rows(hint, offset, record, ranks, "t") >= plan.HINT_RING_ROWS
                record = plan.combine_record_bytes(hidden * 2, 32)
                assert plan.ring_rows(hint, plan.combine_staging_offset(ranks), record, ranks, "t") \
                    >= plan.HINT_RING_ROWS
    assert plan.nvl_size_hint(Config(24), 14336, 8) > plan.nvl_size_hint(Config(24), 14336, 2)
    with pytest.raises(ValueError, match="too small"):
        plan.ring_rows(plan.header_bytes(2) + 100, plan.combine_staging_offset(2), 14336, 2, "combine")


def test_split_and_chunks():
    for ranks in (1, 2, 8):
        for sms in range(2, 134, 2):
            d, c = plan.dispatch_split(sms, ranks), plan.combine_split(sms, ranks)
            assert d.blocks == c.blocks == sms
            assert 1 <= d.send_blocks <= sms and 0 <= c.send_blocks <= sms
            assert (c.send_blocks == 0) == (ranks == 1)
            assert 1 <= plan.num_chunks(sms, ranks) <= plan.MAX_CHUNKS


# ---- the kernels' tables, from their definitions, against the oracle ----------------------------
def tables(in_rank: torch.Tensor, chunks: int):
    """(channel_prefix [R, G+1], send_head [N, R]) as notify_kernel defines them."""
    n, ranks = in_rank.shape
    tpc = plan.tokens_per_chunk(n, chunks)
    prefix = torch.zeros(ranks, chunks + 1, dtype=torch.int64)
    for g in range(chunks):
        lo, hi = min(g * tpc, n), min(g * tpc + tpc, n)
        prefix[:, g + 1] = prefix[:, g] + in_rank[lo:hi].sum(0)
    head = torch.where(in_rank, in_rank.long().cumsum(0) - 1, -1)
    return prefix, head


def routing(seed: int, ranks: int, n_by_rank, experts: int, topk: int):
    gen = torch.Generator().manual_seed(seed)
    in_ranks = []
    for n in n_by_rank:
        idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(n)]) if n else \
            torch.empty(0, topk, dtype=torch.long)
        idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.2, -1)
        in_ranks.append(oracle.layout(idx, experts, ranks, ranks)[3])
    return in_ranks


@pytest.mark.parametrize("seed, ranks, n_by_rank, chunks", [
    (0, 2, (300, 300), 16), (1, 2, (0, 77), 8), (2, 3, (50, 0, 129), 5), (3, 8, [40 * r for r in range(8)], 24),
    (4, 1, (33,), 4), (5, 4, (1, 2, 3, 4), 1024)])
def test_positions_match_oracle_order(seed, ranks, n_by_rank, chunks):
    """Row k of pair (s -> j) at rank_prefix[s-1][j] + k, with k = send_head[t][j], gives exactly the
    oracle's recv_src_idx for every rank; channel_prefix on the sender equals what the receiver
    uses as recv_channel_prefix, and its chunks tile every stream."""
    in_ranks = routing(seed, ranks, n_by_rank, 4 * ranks, 3)
    rank_prefix = oracle.rank_prefix_matrix(in_ranks)
    built = [tables(t, chunks) for t in in_ranks]
    for j in range(ranks):
        expected = oracle.dispatch([torch.zeros(len(t), 8) for t in in_ranks], None, None, None,
                                   in_ranks, None, j)["recv_src_idx"]
        got = torch.full((int(rank_prefix[-1, j]),), -7, dtype=torch.int32)
        for s in range(ranks):
            base = 0 if s == 0 else int(rank_prefix[s - 1, j])
            prefix, head = built[s]
            assert int(prefix[j, -1]) == int(in_ranks[s][:, j].sum())
            for t in range(len(in_ranks[s])):
                if head[t, j] >= 0:
                    got[base + int(head[t, j])] = t
            rows = prefix[j, 1:] - prefix[j, :-1]
            assert (rows >= 0).all() and int(rows.max() if len(rows) else 0) <= plan.tokens_per_chunk(len(in_ranks[s]), chunks)
        assert torch.equal(got, expected), (j, got, expected)


@pytest.mark.parametrize("seed", range(6))
def test_ring_rule_never_overwrites_unconsumed_rows(seed):
    """Any order the blocks may run in: before chunk g is written, wait_ring_space has required the
    consumption of every earlier chunk still holding a slot chunk g overwrites, and no chunk waits
    for itself or a later chunk (no deadlock)."""
    rnd = random.Random(seed)
    chunks = rnd.randint(1, 60)
    rows = [rnd.choice((0, 0, 1, 3, 7, 16)) for _ in range(chunks)]
    prefix = [0]
    for r in rows:
        prefix.append(prefix[-1] + r)
    ring = rnd.randint(max(rows + [1]), max(rows + [1]) + 20)
    cursor = 0
    required = set()
    for g in range(chunks):
        limit = prefix[g + 1] - ring          # wait_ring_space
        while cursor < g and prefix[cursor] < limit:
            required.add(cursor)
            cursor += 1
        assert all(x < g for x in required)
        slots = {k % ring for k in range(prefix[g], prefix[g + 1])}
        assert len(slots) == rows[g]          # a chunk never collides with itself
        for x in range(g):
            if {k % ring for k in range(prefix[x], prefix[x + 1])} & slots:
                assert x in required, (g, x, prefix, ring)


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_claims_with_reused_rings_always_progress(seed):
    """A model of the data kernels on 2 ranks, scheduled at random: sending blocks take chunks from
    the rank's counter in increasing order (send_chunks), wait for ring space by wait_ring_space's
    rule, then signal the chunk; receiving warps take (chunk, part) in chunk order (one claim each),
    wait for the chunk, and the chunk's last part frees it (consumed); a sending block's warps
    receive once its rank has no chunk left. Whatever the order, every chunk is sent once and
    consumed once, and there is always a step to take until all are: no deadlock."""
    rnd = random.Random(seed)
    chunks = rnd.randint(1, 40)
    send_blocks, recv_blocks, warps = rnd.randint(1, 4), rnd.randint(1, 3), rnd.randint(1, 3)
    rows = [[rnd.choice((0, 1, 2, 5, 9)) for _ in range(chunks)] for _ in range(2)]   # rows[src][g]
    prefix = [[0] for _ in range(2)]
    for src in range(2):
        for r in rows[src]:
            prefix[src].append(prefix[src][-1] + r)
    ring = max(max(r) for r in rows) + rnd.randint(0, 6) or 1
    parts = plan.PARTS_PER_CHUNK

    send_counter, recv_counter = [0, 0], [0, 0]
    ready = [[False] * chunks for _ in range(2)]       # ready[src][g]: src's chunk g landed at the peer
    consumed = [[False] * chunks for _ in range(2)]    # consumed[src][g]: the peer freed src's chunk g
    parts_done = [[0] * chunks for _ in range(2)]
    sent = [[0] * chunks for _ in range(2)]
    # senders: [rank, chunk or None, cursor]; receivers: [rank, claimed (chunk, part) or None]
    senders = [[r, None, 0] for r in range(2) for _ in range(send_blocks)]
    receivers = [[r, None] for r in range(2) for _ in range(recv_blocks * warps)]

    def sender_step(s):
        rank, g, cursor = s
        if g is None:                                  # claim_chunk
            g = send_counter[rank]
            send_counter[rank] += 1
            if g >= chunks:                            # no chunk left: the block's warps receive
                senders.remove(s)
                receivers.extend([rank, None] for _ in range(warps))
            else:
                s[1] = g
            return True
        pre = prefix[rank]
        while cursor < g and pre[cursor] < pre[g + 1] - ring:   # wait_ring_space
            if not consumed[rank][cursor]:
                s[2] = cursor
                return False
            cursor += 1
        s[2] = cursor
        sent[rank][g] += 1                             # stores, then chunk_done
        ready[rank][g] = True
        s[1] = None
        return True

    def receiver_step(w):
        rank, claimed = w
        src = 1 - rank
        if claimed is None:
            c = recv_counter[rank]
            recv_counter[rank] += 1
            if c >= chunks * parts:
                receivers.remove(w)
            else:
                w[1] = divmod(c, parts)
            return True
        g, _ = claimed
        if not ready[src][g]:
            return False
        parts_done[src][g] += 1
        if parts_done[src][g] == parts:
            consumed[src][g] = True
        w[1] = None
        return True

    steps = 0
    while senders or receivers:
        actors = [(sender_step, s) for s in senders] + [(receiver_step, w) for w in receivers]
        rnd.shuffle(actors)
        assert any(step(a) for step, a in actors), (
            f"deadlock: senders {senders}, receivers {receivers}, consumed {consumed}")
        steps += 1
        assert steps < 100_000
    assert sent == [[1] * chunks, [1] * chunks] and consumed == [[True] * chunks, [True] * chunks]
