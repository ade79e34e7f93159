"""Internode dispatch / combine on GPUs through the public Buffer API, against epcomm.reference.oracle.

Collective: run under `make test-gpu` (one rank per GPU) or `make test-gpu RANKS_PER_GPU=N` (N ranks
share each GPU under CUDA MPS). EPCOMM_NUM_LOCAL_RANKS = L (set while each Buffer is built) cuts the
R ranks into M = R / L "nodes": every case runs at each split with M >= 2 and L in 1, 2, 4 that the
live R allows (at R = 8: 8 x 1, 4 x 2, 2 x 4; tests/topology.py). Between nodes every transfer is
the RDMA stage (NVSHMEM puts, P2P between PEs of one host standing in for the NIC); inside a node
the NVLink stage.

The module's Buffer is built as DeepEP V1's own internode test builds it, Buffer(group, int(2e9),
int(1e9)), at every topology and for every N (0 on one rank, 1, 4096, 16384, N differing by rank):
the buffers are fixed-size rings the calls stream through. N is not a template argument of any
kernel, and most cases share H = 7168, K = 8, E = 256 (scaled to R), so one session compiles few
specialisations.

Inputs of every rank are rebuilt on every rank from (seed, rank) on the CPU (tests/helpers/gpu.py,
shared with test_intranode_gpu.py); dispatch is bit-exact against the oracle, combine bit-exact against
oracle.combine(num_local_ranks=L) (the kernels' fp32 order), and the round trip combine(dispatch(x))
bit-exact against x * (ranks each token reached) rounded once (helpers round_trip_want: what the
oracle gives there, without every rank's received rows on the host).
"""
from __future__ import annotations

import os
import time
from typing import List

import pytest
import torch

import epcomm
from epcomm.errors import BufferUnusable, DeviceCheckFailed, PeerTimeout
from epcomm.ops import internode_plan as plan
from epcomm.reference import oracle
from tests import topology
from tests.conftest import on_all_ranks
from tests.helpers.gpu import Inputs, check, dev, row_diff, run_dispatch
from tests.helpers.gpu import expected_dispatch as expected
from tests.helpers.internode import (combine_errors, dispatch_errors, inputs_for, lay_out,
                                     oracle_round_trip, round_trip_exact_errors)

pytestmark = pytest.mark.gpu
HIDDEN = 7168
_R = topology.world_size()
ROUND_TRIP_TOKENS = 4096
# What DeepEP V1's tests/test_internode.py passes at every scale (num_nvl_bytes, num_rdma_bytes).
DEEPEP_NVL_BYTES, DEEPEP_RDMA_BYTES = int(2e9), int(1e9)
# Device memory of a rank outside its tensors and Buffers: CUDA context, NVSHMEM, cubins, allocator.
CONTEXT_BYTES = 2 << 30


def _e(nominal: int) -> int:
    """An expert count near `nominal` that the session's rank count divides."""
    return topology.experts(nominal, _R)


def skip_unless_split(world: int, local: int) -> None:
    if world % local or world // local < 2:
        pytest.skip(f"needs at least 2 nodes of {local} ranks ({2 * local}+ ranks, a multiple of {local}); "
                    f"this run has {world}")


def make_buffer(dist_env, local: int, rdma_bytes: int = 256 << 20, timeout_s: str = "", arch: str = "",
                mnnvl: bool = False, nvl_bytes: int = DEEPEP_NVL_BYTES):
    """A Buffer of nodes of `local` ranks; num_nvl_bytes as DeepEP users pass it (the NVLink stage's
    FIFOs may live there)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPCOMM_NUM_LOCAL_RANKS", str(local))
        if timeout_s:
            env.setenv("EPCOMM_TIMEOUT_S", timeout_s)
        if arch:
            env.setenv("EPCOMM_ARCH", arch)
        return epcomm.Buffer(dist_env.group, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes,
                             explicitly_destroy=True, allow_mnnvl=mnnvl)


def release(dist_env, buf) -> None:
    """Destroy a Buffer on every rank, also after a failure (destroy meets before its collectives)."""
    torch.cuda.synchronize()
    dist_env.barrier()
    buf.destroy()


def warm_kernels(dist_env, buf, inputs) -> None:
    """One BF16 dispatch + combine of `inputs` on `buf` on every rank (builds or loads its kernels),
    then meet every rank: a short EPCOMM_TIMEOUT_S then bounds the peers' calls, not one rank's
    first-call JIT time."""
    got = run_dispatch(buf, inputs[dist_env.rank], dist_env.device, False)
    buf.combine(got[0], got[4], topk_weights=got[2])
    torch.cuda.synchronize()
    dist_env.barrier()


_SCALE_INPUTS = {}   # profile -> (L laid out for, every rank's inputs): BF16, FP8 and every L share them


def ring_bytes(config, world: int, local: int, hidden: int = HIDDEN) -> int:
    """num_rdma_bytes that calls with `config` need (independent of N) next to make_buffer's NVL
    buffer, push FIFOs included."""
    return plan.rdma_bytes_for([config], hidden * 2, hidden // 128, 32, world, local, 1 << 20)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["L1", "L2", "L4"])
def setup(dist_env, request):
    """(Buffer, L): M = R / L nodes of L ranks, M >= 2, the Buffer DeepEP V1's internode test
    builds (fixed size whatever M, L and N)."""
    local, world = request.param, dist_env.world_size
    skip_unless_split(world, local)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPCOMM_NUM_LOCAL_RANKS", str(local))
        buf = epcomm.Buffer(dist_env.group, DEEPEP_NVL_BYTES, DEEPEP_RDMA_BYTES, explicitly_destroy=True)
    assert buf.runtime.get_num_rdma_ranks() == world // local
    yield buf, local
    _SCALE_INPUTS.clear()
    release(dist_env, buf)


def skip_unless_memory(dist_env, what: str, ns, fp8: bool) -> None:
    """Skip (on every rank alike) a case whose tensors, with the module's Buffer, do not fit this
    rank's share of the GPU (the processes of every job on it, under MPS) or of the host (every
    rank holds every rank's inputs: counted per rank, though ranks on one host share their pages)."""
    device_total = torch.cuda.get_device_properties(dist_env.device_index).total_memory
    device_need = (topology.round_trip_device_bytes(ns, HIDDEN, fp8) + DEEPEP_NVL_BYTES + DEEPEP_RDMA_BYTES +
                   CONTEXT_BYTES)
    host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host_processes = int(os.environ.get("LOCAL_WORLD_SIZE", dist_env.world_size)) * \
        (dist_env.processes_per_gpu // dist_env.ranks_per_gpu)
    for reason in (topology.memory_skip_reason(what, device_need, device_total, dist_env.processes_per_gpu, "GPU"),
                   topology.memory_skip_reason(what, topology.round_trip_host_bytes(ns, HIDDEN, fp8),
                                               host_total, host_processes, "host")):
        if reason:
            pytest.skip(reason)


# ---- dispatch + cached dispatch + combine ----------------------------------------------------------
# seed, N by rank, H, K, E, fp8, index dtype, alignment, num_sms; H = 7168 but for one odd hidden
# size (each H, index type and BF16 / FP8 is one more set of specialisations to compile)
CASES = [
    (1, (1024,), HIDDEN, 8, _e(256), False, torch.int64, 1, 24),
    (2, (1024,), HIDDEN, 8, _e(256), True, torch.int64, 1, 24),
    (3, (777, 1500), HIDDEN, 8, _e(64), False, torch.int32, 128, 8),
    (4, (333,), 2056, 1, _e(16), False, torch.int64, 1, 48),
    (5, (512,), HIDDEN, 32, _e(64), True, torch.int32, 4, 20),
]


@pytest.mark.parametrize("seed, ns, hidden, topk, experts, fp8, index_dtype, alignment, sms", CASES)
def test_dispatch_and_combine_match_oracle(dist_env, setup, seed, ns, hidden, topk, experts, fp8,
                                           index_dtype, alignment, sms):
    buf, local = setup
    sms = dist_env.sms(sms)
    rank, device = dist_env.rank, dist_env.device
    kw = dict(hidden=hidden, num_experts=experts, num_topk=topk, fp8=fp8, index_dtype=index_dtype)
    inputs = inputs_for(dist_env, local, ns, seed=seed, **kw)
    got = run_dispatch(buf, inputs[rank], device, fp8, config=epcomm.Config(sms), expert_alignment=alignment)
    check(dist_env, dispatch_errors(got, expected(inputs, rank, experts, fp8, alignment=alignment), fp8, rank, inputs),
          "fresh dispatch")

    new_inputs = inputs_for(dist_env, local, ns, seed=seed + 100, **kw)
    new_x = (dev(new_inputs[rank].x_fp8, device), dev(new_inputs[rank].scales, device)) if fp8 \
        else dev(new_inputs[rank].x, device)
    cached = buf.dispatch(new_x, handle=got[4], config=epcomm.Config(sms))
    errors = dispatch_errors(cached, expected(inputs, rank, experts, fp8, data=new_inputs, use_topk=False),
                             fp8, rank, inputs, use_topk=False)
    errors.append("" if cached[1:5] == (None, None, None, None) else "cached dispatch returned more than recv_x")
    check(dist_env, errors, "cached dispatch")

    gen = torch.Generator().manual_seed(seed + 7)
    bias = tuple(torch.randn(len(inputs[rank].x), hidden, generator=gen).to(torch.bfloat16) for _ in range(2))
    check(dist_env, combine_errors(dist_env, buf, got, inputs, local, experts, bias,
                                   epcomm.Config(max(2, sms - 4))), "combine with a 2-tuple bias")


def test_round_trip_with_gpu_layout(dist_env, setup):
    """Layout on the GPU, default configs: combine(dispatch(x)) == x * (ranks reached), weights back."""
    buf, local = setup
    rank, device = dist_env.rank, dist_env.device
    mine = inputs_for(dist_env, local, (ROUND_TRIP_TOKENS,), seed=11, hidden=HIDDEN, num_experts=_e(256), num_topk=8)[rank]
    topk_idx, topk_weights = dev(mine.topk_idx, device), dev(mine.topk_weights, device)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, _e(256))
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(
        dev(mine.x, device), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined, weights, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    check(dist_env, round_trip_exact_errors(combined, weights, mine) +
          [row_diff("num_tokens_per_rdma_rank", per_node, mine.layout[1])], "round trip")


# ---- any N through the fixed-size buffer ------------------------------------------------------------
def scale_inputs(dist_env, local: int, profile: str) -> List[Inputs]:
    """Every rank's inputs (BF16 rows and their FP8 cast) for a token profile, H = 7168, K = 8,
    E = 256 scaled to R; only the latest profile is kept (16384 tokens of 8 ranks are 1.9 GB), and
    kept across L (only the layout depends on it)."""
    if profile not in _SCALE_INPUTS:
        _SCALE_INPUTS.clear()
        ns = topology.tokens_by_rank(profile, dist_env.world_size)
        seed = 300 + topology.TOKEN_PROFILES.index(profile)
        _SCALE_INPUTS[profile] = (local, inputs_for(dist_env, local, ns, seed=seed, hidden=HIDDEN,
                                                    num_experts=_e(256), num_topk=8, fp8=True))
    laid_out_for, inputs = _SCALE_INPUTS[profile]
    if laid_out_for != local:
        _SCALE_INPUTS[profile] = (local, lay_out(inputs, _e(256), local))
    return inputs


SCALE_CASES = [(profile, fp8) for profile in topology.TOKEN_PROFILES for fp8 in (False, True)]


@pytest.mark.parametrize("profile, fp8", SCALE_CASES,
                         ids=[f"{p}-{'fp8' if f else 'bf16'}" for p, f in SCALE_CASES])
def test_any_n_streams_through_the_fixed_buffer(dist_env, setup, profile, fp8):
    """N per rank from topology.tokens_by_rank (0 on one rank, 1, 4096, 16384, N differing by rank)
    on the module's Buffer(group, int(2e9), int(1e9)) at this M x L: the fresh dispatch (BF16 or
    FP8) bit-exact against the oracle, with the 10-tuple handle; a cached BF16 dispatch through
    that handle (the backward of combine); the combine of those rows bit-exact (round_trip_want);
    for N differing by rank also a num_worst_tokens dispatch. Skips where this rank's share of GPU
    or host memory cannot hold the case (the reason names both figures)."""
    buf, local = setup
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    ns = topology.tokens_by_rank(profile, world)
    skip_unless_memory(dist_env, f"N by rank {ns[:4]}{'...' if world > 4 else ''} (H={HIDDEN})", ns, fp8)
    inputs = scale_inputs(dist_env, local, profile)
    mine, experts = inputs[rank], _e(256)
    got = run_dispatch(buf, mine, device, fp8)
    check(dist_env, dispatch_errors(got, expected(inputs, rank, experts, fp8), fp8, rank, inputs),
          f"fresh {'FP8' if fp8 else 'BF16'} dispatch")

    cached = buf.dispatch(dev(mine.x, device), handle=got[4])
    want_bf16 = got[0] if not fp8 else expected(inputs, rank, experts, False)["recv_x"]
    errors = [row_diff("cached BF16 dispatch", cached[0].cpu(), want_bf16.cpu()),
              "" if cached[1:5] == (None, None, None, None) else "cached dispatch returned more than recv_x"]
    del want_bf16
    combined, weights, _ = buf.combine(cached[0], got[4], topk_weights=got[2])
    check(dist_env, errors + round_trip_exact_errors(combined, weights, mine), "cached dispatch + combine")
    del got, cached, combined

    if profile == "differing":
        num_worst = sum(ns)
        worst = run_dispatch(buf, mine, device, fp8, num_worst_tokens=num_worst)
        want = expected(inputs, rank, experts, fp8, num_worst_tokens=num_worst)
        check(dist_env, dispatch_errors(worst, want, fp8, rank, inputs), "num_worst_tokens dispatch")
        if not fp8:
            combined, weights, _ = buf.combine(worst[0], worst[4], topk_weights=worst[2])
            check(dist_env, round_trip_exact_errors(combined, weights, mine), "num_worst_tokens round trip")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()   # the next profile's tensors may differ in size by 16x


def deep_ep_inputs(dist_env, local: int, seed: int, num_tokens: int, num_experts: int, num_topk: int) -> List[Inputs]:
    """Every rank's inputs routed as DeepEP V1's test_internode.py routes them: scores |randn| + 1,
    top-k inside the min(M, 4) best nodes (node-limited routing), 10 entries set to -1, weights
    |randn|; BF16 rows random and their FP8 cast."""
    world = dist_env.world_size
    nodes = world // local
    out = []
    for r in range(world):
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        scores = torch.randn(num_tokens, num_experts, generator=gen).abs() + 1
        node_scores = scores.view(num_tokens, nodes, -1).amax(dim=-1)
        best_nodes = torch.topk(node_scores, min(nodes, 4), dim=-1, sorted=False).indices
        allowed = torch.zeros(num_tokens, nodes, dtype=torch.bool).scatter_(1, best_nodes, True)
        masked = scores.masked_fill(~allowed.repeat_interleave(num_experts // nodes, dim=1), 0.0)
        topk_idx = torch.topk(masked, num_topk, dim=-1, sorted=False).indices
        topk_weights = torch.randn(num_tokens, num_topk, generator=gen).abs()
        if num_tokens:
            rows = torch.randint(0, num_tokens, (10,), generator=gen)
            cols = torch.randint(0, num_topk, (10,), generator=gen)
            topk_idx[rows, cols] = -1
            topk_weights[rows, cols] = 0.0
        x_fp8, scales = oracle.fp8_cast(x)
        out.append(Inputs(x, x_fp8, scales.t().contiguous().t(), topk_idx, topk_weights,
                          oracle.layout(topk_idx, num_experts, world, local)))
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_deep_ep_v1_internode_usage(dist_env, setup, fp8):
    """DeepEP V1's test_internode.py as its users run it, at this M x L: Buffer(group, int(2e9),
    int(1e9)) (the module's), N = 4096, H = 7168, K = 8, E = 256 (scaled to R), node-limited
    routing; get_dispatch_layout against the oracle's layout; dispatch with a DeepEP-style Config
    and async_finish + previous_event, checked against the oracle (handle[-4] included); cached
    dispatch; combine with the returned weights; num_worst_tokens."""
    buf, local = setup
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    experts, num_topk = _e(256), 8
    inputs = deep_ep_inputs(dist_env, local, seed=401, num_tokens=ROUND_TRIP_TOKENS, num_experts=experts,
                            num_topk=num_topk)
    mine = inputs[rank]
    topk_idx, topk_weights = dev(mine.topk_idx, device), dev(mine.topk_weights, device)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, experts)
    check(dist_env, [row_diff(name, got, want) for name, got, want in
                     zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                          "is_token_in_rank"), (per_rank, per_node, per_expert, in_rank), mine.layout)],
          "get_dispatch_layout")

    sms = dist_env.sms(24)
    dispatch_config, combine_config = epcomm.Config(sms, 8, 256, 16, 128), epcomm.Config(sms, 4, 256, 8, 128)
    x = (dev(mine.x_fp8, device), dev(mine.scales, device)) if fp8 else dev(mine.x, device)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    got = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=dispatch_config,
                       previous_event=buf.capture(), async_finish=True, **layout)
    got[5].current_stream_wait()
    recv_gbl_rank_prefix_sum = got[4][-4]
    errors = dispatch_errors(got, expected(inputs, rank, experts, fp8), fp8, rank, inputs)
    received = int(recv_gbl_rank_prefix_sum[-1])
    errors.append("" if received == (got[0][0] if fp8 else got[0]).shape[0] else
                  f"handle[-4][-1] = {received} rows, recv_x has {(got[0][0] if fp8 else got[0]).shape[0]}")
    check(dist_env, errors, "dispatch")

    cached = buf.dispatch(dev(mine.x, device), handle=got[4], config=dispatch_config)[0]
    combined, weights, _ = buf.combine(cached, got[4], topk_weights=got[2], config=combine_config)
    errors = [] if fp8 else [row_diff("cached dispatch", cached.cpu(), got[0].cpu())]
    check(dist_env, errors + round_trip_exact_errors(combined, weights, mine), "cached dispatch + combine")

    num_worst = ROUND_TRIP_TOKENS * world
    worst = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=dispatch_config,
                         num_worst_tokens=num_worst, **layout)
    check(dist_env, dispatch_errors(worst, expected(inputs, rank, experts, fp8, num_worst_tokens=num_worst),
                                    fp8, rank, inputs), "num_worst_tokens dispatch")


def test_handle_is_deep_ep_v1_10_tuple(dist_env, setup):
    """The internode handle as DeepEP V1 code indexes it: 10 elements, [0] the is_token_in_rank
    given, [-4] recv_gbl_rank_prefix_sum (inclusive rows by source rank); each element a tensor on
    this rank's device; a handle of a different Buffer call shape (N differing by rank, one rank
    with N = 0) as well."""
    buf, local = setup
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    errors = []
    for ns in ((257,), topology.tokens_by_rank("zero_on_one", world)):
        inputs = inputs_for(dist_env, local, ns, seed=61, hidden=HIDDEN, num_experts=_e(256), num_topk=8)
        handle = run_dispatch(buf, inputs[rank], device, False)[4]
        errors.append("" if isinstance(handle, tuple) and len(handle) == 10 else
                      f"handle is a {type(handle).__name__} of {len(handle)} elements")
        errors += [f"handle[{i}] is a {type(t).__name__} on {getattr(t, 'device', None)}"
                   for i, t in enumerate(handle) if not (isinstance(t, torch.Tensor) and t.device == device)]
        errors.append(row_diff("handle[0] is_token_in_rank", handle[0], inputs[rank].layout[3]))
        received = torch.tensor([int(i.layout[3][:, rank].sum()) for i in inputs])
        errors.append(row_diff("handle[-4]", handle[-4], received.cumsum(0).int()))
    check(dist_env, errors, "10-tuple handle")


@pytest.mark.parametrize("seed, route, ns", [(21, "nowhere", (600,)), (22, "rank0", (500, 0)),
                                             (23, "random", (0, 900)), (25, "nowhere", (1, 2, 3))])
def test_uneven_loads(dist_env, setup, seed, route, ns):
    """Tokens routed nowhere, ranks receiving nothing, N = 0 on some ranks."""
    buf, local = setup
    rank, device = dist_env.rank, dist_env.device
    inputs = inputs_for(dist_env, local, ns, seed=seed, hidden=HIDDEN, num_experts=_e(64), num_topk=6, route=route)
    got = run_dispatch(buf, inputs[rank], device, False)
    check(dist_env, dispatch_errors(got, expected(inputs, rank, _e(64), False), False, rank, inputs), "dispatch")
    ones = torch.ones(len(inputs[rank].x), HIDDEN, dtype=torch.bfloat16)
    check(dist_env, combine_errors(dist_env, buf, got, inputs, local, _e(64), (ones, None)), "combine")


@pytest.mark.parametrize("fp8", [False, True])
def test_num_worst_tokens(dist_env, setup, fp8):
    buf, local = setup
    rank, device = dist_env.rank, dist_env.device
    ns = (900, 400)
    inputs = inputs_for(dist_env, local, ns, seed=41, hidden=HIDDEN, num_experts=_e(64), num_topk=8, fp8=fp8)
    num_worst = sum(len(i.x) for i in inputs)
    got = run_dispatch(buf, inputs[rank], device, fp8, num_worst_tokens=num_worst)
    want = expected(inputs, rank, _e(64), fp8, num_worst_tokens=num_worst)
    errors = dispatch_errors(got, want, fp8, rank, inputs)
    meta = got[4][7].cpu()
    num_recv = int(want["recv_src_idx"].ge(0).sum())
    errors.append("" if bool((meta[num_recv:] == -1).all()) else "padding rows of recv_src_meta are not -1")
    check(dist_env, errors, "worst dispatch")
    if not fp8:
        combined, weights, _ = buf.combine(got[0], got[4], topk_weights=got[2])
        check(dist_env, round_trip_exact_errors(combined, weights, inputs[rank]), "worst round trip")


def test_back_to_back_reuse_with_a_late_rank(dist_env, setup):
    """20 x {num_worst_tokens dispatch + combine} back to back with rank 1 held back on its stream
    before every call (torch.cuda._sleep), so the other ranks run into each kernel's wait for every
    rank's previous kernel: all outputs kept, each checked against the oracle at the end (a kernel
    that overwrote records a late rank was still reading, or took a stale signal, gives wrong rows)."""
    buf, local = setup
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    experts, ns, rounds = _e(64), (300, 170), 20
    rounds_inputs = [inputs_for(dist_env, local, ns, seed=200 + i, hidden=HIDDEN, num_experts=experts, num_topk=8)
                     for i in range(rounds)]
    num_worst = sum(len(i.x) for i in rounds_inputs[0])
    staged = []   # on the GPU before the loop: no host copy in it waits for the sleeping stream
    for inputs in rounds_inputs:
        mine = inputs[rank]
        staged.append([dev(t, device) for t in (mine.x, mine.topk_idx, mine.topk_weights, *mine.layout)])
    torch.cuda.synchronize()
    dist_env.barrier()
    outputs = []
    for x, idx, w, per_rank, per_node, per_expert, in_rank in staged:
        if rank == 1:
            torch.cuda._sleep(200_000_000)
        got = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                           topk_weights=w, num_worst_tokens=num_worst)
        if rank == 1:
            torch.cuda._sleep(200_000_000)
        outputs.append((got, buf.combine(got[0], got[4], topk_weights=got[2])))
    torch.cuda.synchronize()
    errors = []
    for i, (inputs, (got, (combined, weights, _))) in enumerate(zip(rounds_inputs, outputs)):
        found = dispatch_errors(got, expected(inputs, rank, experts, False, num_worst_tokens=num_worst), False,
                                rank, inputs)
        want_x, want_w = oracle_round_trip(inputs, rank, world, experts, local)
        found += [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)]
        errors += [f"round {i}: {e}" for e in found if e]
    check(dist_env, errors, "back-to-back reuse")


def test_cuda_graph_replay(dist_env, setup):
    """Worst-size dispatch + combine captured once, replayed with new data and routing: no host
    sequence numbers, the kernels' epochs advance on the device."""
    buf, local = setup
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    ns, experts = (640,), _e(64)
    num_worst = 640 * world

    def fill(seed):
        inputs = inputs_for(dist_env, local, ns, seed=seed, hidden=HIDDEN, num_experts=experts, num_topk=8)
        mine = inputs[rank]
        for dst, src in zip(static, (mine.x, mine.topk_idx, mine.topk_weights, *mine.layout)):
            dst.copy_(src)
        return inputs

    first = inputs_for(dist_env, local, ns, seed=51, hidden=HIDDEN, num_experts=experts, num_topk=8)[rank]
    static = [dev(t, device) for t in (first.x, first.topk_idx, first.topk_weights, *first.layout)]

    def step():
        x, idx, w, per_rank, per_node, per_expert, in_rank = static
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                           topk_weights=w, num_worst_tokens=num_worst)
        return out, buf.combine(out[0], out[4], topk_weights=out[2])

    fill(51)
    step()
    torch.cuda.synchronize()
    dist_env.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, combined = step()
    for seed in (52, 53):
        inputs = fill(seed)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        errors = dispatch_errors(out, expected(inputs, rank, experts, False, num_worst_tokens=num_worst), False,
                                 rank, inputs)
        check(dist_env, errors + round_trip_exact_errors(combined[0], combined[1], inputs[rank]),
              f"graph replay seed {seed}")


def fp8_and_bf16_round_trip_exact_errors(dist_env, buf, local: int, seed: int) -> List[str]:
    """BF16 then FP8 dispatch + combine on `buf` (1000 / 300 tokens, 64 experts, top-8), checked
    against the oracle."""
    rank, device = dist_env.rank, dist_env.device
    errors = []
    for fp8 in (False, True):
        inputs = inputs_for(dist_env, local, (1000, 300), seed=seed, hidden=HIDDEN, num_experts=_e(64), num_topk=8,
                            fp8=fp8)
        got = run_dispatch(buf, inputs[rank], device, fp8)
        errors += dispatch_errors(got, expected(inputs, rank, _e(64), fp8), fp8, rank, inputs)
        errors += combine_errors(dist_env, buf, got, inputs, local, _e(64))
    return errors


def test_sm80_feature_set(dist_env, setup):
    """A Buffer created under EPCOMM_ARCH=sm80 (read at construction) runs the kernels built with
    EPCOMM_FEATURE_SM80 on this GPU, and they are exact."""
    _, local = setup
    buf = make_buffer(dist_env, local, rdma_bytes=1 << 30, arch="sm80")
    try:
        errors = fp8_and_bf16_round_trip_exact_errors(dist_env, buf, local, seed=71)
        # every plan's kernel is built for the backend's feature set (ops._common.backend_kernel)
        gb = buf._backend
        planned = sum(len(plans) for plans in gb.plans.values())
        if gb.arch.feature != 80 or not planned:
            errors.append(f"this Buffer's feature set is {gb.arch.feature}, {planned} plans")
        check(dist_env, errors, "sm80 feature set")
    finally:
        release(dist_env, buf)


def test_mnnvl_writes_other_nodes_in_place(dist_env, setup):
    """allow_mnnvl=True: ranks of other nodes whose buffers are mapped here (on this machine every
    "node" is a GPU of one host) get records and partial sums as stores in place plus a released
    signal instead of NVSHMEM puts, with results as exact as the put path's; without it (the
    default Buffer of this module) the kernels' peer table leaves other nodes out (puts)."""
    from epcomm.ops import internode
    default_buf, local = setup
    rank, world = dist_env.rank, dist_env.world_size
    other_nodes = [r for r in range(world) if r // local != rank // local]
    errors = []
    default_table = internode.peer_table(default_buf._backend).cpu()
    if bool((default_table[other_nodes] != 0).any()):
        errors.append(f"default Buffer: other nodes' peer entries {default_table.tolist()} are not 0")
    buf = make_buffer(dist_env, local, rdma_bytes=1 << 30, mnnvl=True)
    try:
        gb = buf._backend
        if not all(gb.rdma.peer_ptrs):
            errors.append("this test needs every rank's buffer mapped (one host)")
        errors += fp8_and_bf16_round_trip_exact_errors(dist_env, buf, local, seed=83)
        table = internode.peer_table(gb).cpu()
        if bool((table == 0).any()):
            errors.append(f"allow_mnnvl: the kernels' peer table {table.tolist()} leaves ranks out")
        check(dist_env, errors, "allow_mnnvl")
    finally:
        release(dist_env, buf)


# ---- fixed-size rings and failures ---------------------------------------------------------------
def test_any_n_streams_through_rings_of_fixed_size(dist_env):
    """A Buffer of exactly the bytes the Config's rings need (nothing depends on N) carries N up to
    16384 per rank, N differing by rank, N = 0 and 1 on some: dispatch (exact and num_worst_tokens)
    and combine bit-exact, many times over every ring."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world < 2:
        pytest.skip("needs 2 or more ranks")
    config = epcomm.Config(dist_env.sms(8))
    buf = make_buffer(dist_env, 1, rdma_bytes=-(-ring_bytes(config, world, 1) // 128) * 128)
    try:
        ns = (16384, 0, 1, 4096)
        inputs = inputs_for(dist_env, 1, ns, seed=91, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
        got = run_dispatch(buf, inputs[rank], device, False, config=config)
        check(dist_env, dispatch_errors(got, expected(inputs, rank, _e(64), False), False, rank, inputs) +
              combine_errors(dist_env, buf, got, inputs, 1, _e(64), config=config), "N up to 16384")
        num_worst = sum(len(i.x) for i in inputs)
        got = run_dispatch(buf, inputs[rank], device, False, config=config, num_worst_tokens=num_worst)
        check(dist_env, dispatch_errors(got, expected(inputs, rank, _e(64), False, num_worst_tokens=num_worst),
                                        False, rank, inputs), "N up to 16384, num_worst_tokens")
    finally:
        release(dist_env, buf)


def test_rings_that_do_not_fit_raise_before_any_launch(dist_env):
    """A buffer smaller than the Config's rings: ValueError on every rank before any launch (a
    function of the Config and the Buffer alone), and the Buffer stays usable with a smaller Config."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world < 2:
        pytest.skip("needs 2 or more ranks")
    small = epcomm.Config(2, 6, 32, 4, 16)
    buf = make_buffer(dist_env, 1, rdma_bytes=-(-ring_bytes(small, world, 1) // 128) * 128)
    try:
        inputs = inputs_for(dist_env, 1, (300, 20), seed=92, hidden=HIDDEN, num_experts=_e(64), num_topk=8)

        def every_rank_raises():
            with pytest.raises(ValueError, match="smaller than the .* bytes"):
                run_dispatch(buf, inputs[rank], device, False, config=epcomm.Config(dist_env.sms(24)))
        on_all_ranks(dist_env, every_rank_raises)
        got = run_dispatch(buf, inputs[rank], device, False, config=small)
        check(dist_env, dispatch_errors(got, expected(inputs, rank, _e(64), False), False, rank, inputs) +
              combine_errors(dist_env, buf, got, inputs, 1, _e(64), config=small), "after the error")
    finally:
        release(dist_env, buf)


@pytest.mark.parametrize("differs", ["num_experts", "topk_weights"])
def test_ranks_with_different_formats_fail_on_every_rank(dist_env, differs):
    """Odd ranks pass twice the experts to dispatch (notify rows of every E_l keep their fields in
    place: the notify kernel compares them), or no topk_weights to combine (combine rows hold
    MAX_TOPK weights whatever K is, and their tags carry K): DeviceCheckFailed on every rank, never
    silently shifted counts or rows."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world < 2:
        pytest.skip("needs 2 or more ranks")
    buf = make_buffer(dist_env, 1)
    odd = rank % 2 == 1
    try:
        def every_rank_fails():
            if differs == "num_experts":
                mine = inputs_for(dist_env, 1, (128,), seed=141, hidden=HIDDEN, num_experts=_e(128) if odd else 64,
                                  num_topk=8)[rank]
                with pytest.raises(DeviceCheckFailed) as caught:
                    run_dispatch(buf, mine, device, False)   # exact mode reads the counts: raises here
            else:
                inputs = inputs_for(dist_env, 1, (128,), seed=142, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
                got = run_dispatch(buf, inputs[rank], device, False)
                buf.combine(got[0], got[4], topk_weights=None if odd else got[2])
                torch.cuda.synchronize()
                with pytest.raises(DeviceCheckFailed) as caught:
                    buf.combine(got[0], got[4], topk_weights=got[2])
            error = caught.value
            op = "internode dispatch" if differs == "num_experts" else "internode combine"
            assert (error.op, error.rank, error.phase) == (op, rank, plan.PHASES[6]), repr(error)
            assert error.peer % 2 != rank % 2, repr(error)   # a rank of the other kind
        on_all_ranks(dist_env, every_rank_fails)
    finally:
        release(dist_env, buf)


def short_timeout_buffer(dist_env, local: int, seed: int):
    """(Buffer of nodes of `local` ranks with a 3 s EPCOMM_TIMEOUT_S and its kernels built, the rank
    that is to skip a call (the last), every rank's inputs of 256 tokens)."""
    buf = make_buffer(dist_env, local, timeout_s="3")
    inputs = inputs_for(dist_env, local, (256,), seed=seed, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
    warm_kernels(dist_env, buf, inputs)
    return buf, dist_env.world_size - 1, inputs


def blames_the_skipper(error: PeerTimeout, rank: int, skipper: int, local: int) -> bool:
    """The peer a waiting rank's PeerTimeout names is the skipper or the RDMA peer on the skipper's
    node of the rank that waited: this rank, or the rank that timed out first and told this one
    (`reported_by`: its culprit is then named on every rank it told)."""
    waiting = rank if error.reported_by is None else error.reported_by
    return waiting != skipper and error.peer in {skipper, skipper // local * local + waiting % local}


def on_waiting_ranks(dist_env, skipper: int, sees_the_timeout) -> None:
    """Once every rank finished its calls so far: sees_the_timeout() on every rank but the skipper
    (which skips the next call), failing on all ranks together."""
    torch.cuda.synchronize()
    dist_env.barrier()
    on_all_ranks(dist_env, lambda: None if dist_env.rank == skipper else sees_the_timeout())


@pytest.mark.parametrize("local", [1, 2, 4], ids=["L1", "L2", "L4"])
def test_peer_timeout_names_the_peer(dist_env, local):
    """The last rank skips a dispatch: the others get PeerTimeout within the Buffer's 3 s bound,
    naming the skipper or, for L > 1, the rank of its node they wait for (their RDMA peer there);
    the Buffer is then unusable and the process carries on."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    skip_unless_split(world, local)
    buf, skipper, inputs = short_timeout_buffer(dist_env, local, seed=101)
    got = run_dispatch(buf, inputs[rank], device, False)   # every rank takes part once
    check(dist_env, dispatch_errors(got, expected(inputs, rank, _e(64), False), False, rank, inputs), "before")

    def waiting_rank_sees_the_timeout():
        began = time.monotonic()
        with pytest.raises(PeerTimeout) as caught:
            run_dispatch(buf, inputs[rank], device, False)
        seconds, error = time.monotonic() - began, caught.value
        assert (error.op, error.rank) == ("internode dispatch", rank), repr(error)
        assert blames_the_skipper(error, rank, skipper, local), repr(error)
        assert 2.0 <= seconds <= 60.0, f"PeerTimeout after {seconds:.1f} s with a 3 s bound"
        with pytest.raises(BufferUnusable):
            run_dispatch(buf, inputs[rank], device, False)
    on_waiting_ranks(dist_env, skipper, waiting_rank_sees_the_timeout)
    release(dist_env, buf)


@pytest.mark.parametrize("local", [1, 2, 4], ids=["L1", "L2", "L4"])
def test_peer_timeout_in_combine(dist_env, local):
    """Every rank dispatches, the last rank skips the combine: the others time out within the 3 s
    bound in combine's waits (the reduce's for pushed rows, the finish's for partial sums), naming
    the skipper or, for L > 1, the RDMA peer on its node that waited for it; then BufferUnusable."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    skip_unless_split(world, local)
    buf, skipper, inputs = short_timeout_buffer(dist_env, local, seed=131)
    got = run_dispatch(buf, inputs[rank], device, False)
    combined, weights, _ = buf.combine(got[0], got[4], topk_weights=got[2])   # every rank once
    check(dist_env, round_trip_exact_errors(combined, weights, inputs[rank]), "before")
    got = run_dispatch(buf, inputs[rank], device, False)   # every rank: the combine alone is skipped

    def waiting_rank_sees_the_timeout():
        began = time.monotonic()
        buf.combine(got[0], got[4], topk_weights=got[2])   # no host sync: the next call reports it
        torch.cuda.synchronize()
        seconds = time.monotonic() - began
        with pytest.raises(PeerTimeout) as caught:
            buf.combine(got[0], got[4], topk_weights=got[2])
        error = caught.value
        assert (error.op, error.rank) == ("internode combine", rank), repr(error)
        assert blames_the_skipper(error, rank, skipper, local), repr(error)
        # A rank whose own wait ran out names it: pushed rows, partial sums, or room in a ring (a
        # sender whose receiver stopped consuming). A rank told by it names where it stopped.
        waits = {plan.PHASES[3], plan.PHASES[4]} | {p for p in plan.PHASES if "ring slots" in p}
        assert error.reported_by is not None or error.phase in waits, repr(error)
        assert 2.0 <= seconds <= 60.0, f"combine ended after {seconds:.1f} s with a 3 s bound"
        with pytest.raises(BufferUnusable):
            buf.combine(got[0], got[4], topk_weights=got[2])
    on_waiting_ranks(dist_env, skipper, waiting_rank_sees_the_timeout)
    release(dist_env, buf)
