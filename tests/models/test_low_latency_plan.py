"""Low-latency plan arithmetic without compiling: shared memory fits a block, the RDMA size hint
covers a layout whose regions are aligned and disjoint, and a model of the combine send part's work
claims ends with any number of resident blocks (tests/compile/test_low_latency_compile.py checks the
formulas against the C++)."""
from __future__ import annotations

import itertools
import random

import pytest

from epcomm.ops import low_latency as ll
from epcomm.ops import low_latency_layout as lay

TARGET = dict(num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=2, num_experts=288)


def test_dispatch_shared_memory_fits_a_block():
    for hidden, topk, fp8 in itertools.product((8, 2048, 7168, 65536), (1, 8, 32), (True, False)):
        if fp8 and hidden % 128:
            continue
        smem = lay.dispatch_smem_bytes(hidden, topk, fp8)
        assert 0 < smem <= 227 * 1024 or lay.message_bytes(hidden, fp8) > lay.SMEM_BUDGET, (hidden, topk, fp8, smem)
        assert lay.tokens_per_round(hidden, topk, fp8) >= 1


def _regions(layout: lay.Layout):
    """(name, offset, bytes) of every region the kernels touch, for both sets."""
    T, H, R, E = layout.num_max_tokens, layout.hidden, layout.num_ranks, layout.num_experts
    out = [("mask", layout.mask, 4 * R), ("failed", layout.failed, 4), ("wait_notes", layout.wait_notes, 4 * R)]
    for s in (0, 1):
        out += [(f"acks{s}", layout.acks(s), 8 * R), (f"epochs{s}", layout.epochs(s), 16),
                (f"tickets{s}", layout.tickets(s), lay.TICKET_BYTES),
                (f"token_tags{s}", layout.token_tags(s), 8 * R * T), (f"record_tags{s}", layout.record_tags(s), 8 * R * T),
                (f"partial_tags{s}", layout.partial_tags(s), 8 * R * T),
                (f"list_tags{s}", layout.list_tags(s), 8 * E), (f"lists{s}", layout.lists(s), E * lay.list_bytes(T)),
                (f"combine_send{s}", layout.send(s), E * T * 2 * H),
                (f"message_stage{s}", layout.send(s), T * max(lay.message_bytes(H, H % 128 == 0), 2 * H)),
                (f"list_stage{s}", layout.list_stage(s), E * lay.list_bytes(T)),
                (f"messages{s}", layout.recv(s), R * T * max(lay.message_bytes(H, H % 128 == 0), 2 * H)),
                (f"partials{s}", layout.recv(s), R * T * 4 * H),
                (f"records{s}", layout.records(s), R * T * lay.RECORD_BYTES),
                (f"partial_stage{s}", layout.partial_stage(s), R * T * 4 * H),
                (f"record_stage{s}", layout.record_stage(s), T * lay.RECORD_BYTES)]
    return out


# Regions of one set that may share memory (never used by the same call): the send buffer holds
# the zero-copy combine input or dispatch's put stages; recv holds dispatch messages or the
# combine regions.
_SHARED_OK = {frozenset((a, b)) for a in ("combine_send",) for b in ("message_stage", "list_stage")} | \
    {frozenset(("messages", b)) for b in ("partials", "partial_stage", "record_stage")}


@pytest.mark.parametrize("T, H, R, E", [(128, 7168, 2, 288), (1, 8, 1, 1), (1024, 8192, 8, 256),
                                        (64, 1032, 2, 64), (256, 2176, 4, 12), (32, 256, 2, 2)])
def test_layout_regions_disjoint_aligned_and_inside_hint(T, H, R, E):
    layout = lay.Layout(T, H, R, E)
    total = lay.rdma_size_hint(T, H, R, E)
    assert total == layout.total_bytes and total % 128 == 0
    regions = _regions(layout)
    for name, offset, nbytes in regions:
        assert offset % 16 == 0, name
        assert 0 <= offset and offset + nbytes <= total, (name, offset, nbytes, total)
    for (a, ao, an), (b, bo, bn) in itertools.combinations(regions, 2):
        if ao < bo + bn and bo < ao + an:
            assert a[-1] == b[-1] and frozenset((a[:-1], b[:-1])) in _SHARED_OK, \
                f"{a} [{ao}, {ao + an}) overlaps {b} [{bo}, {bo + bn})"
    # clean_low_latency_buffer zeroes control and signals, and nothing of the data.
    assert layout.signals_end <= layout.send(0)
    assert layout.lists(1) + E * lay.list_bytes(T) <= layout.signals_end
    assert layout.records(1) + R * T * lay.RECORD_BYTES <= layout.signals_end   # zeroed by clean


def test_signals_do_not_move_with_hidden():
    a, b = lay.Layout(128, 7168, 2, 288), lay.Layout(128, 4096, 2, 288)
    assert [a.token_tags(s) for s in (0, 1)] == [b.token_tags(s) for s in (0, 1)]
    assert a.signals_end == b.signals_end and a.mask == b.mask


def test_rdma_size_hint_is_no_larger_than_deepep():
    """DeepEP V1 sizes both sets as 2 x (send + recv) of E*T messages; ours must not need more."""
    T, H, R, E = TARGET.values()
    scales = H // 128
    dispatch_msg = 16 + max(2 * H, H + 4 * scales)
    combine_msg = 4 * scales + 2 * H
    deepep = 2 * (max(T * dispatch_msg, E * T * combine_msg) + E * T * max(dispatch_msg, combine_msg)
                  + (E * 4 + 127) // 128 * 128)
    ours = lay.rdma_size_hint(T, H, R, E)
    assert ours <= deepep, (ours, deepep)
    # two sets of: the zero-copy rows, received + staged fp32 partials: nothing was forgotten
    assert ours >= 2 * (E * T * 2 * H + 2 * R * T * 4 * H)


def test_rdma_size_hint_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        lay.rdma_size_hint(128, 7168, 3, 256)
    with pytest.raises(ValueError, match="hidden"):
        lay.rdma_size_hint(128, 0, 2, 256)


def test_names_and_bounds_for_buffer():
    assert lay.MAX_TOPK == 32
    assert ll.SEND | ll.RECV == 3
    src = ll.dispatch_source(7168, 8, 2, 288, 128, True, False, False)
    assert src.uses_nvshmem and src.kernels == (
        "epcomm::ll::dispatch_kernel<7168, 8, 2, 288, 128, true, false, false, long long, 512>",)
    # round_scale / UE8M0 mean nothing without FP8 and must not create separate BF16 kernels
    assert ll.dispatch_source(1032, 8, 2, 64, 64, False, True, True) == ll.dispatch_source(1032, 8, 2, 64, 64, False,
                                                                                              False, False)


def _combine_send_model(rnd, ranks, grid, resident, tokens, warps, fused, claims=True):
    """The combine send part (then, fused, the receive part) on every rank, blocks scheduled at
    random with at most `resident` blocks of a rank running, the others started in blockIdx order
    as running ones exit (a launch that another kernel's SMs leave short). claims: records (`warps`
    units per step of a block: the kernel's warps each claim one), then items (one per claim) from
    the rank's counters, as the kernel; otherwise the old static split by blockIdx. Each item
    needs the source's record (not for this rank's own); a fused block then waits for every rank's
    partial of its tokens t = blockIdx + j * grid. -> True if every block finished."""
    record = [[False] * tokens for _ in range(ranks)]      # record[src][t] sent to every rank
    partial = [[[False] * tokens for _ in range(ranks)] for _ in range(ranks)]   # [expert rank][src][t]
    counters = [[0, 0] for _ in range(ranks)]
    blocks = [{"rank": r, "b": b, "phase": 0, "item": None, "units": None} for r in range(ranks) for b in range(grid)]
    waiting = {r: [blk for blk in blocks if blk["rank"] == r] for r in range(ranks)}
    running = []

    def units(blk, phase):   # the static split of the old kernel, per phase
        b = blk["b"]
        if phase == 0:
            return [t for w in range(warps) for t in range((warps - 1 - w) * grid + b, tokens, grid * warps)]
        return list(range(b, ranks * tokens, grid))

    def step(blk):   # one step of a running block; False if it is waiting
        rank, phase = blk["rank"], blk["phase"]
        if phase == 0:
            if claims:
                base = counters[rank][0]
                counters[rank][0] += warps
                if base >= tokens:
                    blk["phase"] = 1
                    return True
                got = range(base, min(base + warps, tokens))
            else:
                got = units(blk, 0)
                blk["phase"] = 1
            for t in got:
                record[rank][t] = True
            return True
        if phase == 1:
            if blk["item"] is None:
                if claims:
                    i = counters[rank][1]
                    counters[rank][1] += 1
                    if i >= ranks * tokens:
                        blk["phase"] = 2
                        return True
                else:
                    blk["units"] = units(blk, 1) if blk["units"] is None else blk["units"]
                    if not blk["units"]:
                        blk["phase"] = 2
                        return True
                    i = blk["units"].pop(0)
                blk["item"] = i
                return True
            i = blk["item"]
            src, t = (rank + 1 + i // tokens) % ranks, i % tokens
            if not record[src][t] and (src != rank or not claims):
                return False
            partial[rank][src][t] = True
            blk["item"] = None
            return True
        mine = list(range(blk["b"], tokens, grid)) if fused else []
        if all(partial[d][rank][t] for d in range(ranks) for t in mine):
            running.remove(blk)
            return True
        return False

    for _ in range(200_000):
        for r in range(ranks):
            while waiting[r] and sum(blk["rank"] == r for blk in running) < resident:
                running.append(waiting[r].pop(0))
        if not running:
            return True
        order = list(running)
        rnd.shuffle(order)
        if not any(step(blk) for blk in order):
            return False
    raise AssertionError("the model did not end")


@pytest.mark.parametrize("seed", range(30))
def test_combine_send_claims_progress_with_few_resident_blocks(seed):
    """Model of cuda_src/low_latency.cu's combine send part (claims: records, then items): with
    any number >= 1 of resident blocks per rank, in any order, every launch ends, fused or not. The
    old static split by blockIdx deadlocks in the same model once one block is resident and an item
    needs a record another block owns (the model can tell)."""
    rnd = random.Random(seed)
    shape = dict(ranks=rnd.randint(1, 3), grid=rnd.randint(2, 6), tokens=rnd.randint(1, 12), warps=rnd.randint(1, 3))
    for resident in (1, rnd.randint(1, shape["grid"]), shape["grid"]):
        for fused in (False, True):
            assert _combine_send_model(random.Random(seed * 7 + resident), resident=resident, fused=fused, **shape), \
                (shape, resident, fused)
    # 3 tokens on 2 blocks, statically: each rank's block 0 takes items 0, 2 and 4; item 4 is the
    # rank's own token 1, whose record (the old kernel waited for its own too) is block 1's, and
    # block 1 starts only once block 0 has ended.
    static = dict(ranks=2, grid=2, tokens=3, warps=1)
    for fused in (False, True):
        assert not _combine_send_model(random.Random(seed), resident=1, fused=fused, claims=False, **static)
        assert _combine_send_model(random.Random(seed), resident=2, fused=fused, claims=False, **static)
        assert _combine_send_model(random.Random(seed), resident=1, fused=fused, **static)
