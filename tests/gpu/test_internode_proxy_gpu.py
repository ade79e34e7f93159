"""Internode dispatch / combine over a CPU-proxy remote transport: NVSHMEM's UCX transport on TCP
loopback, P2P between the PEs off, R nodes of 1 rank (on one GPU under MPS). Run by
`python -m tests.gpu.proxy_transport`, which sets the transport up (tests/gpu/proxy_transport.py);
skipped in every other session (EPCOMM_TEST_PROXY_TRANSPORT unset).

Every transfer between ranks is then an RDMA-stage put carried by NVSHMEM's proxy thread and UCX:
the path of RoCE and EFA clusters without IBGDA, and without GDRCopy (no remote atomics there).
Dispatch bit-exact against the oracle, combine bit-exact against oracle.combine, the round trip
bit-exact (helpers round_trip_want).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import epcomm
from epcomm.runtime.nvshmem import Nvshmem
from tests import topology
from tests.helpers.gpu import check, dev, run_dispatch
from tests.helpers.gpu import expected_dispatch as expected
from tests.helpers.internode import combine_errors, dispatch_errors, inputs_for, round_trip_exact_errors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("EPCOMM_TEST_PROXY_TRANSPORT") != "ucx",
                                 reason="the proxy-transport check runs under python -m tests.gpu.proxy_transport "
                                        "(NVSHMEM's UCX transport over TCP, P2P off)")]
HIDDEN = 7168
EXPERTS = topology.experts(256, topology.world_size())
# What the harness sets; the test refuses to pass under anything else.
TRANSPORT_ENV = {"NVSHMEM_REMOTE_TRANSPORT": "ucx", "NVSHMEM_DISABLE_P2P": "1"}
# Step markers written straight to the log: NVSHMEM ends the process on a transport error, so
# pytest's report never comes; tests/gpu/proxy_transport.py reads the step begun and not returned.


def _mark(step: str, state: str) -> None:
    sys.__stderr__.write(f"proxy step: {step}: {state}\n")
    sys.__stderr__.flush()


def test_symmetric_allocation_over_the_proxy(dist_env):
    """NVSHMEM's own start-up and collective allocation, before any epcomm kernel: its initialisation,
    nvshmem_malloc and nvshmem_free each run NVSHMEM's barrier, whose signals to a PE that P2P
    cannot reach go through the proxy as remote atomics. Runs first, so an abort there is told
    apart from one in epcomm's kernels."""
    _mark("nvshmem_init", "begun")
    world = Nvshmem.init(dist_env.group, dist_env.device.index)
    _mark("nvshmem_init", "returned")
    _mark("nvshmem_malloc", "begun")
    ptr = world.malloc(1 << 20)
    _mark("nvshmem_malloc", "returned")
    _mark("nvshmem_free", "begun")
    world.free(ptr)
    _mark("nvshmem_free", "returned")


@pytest.fixture(scope="module")
def buf(dist_env):
    """DeepEP V1's internode Buffer(group, int(2e9), int(1e9)), every rank its own node."""
    if dist_env.world_size < 2:
        pytest.skip("needs 2 or more ranks (nodes of 1 rank)")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPCOMM_NUM_LOCAL_RANKS", "1")
        buffer = epcomm.Buffer(dist_env.group, int(2e9), int(1e9), explicitly_destroy=True)
    yield buffer
    torch.cuda.synchronize()
    dist_env.barrier()
    buffer.destroy()


def test_every_peer_is_reached_through_the_proxy(dist_env, buf):
    """The transport settings reached NVSHMEM, and no other PE's heap is mapped here (P2P off): every
    transfer of this module goes through the remote transport."""
    errors = [f"{name}={os.environ.get(name)!r}, want {value!r}" for name, value in TRANSPORT_ENV.items()
              if os.environ.get(name) != value]
    mapped = [r for r, address in enumerate(buf._backend.rdma.peer_ptrs) if address and r != dist_env.rank]
    errors.append(f"ranks {mapped} are mapped over P2P" if mapped else "")
    errors.append("" if buf.runtime.get_num_rdma_ranks() == dist_env.world_size else
                  f"{buf.runtime.get_num_rdma_ranks()} nodes, want {dist_env.world_size}")
    check(dist_env, errors, "proxy transport")


@pytest.mark.parametrize("profile", ["zero_on_one", "one", "n4096"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_round_trip_over_the_proxy(dist_env, buf, profile, fp8):
    """Fresh dispatch (BF16 or FP8) against the oracle, cached BF16 dispatch, combine of those rows
    bit-exact; N by rank from topology.tokens_by_rank."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    ns = topology.tokens_by_rank(profile, world)
    inputs = inputs_for(dist_env, 1, ns, seed=500 + len(profile), hidden=HIDDEN, num_experts=EXPERTS,
                        num_topk=8, fp8=fp8)
    mine = inputs[rank]
    got = run_dispatch(buf, mine, device, fp8)
    check(dist_env, dispatch_errors(got, expected(inputs, rank, EXPERTS, fp8), fp8, rank, inputs), "dispatch")
    cached = buf.dispatch(dev(mine.x, device), handle=got[4])[0]
    combined, weights, _ = buf.combine(cached, got[4], topk_weights=got[2])
    check(dist_env, round_trip_exact_errors(combined, weights, mine), "cached dispatch + combine")


def test_combine_of_distinct_rows_with_bias(dist_env, buf):
    """Each rank combines rows of its own (its received rows x (rank + 1)) plus a bias: bit-exact
    against oracle.combine, N differing by rank."""
    rank, device = dist_env.rank, dist_env.device
    inputs = inputs_for(dist_env, 1, (300, 41, 0), seed=531, hidden=HIDDEN, num_experts=EXPERTS, num_topk=8)
    got = run_dispatch(buf, inputs[rank], device, False)
    gen = torch.Generator().manual_seed(532 + rank)
    bias = torch.randn(len(inputs[rank].x), HIDDEN, generator=gen).to(torch.bfloat16)
    check(dist_env, combine_errors(dist_env, buf, got, inputs, 1, EXPERTS, (bias, None)), "combine")


def test_num_worst_tokens_over_the_proxy(dist_env, buf):
    """The graph-capturable form (no host read between notify and the data kernel) over the proxy."""
    rank, device = dist_env.rank, dist_env.device
    inputs = inputs_for(dist_env, 1, (700, 90), seed=541, hidden=HIDDEN, num_experts=EXPERTS, num_topk=8)
    num_worst = sum(len(i.x) for i in inputs)
    got = run_dispatch(buf, inputs[rank], device, False, num_worst_tokens=num_worst)
    want = expected(inputs, rank, EXPERTS, False, num_worst_tokens=num_worst)
    errors = dispatch_errors(got, want, False, rank, inputs)
    combined, weights, _ = buf.combine(got[0], got[4], topk_weights=got[2])
    check(dist_env, errors + round_trip_exact_errors(combined, weights, inputs[rank]), "num_worst_tokens")
