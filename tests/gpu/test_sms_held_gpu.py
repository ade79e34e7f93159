"""The low-latency send parts while another kernel holds all SMs but a few (hook mode, a second
micro-batch on another stream): no block may wait for work that a later block would do.
Collective, as tests/gpu/test_low_latency_gpu.py; the SM holder is a test kernel built beside
cuda_src/ (tests/helpers/kernels.py). Skips where the premise cannot hold: ranks sharing a GPU
without an MPS partition, or other jobs sharing it (run with tests.gpu_session --jobs 1)."""
from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch

from tests import topology
from tests.helpers.kernels import build_test_kernel
from tests.helpers.low_latency import (ALL_SHAPES, FP8_TARGET, case_inputs, check_combine, check_dispatch,
                                       combine_input, gather, shared_buffer, verdict)

pytestmark = pytest.mark.gpu


HOLD_SRC = r"""
#include "common/ptx.cuh"
namespace epcomm {
struct HoldParams {
    const unsigned int *release; unsigned int *released; unsigned int *started; unsigned long long *ended_at;
    unsigned long long max_ns;
};
// Launched with all the dynamic shared memory a block may have: one block per SM and nothing else
// beside it. Counts itself in *started, then holds its SM until *release != 0 (counting itself in
// *released) or max_ns passed; *ended_at: the %globaltimer of the last block's end.
__global__ void hold_sms(const __grid_constant__ HoldParams p) {
    extern __shared__ unsigned int hold_smem[];
    if (threadIdx.x == 0) {
        atomicAdd(p.started, 1u);
        const unsigned long long start = globaltimer_ns();
        unsigned int flag = 0;
        while ((flag = *reinterpret_cast<const volatile unsigned int *>(p.release)) == 0 &&
               globaltimer_ns() - start < p.max_ns)
            __nanosleep(2000);
        hold_smem[0] = flag;
        if (flag != 0) atomicAdd(p.released, 1u);
        atomicMax(p.ended_at, globaltimer_ns());
    }
    __syncthreads();
}
}
"""
HOLD_MAX_S = 15.0   # under EPCOMM_TIMEOUT_S (20 s): a stalled send part shows as a held-too-long holder


class HoldParams(ctypes.Structure):
    _fields_ = [("release", ctypes.c_void_p), ("released", ctypes.c_void_p), ("started", ctypes.c_void_p),
                ("ended_at", ctypes.c_void_p), ("max_ns", ctypes.c_uint64)]


@pytest.fixture(scope="module")
def sm_holder(dist_env):
    """(kernel, shared-memory bytes, stream) of hold_sms, built from a copy of cuda_src/ plus
    HOLD_SRC; the stream is created non-blocking (no implicit order with the legacy default
    stream the low-latency calls may run on). Skips where the premise cannot hold
    (topology.sm_holding_skip_reason)."""
    reason = topology.sm_holding_skip_reason(
        dist_env.shared_gpu, os.environ.get("EPCOMM_TEST_MPS_UNPARTITIONED") != "1",
        dist_env.processes_per_gpu, dist_env.ranks_per_gpu)
    if reason:
        pytest.skip(reason)
    from epcomm.runtime.launch import driver
    smem = getattr(torch.cuda.get_device_properties(dist_env.device), "shared_memory_per_block_optin", 0)
    if not smem:   # older torch: CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        value = ctypes.c_int()
        assert driver().cuDeviceGetAttribute(ctypes.byref(value), 97, dist_env.device.index) == 0
        smem = value.value
    kernel = build_test_kernel("hold_sms.cu", HOLD_SRC, "epcomm::hold_sms", dist_env.device.index)
    kernel.set_max_dynamic_smem(smem)
    torch.cuda.synchronize()   # torch's context is current on this thread
    stream = ctypes.c_void_p()
    assert driver().cuStreamCreate(ctypes.byref(stream), 1) == 0   # CU_STREAM_NON_BLOCKING
    yield kernel, smem, stream.value
    torch.cuda.synchronize()
    driver().cuStreamDestroy_v2(stream)


def _while_held(dist_env, holder, free_sms: int, launch, what: str, problems: list):
    """Run launch() (it queues kernels on the current stream) while hold_sms holds all SMs but
    `free_sms` from a side stream, on every rank at about the same time. The holder is released by
    a store queued on the current stream after launch()'s kernels, so it reports every block
    released by the flag only if those kernels finished on `free_sms` SMs alone. Skips (on every
    rank) when the holder's blocks are not all resident: an MPS partition may give a process fewer
    SMs than the device properties report, and then no SM would be left free."""
    kernel, smem, side = holder
    dev = dist_env.device
    blocks = torch.cuda.get_device_properties(dev).multi_processor_count - free_sms
    flags = torch.zeros(3, dtype=torch.int32, device=dev)   # [release, blocks released by it, blocks started]
    ended_at = torch.zeros(1, dtype=torch.int64, device=dev)
    torch.cuda.synchronize()
    dist_env.barrier()
    kernel.launch((blocks, 1, 1), (1024, 1, 1),
                  HoldParams(flags.data_ptr(), flags.data_ptr() + 4, flags.data_ptr() + 8, ended_at.data_ptr(),
                             int(HOLD_MAX_S * 1e9)), side, smem=smem)
    deadline = time.monotonic() + 1.0   # resident blocks start in microseconds
    while int(flags[2].item()) < blocks and time.monotonic() < deadline:   # a copy: no SM needed
        time.sleep(0.01)
    started = int(flags[2].item())
    if not dist_env.all_ok(started == blocks):
        flags[0].fill_(1)
        torch.cuda.synchronize()
        pytest.skip(f"{what}: the {blocks} holder blocks did not all become resident on every rank "
                    f"(this rank: {started}; an MPS partition smaller than the SM count the device "
                    f"reports): no {free_sms} SMs can be left free")
    start = time.monotonic()
    out = launch()
    flags[0].fill_(1)    # current stream: runs once launch()'s kernels are done
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    released = int(flags[1].item())
    if released != blocks:
        problems.append(f"{what}: did not finish on {free_sms} free SMs ({released} of {blocks} holder blocks "
                        f"released by it, {elapsed:.1f} s; the holder gives up after {HOLD_MAX_S} s); "
                        f"{_trace_against(int(ended_at.item()), dev.index)}")
    return out


def _trace_against(held_until_ns: int, device_index: int) -> str:
    """Where the latest (traced) launch's blocks were when the holder ended: per phase end, in
    ms from then (negative: while the SMs were held), the earliest and latest block. A stall on a
    peer shows as blocks started and released while held that finished only after; a stall for
    lack of an SM as blocks that started only after."""
    from epcomm.ops import low_latency
    rows = low_latency.last_trace(device_index)
    if rows is None:
        return "no trace"
    seen = []
    for slot in ("start", "released", "send_a", "send_c", "send_done", "recv_done"):
        stamps = rows[:, :, low_latency.TRACE_SLOTS.index(slot)]
        per_block = [int(b[b > 0].max()) for b in stamps if bool((b > 0).any())]
        if per_block:
            ms = [(t - held_until_ns) / 1e6 for t in per_block]
            seen.append(f"{slot} {min(ms):+.1f}..{max(ms):+.1f} ms ({len(ms)} of {rows.shape[0]} blocks)")
    return "trace: " + ("; ".join(seen) or "no block stamped")


@pytest.mark.parametrize("free_sms", [1, 5])
def test_sends_with_most_sms_held(dist_env, sm_holder, free_sms):
    """Another kernel (another stream) holds all SMs but `free_sms` while the hook-mode send parts of
    dispatch and combine, and a fused combine, run: only that many of their blocks are resident at
    a time, so no block may wait for work that a later block would do (the combine send part claims
    records and items from counters). Each must finish while the SMs are held, without a
    timeout, bit for bit against the oracle. (A fused dispatch is not run here: its blocks send their
    own tokens and lists, then wait for the peer's.) The profiling builds run (they differ by
    their stamps alone), so that a call that stalls says where its blocks were."""
    from epcomm.ops import low_latency
    tracing = low_latency.tracing()
    low_latency.set_tracing(True)
    try:
        _sends_with_most_sms_held(dist_env, sm_holder, free_sms)
    finally:
        low_latency.set_tracing(tracing)


def _sends_with_most_sms_held(dist_env, sm_holder, free_sms):
    case, rank, num_ranks, dev = FP8_TARGET, dist_env.rank, dist_env.world_size, dist_env.device
    buf = shared_buffer(dist_env, shapes=ALL_SHAPES)
    kernel, smem, _ = sm_holder
    if kernel.max_active_blocks_per_sm(1024, smem) != 1:
        pytest.skip("the premise does not hold on this GPU: one holder block per SM")
    buf.clean_low_latency_buffer(case.T, case.H, case.E)
    inputs = gather(case_inputs(case, rank, 80 + free_sms))
    x, topk_idx, weights = (t.to(dev) for t in inputs[rank])
    # The same calls once with every SM free: they compile and load their kernels first. Under lazy
    # module loading (CUDA's default) a kernel's first launch loads it, which may wait for the
    # device's running kernels, the holder included: the send part would then never start.
    (recv_x, scales), count, handle, _, hook = buf.low_latency_dispatch(x, topk_idx, case.T, case.E,
                                                                         return_recv_hook=True)
    hook()
    x_c = combine_input(case, rank, num_ranks, recv_x, scales, count)
    buf.low_latency_combine(x_c, topk_idx, weights, handle, return_recv_hook=True)[2]()
    buf.low_latency_combine(x_c, topk_idx, weights, handle)
    torch.cuda.synchronize()
    dist_env.barrier()
    problems = []
    (recv_x, scales), count, handle, _, hook = _while_held(
        dist_env, sm_holder, free_sms,
        lambda: buf.low_latency_dispatch(x, topk_idx, case.T, case.E, return_recv_hook=True),
        "dispatch send part (hook)", problems)
    hook()
    torch.cuda.synchronize()
    p, _ = check_dispatch(case, rank, num_ranks, inputs, (recv_x, scales, count, handle, None))
    problems += [f"dispatch: {m}" for m in p]
    x_c = combine_input(case, rank, num_ranks, recv_x, scales, count)
    combined, _, hook = _while_held(
        dist_env, sm_holder, free_sms,
        lambda: buf.low_latency_combine(x_c, topk_idx, weights, handle, return_recv_hook=True),
        "combine send part (hook)", problems)
    hook()
    torch.cuda.synchronize()
    problems += [f"hook combine: {m}" for m in check_combine(case, rank, inputs, x_c, handle, combined)]
    combined, _, _ = _while_held(dist_env, sm_holder, free_sms,
                                 lambda: buf.low_latency_combine(x_c, topk_idx, weights, handle),
                                 "fused combine", problems)
    problems += [f"fused combine: {m}" for m in check_combine(case, rank, inputs, x_c, handle, combined)]
    try:
        buf.check_errors()   # a PeerTimeout recorded by any of them raises here
    except Exception as e:            # reported on every rank by verdict, not raised on this one alone
        problems.append(f"error recorded: {e!r}")
    verdict(dist_env, problems, f"sends with {free_sms} free SMs")
