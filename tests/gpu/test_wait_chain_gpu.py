"""The Guard's chain of waits (cuda_src/common/timeout.cuh, "notes"), one process: a kernel plays
rank 0 of a 3-rank world whose buffers are three blocks of this GPU's memory (mapped peers), and
waits for peer 1, which never answers. What it records, and when, depends on the note of rank 1
that reaches rank 0 while it waits: none (it names rank 1 at its deadline), or any (rank 1 is
waiting: rank 0 waits one more bound, so rank 1's own report, naming the culprit, reaches it
first; at the second bound it names rank 1), a note naming rank 0 included (flow control makes
waits look circular). A note left from before the kernel does not count. Runs on every rank of a
GPU session, each alone.

The kernel waits while this process's other stream writes what peers would: every such write is
made once before the launch, so its kernel is loaded (CUDA loads kernels lazily, and a load waits
for the kernels already running: this one, which would then never see the write)."""
from __future__ import annotations

import ctypes
import time

import pytest
import torch

from epcomm.runtime import cuda_decls, status
from tests.helpers.kernels import build_test_kernel

pytestmark = pytest.mark.gpu

CHAIN_SRC = r"""
#include "common/timeout.cuh"
namespace epcomm {
struct ChainParams {
    unsigned int *flag;
    unsigned int *notes;
    ErrorRecord *err;
    const long long *peer_bases;
    const unsigned int *ready;
    unsigned long long timeout_ns;
    int rank;
    int num_ranks;
    int peer;
};
// One thread waits through a Guard, as every kernel's waits do, for *ready from `peer` (every
// thread makes the Guard: block 0's clear the notes).
__global__ void wait_for_peer(const __grid_constant__ ChainParams p) {
    const Guard g = Guard::make(p.flag, p.notes, p.err, p.timeout_ns, 0, p.rank, p.peer_bases, p.num_ranks);
    if (threadIdx.x != 0) return;
    g.wait(p.peer, 0, [&] { return *reinterpret_cast<const volatile unsigned int *>(p.ready) != 0u; });
}
}
"""


class ChainParams(ctypes.Structure):
    _fields_ = [("flag", ctypes.c_void_p), ("notes", ctypes.c_void_p), ("err", ctypes.c_void_p),
                ("peer_bases", ctypes.c_void_p), ("ready", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64),
                ("rank", ctypes.c_int), ("num_ranks", ctypes.c_int), ("peer", ctypes.c_int)]


RANKS, WAITER, PEER, THIRD = 3, 0, 1, 2
WORDS, NOTES = 16, 4            # a rank's buffer: u32 words, the flag at 0, notes[R] from word 4
TIMEOUT_S = 1.0
_C = cuda_decls.header("common/timeout.cuh")   # the Guard's words, as the kernel declares them
REPORT, RANK_BITS, FLAG_LOCAL = _C.constant("kReport"), _C.constant("kReportRankBits"), _C.constant("kFlagLocal")


def report_word(reporter: int, culprit: int) -> int:
    return REPORT | (reporter << RANK_BITS) | culprit


@pytest.fixture(scope="module")
def kernel(dist_env):
    return build_test_kernel("wait_chain.cu", CHAIN_SRC, "epcomm::wait_for_peer", dist_env.device.index)


def wait_for_the_silent_peer(kernel, device, peer_note=None, report_after_s=None, stale_note=None):
    """(ErrorRecord fields, the three buffers, seconds until the kernel ended) of rank 0's wait for
    rank 1. `peer_note`: rank 1's note, landing in rank 0's buffer a quarter of the bound after the
    launch; `report_after_s`: rank 1's report (naming rank 2) lands in rank 0's flag that long
    after the launch; `stale_note`: rank 1's note as rank 0's buffer holds it before the launch."""
    buffers = torch.zeros(RANKS, WORDS, dtype=torch.int32, device=device)
    buffers[WAITER, NOTES + PEER].fill_(stale_note or 0)   # also loads the fills made while it waits
    buffers[WAITER, 0].fill_(0)
    record = torch.zeros(8, dtype=torch.int32, device=device)
    ready = torch.zeros(1, dtype=torch.int32, device=device)
    bases = torch.tensor([buffers[r].data_ptr() for r in range(RANKS)], dtype=torch.int64, device=device)
    params = ChainParams(buffers[WAITER].data_ptr(), buffers[WAITER, NOTES:].data_ptr(), record.data_ptr(),
                         bases.data_ptr(), ready.data_ptr(), int(TIMEOUT_S * 1e9), WAITER, RANKS, PEER)
    waiting, telling = torch.cuda.Stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    began = time.monotonic()
    kernel.launch((1, 1, 1), (32, 1, 1), params, waiting.cuda_stream)
    with torch.cuda.stream(telling):   # the kernel holds one SM: the fills run beside it
        if peer_note is not None:
            time.sleep(TIMEOUT_S / 4)
            buffers[WAITER, NOTES + PEER].fill_(peer_note)
        if report_after_s is not None:
            time.sleep(max(0.0, report_after_s - (time.monotonic() - began)))
            buffers[WAITER, 0].fill_(_i32(report_word(PEER, THIRD)))
    waiting.synchronize()
    seconds = time.monotonic() - began
    torch.cuda.synchronize(device)
    code, op, rank, peer, phase, reporter = record.cpu().tolist()[:6]
    return dict(code=code, rank=rank, peer=peer, reporter=reporter), buffers.cpu(), seconds


def _u32(value: int) -> int:
    return value & 0xffffffff


def _i32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def test_a_peer_without_a_note_is_named_at_the_deadline(kernel, dist_env):
    got, buffers, seconds = wait_for_the_silent_peer(kernel, dist_env.device)
    assert got == dict(code=status.CODE_PEER_TIMEOUT, rank=WAITER, peer=PEER, reporter=-1), got
    assert TIMEOUT_S <= seconds < 1.75 * TIMEOUT_S, seconds
    # Half way, rank 0 told every peer whom it waits for; at the deadline, that it failed.
    for r in range(RANKS):
        assert buffers[r, NOTES + WAITER].item() == PEER + 1, (r, buffers[r].tolist())
    assert buffers[WAITER, 0].item() == FLAG_LOCAL
    for r in (PEER, THIRD):
        assert _u32(buffers[r, 0].item()) == report_word(WAITER, PEER), (r, buffers[r].tolist())


def test_a_peer_waiting_for_a_third_rank_is_given_one_more_bound(kernel, dist_env):
    """Rank 1's report (it timed out waiting for rank 2) comes after rank 0's deadline: rank 0,
    still waiting, records it, naming rank 2 as rank 1 did."""
    got, _, seconds = wait_for_the_silent_peer(kernel, dist_env.device, peer_note=THIRD + 1,
                                               report_after_s=1.4 * TIMEOUT_S)
    assert got == dict(code=status.CODE_PEER_REPORTED_TIMEOUT, rank=WAITER, peer=THIRD, reporter=PEER), got
    assert 1.4 * TIMEOUT_S <= seconds < 2 * TIMEOUT_S + 1.0, seconds


def test_the_second_bound_is_a_bound(kernel, dist_env):
    got, _, seconds = wait_for_the_silent_peer(kernel, dist_env.device, peer_note=THIRD + 1)
    assert got == dict(code=status.CODE_PEER_TIMEOUT, rank=WAITER, peer=PEER, reporter=-1), got
    assert 2 * TIMEOUT_S <= seconds < 2 * TIMEOUT_S + 1.0, seconds


def test_a_note_from_before_the_kernel_does_not_count(kernel, dist_env):
    got, _, seconds = wait_for_the_silent_peer(kernel, dist_env.device, stale_note=THIRD + 1)
    assert got == dict(code=status.CODE_PEER_TIMEOUT, rank=WAITER, peer=PEER, reporter=-1), got
    assert TIMEOUT_S <= seconds < 1.75 * TIMEOUT_S, seconds


def test_a_peer_waiting_for_this_rank_is_given_one_more_bound(kernel, dist_env):
    got, _, seconds = wait_for_the_silent_peer(kernel, dist_env.device, peer_note=WAITER + 1)
    assert got == dict(code=status.CODE_PEER_TIMEOUT, rank=WAITER, peer=PEER, reporter=-1), got
    assert 2 * TIMEOUT_S <= seconds < 2 * TIMEOUT_S + 1.0, seconds
