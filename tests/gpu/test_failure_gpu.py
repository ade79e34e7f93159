"""No silent failure on the GPU (marker gpu, collective, any R >= 2; run with make test-gpu).

The last rank skips a call; on every other rank the call's waits run out after EPCOMM_TIMEOUT_S:
  * the call's outputs read NaN (floating point) and -1 (counts, top-k ids) once the stream got
    past it, whatever the caller queued after it (ops/poison.py);
  * PeerTimeout (op, rank, peer = the skipper) comes from Buffer.check_errors, the next call, an
    event wait, or, with EPCOMM_SYNC_CALLS=1, the call itself; BufferUnusable afterwards.
Each test prints the seconds from the call to the raise on each waiting rank (for the run's notes).
Recovery: after such a failure (a peer that came too late, or one that rejected its own input)
every rank calls Buffer.recover() and the same Buffer's next round trip is bit-exact against the
oracle; a rank that never joins the recovery is named by PeerTimeout on the others.
"""
from __future__ import annotations

import time

import pytest
import torch

from epcomm.reference import oracle
from tests.conftest import on_all_ranks
from tests.helpers.gpu import (all_inputs, check, combine_inputs, dev, dispatch_errors, expected_dispatch,
                               row_diff, run_dispatch)

pytestmark = pytest.mark.gpu

TIMEOUT_S = 3.0
HIDDEN = 1024


def _skipper(dist_env) -> int:
    if dist_env.world_size < 2:
        pytest.skip("needs 2 or more ranks")
    return dist_env.world_size - 1


def _shape(dist_env):
    """(N, E, K) from R: 4 experts per rank, top-k up to 8."""
    experts = 4 * dist_env.world_size
    return 128, experts, min(8, experts)


def _cpu_inputs(dist_env, seed: int, rank: int):
    """Rank `rank`'s (x, topk_idx, topk_weights) on the CPU: any rank can rebuild any rank's."""
    n, experts, k = _shape(dist_env)
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    x = torch.randn(n, HIDDEN, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    return x, idx, weights


def _inputs(dist_env, seed: int):
    return tuple(t.to(dist_env.device) for t in _cpu_inputs(dist_env, seed, dist_env.rank))


def _buffer(dist_env, low_latency: bool, sync_calls: bool = False):
    import epcomm
    n, experts, _ = _shape(dist_env)
    world = dist_env.world_size
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EPCOMM_TIMEOUT_S", str(TIMEOUT_S))
        if sync_calls:
            patch.setenv("EPCOMM_SYNC_CALLS", "1")
        if low_latency:
            rdma = epcomm.Buffer.get_low_latency_rdma_size_hint(n, HIDDEN, world, experts)
            return epcomm.Buffer(dist_env.group, num_rdma_bytes=rdma, low_latency_mode=True, explicitly_destroy=True)
        nvl = epcomm.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(HIDDEN * 2, world)
        return epcomm.Buffer(dist_env.group, num_nvl_bytes=nvl, explicitly_destroy=True)


def _dispatch(buf, dist_env, inputs, async_finish: bool = False):
    """Intranode dispatch with num_worst_tokens (no host read of the counts: nothing syncs)."""
    x, idx, weights = inputs
    n, experts, _ = _shape(dist_env)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=weights, num_worst_tokens=n * dist_env.world_size,
                        async_finish=async_finish)


def _ll_dispatch(buf, dist_env, inputs, return_recv_hook: bool = False):
    x, idx, _ = inputs
    n, experts, _ = _shape(dist_env)
    return buf.low_latency_dispatch(x, idx, n, experts, use_fp8=False, return_recv_hook=return_recv_hook)


def _release(dist_env, buf) -> None:
    """Every rank is alive and its kernels finished: destroy's meeting finds them all after the
    failure, so teardown is collective."""
    torch.cuda.synchronize()
    _destroy(dist_env, buf)


def _destroy(dist_env, buf) -> None:
    torch.cuda.synchronize()
    dist_env.barrier()
    buf.destroy()


def _round_trip(buf, dist_env, inputs, low_latency: bool):
    """Dispatch then combine of the received rows, with no host synchronisation in between (the
    combine's own start check may already raise a failure of the dispatch)."""
    if low_latency:
        recv, _, handle, _, _ = _ll_dispatch(buf, dist_env, inputs)
        buf.low_latency_combine(recv, inputs[1], inputs[2], handle)
    else:
        recv_x, _, _, _, handle, _ = _dispatch(buf, dist_env, inputs)
        buf.combine(recv_x, handle)


def _warm(dist_env, buf, low_latency: bool) -> None:
    """One valid call on every rank (kernels built, peers in step), then meet."""
    _round_trip(buf, dist_env, _inputs(dist_env, seed=1), low_latency)
    torch.cuda.synchronize()
    buf.check_errors()
    dist_env.barrier()


def _all_nan(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool(torch.isnan(t.float()).all())


def _after_skip(dist_env, skipper, waiting_rank_check) -> None:
    """waiting_rank_check() on every rank but the skipper, failing on all ranks together."""
    def check():
        if dist_env.rank != skipper:
            waiting_rank_check()
    on_all_ranks(dist_env, check)


def _expect_timeout(dist_env, skipper, raiser, began: float, op_word: str) -> None:
    from epcomm.errors import PeerTimeout
    with pytest.raises(PeerTimeout) as caught:
        raiser()
    seconds, error = time.monotonic() - began, caught.value
    print(f"rank {dist_env.rank}: PeerTimeout {seconds:.2f} s after the call (EPCOMM_TIMEOUT_S={TIMEOUT_S:g}): "
          f"{error}")
    assert error.rank == dist_env.rank and error.peer == skipper and op_word in error.op, repr(error)
    assert seconds <= TIMEOUT_S + 1.0 + 2.0, f"PeerTimeout {seconds:.1f} s after the call"


@pytest.mark.parametrize("low_latency", [False, True], ids=["intranode", "low_latency"])
def test_skipped_call_poisons_outputs_and_raises(dist_env, low_latency):
    from epcomm.errors import BufferUnusable
    skipper = _skipper(dist_env)
    buf = _buffer(dist_env, low_latency)
    _warm(dist_env, buf, low_latency)
    inputs = _inputs(dist_env, seed=2)

    def waiting_rank():
        began = time.monotonic()
        if low_latency:
            recv_x, recv_count, _, _, _ = _ll_dispatch(buf, dist_env, inputs)
            torch.cuda.synchronize()
            assert _all_nan(recv_x), "recv_x of a timed-out low-latency dispatch is not all NaN"
            assert bool((recv_count == -1).all()), f"recv_count {recv_count.tolist()} (want -1 everywhere)"
        else:
            recv_x, recv_idx, recv_weights, _, _, _ = _dispatch(buf, dist_env, inputs)
            torch.cuda.synchronize()
            assert _all_nan(recv_x) and _all_nan(recv_weights), "outputs of a timed-out dispatch are not all NaN"
            assert bool((recv_idx == -1).all()), "recv_topk_idx of a timed-out dispatch is not all -1"
        _expect_timeout(dist_env, skipper, buf.check_errors, began, "dispatch")
        with pytest.raises(BufferUnusable):
            buf.get_dispatch_layout(inputs[1], _shape(dist_env)[1])
    _after_skip(dist_env, skipper, waiting_rank)
    _release(dist_env, buf)


def test_sync_calls_raise_at_the_call(dist_env):
    """EPCOMM_SYNC_CALLS=1: the timed-out call raises PeerTimeout itself."""
    skipper = _skipper(dist_env)
    buf = _buffer(dist_env, low_latency=False, sync_calls=True)
    _warm(dist_env, buf, low_latency=False)
    inputs = _inputs(dist_env, seed=3)
    _after_skip(dist_env, skipper,
                lambda: _expect_timeout(dist_env, skipper, lambda: _dispatch(buf, dist_env, inputs),
                                        time.monotonic(), "dispatch"))
    _release(dist_env, buf)


@pytest.mark.parametrize("path", ["event", "hook"])
def test_event_and_hook_paths_raise(dist_env, path):
    """An async call's event, or a low-latency recv hook, reports the failure like a call."""
    skipper = _skipper(dist_env)
    low_latency = path == "hook"
    buf = _buffer(dist_env, low_latency)
    _warm(dist_env, buf, low_latency)
    inputs = _inputs(dist_env, seed=4)

    def waiting_rank():
        began = time.monotonic()
        if path == "event":
            *_, event = _dispatch(buf, dist_env, inputs, async_finish=True)
            torch.cuda.synchronize()
            _expect_timeout(dist_env, skipper, event.current_stream_wait, began, "dispatch")
        else:
            recv_x, recv_count, _, _, hook = _ll_dispatch(buf, dist_env, inputs, return_recv_hook=True)
            hook()    # the receive part's waits run out
            torch.cuda.synchronize()
            assert _all_nan(recv_x) and bool((recv_count == -1).all()), "hooked outputs not poisoned"
            _expect_timeout(dist_env, skipper, buf.check_errors, began, "dispatch")
    _after_skip(dist_env, skipper, waiting_rank)
    _release(dist_env, buf)


def test_low_latency_mismatched_arguments_raise_on_every_rank(dist_env):
    """Odd ranks pass twice the experts, or one token fewer per rank as T: ValueError naming the
    argument on every rank (checked once per argument set), and the Buffer then serves valid calls."""
    import epcomm
    if dist_env.world_size < 2:
        pytest.skip("needs 2 or more ranks")
    n, experts, k = _shape(dist_env)
    odd = dist_env.rank % 2 == 1
    rdma = epcomm.Buffer.get_low_latency_rdma_size_hint(n, HIDDEN, dist_env.world_size, 2 * experts)
    buf = epcomm.Buffer(dist_env.group, num_rdma_bytes=rdma, low_latency_mode=True, explicitly_destroy=True)
    x, idx, weights = _inputs(dist_env, seed=6)

    def every_rank_raises():
        with pytest.raises(ValueError, match="num_experts must be equal on every rank"):
            buf.low_latency_dispatch(x, idx, n, 2 * experts if odd else experts, use_fp8=False)
        with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank must be equal on every rank"):
            buf.low_latency_dispatch(x[:n - 1], idx[:n - 1], n - 1 if odd else n, experts, use_fp8=False)
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, experts, use_fp8=False)
        combined, _, _ = buf.low_latency_combine(recv, idx, weights, handle)
        expected = x.float() * weights.sum(1, keepdim=True)
        assert torch.allclose(combined.float(), expected, rtol=2e-2, atol=2e-2)
    on_all_ranks(dist_env, every_rank_raises)
    _destroy(dist_env, buf)


def test_rebuilt_handle_is_checked_in_full(dist_env):
    """A copy of a real handle passes the full check and combines like the original; one with
    is_token_in_rank inverted is rejected before any launch, naming it, on every rank."""
    buf = _buffer(dist_env, low_latency=False)
    x, idx, weights = _inputs(dist_env, seed=7)

    def every_rank():
        recv_x, _, _, _, handle, _ = _dispatch(buf, dist_env, (x, idx, weights))
        combined, _, _ = buf.combine(recv_x, handle)
        again, _, _ = buf.combine(recv_x, tuple(handle))
        assert torch.equal(combined, again), "a faithful copy of the handle combined differently"
        inverted = list(handle)
        inverted[4] = ~handle[4]
        with pytest.raises(ValueError, match="handle is not a consistent dispatch handle"):
            buf.combine(recv_x, tuple(inverted))
        torch.cuda.synchronize()
        buf.check_errors()
    on_all_ranks(dist_env, every_rank)
    _destroy(dist_env, buf)


def test_valid_calls_are_not_poisoned(dist_env):
    """The poison launch after every call leaves valid outputs alone (a round trip stays exact)."""
    buf = _buffer(dist_env, low_latency=False)
    x, idx, weights = _inputs(dist_env, seed=5)

    def round_trip():
        recv_x, _, recv_weights, _, handle, _ = _dispatch(buf, dist_env, (x, idx, weights))
        combined, _, _ = buf.combine(recv_x, handle)
        torch.cuda.synchronize()
        buf.check_errors()
        assert not torch.isnan(recv_x.float()).any() and not torch.isnan(combined.float()).any()
        _, _, _, in_rank, _ = buf.get_dispatch_layout(idx, _shape(dist_env)[1])
        expected = x.float() * in_rank.sum(1, keepdim=True)
        assert torch.allclose(combined.float(), expected, rtol=1e-2, atol=1e-2)
    on_all_ranks(dist_env, round_trip)
    _destroy(dist_env, buf)


# ---- recovery ---------------------------------------------------------------------------------------
def _normal_round_trip_errors(dist_env, buf, seed: int):
    """A dispatch and a weighted combine, both bit-exact against the oracle (the problems found)."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    n, experts, k = _shape(dist_env)
    inputs = all_inputs(dist_env, [n] * world, seed=seed, hidden=HIDDEN, num_experts=experts, num_topk=k)
    got = run_dispatch(buf, inputs[rank], device, False)
    errors = dispatch_errors(got, expected_dispatch(inputs, rank, experts, False), False)
    xs, ws = combine_inputs(inputs, world, experts)
    combined, weights, _ = buf.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device))
    want_x, want_w = oracle.combine(xs, [i.layout[3] for i in inputs], rank, ws)
    errors += [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)]
    return [e for e in errors if e]


def _ll_round_trip_errors(dist_env, buf, seed: int):
    """A BF16 low-latency dispatch and the combine of its received rows, bit-exact against the
    oracle (every rank's inputs rebuilt here, so no gather is needed)."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    n, experts, _ = _shape(dist_env)
    everyone = [_cpu_inputs(dist_env, seed, r) for r in range(world)]
    x, idx, weights = (t.to(device) for t in everyone[rank])
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, n, experts, use_fp8=False)
    combined, _, _ = buf.low_latency_combine(recv_x, idx, weights, handle)
    torch.cuda.synchronize()
    wants = [oracle.low_latency_dispatch([e[0] for e in everyone], [e[1] for e in everyone], n, experts, r,
                                         use_fp8=False) for r in range(world)]
    want = wants[rank]
    errors = []
    if not torch.equal(recv_count.cpu(), want["recv_count"]):
        errors.append(f"recv_count {recv_count.tolist()} != oracle {want['recv_count'].tolist()}")
    else:
        for e, count in enumerate(want["recv_count"].tolist()):
            errors += [row_diff(f"recv_x of local expert {e}", recv_x[e, :count], want["recv_x"][e, :count]),
                       row_diff(f"src_info of local expert {e}", handle[0][e, :count], want["src_info"][e, :count])]
    want_x = oracle.low_latency_combine([w["recv_x"] for w in wants],
                                        [(w["src_info"], w["layout_range"], n, HIDDEN, experts) for w in wants],
                                        everyone[rank][1], everyone[rank][2], rank)
    errors.append(row_diff("combined_x", combined, want_x))
    return [e for e in errors if e]


def _recovered_round_trip(dist_env, buf, low_latency: bool, seed: int, began: float, problems):
    """recover() on this rank (timed), then the checked round trip; problems collects what failed."""
    try:
        buf.recover()
    except Exception as e:
        problems.append(f"recover() raised {e!r}")
        return
    print(f"rank {dist_env.rank}: recovered {time.monotonic() - began:.2f} s after the failed call", flush=True)
    problems += (_ll_round_trip_errors if low_latency else _normal_round_trip_errors)(dist_env, buf, seed)


@pytest.mark.parametrize("low_latency", [False, True], ids=["intranode", "low_latency"])
def test_buffer_recovers_after_a_late_peer(dist_env, low_latency):
    """The last rank sleeps past EPCOMM_TIMEOUT_S before its round trip: every rank raises
    PeerTimeout (the waiting ranks naming the sleeper), every rank calls recover(), and the same
    Buffer's next round trip is bit-exact against the oracle; teardown is collective again."""
    from epcomm.errors import PeerTimeout
    sleeper = _skipper(dist_env)
    buf = _buffer(dist_env, low_latency)
    _warm(dist_env, buf, low_latency)
    inputs, problems = _inputs(dist_env, seed=8), []
    began = time.monotonic()
    if dist_env.rank == sleeper:
        time.sleep(TIMEOUT_S + 0.5)
    try:
        _round_trip(buf, dist_env, inputs, low_latency)
        buf.check_errors(synchronize=True)
        problems.append("the round trip raised nothing")
    except PeerTimeout as e:
        seconds = time.monotonic() - began
        print(f"rank {dist_env.rank}: PeerTimeout {seconds:.2f} s after the call "
              f"({'slept first' if dist_env.rank == sleeper else 'waited'}): {e}", flush=True)
        if dist_env.rank != sleeper and (e.peer != sleeper or seconds > TIMEOUT_S + 3.0):
            problems.append(f"PeerTimeout names peer {e.peer} (want {sleeper}) after {seconds:.1f} s")
    _recovered_round_trip(dist_env, buf, low_latency, seed=9, began=began, problems=problems)
    check(dist_env, problems, "recovery after a late peer")
    _destroy(dist_env, buf)


@pytest.mark.parametrize("low_latency", [False, True], ids=["intranode", "low_latency"])
def test_rank_that_rejects_its_input_leaves_peers_bounded_and_buffers_recoverable(dist_env, low_latency):
    """Rank 0 passes x as float32: a TypeError on rank 0 before any launch. Its peers' kernels wait
    for it and raise PeerTimeout naming rank 0 within the bound (the GPU backend has no host
    exchange to hear of the rejection); then every rank calls recover() and the Buffers serve a
    bit-exact round trip."""
    from epcomm.errors import PeerTimeout
    _skipper(dist_env)
    buf = _buffer(dist_env, low_latency)
    _warm(dist_env, buf, low_latency)
    x, idx, weights = _inputs(dist_env, seed=10)
    problems, began = [], time.monotonic()
    if dist_env.rank == 0:
        with pytest.raises(TypeError, match="x"):
            _round_trip(buf, dist_env, (x.float(), idx, weights), low_latency)
        buf.check_errors(synchronize=True)   # the rejection left this rank's Buffer untouched
    else:
        try:
            _round_trip(buf, dist_env, (x, idx, weights), low_latency)
            buf.check_errors(synchronize=True)
            problems.append("the peers of a rank that rejected its input raised nothing")
        except PeerTimeout as e:
            seconds = time.monotonic() - began
            print(f"rank {dist_env.rank}: PeerTimeout {seconds:.2f} s after the call: {e}", flush=True)
            if e.peer != 0 or seconds > TIMEOUT_S + 3.0:
                problems.append(f"PeerTimeout names peer {e.peer} (want 0) after {seconds:.1f} s")
    _recovered_round_trip(dist_env, buf, low_latency, seed=11, began=began, problems=problems)
    check(dist_env, problems, "rejected input, then recovery")
    _destroy(dist_env, buf)


def test_recovery_names_a_rank_that_never_joins(dist_env):
    """The last rank does not call recover(): the others raise PeerTimeout naming it within the
    meeting's bound, and their Buffer stays unusable (a later recover() too)."""
    from epcomm.errors import BufferUnusable, PeerTimeout
    absent = _skipper(dist_env)
    buf = _buffer(dist_env, low_latency=False)
    _warm(dist_env, buf, low_latency=False)
    bound = 1.0

    def waiting_rank():
        began = time.monotonic()
        with pytest.raises(PeerTimeout) as caught:
            buf.recover(timeout_s=bound)
        seconds = time.monotonic() - began
        print(f"rank {dist_env.rank}: recover() raised {seconds:.2f} s in: {caught.value}", flush=True)
        assert caught.value.peer == absent and seconds <= bound + 1.0, (caught.value, seconds)
        with pytest.raises(BufferUnusable, match="found a rank missing"):
            buf.recover()
        with pytest.raises(BufferUnusable):
            buf.get_dispatch_layout(_inputs(dist_env, seed=12)[1], _shape(dist_env)[1])
    _after_skip(dist_env, absent, waiting_rank)
    _release(dist_env, buf)


# ---- ranks sharing a GPU without an SM partition ---------------------------------------------------
def _poison_report(outputs: dict) -> tuple:
    """(problems, summary) for the outputs of a failed call: floating point all NaN, integer all -1."""
    problems, said = [], []
    for name, t in outputs.items():
        if t is None:
            continue
        ok = _all_nan(t) if t.dtype.is_floating_point else t.numel() > 0 and bool((t == -1).all())
        said.append(f"{name} {'all NaN' if t.dtype.is_floating_point else 'all -1'}" if ok else f"{name} NOT poisoned")
        if not ok:
            problems.append(f"{name} of the failed call is not all {'NaN' if t.dtype.is_floating_point else '-1'}")
    return problems, ", ".join(said)


@pytest.mark.parametrize("low_latency", [False, True], ids=["intranode", "low_latency"])
def test_oversubscribed_shared_gpu_raises_on_every_rank(dist_env, low_latency):
    """Run only in a session without an SM partition:
        python -m tests.gpu_session --ranks-per-gpu 8 --gpus 1 --no-sm-partition --log-dir DIR -- \\
            -q -rs -s -m gpu tests/gpu/test_failure_gpu.py -k oversubscribed
    Every rank sees all SMs, so the ranks' grids (normal mode: Buffer.num_sms blocks per rank;
    low latency: one block per SM) cannot all be resident: peers wait for blocks that never run.
    Each rank must raise PeerTimeout within EPCOMM_TIMEOUT_S + 1 s of its round trip, every output
    of the failed call reads NaN / -1, and it prints one MPS-REPRO line of what it saw. A first
    round trip builds the kernels (it may fail the same way; recover() follows it); recover()
    after the measured one makes the teardown collective again."""
    import os
    from epcomm.errors import EpcommError, PeerTimeout
    if os.environ.get("EPCOMM_TEST_MPS_UNPARTITIONED") != "1" or not dist_env.shared_gpu:
        pytest.skip("the oversubscription reproduction needs ranks sharing a GPU without an SM partition "
                    "(python -m tests.gpu_session --ranks-per-gpu N --no-sm-partition)")
    _skipper(dist_env)
    mode = "low_latency" if low_latency else "intranode"
    buf = _buffer(dist_env, low_latency)
    try:
        _round_trip(buf, dist_env, _inputs(dist_env, seed=13), low_latency)   # builds the kernels
        buf.check_errors(synchronize=True)
    except EpcommError:
        pass
    buf.recover(timeout_s=300.0)   # the ranks built their kernels at different speeds
    dist_env.barrier()

    x, idx, weights = _inputs(dist_env, seed=14)
    problems, began, dispatched, combined = [], time.monotonic(), {}, {}
    try:   # the combine's start check may already see the dispatch's failure
        if low_latency:
            recv_x, recv_count, handle, _, _ = _ll_dispatch(buf, dist_env, (x, idx, weights))
            dispatched.update(recv_x=recv_x, recv_count=recv_count)
            combined["combined_x"] = buf.low_latency_combine(recv_x, idx, weights, handle)[0]
        else:
            recv_x, recv_idx, recv_weights, _, handle, _ = _dispatch(buf, dist_env, (x, idx, weights))
            dispatched.update(recv_x=recv_x, recv_topk_idx=recv_idx, recv_topk_weights=recv_weights)
            combined["combined_x"] = buf.combine(recv_x, handle)[0]
        buf.check_errors(synchronize=True)
        seconds = time.monotonic() - began
        line = f"no error after {seconds:.2f} s (the grids were resident after all)"
        problems.append(f"the round trip raised nothing ({seconds:.2f} s)")
    except PeerTimeout as e:
        seconds = time.monotonic() - began
        torch.cuda.synchronize()
        failed = {**combined, **(dispatched if "dispatch" in e.op else {})}
        poison_problems, summary = _poison_report(failed)
        problems += poison_problems
        if seconds > TIMEOUT_S + 1.0:
            problems.append(f"PeerTimeout {seconds:.2f} s after the call, past EPCOMM_TIMEOUT_S + 1 s")
        line = f"PeerTimeout after {seconds:.2f} s: {e}; outputs of the failed call: {summary}"
    print(f"MPS-REPRO rank {dist_env.rank}/{dist_env.world_size} {mode} (EPCOMM_TIMEOUT_S={TIMEOUT_S:g}): {line}",
          flush=True)
    buf.recover()
    check(dist_env, problems, f"{mode} round trip on an oversubscribed GPU")
    _destroy(dist_env, buf)
