"""No silent failure on the CPU backend: every wait on a peer is bounded by EPCOMM_TIMEOUT_S, an
error that one rank sees (its own bad input, or a rule the exchanged data breaks there) raises on
every rank, arguments that must agree across ranks are checked, and the Buffer stays usable after
every error that is not a timeout.

One run of 3 gloo processes goes through every case; each case builds its Buffer on a FRESH gloo
group (dist.new_group), because a timed-out wait makes gloo close that group's connections.
run_ranks' timeout bounds the whole run, so a case that hangs fails instead of blocking.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tests.conftest import run_ranks
from tests.helpers.validation import expect as _raises

R = 3
TIMEOUT_S = 2.0
H, K = 128, 2
T = 4                       # num_max_dispatch_tokens_per_rank
E = 2 * R


def _fresh_group():
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo")


def _tokens(rank, n=T):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    return x, idx, torch.rand(n, K, generator=g)


def _normal_round_trip(buf, rank):
    """A valid dispatch + combine: combine(dispatch(x)) sums each token once per rank it reached."""
    x, idx, w = _tokens(rank)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=idx, topk_weights=w)
    combined, _, _ = buf.combine(recv_x, handle)
    expected = x.float() * in_rank.sum(1, keepdim=True)
    assert torch.allclose(combined.float(), expected, rtol=1e-2, atol=1e-2)
    return handle


def _ll_round_trip(buf, rank, num_experts=E):
    x, idx, w = _tokens(rank)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, num_experts, use_fp8=False)
    combined, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    expected = (x.float() * (w * (idx >= 0)).sum(1, keepdim=True))
    assert torch.allclose(combined.float(), expected, rtol=2e-2, atol=2e-2)


def _buffer(group, **kwargs):
    from epcomm import Buffer
    rdma = Buffer.get_low_latency_rdma_size_hint(T, H, R, 2 * E)
    return Buffer(group, 1 << 20, rdma, low_latency_mode=True, explicitly_destroy=True, **kwargs)


# ---- cases ---------------------------------------------------------------------------------------
def _case_peer_never_calls(rank, world):
    """The last rank skips a dispatch: every other rank raises PeerTimeout naming it, and the Buffer
    is unusable afterwards, recover() included (the group's connections to the peer are gone)."""
    from epcomm.errors import BufferUnusable, PeerTimeout
    buf = _buffer(_fresh_group())
    x, idx, w = _tokens(rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    if rank == world - 1:
        time.sleep(TIMEOUT_S + 1)   # never calls; the others give up meanwhile
        return
    start = time.monotonic()
    error = _raises(lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w),
                    PeerTimeout, "Buffer.dispatch", f"rank {rank}", f"peer {world - 1}")
    assert (error.op, error.rank, error.peer, error.timeout_s) == ("Buffer.dispatch", rank, world - 1, TIMEOUT_S)
    assert time.monotonic() - start >= TIMEOUT_S * 0.9, "raised before the bound ran out"
    _raises(lambda: buf.get_dispatch_layout(idx, E), BufferUnusable, "unusable")
    _raises(buf.recover, BufferUnusable, "Buffer.recover: the CPU backend cannot recover", "new process group")


def _case_rank_rejects_its_input(rank, world):
    """Rank 0 passes a bad x: it raises its own TypeError, the others PeerFailed naming rank 0 (no
    timeout); then the same Buffer serves valid calls on every rank (after a recover(), which
    the GPU needs and the CPU backend accepts)."""
    from epcomm.errors import PeerFailed
    buf = _buffer(_fresh_group())
    x, idx, w = _tokens(rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    bad_x = x.float() if rank == 0 else x
    call = lambda: buf.dispatch(bad_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,  # noqa: E731
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    if rank == 0:
        _raises(call, TypeError, "Buffer.dispatch: x")
    else:
        error = _raises(call, PeerFailed, "Buffer.dispatch", "rank 0", "x must be")
        assert (error.rank, error.peer) == (rank, 0)
    # the same in low-latency mode
    _raises(lambda: buf.low_latency_dispatch(bad_x, idx, T, E, use_fp8=False),
            TypeError if rank == 0 else PeerFailed, "Buffer.low_latency_dispatch")
    # recover() is collective on both backends; here it only meets (nothing to clear). Its own
    # arguments rejected on rank 0 reach the others like any call's
    for bad, error in ((0, ValueError), ("1", TypeError)):
        if rank == 0:
            _raises(lambda: buf.recover(timeout_s=bad), error, "Buffer.recover: timeout_s must be")
        else:
            _raises(lambda: buf.recover(timeout_s=1.5), PeerFailed, "Buffer.recover", "rank 0", "timeout_s must be")
    buf.recover()
    _normal_round_trip(buf, rank)
    _ll_round_trip(buf, rank)
    buf.destroy()


def _case_data_dependent_errors(rank, world):
    """Errors only the receiving rank can see raise on every rank, and the Buffer stays usable."""
    from epcomm.errors import PeerFailed
    buf = _buffer(_fresh_group())
    # low-latency: rank 0 sends each of its T tokens twice to expert 0 (duplicate top-k ids), 2T rows
    # for one source where T fit; only rank 0 (expert 0's owner) counts them
    x, idx, w = _tokens(rank)
    dup = torch.zeros_like(idx) if rank == 0 else idx
    try:
        buf.low_latency_dispatch(x, dup, T, E, use_fp8=False)
        raise AssertionError("duplicate experts beyond T were accepted")
    except (ValueError, PeerFailed) as e:
        assert "num_max_dispatch_tokens_per_rank" in str(e), e
        assert isinstance(e, ValueError) == (rank == 0), f"rank {rank} raised {type(e).__name__}"
    _ll_round_trip(buf, rank)
    # normal mode: num_worst_tokens=1 where every rank receives more than one row
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    try:
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=1)
        raise AssertionError("num_worst_tokens smaller than the received rows was accepted")
    except (ValueError, PeerFailed) as e:
        assert "num_worst_tokens" in str(e), e
    _normal_round_trip(buf, rank)
    buf.destroy()


def _case_cross_rank_mismatches(rank, world):
    """Collective arguments that differ between ranks raise ValueError naming them on every rank."""
    buf = _buffer(_fresh_group())
    x, idx, w = _tokens(rank)
    _raises(lambda: buf.low_latency_dispatch(x, idx, T, E if rank else 2 * E, use_fp8=False),
            ValueError, "Buffer.low_latency_dispatch", "num_experts must be equal on every rank")
    _raises(lambda: buf.low_latency_dispatch(x[:T - 1], idx[:T - 1], T if rank else T - 1, E, use_fp8=False),
            ValueError, "num_max_dispatch_tokens_per_rank must be equal on every rank")
    _raises(lambda: buf.low_latency_dispatch(x, idx[:, :1].contiguous() if rank == 0 else idx, T, E, use_fp8=False),
            ValueError, "num_topk must be equal on every rank")
    _raises(lambda: buf.clean_low_latency_buffer(T, H, E) if rank == 0 else
            buf.low_latency_dispatch(x, idx, T, E, use_fp8=False),
            ValueError, "the ranks are in different calls")
    _ll_round_trip(buf, rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    x_rank = torch.cat([x, x], 1) if rank == world - 1 else x
    _raises(lambda: buf.dispatch(x_rank, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w),
            ValueError, "Buffer.dispatch", "hidden must be equal on every rank")
    _normal_round_trip(buf, rank)
    buf.destroy()
    # EPCOMM_NUM_LOCAL_RANKS: 1 on rank 0, R elsewhere
    os.environ["EPCOMM_NUM_LOCAL_RANKS"] = "1" if rank == 0 else str(R)
    try:
        _raises(lambda: _buffer(_fresh_group()), ValueError, "EPCOMM_NUM_LOCAL_RANKS must be equal on every rank")
    finally:
        del os.environ["EPCOMM_NUM_LOCAL_RANKS"]


def _case_rebuilt_handles(rank, world):
    """A handle rebuilt as a new tuple is checked in full: a faithful copy works, one with
    is_token_in_rank inverted (or a shortened row list) is rejected, naming the element."""
    for internode in (False, True):
        if internode:
            os.environ["EPCOMM_NUM_LOCAL_RANKS"] = "1"
        try:
            buf = _buffer(_fresh_group())
        finally:
            os.environ.pop("EPCOMM_NUM_LOCAL_RANKS", None)
        handle = _normal_round_trip(buf, rank)
        x, _, _ = _tokens(rank)
        copy = tuple(handle)
        recv_x, *_ = buf.dispatch(x, handle=copy)
        combined, _, _ = buf.combine(recv_x, copy)
        in_rank_index = 0 if internode else 4
        inverted = list(copy)
        inverted[in_rank_index] = ~copy[in_rank_index]
        for bad in (tuple(inverted), list(inverted)):
            _raises(lambda: buf.combine(recv_x, bad), ValueError, "Buffer.combine: handle is not a consistent",
                    "is_token_in_rank" if not internode else "handle[")
            _raises(lambda: buf.dispatch(x, handle=bad), ValueError, "Buffer.dispatch: handle is not a consistent")
        if not internode:
            short = list(copy)
            short[3] = copy[3][:-1]
            _raises(lambda: buf.combine(recv_x[:-1], tuple(short)), ValueError, "handle[3] (recv_src_idx)")
        _normal_round_trip(buf, rank)
        buf.destroy()


def _case_lesser_items(rank, world):
    """Each misuse gets an error naming the argument or what is expected."""
    from epcomm import Buffer, EventOverlap
    buf = _buffer(_fresh_group())
    x, idx, w = _tokens(rank)
    _raises(lambda: buf.get_dispatch_layout(idx, 2 ** 40), ValueError, "num_experts must be at most")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    _raises(lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                 num_worst_tokens=2 ** 40), ValueError, "num_worst_tokens must be at most")
    _raises(lambda: buf.low_latency_dispatch(x, idx, T, 2 ** 40 * R, use_fp8=False), ValueError,
            "num_experts must be at most")
    _raises(lambda: buf.get_dispatch_layout(idx, E, previous_event=EventOverlap(object()), async_finish=True),
            TypeError, "previous_event must wrap a torch.cuda.Event")
    # low-latency combine with fewer top-k rows than dispatched: the returned handle knows N; a
    # rebuilt tuple is caught where the rows come back, on every rank
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    _raises(lambda: buf.low_latency_combine(recv, idx[:-1], w[:-1], handle), ValueError,
            "topk_idx must have the 4 rows of the low_latency_dispatch")
    _raises(lambda: buf.low_latency_combine(recv, idx[:-1], w[:-1], tuple(handle)), ValueError,
            "topk_idx has 3 rows")
    _ll_round_trip(buf, rank)
    # a cached dispatch with a shortened handle names the handle, not num_worst_tokens
    handle = _normal_round_trip(buf, rank)
    short = list(handle)
    short[3] = handle[3][:-1]
    error = _raises(lambda: buf.dispatch(x, handle=tuple(short)), ValueError, "handle[3] (recv_src_idx)")
    assert "num_worst_tokens" not in str(error), error
    buf.destroy()
    os.environ["EPCOMM_BACKEND"] = "gpu"
    try:
        _raises(lambda: Buffer(_fresh_group(), 1 << 20), RuntimeError, "needs CUDA", "EPCOMM_BACKEND=cpu")
    finally:
        os.environ["EPCOMM_BACKEND"] = "cpu"


def _case_once_per_shape_agreement(rank, world):
    """The GPU Buffer's once-per-argument-set check (epcomm.agreement), here over the process
    store: equal sets pass, a differing one raises ValueError naming it on every rank, a rank that
    does not join in time is named on every rank, itself too when it comes late, and the group
    stays usable (a timed-out collective would have stayed queued there, blocking the next one)."""
    from epcomm.agreement import agree
    from epcomm.errors import PeerTimeout
    from epcomm.runtime.rendezvous import group_rendezvous
    group, names = _fresh_group(), ("num_experts", "use_fp8")
    meeting = group_rendezvous(group, "test-agreement")
    agree(meeting, "Buffer.low_latency_dispatch", names, (E, True), TIMEOUT_S)
    _raises(lambda: agree(meeting, "Buffer.low_latency_dispatch", names, (E * (1 + (rank == 1)), True), TIMEOUT_S),
            ValueError, "Buffer.low_latency_dispatch: num_experts must be equal on every rank",
            f"[{E}, {2 * E}, {E}]")
    late = world - 1
    if rank == late:
        time.sleep(TIMEOUT_S + 0.5)
    began = time.monotonic()
    error = _raises(lambda: agree(meeting, "Buffer.low_latency_dispatch", names, (E, True), TIMEOUT_S),
                    PeerTimeout, "agree on the arguments")
    assert error.peer == late, error
    if rank == late:
        assert "gave up waiting for rank" in str(error) and time.monotonic() - began < TIMEOUT_S / 2, error
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    assert total.item() == world


def _case_host_memory_is_lazy(rank, world):
    """A GPU-sized num_nvl_bytes costs no host memory until viewed; a view that cannot fit says so."""
    from epcomm import Buffer
    buf = Buffer(_fresh_group(), 1 << 50, 0, explicitly_destroy=True)
    _raises(lambda: buf.get_local_buffer_tensor(torch.uint8), MemoryError, "num_nvl_bytes", str(1 << 50))
    buf.destroy()


def _all_cases(rank, world, group):
    os.environ["EPCOMM_TIMEOUT_S"] = str(TIMEOUT_S)
    for case in (_case_rank_rejects_its_input, _case_data_dependent_errors, _case_cross_rank_mismatches,
                 _case_rebuilt_handles, _case_lesser_items, _case_host_memory_is_lazy,
                 _case_once_per_shape_agreement, _case_peer_never_calls):
        try:
            case(rank, world)
        except BaseException as e:
            raise AssertionError(f"{case.__name__} on rank {rank}: {e}") from e


def test_failure_semantics_cpu():
    run_ranks(_all_cases, R, timeout=240)


def test_gpu_failure_patterns_read_as_nan_and_minus_one():
    """The bytes the GPU poison launch writes into a failed call's outputs (epcomm/ops/poison.py)
    read as NaN in every floating-point output dtype and as -1 in the integer ones."""
    from epcomm.ops.poison import pattern
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32, torch.int64):
        raw = torch.tensor(list(pattern(dtype).to_bytes(4, "little")) * 4, dtype=torch.uint8)
        values = raw.view(dtype)
        if dtype.is_floating_point:
            assert torch.isnan(values.float()).all(), (dtype, values)
        else:
            assert (values == -1).all(), (dtype, values)
