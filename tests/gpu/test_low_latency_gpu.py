"""Low-latency dispatch / combine on the GPU through the public Buffer API, checked against
epcomm.reference.oracle on all-gathered inputs: dispatched rows, scales, counts, handles bit for
bit; combine bit for bit against oracle.ll_combine_rows and, as DeepEP checks it, by calc_diff
against sum_k w_k * x. Collective: run every rank under torchrun (`make test-gpu`, or
torchrun --nproc_per_node=2 -m pytest -q -rs -m gpu tests/gpu/test_low_latency_gpu.py).

Each test starts with clean_low_latency_buffer (collective), so a failed test does not poison the
next one. Buffers are shared per set of constructor flags and destroyed at the end of the module
(tests/helpers/low_latency.py, tests/gpu/conftest.py).
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from epcomm.ops.low_latency_layout import RECORD_BYTES, Layout
from tests.helpers.low_latency import (ALL_SHAPES, CASES, FP8_TARGET, POOL, SMALL, TARGET, Case, bits,
                                       case_inputs, check_combine, check_dispatch, checked_round_trip,
                                       combine_input, experts_for, first_mismatch, gather, say,
                                       shared_buffer, verdict)

pytestmark = pytest.mark.gpu


# ---- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
def test_dispatch_combine_match_oracle(dist_env, case):
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    if case.E % dist_env.world_size:
        pytest.skip(f"E={case.E} does not split over {dist_env.world_size} ranks")
    verdict(dist_env, checked_round_trip(dist_env, buf, case), str(case))


@pytest.mark.parametrize("mode", ["hook", "async"])
def test_hook_and_async_modes(dist_env, mode):
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    problems = []
    for i, case in enumerate((FP8_TARGET, replace(FP8_TARGET, fp8=False))):
        problems += checked_round_trip(dist_env, buf, case, seed=10 + i, mode=mode)
    verdict(dist_env, problems, f"{mode} mode")


def test_zero_copy_and_out(dist_env):
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    problems = checked_round_trip(dist_env, buf, FP8_TARGET, seed=3, zero_copy=True, use_out=True)
    problems += checked_round_trip(dist_env, buf, FP8_TARGET, seed=4, zero_copy=True, mode="hook", clean=False)
    verdict(dist_env, problems, "zero-copy / out=")


def test_back_to_back_calls_without_clean(dist_env):
    """Many calls on alternating buffer sets, each checked: the device-side call counts stay in step."""
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    problems = []
    for i in range(6):
        problems += checked_round_trip(dist_env, buf, replace(SMALL, fp8=bool(i % 2)), seed=20 + i, clean=i == 0,
                         mode=("sync", "hook", "async")[i % 3])
    verdict(dist_env, problems, "back-to-back calls")


def test_stale_bytes_in_record_slots_are_never_taken_for_records(dist_env):
    """The combine's top-k records are stamped words read without a tag (cuda_src/low_latency.cu):
    bytes left in their slots must never pass for this call's record. Before each checked call both
    sets' record slots on every rank are filled with such bytes: random words, and words whose high
    half is a small integer (what a raw epoch stamp would have taken for its own)."""
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    dev, problems = dist_env.device, []

    def fill(case, seed):
        layout = Layout(case.T, case.H, dist_env.world_size, case.E)
        n = dist_env.world_size * case.T * RECORD_BYTES // 8
        g = torch.Generator(device=dev).manual_seed(seed)
        for s in (0, 1):
            words = buf.get_local_buffer_tensor(torch.int64, (n,), layout.records(s), use_rdma_buffer=True)
            words.random_(generator=g)
            small = torch.randint(0, 1024, ((n + 1) // 2,), device=dev, generator=g)
            words[::2] = (small << 32) | (words[::2] & 0xffffffff)
        torch.cuda.synchronize()
        dist_env.barrier()   # every rank's slots are filled before any rank's combine writes them

    for i, case in enumerate((FP8_TARGET, replace(SMALL, fp8=False))):
        buf.clean_low_latency_buffer(case.T, case.H, case.E)
        for j in range(3):   # epochs 1, 2 of each set: the stamps of a fresh buffer and of later calls
            fill(case, 1000 * dist_env.rank + 10 * i + j)
            problems += checked_round_trip(dist_env, buf, case, seed=60 + 10 * i + j, clean=False)
    verdict(dist_env, problems, "stale record bytes")


def test_shape_change_needs_clean(dist_env):
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    checked_round_trip(dist_env, buf, SMALL)
    other = replace(SMALL, T=32, N=(32,))
    x, topk_idx, _ = (t.to(dist_env.device) for t in case_inputs(other, dist_env.rank, 0))
    with pytest.raises(ValueError, match="clean_low_latency_buffer"):
        buf.low_latency_dispatch(x, topk_idx, other.T, other.E)
    with pytest.raises(NotImplementedError, match="use_logfmt"):
        buf.low_latency_combine(torch.zeros(SMALL.E // dist_env.world_size, dist_env.world_size * SMALL.T,
                                            SMALL.H, dtype=torch.bfloat16, device=dist_env.device),
                                topk_idx[:, :SMALL.K], torch.ones(topk_idx.shape[0], SMALL.K, device=dist_env.device),
                                (torch.zeros(SMALL.E // dist_env.world_size, dist_env.world_size * SMALL.T,
                                             dtype=torch.int32, device=dist_env.device),
                                 torch.zeros(SMALL.E // dist_env.world_size, dist_env.world_size, dtype=torch.int64,
                                             device=dist_env.device), SMALL.T, SMALL.H, SMALL.E),
                                use_logfmt=True)
    dist_env.barrier()


def test_combine_uses_its_own_weights_and_slots(dist_env):
    """The expert ranks sum with each combine call's own top-k weights and slots (sent with the
    call), never with an earlier call's: one dispatch, then three combines of its output (the
    first and the third on the same buffer set) with new weights each, the third also with slots
    dropped (-1) after the dispatch; each bit for bit against the oracle."""
    case, rank, num_ranks, dev = FP8_TARGET, dist_env.rank, dist_env.world_size, dist_env.device
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    buf.clean_low_latency_buffer(case.T, case.H, case.E)
    inputs = gather(case_inputs(case, rank, 60))
    x, topk_idx, _ = (t.to(dev) for t in inputs[rank])
    (recv_x, scales), count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, case.T, case.E)
    torch.cuda.synchronize()
    problems, _ = check_dispatch(case, rank, num_ranks, inputs, (recv_x, scales, count, handle, None))
    x_c = combine_input(case, rank, num_ranks, recv_x, scales, count)
    gen = torch.Generator().manual_seed(61 + rank)
    for i in range(3):
        idx = inputs[rank][1]
        weights = torch.rand(idx.shape, generator=gen) * 2 + 0.05
        if i == 2:
            idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.3, -1)
        combined, _, _ = buf.low_latency_combine(x_c, idx.to(dev), weights.to(dev), handle)
        torch.cuda.synchronize()
        now = list(inputs)
        now[rank] = (inputs[rank][0], idx, weights)
        problems += [f"combine {i}: {m}" for m in check_combine(case, rank, now, x_c, handle, combined)]
    verdict(dist_env, problems, "combine-time weights and slots")


def test_cuda_graph_replay(dist_env):
    """Capture dispatch + combine once; replay 100 times with new inputs copied in; check each."""
    case, rank, num_ranks, dev = SMALL, dist_env.rank, dist_env.world_size, dist_env.device
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    buf.clean_low_latency_buffer(case.T, case.H, case.E)
    static = [t.to(dev) for t in case_inputs(case, rank, 0)]

    def step():
        recv, count, handle, _, _ = buf.low_latency_dispatch(static[0], static[1], case.T, case.E)
        x_c = combine_input(case, rank, num_ranks, recv[0], recv[1], count)
        combined, _, _ = buf.low_latency_combine(x_c, static[1], static[2], handle)
        return recv, count, handle, x_c, combined

    step()                                   # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, count, handle, x_c, combined = step()
    problems = []
    for i in range(100):
        inputs = gather(case_inputs(case, rank, 100 + i))
        for dst, src in zip(static, inputs[rank]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        p, _ = check_dispatch(case, rank, num_ranks, inputs, (recv[0], recv[1], count, handle, None))
        p += check_combine(case, rank, inputs, x_c, handle, combined)
        problems += [f"replay {i}: {m}" for m in p]
        if not dist_env.all_ok(not p):
            break
    del graph
    verdict(dist_env, problems, "CUDA graph replay")


@pytest.mark.parametrize("case", [FP8_TARGET, CASES[5]], ids=str)
def test_put_path(dist_env, case):
    """allow_nvlink_for_low_latency_mode=False: NVSHMEM puts + signals even to NVLink peers."""
    if dist_env.world_size < 2:
        pytest.skip("needs 2 ranks")
    buf = shared_buffer(dist_env, shapes=[TARGET, dict(T=64, H=1032, E=CASES[5].E)], allow_nvlink_for_low_latency_mode=False)
    problems = checked_round_trip(dist_env, buf, case, seed=5)
    problems += checked_round_trip(dist_env, buf, case, seed=6, mode="hook", zero_copy=True, clean=False)
    problems += checked_round_trip(dist_env, buf, case, seed=7, clean=False)   # puts staged from a non-zero-copy x
    verdict(dist_env, problems, f"put path {case}")


def test_sm80_feature_set(dist_env):
    """EPCOMM_ARCH=sm80: the Ampere code path (software e4m3 rounding) on this GPU, bit for bit."""
    buf = shared_buffer(dist_env, env={"EPCOMM_ARCH": "sm80"})
    problems = []
    for case in (FP8_TARGET, replace(FP8_TARGET, round_scale=True, ue8m0=True), replace(FP8_TARGET, fp8=False)):
        problems += checked_round_trip(dist_env, buf, case, seed=8)
    verdict(dist_env, problems, "sm80 feature set")


SHRINK_CASE = Case(64, 2048, experts_for(16), 4, (64, 33))


def _masking(num_ranks: int, masked_by: dict) -> list:
    """Per rank, its rank mask as the oracle takes it: masked_by[r] = the ranks r masks."""
    masks = [torch.zeros(num_ranks, dtype=torch.int32) for _ in range(num_ranks)]
    for r, peers in masked_by.items():
        for peer in peers:
            masks[r][peer] = 1
    return masks


def test_shrink_masks_a_silent_peer(dist_env):
    """enable_shrink: the last rank skips a call; every other rank masks it after the timeout and
    completes without its experts; the mask shows it; after clean all work again. Explicit masks
    (every rank masks every other) need no timeout."""
    if dist_env.world_size < 2:
        pytest.skip("needs 2 or more ranks (one of them silent)")
    case, rank, num_ranks, dev = SHRINK_CASE, dist_env.rank, dist_env.world_size, dist_env.device
    silent = num_ranks - 1
    buf = shared_buffer(dist_env, shapes=[dict(T=case.T, H=case.H, E=case.E)], env={"EPCOMM_TIMEOUT_S": 2},
                  enable_shrink=True)
    buf.clean_low_latency_buffer(case.T, case.H, case.E)
    buf.low_latency_clean_mask_buffer()
    dist_env.barrier()
    problems = []
    mask = torch.zeros(num_ranks, dtype=torch.int32, device=dev)
    inputs = [case_inputs(case, r, 31) for r in range(num_ranks)]
    x, topk_idx, weights = (t.to(dev) for t in inputs[rank])
    masks = _masking(num_ranks, {r: [silent] for r in range(num_ranks) if r != silent})
    rows = None
    if rank != silent:
        start = time.monotonic()
        (recv_x, scales), count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, case.T, case.E)
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
        buf.low_latency_query_mask_buffer(mask)
        if mask.tolist() != masks[rank].tolist():
            problems.append(f"mask after the silent peer: {mask.tolist()}, want {masks[rank].tolist()}")
        p, _ = check_dispatch(case, rank, num_ranks, inputs, (recv_x, scales, count, handle, None), masks)
        problems += [f"masked dispatch: {m}" for m in p]
        x_c = combine_input(case, rank, num_ranks, recv_x, scales, count)
        combined, _, _ = buf.low_latency_combine(x_c, topk_idx, weights, handle)
        torch.cuda.synchronize()
        from epcomm.reference.oracle import ll_valid_rows
        rows = ll_valid_rows(x_c.cpu(), handle[0].cpu(), handle[1].cpu())
        say(f"shrink: dispatch with a silent peer finished after {elapsed:.1f} s (timeout 2 s)")
    every_rows = gather(rows)   # the silent rank joins here: it holds no rows
    if rank != silent:
        from epcomm.reference.oracle import ll_combine_rows
        empty = (torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, case.H, dtype=torch.bfloat16))
        every_rows = [empty if r is None else r for r in every_rows]
        want = ll_combine_rows(every_rows, topk_idx.cpu(), weights.cpu(), rank, case.E, masks)
        if not torch.equal(bits(combined.cpu()), bits(want)):
            problems.append(f"masked combine: {first_mismatch(combined.cpu().float(), want.float())}")
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(mask)
        if mask.tolist() != [0] * num_ranks:
            problems.append(f"mask after clean: {mask.tolist()}")
    dist_env.barrier()
    # Every rank masks every other explicitly: nobody waits, each keeps its own tokens only.
    buf.clean_low_latency_buffer(case.T, case.H, case.E)
    for peer in range(num_ranks):
        if peer != rank:
            buf.low_latency_update_mask_buffer(peer, True)
    masks = _masking(num_ranks, {r: [p for p in range(num_ranks) if p != r] for r in range(num_ranks)})
    problems += [f"explicit masks: {m}" for m in checked_round_trip(dist_env, buf, case, seed=32, rank_masks=masks, clean=False)]
    buf.low_latency_query_mask_buffer(mask)
    if mask.tolist() != masks[rank].tolist():
        problems.append(f"query after update: {mask.tolist()}, want {masks[rank].tolist()}")
    buf.low_latency_clean_mask_buffer()
    problems += [f"after clean: {m}" for m in checked_round_trip(dist_env, buf, case, seed=33)]
    verdict(dist_env, problems, "shrink")


MASKED_WAIT_TIMEOUT_S = 30   # no peer is silent here: ranks sharing a GPU may be seconds apart


def test_shrink_mask_between_dispatch_and_combine(dist_env):
    """Masks set after a dispatch (pairs of ranks 2i, 2i+1 mask each other; an odd last rank masks
    nobody): the combine adds no partial sum of a masked rank and nobody waits for one (a wait for
    a masked rank would last the whole timeout), bit for bit. The timeout is long, so a late peer
    is not masked by it (shrink masks a peer that times out)."""
    if dist_env.world_size < 2:
        pytest.skip("needs 2 or more ranks")
    case, rank, num_ranks, dev = SHRINK_CASE, dist_env.rank, dist_env.world_size, dist_env.device
    buf = shared_buffer(dist_env, shapes=[dict(T=case.T, H=case.H, E=case.E)],
                  env={"EPCOMM_TIMEOUT_S": MASKED_WAIT_TIMEOUT_S}, enable_shrink=True)
    buf.low_latency_clean_mask_buffer()
    problems = [f"unmasked warm-up: {m}" for m in checked_round_trip(dist_env, buf, case, seed=70)]
    inputs = gather(case_inputs(case, rank, 71))
    x, topk_idx, weights = (t.to(dev) for t in inputs[rank])
    (recv_x, scales), count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, case.T, case.E)
    torch.cuda.synchronize()
    mask = torch.zeros(num_ranks, dtype=torch.int32, device=dev)
    buf.low_latency_query_mask_buffer(mask)
    if mask.any():
        problems.append(f"the unmasked dispatch masked ranks {mask.nonzero().flatten().tolist()} (a peer "
                        f"later than the {MASKED_WAIT_TIMEOUT_S} s timeout)")
    p, _ = check_dispatch(case, rank, num_ranks, inputs, (recv_x, scales, count, handle, None))
    problems += [f"dispatch: {m}" for m in p]
    x_c = combine_input(case, rank, num_ranks, recv_x, scales, count)
    dist_env.barrier()   # every dispatch is complete before any mask is set
    partners = {r: [r ^ 1] if (r ^ 1) < num_ranks else [] for r in range(num_ranks)}
    for peer in partners[rank]:
        buf.low_latency_update_mask_buffer(peer, True)
    start = time.monotonic()
    combined, _, _ = buf.low_latency_combine(x_c, topk_idx, weights, handle)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    if elapsed > MASKED_WAIT_TIMEOUT_S / 3:
        problems.append(f"the masked combine took {elapsed:.2f} s (timeout {MASKED_WAIT_TIMEOUT_S} s): "
                        f"something waited for the masked rank")
    masks = _masking(num_ranks, partners)
    problems += [f"masked combine: {m}" for m in check_combine(case, rank, inputs, x_c, handle, combined, masks)]
    buf.low_latency_clean_mask_buffer()
    verdict(dist_env, problems, "mask between dispatch and combine")


def test_hook_overlap(dist_env):
    """Between the send launch and the hook no kernel holds an SM: a matmul launched there should
    take as long as alone. Both are timed warm (cuBLAS initialised, one untimed round of each first)
    and interleaved, so clocks and caches are alike; both times are reported (the evidence); only
    correctness is asserted."""
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    case, rank, dev = FP8_TARGET, dist_env.rank, dist_env.device
    buf.clean_low_latency_buffer(case.T, case.H, case.E)
    inputs = gather(case_inputs(case, rank, 40))
    x, topk_idx, _ = (t.to(dev) for t in inputs[rank])
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)

    def alone():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ a
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3, None

    def between():
        recv, count, handle, _, hook = buf.low_latency_dispatch(x, topk_idx, case.T, case.E, return_recv_hook=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()   # after the send kernel in stream order: only a resident receiver could slow the matmul
        a @ a
        end.record()
        hook()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3, (recv, count, handle)

    alone(), between()   # warm-up: cuBLAS handle and workspace, the kernels' first loads
    times = {"alone": [], "between": []}
    out = None
    for _ in range(10):
        times["alone"].append(alone()[0])
        us, out = between()
        times["between"].append(us)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    say(f"hook overlap: 4096^3 bf16 matmul, warm, median of 10: alone {med['alone']:.1f} us, "
         f"between send and hook {med['between']:.1f} us (ratio {med['between'] / med['alone']:.2f})")
    recv, count, handle = out
    problems, _ = check_dispatch(case, rank, dist_env.world_size, inputs, (recv[0], recv[1], count, handle, None))
    verdict(dist_env, problems, "hook overlap")


def names_the_silent_rank(error, rank: int, silent: int) -> bool:
    """A PeerTimeout of the silent-peer test names who failed to answer. A rank whose own wait ran
    out: the silent rank (or, for the silent rank itself, a rank that stopped sending once it had
    failed). A rank told by the rank that failed first (`reported_by`): that rank's culprit, the
    silent rank."""
    if error.reported_by is None:
        return error.peer == silent if rank != silent else 0 <= error.peer < silent
    return error.reported_by != silent and error.peer == silent


def test_peer_timeout_names_the_peer(dist_env):
    """Without shrink a silent peer is a PeerTimeout naming it, on each rank in turn; the Buffer is
    unusable afterwards. Every rank calls once first, so the argument set is agreed (a rank that
    skips its first call of a set is named by that meeting instead, tests/cpu/test_failure_semantics.py)
    and the timeout tested is the kernel's."""
    if dist_env.world_size < 2:
        pytest.skip("needs 2 or more ranks (one of them silent)")
    from epcomm.errors import BufferUnusable, PeerTimeout
    case, rank, dev = SHRINK_CASE, dist_env.rank, dist_env.device
    buf = shared_buffer(dist_env, shapes=[dict(T=case.T, H=case.H, E=case.E)], env={"EPCOMM_TIMEOUT_S": 2})
    buf.clean_low_latency_buffer(case.T, case.H, case.E)
    x, topk_idx, _ = (t.to(dev) for t in case_inputs(case, rank, 50))
    buf.low_latency_dispatch(x, topk_idx, case.T, case.E)   # every rank: agreed and built
    torch.cuda.synchronize()
    dist_env.barrier()
    errors = []

    def call_until_it_raises():
        """A timed-out call only records the failure; the next call raises it."""
        for _ in range(3):
            try:
                buf.low_latency_dispatch(x, topk_idx, case.T, case.E)
                torch.cuda.synchronize()
            except (PeerTimeout, BufferUnusable) as e:
                errors.append(e)
                break
        torch.cuda.synchronize()

    problems = []
    try:
        silent = dist_env.world_size - 1
        if rank != silent:   # the last rank is silent: the others' call times out waiting for it
            call_until_it_raises()
        dist_env.barrier()
        if rank == silent:   # its calls find the others' report, or wait in vain for their data
            call_until_it_raises()
        dist_env.barrier()
        first = errors[0] if errors else None
        if (not isinstance(first, PeerTimeout) or first.op != "low_latency_dispatch"
                or not names_the_silent_rank(first, rank, silent)):
            problems.append(f"want PeerTimeout(op=low_latency_dispatch) naming silent rank {silent}, got {first!r}")
        else:
            say(f"timeout reported as: {first}")
        try:
            buf.low_latency_dispatch(x, topk_idx, case.T, case.E)
            problems.append("the Buffer accepted a call after the timeout")
        except BufferUnusable:
            pass
    finally:
        POOL.forget(buf)
        torch.cuda.synchronize()
        buf.destroy()   # every rank is alive: destroy's meeting finds them all
    verdict(dist_env, problems, "peer timeout")
