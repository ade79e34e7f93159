"""Internode plan arithmetic without compiling: ring layouts and size hints (no larger than DeepEP
V1's for the same Config, independent of N), a model of the streaming protocol (every stream
finishes under any interleaving, no ring slot is overwritten before it was consumed, FIFO
presence is decided right), and the routing tables and summation order the kernels implement
(re-derived here in plain Python from their definitions in cuda_src/internode*.cu*), which reproduce
the oracle exactly (tests/compile/test_internode_compile.py checks the mirrors against the C++)."""
from __future__ import annotations

import random

import pytest
import torch

from epcomm.config import COMBINE_CHUNKS, DISPATCH_CHUNKS, Config, recommended
from epcomm.ops import internode_plan as plan
from epcomm.reference import oracle


# ---- rings, layouts, size hints ----------------------------------------------------------------
def test_channels_and_rings_follow_the_config():
    assert plan.num_channels(24) == 12 and plan.num_channels(2) == 1
    assert plan.tokens_per_channel(0, 12) == 1            # N = 0 still has a valid channel size
    assert plan.tokens_per_channel(4097, 12) * 12 >= 4097
    config = Config(24, 36, 288, 20, 128)                 # DeepEP's EP16 dispatch entry; 128 -> 140
    d = plan.dispatch_rings(config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
    c = plan.combine_rings(config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
    f = plan.push_rings(config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens)
    assert (d.ring, d.stage, d.chunk) == (140, 40, 20)
    assert (c.ring, c.stage, c.chunk) == (70, 40, 20)     # fp32 partials: half the tokens, the same bytes
    assert (f.ring, f.stage, f.chunk) == (288, 72, 36)
    with pytest.raises(ValueError, match="129 channels; internode mode supports up to 128"):
        plan.check_channels("dispatch", 258)


@pytest.mark.parametrize("ranks, local", [(2, 1), (4, 2), (16, 8), (24, 8), (256, 8)])
def test_layouts_are_aligned_and_fit_the_hint(ranks, local):
    config = Config(24)
    need = plan.rdma_bytes_needed(config, 7168 * 2, 56, 32, ranks, local)
    rdma = (config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
    for row, scales, topk in ((7168 * 2, 0, 8), (7168, 56, 32), (16, 0, 0)):
        record = plan.dispatch_record_bytes(row, scales, topk, local)
        d = plan.DispatchLayout(ranks, local, record, 12, plan.dispatch_rings(*rdma))
        assert record % 16 == 0 and d.recv_offset % 256 == 0 and d.stage_offset % 16 == 0
        assert d.end <= need or row == 16
    pushes = plan.push_rings(config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens)
    in_nvl = plan.CombineLayout(ranks, local, 7168 * 2, 12, plan.combine_rings(*rdma), pushes, 1 << 40)
    in_rdma = plan.CombineLayout(ranks, local, 7168 * 2, 12, plan.combine_rings(*rdma), pushes, 0)
    assert in_nvl.push_in_nvl and in_nvl.push_offset == 0 and in_nvl.end <= need
    assert not in_rdma.push_in_nvl and in_rdma.push_offset >= in_nvl.end and in_rdma.push_offset % 256 == 0
    assert in_rdma.end == in_rdma.push_offset + in_nvl.fifo_bytes
    assert in_nvl.partial_bytes % 16 == 0 and in_nvl.push_bytes % 16 == 0
    assert plan.notify_offsets(ranks, ranks // local)[2] <= need


def deepep_rdma_hint(config, hidden_bytes, num_ranks):
    """DeepEP V1's Config::get_rdma_buffer_size_hint (csrc/config.hpp), as numbers: per (channel,
    RDMA rank) 2 x (8 x 2 + 2) ints, and per token of the receive ring x 2 (send + receive) the row,
    an 8-byte SourceMeta, 128 int64 + 128 float top-k slots, 128 scales and an int4."""
    nodes, channels, recv = num_ranks // 8, config.num_sms // 2, config.num_max_rdma_chunked_recv_tokens
    per_token = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16
    return -(-(channels * nodes * 18 * 2 * 4 + channels * nodes * recv * per_token * 2) // 128) * 128


def deepep_nvl_hint(config, hidden_bytes, num_ranks):
    """DeepEP V1's Config::get_nvl_buffer_size_hint, as numbers (per channel and NVL rank (2 M + 3)
    ints, and per token of the receive queue the row, SourceMeta, top-k slots and scales)."""
    nodes, peers, channels = max(num_ranks // 8, 1), min(num_ranks, 8), config.num_sms // 2
    per_token = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4
    return -(-(channels * peers * (2 * nodes + 3) * 4 +
               channels * peers * config.num_max_nvl_chunked_recv_tokens * per_token) // 128) * 128


CONFIGS = [Config(sms, *entry) for sms in (20, 24) for table in (DISPATCH_CHUNKS, COMBINE_CHUNKS)
           for entry in table.values()] + [Config(), Config(48), Config(132, 6, 256, 6, 256)]


@pytest.mark.parametrize("ranks", [16, 32, 64, 128, 256])
def test_size_hints_are_no_larger_than_deepeps(ranks):
    for config in CONFIGS:
        for hidden in (2048, 4096, 7168):
            rdma = config.get_rdma_buffer_size_hint(hidden * 2, ranks)
            nvl = config.get_nvl_buffer_size_hint(hidden * 2, ranks)
            assert rdma % 128 == 0 and nvl % 128 == 0
            assert rdma <= deepep_rdma_hint(config, hidden * 2, ranks), (config, hidden)
            assert nvl <= deepep_nvl_hint(config, hidden * 2, ranks), (config, hidden)
            # what the hints cover is what the layouts of that Config need, BF16 and FP8, any K
            local = plan.hint_local_ranks(ranks)
            for row, scales in ((hidden * 2, 0), (hidden, hidden // 128)):
                assert plan.rdma_bytes_needed(config, row, scales, 32, ranks, local) <= rdma


@pytest.mark.parametrize("ranks", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("sms", [20, 24])
def test_deepep_buffer_sizes_hold_every_scale(ranks, sms):
    """DeepEP's test_internode.py builds Buffer(group, int(2e9), int(1e9)): with the recommended
    Configs (nodes of 8) the rings fit it up to EP256, whatever N (nothing here depends on N)."""
    for kind in ("dispatch", "combine"):
        config = recommended(kind, ranks, sms)
        assert plan.rdma_bytes_needed(config, 7168 * 2, 56, 32, ranks, 8) <= int(1e9), (kind, config)
        assert plan.nvl_size_hint(config, 7168 * 2, ranks) <= int(2e9), (kind, config)


# ---- the streaming protocol, modelled --------------------------------------------------------------
def _channel_tokens(n, channels, c):
    tpc = plan.tokens_per_channel(n, channels)
    return range(min(c * tpc, n), min((c + 1) * tpc, n))


class _Protocol:
    """One channel of dispatch and combine as the kernels run it (internode_dispatch.cuh,
    internode_combine.cuh): every actor (a stream of a warp) moves by its own rules or cannot; a
    scheduler runs random movable actors until every stream is done. Visibility is immediate
    (the kernels order each word behind the data it announces)."""

    def __init__(self, routing, local, channels, c, rings, combine_rings, pushes, rng):
        self.routing, self.local, self.rng = routing, local, rng
        self.ranks = len(routing)
        self.nodes = self.ranks // local
        self.rings, self.combine_rings, self.pushes = rings, combine_rings, pushes
        L, M, R = local, self.nodes, self.ranks
        # record streams (source s -> node m): this channel's tokens of s that reach m, in order
        self.streams = {(s, m): [t for t in _channel_tokens(len(routing[s]), channels, c)
                                 if bool(routing[s][t, m * L:(m + 1) * L].any())]
                        for s in range(R) for m in range(M)}

    def schedule(self, actors):
        while True:
            live = [a for a in actors if not a.done()]
            if not live:
                return
            self.rng.shuffle(live)
            assert any(a.step() for a in live), "no stream can move: deadlock"


class _RingSlot:
    def __init__(self, size):
        self.slots, self.size = [None] * size, size

    def write(self, index, value, freed):
        """freed: how many entries every reader consumed (slot index - size must be among them)."""
        assert index - self.size < freed, f"slot of {index} overwritten before {index - self.size} was consumed"
        self.slots[index % self.size] = value

    def read(self, index):
        return self.slots[index % self.size]


def _run_dispatch(proto):
    L, M, R, rings = proto.local, proto.nodes, proto.ranks, proto.rings
    ring = {(s, m): _RingSlot(rings.ring) for s in range(R) for m in range(M)}        # on (m, s % L)
    stage = {(s, m): _RingSlot(rings.stage) for s in range(R) for m in range(M)}
    sent = {key: 0 for key in proto.streams}
    heads = {(s, m, j): 0 for s in range(R) for m in range(M) for j in range(L)}
    got = {}

    class Sender:
        def __init__(self, s, m):
            self.s, self.m, self.records = s, m, proto.streams[(s, m)]

        def done(self):
            return sent[(self.s, self.m)] == len(self.records)

        def step(self):
            s, m, k = self.s, self.m, sent[(self.s, self.m)]
            head = min(heads[(s, m, j)] for j in range(L))
            direct = m == s // L
            end = min(len(self.records), k + rings.chunk, head + (rings.ring if direct else rings.stage))
            if end <= k:
                return False
            for r in range(k, end):
                if not direct:
                    stage[(s, m)].write(r, (s, self.records[r], r), head)
                ring[(s, m)].write(r, (s, self.records[r], r), head)
            sent[(s, m)] = end
            return True

    class Receiver:
        def __init__(self, rank, s):
            self.rank, self.s, self.taken = rank, s, 0
            self.m, self.j = divmod(rank, L)

        def done(self):
            return self.taken == len(proto.streams[(self.s, self.m)])

        def step(self):
            tail = sent[(self.s, self.m)]
            if tail <= self.taken:
                return False
            for r in range(self.taken, tail):
                src, t, index = ring[(self.s, self.m)].read(r)
                assert (src, index) == (self.s, r)
                if proto.routing[src][t, self.rank]:
                    got.setdefault(self.rank, []).append((src, t))
            self.taken = tail
            heads[(self.s, self.m, self.j)] = tail
            return True

    proto.schedule([Sender(s, m) for s in range(R) for m in range(M)] +
                   [Receiver(x, s) for x in range(R) for s in range(R)])
    return got


def _run_combine(proto):
    """Pushers (x, reducer l), reducers (m, l) over the linear order of sources (0..M-1, l),
    receivers (source): returns {source: [(token, node, the local ranks summed)]}."""
    L, M, R = proto.local, proto.nodes, proto.ranks
    rings, pushes = proto.combine_rings, proto.pushes
    fifo = {(red, j): _RingSlot(pushes.ring) for red in range(R) for j in range(L)}
    progress = {(red, j): 0 for red in range(R) for j in range(L)}
    fifo_head = {(red, j): 0 for red in range(R) for j in range(L)}
    partial = {(s, m): _RingSlot(rings.ring) for s in range(R) for m in range(M)}   # on the source s
    staged = {(s, m): _RingSlot(rings.stage) for s in range(R) for m in range(M)}
    tails = {(s, m): 0 for s in range(R) for m in range(M)}
    src_heads = {(s, m): 0 for s in range(R) for m in range(M)}
    out = {}

    def order(red):
        """The reducer's linear order: (source, record index, token) of sources (n, l), n ascending."""
        m, l = divmod(red, L)
        return [(n * L + l, k, t) for n in range(M) for k, t in enumerate(proto.streams[(n * L + l, m)])]

    class Pusher:
        def __init__(self, x, l):
            self.x, (self.m, self.j) = x, divmod(x, L)
            self.red = self.m * L + l
            lin = order(self.red)
            self.rows = [q for q, (s, _, t) in enumerate(lin) if proto.routing[s][t, x]]
            self.total, self.next, self.written, self.published = len(lin), 0, 0, -1

        def done(self):
            return self.next == len(self.rows) and self.published == self.total

        def step(self):
            key = (self.red, self.j)
            moved = False
            batch = min(pushes.chunk, fifo_head[key] + pushes.ring - self.written)
            for _ in range(max(batch, 0)):
                if self.next == len(self.rows):
                    break
                fifo[key].write(self.written, self.rows[self.next], fifo_head[key])
                self.written, self.next, moved = self.written + 1, self.next + 1, True
            q = self.rows[self.next] if self.next < len(self.rows) else self.total
            if q != self.published:
                progress[key] = self.published = q
                moved = True
            return moved

    class Reducer:
        def __init__(self, red):
            self.red, (self.m, self.l) = red, divmod(red, L)
            self.lin, self.q, self.taken = order(red), 0, [0] * L

        def done(self):
            return self.q == len(self.lin)

        def step(self):
            s, k, _ = self.lin[self.q]
            n = s // L
            count = len(proto.streams[(s, self.m)])
            window = rings.ring if n == self.m else rings.stage
            ready = min(progress[(self.red, j)] for j in range(L)) - self.q
            room = src_heads[(s, self.m)] + window - k
            end = k + min(count - k, rings.chunk, ready, room)
            if end <= k:
                return False
            for kk in range(k, end):
                _, _, t = self.lin[self.q]
                present = []
                for j in range(L):
                    entry = fifo[(self.red, j)].read(self.taken[j])
                    if entry == self.q:   # the tag of this index
                        present.append(j)
                        self.taken[j] += 1
                assert present == [j for j in range(L) if proto.routing[s][t, self.m * L + j]]
                value = (t, self.m, tuple(present))
                if n != self.m:
                    staged[(s, self.m)].write(kk, value, src_heads[(s, self.m)])
                partial[(s, self.m)].write(kk, value, src_heads[(s, self.m)])
                self.q += 1
            for j in range(L):
                fifo_head[(self.red, j)] = self.taken[j]
            tails[(s, self.m)] = end
            return True

    class SourceReceiver:
        """A round of min(8 warps, stage) tokens at a time; consumed counts handed back per round."""
        def __init__(self, s, channel_tokens):
            self.s, self.tokens, self.i = s, channel_tokens, 0
            self.round = min(8, rings.stage)

        def done(self):
            return self.i == len(self.tokens)

        def index(self, t, m):
            return proto.streams[(self.s, m)].index(t)

        def step(self):
            batch = self.tokens[self.i:self.i + self.round]
            pairs = [(t, m) for t in batch for m in range(M) if t in proto.streams[(self.s, m)]]
            if any(tails[(self.s, m)] <= self.index(t, m) for t, m in pairs):
                return False
            for t, m in pairs:
                value = partial[(self.s, m)].read(self.index(t, m))
                assert value[:2] == (t, m)
                out.setdefault(self.s, []).append(value)
                src_heads[(self.s, m)] = self.index(t, m) + 1
            self.i += len(batch)
            return True

    tokens = {s: [t for t in sorted({t for m in range(M) for t in proto.streams[(s, m)]})] for s in range(R)}
    proto.schedule([Pusher(x, l) for x in range(R) for l in range(L)] + [Reducer(r) for r in range(R)] +
                   [SourceReceiver(s, tokens[s]) for s in range(R)])
    return out


@pytest.mark.parametrize("ranks, local, seed", [(2, 1, 0), (4, 2, 1), (4, 1, 2), (6, 3, 3), (8, 2, 4), (8, 4, 5)])
def test_streaming_protocol_finishes_and_never_overwrites(ranks, local, seed):
    """Rings far smaller than the streams (ring 3 or 4, chunk 2, FIFO 3), N differing by rank, N = 0 on
    some: under random interleavings every stream of every channel finishes, no slot is reused
    before its readers consumed it, every rank receives exactly its rows and every source gets one
    partial per (token, node reached) holding the local ranks the token went to."""
    rng = random.Random(seed)
    tokens = [rng.choice([0, 1, 9, 40]) for _ in range(ranks)]
    routing = _random_routing(ranks, tokens, rng)
    channels = 3
    rings, combine_rings, pushes = plan.dispatch_rings(4, 2), plan.combine_rings(6, 2), plan.push_rings(3, 2)
    assert (rings.stage, combine_rings.ring, combine_rings.stage) == (4, 3, 3)
    for c in range(channels):
        proto = _Protocol(routing, local, channels, c, rings, combine_rings, pushes, rng)
        got = _run_dispatch(proto)
        for x in range(ranks):
            want = sorted((s, t) for s in range(ranks) for t in _channel_tokens(tokens[s], channels, c)
                          if routing[s][t, x])
            assert sorted(got.get(x, [])) == want
        partials = _run_combine(proto)
        for s in range(ranks):
            want = [(t, m, tuple(j for j in range(local) if routing[s][t, m * local + j]))
                    for t in _channel_tokens(tokens[s], channels, c) for m in range(ranks // local)
                    if routing[s][t, m * local:(m + 1) * local].any()]
            assert partials.get(s, []) == want


# ---- the protocol, re-derived in Python ---------------------------------------------------------
def _notify_tables(is_token_in_rank, rank_prefix, rank, local, chunks):
    """notify_kernel's send_rdma_head [N, M], rdma_channel_prefix [M, G+1], send_nvl_head [N, R]."""
    n, ranks = is_token_in_rank.shape
    nodes = ranks // local
    tpc = plan.tokens_per_channel(n, chunks)
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
