"""Buffer.recover's and Buffer.destroy's host logic without a GPU: the bounded store rendezvous
(epcomm/runtime/rendezvous.py) on threads over one HashStore and on gloo processes over
torch.distributed's own store, GpuBackend.recover's steps on fakes of its device parts (order:
quiesce, meet, barrier, clear, barrier, reset; nothing cleared when a rank is missing), and
GpuBackend.destroy's (meet, then barrier and frees; none of them when a rank is missing). The GPU run of the same path is in
tests/gpu/test_failure_gpu.py; the CPU backend's recover() in tests/cpu/test_failure_semantics.py."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch
import torch.distributed as dist

from epcomm.errors import BufferUnusable, PeerTimeout
from epcomm.runtime.rendezvous import Rendezvous, group_rendezvous
from tests.conftest import run_ranks

BOUND_S = 0.3


def _meet_on_threads(num_ranks: int, delays, timeout_s: float = BOUND_S, prefix: str = "t"):
    """Each rank r meets after delays[r] seconds (None: never); -> {rank: (outcome, seconds in meet)}."""
    store, results = dist.HashStore(), {}

    def rank_main(rank):
        if delays[rank] is None:
            return
        time.sleep(delays[rank])
        began = time.monotonic()
        try:
            Rendezvous(store, prefix, rank, num_ranks).meet("Buffer.recover", "meet", timeout_s)
            results[rank] = ("met", time.monotonic() - began)
        except PeerTimeout as e:
            results[rank] = (e, time.monotonic() - began)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in meet()"
    return results


def test_every_rank_meets():
    results = _meet_on_threads(4, [0.0, 0.05, 0.1, 0.0])
    assert [results[r][0] for r in range(4)] == ["met"] * 4


def test_a_missing_rank_is_named_on_every_rank_within_the_bound():
    results = _meet_on_threads(3, [0.0, 0.0, None])
    for rank in (0, 1):
        error, seconds = results[rank]
        assert isinstance(error, PeerTimeout), results
        assert (error.op, error.rank, error.peer) == ("Buffer.recover", rank, 2), error
        assert BOUND_S * 0.9 <= seconds <= BOUND_S + 1.0, seconds


def test_a_rank_arriving_after_the_others_gave_up_raises_at_once():
    """Every rank follows the first decision written, so the late rank does not wait for ranks
    that already left (nor proceed without them)."""
    results = _meet_on_threads(2, [0.0, BOUND_S + 0.3])
    early, late = results[0][0], results[1]
    assert isinstance(early, PeerTimeout) and early.peer == 1, results
    assert isinstance(late[0], PeerTimeout), results
    assert late[0].peer == 1 and "rank 0 gave up waiting for rank 1" in str(late[0]), late[0]
    assert late[1] < BOUND_S, f"the late rank waited {late[1]:.2f} s for ranks that had left"


def test_successive_rounds_do_not_see_each_others_arrivals():
    store, met = dist.HashStore(), []

    def rank_main(rank, rounds):
        z = Rendezvous(store, "r", rank, 2)
        for _ in range(rounds):
            z.meet("op", "meet", BOUND_S)
            met.append(rank)
    # rank 1 meets once, rank 0 twice: round 1 must not be satisfied by round 0's arrivals
    t = threading.Thread(target=rank_main, args=(1, 1))
    t.start()
    with pytest.raises(PeerTimeout) as caught:
        rank_main(0, 2)
    t.join(5)
    assert sorted(met) == [0, 1] and caught.value.peer == 1


def _ranks_meet_over_the_process_store(rank, world, group):
    z = group_rendezvous(group, "test-recovery")
    z.meet("Buffer.recover", "meet", 10.0)
    z.meet("Buffer.recover", "meet", 10.0)
    if rank == world - 1:
        time.sleep(BOUND_S + 1.0)
        return
    with pytest.raises(PeerTimeout) as caught:
        z.meet("Buffer.recover", "meet", BOUND_S)
    assert caught.value.peer == world - 1


def test_rendezvous_over_torch_distributed_store():
    run_ranks(_ranks_meet_over_the_process_store, 2, timeout=120)


# ---- GpuBackend.recover on fakes ----------------------------------------------------------------------
class _FakeSymmetric:
    def __init__(self, nbytes: int, log=None):
        self.nbytes, self.memory, self.log = nbytes, torch.full((nbytes,), 0x5A, dtype=torch.uint8), log

    def free(self):
        self.log.steps.append(f"free {self.nbytes}")

    def view(self, dtype, shape, offset_bytes=0):
        count = math.prod(shape)
        return self.memory[offset_bytes:offset_bytes + count * dtype.itemsize].view(dtype).view(shape)


class _Log:
    def __init__(self, backend):
        self.backend, self.steps = backend, []

    def buffers_clear(self) -> bool:
        return all(not bool(b.memory.any()) for b in (self.backend.nvl, self.backend.rdma))


class _FakeNvshmem:
    def __init__(self, log):
        self.log, self.live, self.peer_missing = log, True, False

    def barrier_all(self):
        self.log.steps.append(f"barrier (buffers {'clear' if self.log.buffers_clear() else 'untouched'})")

    def remove_teardown(self, callback):
        self.log.steps.append("not at exit")


class _FakeStatus:
    timeout_s = BOUND_S

    def __init__(self, log):
        self.log, self.error = log, RuntimeError("the failure")

    def reset(self):
        self.log.steps.append("reset record")
        self.error = None


class _FakeLowLatency:
    def __init__(self, log):
        self.log = log

    def mask_state(self):
        self.log.steps.append("save mask")
        return "mask"

    def restart(self, mask):
        self.log.steps.append(f"restart ({mask} back, buffers {'clear' if self.log.buffers_clear() else 'untouched'})")


def _fake_backend(num_ranks: int = 1):
    from epcomm.gpu import GpuBackend
    gb = object.__new__(GpuBackend)
    log = _Log(gb)
    gb._destroyed, gb._unrecoverable = False, None
    gb.nvl, gb.rdma = _FakeSymmetric(256, log), _FakeSymmetric(512, log)
    gb.nvshmem, gb.status, gb._ll = _FakeNvshmem(log), _FakeStatus(log), _FakeLowLatency(log)
    gb._rendezvous = Rendezvous(dist.HashStore(), "fake", 0, num_ranks)
    gb._teardown = Rendezvous(dist.HashStore(), "fake-destroy", 0, num_ranks)
    gb._synchronize = lambda: log.steps.append("synchronize")
    return gb, log


def test_gpu_recover_clears_every_rank_state_between_two_barriers():
    gb, log = _fake_backend()
    gb.recover(None)
    assert log.steps == ["synchronize", "barrier (buffers untouched)", "save mask",
                         "restart (mask back, buffers clear)", "barrier (buffers clear)", "reset record"]
    assert gb.status.error is None and gb.nvshmem.peer_missing is False
    gb.recover(1.0)   # a healthy Buffer may recover again (a new round)
    assert gb._rendezvous.rounds == 2


def test_gpu_recover_with_a_missing_rank_clears_nothing_and_stays_unusable():
    gb, log = _fake_backend(num_ranks=2)
    began = time.monotonic()
    with pytest.raises(PeerTimeout) as caught:
        gb.recover(BOUND_S)
    assert caught.value.peer == 1 and time.monotonic() - began < BOUND_S + 1.0
    assert log.steps == ["synchronize"] and not log.buffers_clear() and gb.status.error is not None
    assert not gb.nvshmem.peer_missing, "a rank missing from recover() may be alive: destroy() still meets"
    with pytest.raises(BufferUnusable, match="Buffer.recover found a rank missing"):
        gb.check_errors()
    with pytest.raises(BufferUnusable, match="an earlier recovery found a rank missing"):
        gb.recover(None)
    gb.status.free = lambda: log.steps.append("free record")
    with pytest.warns(RuntimeWarning, match="waiting for peer 1"):   # destroy still meets the rank
        gb.destroy()
    assert log.steps[-3:] == ["not at exit", "synchronize", "free record"], log.steps
    with pytest.raises(BufferUnusable, match="destroyed"):
        gb.recover(None)


def test_gpu_recover_default_bound_is_twice_the_buffer_timeout():
    gb, _ = _fake_backend(num_ranks=2)
    began = time.monotonic()
    with pytest.raises(PeerTimeout) as caught:
        gb.recover(None)
    assert caught.value.timeout_s == 2 * BOUND_S and time.monotonic() - began >= 2 * BOUND_S * 0.9


def test_low_latency_restart_forgets_the_call_counts_and_keeps_the_mask():
    from epcomm.ops.low_latency import LowLatency
    ll = object.__new__(LowLatency)
    ll._mask = torch.zeros(4, dtype=torch.int32)
    ll.next_set, ll.signal_shape = 1, (128, 32)
    ll.restart(torch.tensor([0, 1, 0, 1], dtype=torch.int32))
    assert ll._mask.tolist() == [0, 1, 0, 1] and ll.next_set == 0 and ll.signal_shape is None


def test_gpu_destroy_meets_then_barriers_and_frees_once():
    gb, log = _fake_backend()
    gb.status.free = lambda: log.steps.append("free record")
    gb.destroy()
    gb.destroy()
    assert log.steps == ["not at exit", "synchronize", "barrier (buffers untouched)", "free 256", "free 512",
                         "free record"]
    assert gb.nvshmem.peer_missing is False and gb._teardown.rounds == 1


def test_gpu_destroy_with_a_missing_rank_takes_nothing_collective_and_names_it():
    """Whatever each rank saw of earlier failures, destroy decides from the meeting alone: a rank
    that does not come is named, nothing collective (barrier, collective free) is attempted, and
    the world remembers it, so a later Buffer's destroy does not meet again."""
    gb, log = _fake_backend(num_ranks=2)
    gb.status.free = lambda: log.steps.append("free record")
    with pytest.warns(RuntimeWarning, match="symmetric memory left to process exit .*waiting for peer 1"):
        gb.destroy()
    assert log.steps == ["not at exit", "synchronize", "free record"] and gb.nvshmem.peer_missing
    other, other_log = _fake_backend(num_ranks=2)
    other.nvshmem, other.status.free = gb.nvshmem, lambda: other_log.steps.append("free record")
    began = time.monotonic()
    other.destroy()
    assert other_log.steps == ["free record"] and time.monotonic() - began < BOUND_S / 2
