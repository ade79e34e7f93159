"""Internode dispatch / combine on GPUs through the public Buffer API, against epcomm.reference.oracle.

Collective: run under torchrun (`make test-gpu`). EPCOMM_NUM_LOCAL_RANKS cuts the GPUs of one host
into "nodes" (set while each Buffer is built): with L = 1 on the 2-GPU machine every GPU is a node,
so every transfer between ranks goes through NVSHMEM puts (P2P transport between PEs of one host)
and the NVLink stage is the degenerate own-buffer case. L = 2 with M >= 2 (4+ GPUs)
exercises the NVLink pull / push between local ranks; those cases skip on fewer GPUs.

Inputs of every rank are rebuilt on every rank from (seed, rank) on the CPU (tests/helpers/gpu.py,
shared with test_intranode_gpu.py); dispatch is bit-exact against the oracle, combine bit-exact against
oracle.combine(num_local_ranks=L) (the kernels' fp32 order) and within calc_diff < 5e-6 of
x * (ranks each token reached) on the round trip.
"""
from __future__ import annotations

import time
from typing import List

import pytest
import torch

import epcomm
from epcomm.errors import BufferUnusable, DeviceCheckFailed, PeerTimeout
from epcomm.ops import internode
from epcomm.ops import internode_plan as plan
from epcomm.reference import oracle
from tests import topology
from tests.conftest import on_all_ranks
from tests.helpers.gpu import calc_diff, check, combine_inputs, dev, make_inputs, row_diff, run_dispatch
from tests.helpers.gpu import expected_dispatch as expected

pytestmark = pytest.mark.gpu
HIDDEN = 7168
_R = topology.world_size()
ROUND_TRIP_TOKENS = 4096


def _e(nominal: int) -> int:
    """An expert count near `nominal` that the session's rank count divides."""
    return topology.experts(nominal, _R)


def make_buffer(dist_env, local: int, rdma_bytes: int = 256 << 20, timeout_s: str = "", arch: str = "",
                mnnvl: bool = False):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPCOMM_NUM_LOCAL_RANKS", str(local))
        if timeout_s:
            env.setenv("EPCOMM_TIMEOUT_S", timeout_s)
        if arch:
            env.setenv("EPCOMM_ARCH", arch)
        return epcomm.Buffer(dist_env.group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma_bytes,
                             explicitly_destroy=True, allow_mnnvl=mnnvl)


def release(dist_env, buf, failed: bool = False) -> None:
    """failed: the Buffer recorded a failure, but every rank is alive and its kernels finished, so
    teardown may still be collective (a failure marks the peers possibly dead)."""
    torch.cuda.synchronize()
    if failed:
        buf._backend.nvshmem.peer_failed = False
    dist_env.barrier()
    buf.destroy()


def warm_kernels(dist_env, buf, hidden: int = HIDDEN, index_type: str = "long long") -> None:
    """Build (or load) the kernels of a BF16 dispatch + combine on `buf`, then meet every rank: a
    short EPCOMM_TIMEOUT_S then bounds the peers' calls, not one rank's first-call JIT time."""
    gb, world = buf._backend, dist_env.world_size
    local = gb.num_local_ranks
    for name in (plan.notify_kernel(world, local), plan.dispatch_kernel(world, local, hidden * 2, 0, index_type, True),
                 plan.combine_kernel(world, local, hidden * 2)):
        internode._kernel(gb, name)
    torch.cuda.synchronize()
    dist_env.barrier()


def ring_bytes(config, world: int, local: int, hidden: int = HIDDEN) -> int:
    """num_rdma_bytes that calls with `config` need (independent of N) next to make_buffer's NVL
    buffer, push FIFOs included."""
    return plan.rdma_bytes_for([config], hidden * 2, hidden // 128, 32, world, local, 1 << 20)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["L1", "L2", "L4"])
def setup(dist_env, request):
    """(Buffer, L): M = R / L nodes of L ranks, M >= 2 (at R = 8: 8 x 1, 4 x 2, 2 x 4)."""
    local, world = request.param, dist_env.world_size
    if world % local or world // local < 2:
        pytest.skip(f"needs at least 2 nodes of {local} ranks ({2 * local}+ ranks, a multiple of {local}); "
                    f"this run has {world}")
    # The rings of the largest Config of this module (FP8 scales, K = 32 cover every case); the NVL
    # buffer of make_buffer is too small for combine's push FIFOs, so they take RDMA bytes too.
    need = max(ring_bytes(epcomm.Config(dist_env.sms(48)), world, local),
               ring_bytes(epcomm.Buffer.get_dispatch_config(world), world, local))
    buf = make_buffer(dist_env, local, rdma_bytes=max(need, 1 << 30))
    assert buf.runtime.get_num_rdma_ranks() == world // local
    yield buf, local
    release(dist_env, buf)


def inputs_for(dist_env, local: int, ns, **kw):
    """Every rank's inputs with the internode layout (num_tokens_per_rdma_rank for L)."""
    world = dist_env.world_size
    out = []
    for r in range(world):
        inp = make_inputs(rank=r, num_tokens=ns[r % len(ns)], num_ranks=world, **kw)
        inp.layout = oracle.layout(inp.topk_idx.long(), kw["num_experts"], world, local)
        out.append(inp)
    return out


def dispatch_errors(got, want, fp8: bool, rank: int, inputs, use_topk=True) -> List[str]:
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = got
    src = want["recv_src_idx"]
    errors = [row_diff("recv_x (fp8)", recv_x[0], want["recv_x"], src),
              row_diff("recv_x_scales", recv_x[1], want["recv_x_scales"], src)] if fp8 else \
        [row_diff("recv_x", recv_x, want["recv_x"], src)]
    if use_topk:
        errors += [row_diff("recv_topk_idx", recv_topk_idx, want["recv_topk_idx"], src),
                   row_diff("recv_topk_weights", recv_topk_weights, want["recv_topk_weights"], src)]
    if handle is not None:
        received = torch.tensor([int(i.layout[3][:, rank].sum()) for i in inputs])
        sources = torch.repeat_interleave(torch.arange(len(inputs)), received).int()
        meta = handle[7].cpu()
        errors += [row_diff("handle[6] recv_gbl_rank_prefix_sum", handle[6], received.cumsum(0).int()),
                   row_diff("handle[7][:, 0] source rank", meta[:len(sources), 0].contiguous(), sources),
                   row_diff("handle[7][:, 1] source token", meta[:, 1].contiguous(), src)]
        if counts != want["num_recv_tokens_per_expert_list"]:
            errors.append(f"num_recv_tokens_per_expert_list: got {counts}, want "
                          f"{want['num_recv_tokens_per_expert_list']}")
    return errors


def combine_errors(dist_env, buf, got, inputs, local: int, experts: int, bias=None, config=None) -> List[str]:
    """Combine of distinct per-rank rows (combine_inputs) through `got`'s handle vs the oracle,
    bit-exact (the kernels sum in oracle.combine's order for nodes of `local` ranks)."""
    rank, device = dist_env.rank, dist_env.device
    xs, ws = combine_inputs(inputs, dist_env.world_size, experts)
    on_device = None if bias is None else tuple(dev(b, device) for b in bias)
    combined, weights, _ = buf.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                                       bias=on_device, config=config)
    want_x, want_w = oracle.combine(xs, [i.layout[3] for i in inputs], rank, ws,
                                    (None, None) if bias is None else bias, num_local_ranks=local)
    return [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)]


def oracle_round_trip(inputs, rank: int, world: int, experts: int, local: int):
    """oracle.combine of the rows every rank received (dispatch's own output fed back, no bias)."""
    wants = [expected(inputs, r, experts, False) for r in range(world)]
    return oracle.combine([w["recv_x"] for w in wants], [i.layout[3] for i in inputs], rank,
                          [w["recv_topk_weights"] for w in wants], (None, None), num_local_ranks=local)


def round_trip_errors(combined, weights, mine) -> List[str]:
    """combine(dispatch(x)) == x * (ranks the token reached) within calc_diff 5e-6; weights back."""
    reached = mine.layout[3].sum(1, keepdim=True).float()
    diff = calc_diff(combined.float().cpu(), mine.x.float() * reached)
    errors = [f"calc_diff {diff} >= 5e-6" if diff >= 5e-6 else ""]
    if weights is not None:
        gap = float((weights.cpu() - mine.topk_weights).abs().max()) if weights.numel() else 0.0
        errors.append(f"weights differ by {gap}" if gap >= 1e-9 else "")
    return errors


# ---- dispatch + cached dispatch + combine ----------------------------------------------------------
CASES = [  # seed, N by rank, H, K, E, fp8, index dtype, alignment, num_sms
    (1, (1024,), HIDDEN, 8, _e(256), False, torch.int64, 1, 24),
    (2, (1024,), HIDDEN, 8, _e(256), True, torch.int64, 1, 24),
    (3, (777, 1500), HIDDEN, 8, _e(64), False, torch.int32, 128, 8),
    (4, (333,), 2056, 1, _e(16), False, torch.int64, 1, 48),
    (5, (512,), 4096, 32, _e(64), True, torch.int32, 4, 20),
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
    check(dist_env, round_trip_errors(combined, weights, mine) +
          [row_diff("num_tokens_per_rdma_rank", per_node, mine.layout[1])], "round trip")


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
        check(dist_env, round_trip_errors(combined, weights, inputs[rank]), "worst round trip")


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
        check(dist_env, errors + round_trip_errors(combined[0], combined[1], inputs[rank]),
              f"graph replay seed {seed}")


def fp8_and_bf16_round_trip_errors(dist_env, buf, local: int, seed: int) -> List[str]:
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


def test_sm80_feature_set(dist_env, setup, monkeypatch):
    """A Buffer created under EPCOMM_ARCH=sm80 (read at construction) runs the kernels built with
    EPCOMM_FEATURE_SM80 on this GPU, and they are exact."""
    from epcomm.ops import _common
    _, local = setup
    features = set()
    get_kernel = _common.get_kernel

    def recording_get_kernel(src, kernel, device_index, feature):
        features.add(feature)
        return get_kernel(src, kernel, device_index, feature)
    monkeypatch.setattr(_common, "get_kernel", recording_get_kernel)
    buf = make_buffer(dist_env, local, rdma_bytes=1 << 30, arch="sm80")
    try:
        errors = fp8_and_bf16_round_trip_errors(dist_env, buf, local, seed=71)
        if features != {80}:
            errors.append(f"the kernels were looked up for feature sets {features}")
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
        errors += fp8_and_bf16_round_trip_errors(dist_env, buf, local, seed=83)
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
        release(dist_env, buf, failed=True)


def short_timeout_buffer(dist_env, local: int, seed: int):
    """(Buffer of nodes of `local` ranks with a 3 s EPCOMM_TIMEOUT_S and its kernels built, the rank
    that is to skip a call (the last), every rank's inputs of 256 tokens)."""
    buf = make_buffer(dist_env, local, timeout_s="3")
    inputs = inputs_for(dist_env, local, (256,), seed=seed, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
    warm_kernels(dist_env, buf)
    return buf, dist_env.world_size - 1, inputs


def on_waiting_ranks(dist_env, skipper: int, sees_the_timeout) -> None:
    """Once every rank finished its calls so far: sees_the_timeout() on every rank but the skipper
    (which skips the next call), failing on all ranks together."""
    torch.cuda.synchronize()
    dist_env.barrier()
    on_all_ranks(dist_env, lambda: None if dist_env.rank == skipper else sees_the_timeout())


def test_peer_timeout_names_the_peer(dist_env):
    """The last rank skips a dispatch: the others get PeerTimeout naming it (op, rank, peer) within
    the Buffer's 3 s bound; the Buffer is then unusable and the process carries on."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world < 2:
        pytest.skip("needs 2 or more ranks")
    buf, skipper, inputs = short_timeout_buffer(dist_env, 1, seed=101)
    got = run_dispatch(buf, inputs[rank], device, False)   # every rank takes part once
    check(dist_env, dispatch_errors(got, expected(inputs, rank, _e(64), False), False, rank, inputs), "before")

    def waiting_rank_sees_the_timeout():
        began = time.monotonic()
        with pytest.raises(PeerTimeout) as caught:
            run_dispatch(buf, inputs[rank], device, False)
        seconds, error = time.monotonic() - began, caught.value
        assert (error.op, error.rank, error.peer) == ("internode dispatch", rank, skipper), repr(error)
        assert 2.0 <= seconds <= 60.0, f"PeerTimeout after {seconds:.1f} s with a 3 s bound"
        with pytest.raises(BufferUnusable):
            run_dispatch(buf, inputs[rank], device, False)
    on_waiting_ranks(dist_env, skipper, waiting_rank_sees_the_timeout)
    release(dist_env, buf, failed=True)   # the skipper is alive: teardown may be collective


@pytest.mark.parametrize("local", [1, 2, 4], ids=["L1", "L2", "L4"])
def test_peer_timeout_in_combine(dist_env, local):
    """Every rank dispatches, the last rank skips the combine: the others time out within the 3 s
    bound in combine's waits (the reduce's for pushed rows, the finish's for partial sums), naming
    the skipper or, for L > 1, the RDMA peer on its node that waited for it; then BufferUnusable."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world % local or world // local < 2:
        pytest.skip(f"needs at least 2 nodes of {local} ranks; this run has {world}")
    buf, skipper, inputs = short_timeout_buffer(dist_env, local, seed=131)
    got = run_dispatch(buf, inputs[rank], device, False)
    combined, weights, _ = buf.combine(got[0], got[4], topk_weights=got[2])   # every rank once
    check(dist_env, round_trip_errors(combined, weights, inputs[rank]), "before")
    got = run_dispatch(buf, inputs[rank], device, False)   # every rank: the combine alone is skipped

    def waiting_rank_sees_the_timeout():
        began = time.monotonic()
        buf.combine(got[0], got[4], topk_weights=got[2])   # no host sync: the next call reports it
        torch.cuda.synchronize()
        seconds = time.monotonic() - began
        with pytest.raises(PeerTimeout) as caught:
            buf.combine(got[0], got[4], topk_weights=got[2])
        error = caught.value
        waited_for = {skipper, skipper // local * local + rank % local}
        assert (error.op, error.rank) == ("internode combine", rank) and error.peer in waited_for, repr(error)
        assert error.phase in (plan.PHASES[3], plan.PHASES[4]), repr(error)
        assert 2.0 <= seconds <= 60.0, f"combine ended after {seconds:.1f} s with a 3 s bound"
        with pytest.raises(BufferUnusable):
            buf.combine(got[0], got[4], topk_weights=got[2])
    on_waiting_ranks(dist_env, skipper, waiting_rank_sees_the_timeout)
    release(dist_env, buf, failed=True)
