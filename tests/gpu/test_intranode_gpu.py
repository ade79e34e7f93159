"""Intranode dispatch / combine on GPUs through the public Buffer API, against epcomm.reference.oracle.

Collective: run under torchrun (`make test-gpu`); every rank runs every test. Inputs of every rank
are rebuilt on every rank from (seed, rank) on the CPU, so each rank computes its expected outputs
with the oracle without gathering tensors. Checks are bit-exact for dispatch (it only moves bytes)
and for combine against the oracle (same fp32 summation order); every rank reports the first
differing row of each output, and all ranks fail together (dist_env.all_ok).
"""
from __future__ import annotations

import time

import pytest
import torch

import epcomm
from epcomm.errors import BufferUnusable, PeerTimeout
from epcomm.ops import intranode_plan as plan
from epcomm.reference import oracle
from tests import topology
from tests.helpers.gpu import (all_inputs, calc_diff, check, combine_inputs, dev, dispatch_errors,
                               expected_dispatch, make_inputs, row_diff, run_dispatch)

pytestmark = pytest.mark.gpu
HIDDEN = 7168
_R = topology.world_size()


def _e(nominal: int) -> int:
    """An expert count near `nominal` that the session's rank count divides."""
    return topology.experts(nominal, _R)




# ---- Buffer -------------------------------------------------------------------------------------
def hint_bytes(world_size: int, hidden: int = HIDDEN) -> int:
    config = epcomm.Buffer.get_dispatch_config(world_size)
    return config.get_nvl_buffer_size_hint(hidden * 2, world_size)


@pytest.fixture(scope="module")
def buffer(dist_env):
    buf = epcomm.Buffer(dist_env.group, num_nvl_bytes=hint_bytes(dist_env.world_size),
                        explicitly_destroy=True)
    yield buf
    torch.cuda.synchronize()
    dist_env.barrier()
    buf.destroy()




# ---- dispatch -----------------------------------------------------------------------------------
CASES = [  # seed, N by rank (times world size), H, K, E, fp8, index dtype, alignment, num_sms
    (1, (1024,), HIDDEN, 8, _e(256), False, torch.int64, 1, 24),
    (2, (1024,), HIDDEN, 8, _e(256), True, torch.int64, 1, 24),
    (3, (777, 1500), HIDDEN, 8, _e(64), False, torch.int64, 128, 8),
    (4, (333,), 2056, 1, _e(16), False, torch.int64, 1, 48),
    (5, (512,), 4096, 32, _e(64), True, torch.int64, 4, 20),
    (6, (4096,), HIDDEN, 8, _e(256), False, torch.int64, 1, 24),
    (7, (300,), 1024, 8, _e(32), False, torch.int32, 1, 16),
]


def n_by_rank(pattern, world_size):
    return [pattern[r % len(pattern)] for r in range(world_size)]


@pytest.mark.parametrize("seed, ns, hidden, topk, experts, fp8, index_dtype, alignment, sms", CASES)
def test_dispatch_and_combine_match_oracle(dist_env, buffer, seed, ns, hidden, topk, experts, fp8,
                                           index_dtype, alignment, sms):
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    sms = dist_env.sms(sms)
    inputs = all_inputs(dist_env, n_by_rank(ns, world), seed=seed, hidden=hidden, num_experts=experts,
                        num_topk=topk, fp8=fp8, index_dtype=index_dtype)
    got = run_dispatch(buffer, inputs[rank], device, fp8, config=epcomm.Config(sms),
                       expert_alignment=alignment)
    want = expected_dispatch(inputs, rank, experts, fp8, alignment=alignment)
    check(dist_env, dispatch_errors(got, want, fp8), "fresh dispatch")

    # Cached dispatch: same routing, new data, equals a fresh dispatch of the new data.
    new_inputs = [make_inputs(seed + 100, r, len(i.x), hidden, experts, topk, world, fp8, index_dtype)
                  for r, i in enumerate(inputs)]
    new_x = (dev(new_inputs[rank].x_fp8, device), dev(new_inputs[rank].scales, device)) if fp8 \
        else dev(new_inputs[rank].x, device)
    cached = buffer.dispatch(new_x, handle=got[4], config=epcomm.Config(sms))
    want_cached = expected_dispatch(inputs, rank, experts, fp8, data=new_inputs)
    errors = dispatch_errors(cached, want_cached, fp8, use_topk=False)
    errors.append("" if cached[1:5] == (None, None, None, None) else "cached dispatch returned more than recv_x")
    check(dist_env, errors, "cached dispatch")

    # Combine of distinct per-rank inputs, with weights and a 2-tuple bias: bit-exact vs the oracle.
    xs, ws = combine_inputs(inputs, world, experts)
    gen = torch.Generator().manual_seed(seed + 7)
    bias = tuple(torch.randn(len(inputs[rank].x), hidden, generator=gen).to(torch.bfloat16) for _ in range(2))
    combined, weights, _ = buffer.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                                          bias=tuple(dev(b, device) for b in bias),
                                          config=epcomm.Config(max(2, sms - 4)))
    want_x, want_w = oracle.combine(xs, [i.layout[3] for i in inputs], rank, ws, bias)
    check(dist_env, [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)],
          "combine")


def test_round_trip_with_gpu_layout(dist_env, buffer):
    """The targets.md setting through the whole public API (layout on the GPU, default configs):
    combine(dispatch(x)) == x * (ranks each token reached); weights come back unchanged."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    mine = make_inputs(11, rank, 4096, HIDDEN, 256, 8, world)
    topk_idx, topk_weights = dev(mine.topk_idx, device), dev(mine.topk_weights, device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 256)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        dev(mine.x, device), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    combined, weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    reached = mine.layout[3].sum(1, keepdim=True).float()
    diff = calc_diff(combined.float().cpu(), mine.x.float() * reached)
    weight_error = float((weights.cpu() - mine.topk_weights).abs().max())
    check(dist_env, [f"calc_diff {diff} >= 5e-6" if diff >= 5e-6 else "",
                     f"weights differ by {weight_error}" if weight_error >= 1e-9 else ""], "round trip")


@pytest.mark.parametrize("seed, route, ns", [(21, "nowhere", (600,)), (22, "rank0", (500, 0)),
                                             (23, "random", (0, 900)), (24, "rank0", (0, 313)),
                                             (25, "nowhere", (1, 2, 3))])
def test_uneven_loads(dist_env, buffer, seed, route, ns):
    """Tokens going nowhere, ranks receiving nothing, N = 0 on some ranks, N differing by rank."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    inputs = all_inputs(dist_env, n_by_rank(ns, world), seed=seed, hidden=HIDDEN, num_experts=_e(64),
                        num_topk=6, route=route)
    got = run_dispatch(buffer, inputs[rank], device, False)
    check(dist_env, dispatch_errors(got, expected_dispatch(inputs, rank, 64, False), False), "dispatch")
    xs, ws = combine_inputs(inputs, world, 64)
    combined, weights, _ = buffer.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                                          bias=dev(torch.ones(len(inputs[rank].x), HIDDEN, dtype=torch.bfloat16), device))
    want_x, want_w = oracle.combine(xs, [i.layout[3] for i in inputs], rank, ws,
                                    (torch.ones(len(inputs[rank].x), HIDDEN, dtype=torch.bfloat16), None))
    check(dist_env, [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)],
          "combine")


def test_without_topk(dist_env, buffer):
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    inputs = all_inputs(dist_env, n_by_rank((700, 50), world), seed=31, hidden=HIDDEN, num_experts=_e(128),
                        num_topk=4, fp8=True)
    got = run_dispatch(buffer, inputs[rank], device, True, use_topk=False)
    want = expected_dispatch(inputs, rank, 128, True, use_topk=False)
    errors = dispatch_errors(got, want, True, use_topk=False)
    errors.append("" if got[1] is None and got[2] is None else "recv top-k returned without top-k input")
    check(dist_env, errors, "dispatch without top-k")
    xs = [expected_dispatch(inputs, r, 128, False, use_topk=False)["recv_x"] for r in range(world)]
    combined, weights, _ = buffer.combine(dev(xs[rank], device), got[4])
    want_x, _ = oracle.combine(xs, [i.layout[3] for i in inputs], rank)
    check(dist_env, [row_diff("combined_x", combined, want_x), "" if weights is None else "weights returned"],
          "combine without weights")


# ---- num_worst_tokens and CUDA graphs -------------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True])
def test_num_worst_tokens(dist_env, buffer, fp8):
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    ns = n_by_rank((900, 400), world)
    inputs = all_inputs(dist_env, ns, seed=41, hidden=HIDDEN, num_experts=_e(64), num_topk=8, fp8=fp8)
    num_worst = sum(ns)
    got = run_dispatch(buffer, inputs[rank], device, fp8, num_worst_tokens=num_worst)
    # The oracle pads to num_worst_tokens: zero rows and scales, top-k -1 / 0, recv_src_idx -1, no
    # per-expert list; its prefix is the exact dispatch.
    want = expected_dispatch(inputs, rank, 64, fp8, num_worst_tokens=num_worst)
    check(dist_env, dispatch_errors(got, want, fp8), "worst dispatch")
    if not fp8:
        recv_x, _, recv_w, _, handle, _ = got
        combined, weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
        reached = inputs[rank].layout[3].sum(1, keepdim=True).float()
        diff = calc_diff(combined.float().cpu(), inputs[rank].x.float() * reached)
        check(dist_env, [f"calc_diff {diff}" if diff >= 5e-6 else ""], "worst round trip")


def test_cuda_graph_replay(dist_env, buffer):
    """Worst-size dispatch + combine captured once, replayed with new data and new routing."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    ns = n_by_rank((640,), world)
    num_worst, experts = sum(ns), _e(64)

    def fill(seed):
        inputs = all_inputs(dist_env, ns, seed=seed, hidden=HIDDEN, num_experts=experts, num_topk=8)
        mine = inputs[rank]
        for dst, src in zip(static, (mine.x, mine.topk_idx, mine.topk_weights, *mine.layout[:1], mine.layout[2],
                                     mine.layout[3])):
            dst.copy_(src)
        return inputs

    first = all_inputs(dist_env, ns, seed=51, hidden=HIDDEN, num_experts=experts, num_topk=8)[rank]
    static = [dev(t, device) for t in (first.x, first.topk_idx, first.topk_weights, first.layout[0],
                                       first.layout[2], first.layout[3])]

    def step():
        x, idx, w, per_rank, per_expert, in_rank = static
        out = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                              num_worst_tokens=num_worst)
        combined = buffer.combine(out[0], out[4], topk_weights=out[2])
        return out, combined

    fill(51)
    step()   # compiles and sets up outside the capture
    torch.cuda.synchronize()
    dist_env.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, combined = step()
    for seed in (52, 53, 54):
        inputs = fill(seed)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        errors = dispatch_errors(out, expected_dispatch(inputs, rank, experts, False, num_worst_tokens=num_worst),
                                 False)
        reached = inputs[rank].layout[3].sum(1, keepdim=True).float()
        diff = calc_diff(combined[0].float().cpu(), inputs[rank].x.float() * reached)
        errors.append(f"replay combine calc_diff {diff}" if diff >= 5e-6 else "")
        errors.append(row_diff("replay combined weights", combined[1], inputs[rank].topk_weights))
        check(dist_env, errors, f"graph replay seed {seed}")


# ---- streams, feature sets, ring reuse, errors ------------------------------------------------------
@pytest.mark.parametrize("mode", ["async", "previous_event", "allocate_on_comm_stream"])
def test_stream_options(dist_env, buffer, mode):
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    inputs = all_inputs(dist_env, n_by_rank((800,), world), seed=61, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
    kw = dict(async_finish=True)
    if mode != "async":
        kw["previous_event"] = epcomm.Buffer.capture()
    if mode == "allocate_on_comm_stream":
        kw["allocate_on_comm_stream"] = True
    got = run_dispatch(buffer, inputs[rank], device, False, **kw)
    got[5].current_stream_wait()
    check(dist_env, dispatch_errors(got, expected_dispatch(inputs, rank, 64, False), False), f"dispatch {mode}")
    if mode != "async":
        kw["previous_event"] = epcomm.Buffer.capture()
    combined, weights, event = buffer.combine(got[0], got[4], topk_weights=got[2], **kw)
    event.current_stream_wait()
    reached = inputs[rank].layout[3].sum(1, keepdim=True).float()
    diff = calc_diff(combined.float().cpu(), inputs[rank].x.float() * reached)
    check(dist_env, [f"calc_diff {diff}" if diff >= 5e-6 else ""], f"combine {mode}")


def test_sm80_feature_set(dist_env):
    """A Buffer created under EPCOMM_ARCH=sm80 runs the kernels compiled with EPCOMM_FEATURE_SM80 on
    this GPU (the variable is read at construction), and they are exact."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPCOMM_ARCH", "sm80")
        buffer = epcomm.Buffer(dist_env.group, num_nvl_bytes=hint_bytes(world), explicitly_destroy=True)
    try:
        for fp8 in (False, True):
            inputs = all_inputs(dist_env, n_by_rank((1000, 300), world), seed=71, hidden=HIDDEN, num_experts=_e(64),
                                num_topk=8, fp8=fp8)
            got = run_dispatch(buffer, inputs[rank], device, fp8)
            errors = dispatch_errors(got, expected_dispatch(inputs, rank, 64, fp8), fp8)
            xs, ws = combine_inputs(inputs, world, 64)
            combined, weights, _ = buffer.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device))
            want_x, want_w = oracle.combine(xs, [i.layout[3] for i in inputs], rank, ws)
            errors += [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)]
            check(dist_env, errors, f"sm80 fp8={fp8}")
        # every plan's kernel is built for the backend's feature set (ops._common.backend_kernel)
        gb = buffer._backend
        planned = sum(len(plans) for plans in gb.plans.values())
        check(dist_env, [] if gb.arch.feature == 80 and planned else
              [f"this Buffer's feature set is {gb.arch.feature}, {planned} plans"], "sm80 builds used")
    finally:
        torch.cuda.synchronize()
        dist_env.barrier()
        buffer.destroy()


def small_buffer_bytes(world: int, ring_rows: int, num_topk: int, experts: int, sms: int) -> int:
    dispatch = plan.dispatch_staging_offset(world, experts // world) + \
        (world - 1) * ring_rows * plan.dispatch_record_bytes(HIDDEN * 2, 0, num_topk)
    combine = plan.combine_staging_offset(world) + (world - 1) * ring_rows * plan.combine_record_bytes(HIDDEN * 2, num_topk)
    return -(-max(dispatch, combine) // 128) * 128


def test_ring_reuse_with_a_small_buffer(dist_env):
    """Rings far smaller than the streams: senders wait for consumed chunks, many times over."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world == 1:
        pytest.skip("needs 2 or more ranks")
    sms, experts = dist_env.sms(24), _e(64)
    streams = n_by_rank((2048, 1536), world)
    # 40 rows, or one chunk of the longest stream where fewer SMs (an MPS share) cut fewer chunks:
    # still a ring many times smaller than the stream.
    ring_rows = max(40, plan.tokens_per_chunk(max(streams), plan.num_chunks(sms, world)))
    buf = epcomm.Buffer(dist_env.group, num_nvl_bytes=small_buffer_bytes(world, ring_rows, 8, experts, sms),
                        explicitly_destroy=True)
    try:
        for seed in (81, 82):
            inputs = all_inputs(dist_env, streams, seed=seed, hidden=HIDDEN,
                                num_experts=experts, num_topk=8)
            got = run_dispatch(buf, inputs[rank], device, False, config=epcomm.Config(sms))
            errors = dispatch_errors(got, expected_dispatch(inputs, rank, experts, False), False)
            xs, ws = combine_inputs(inputs, world, experts)
            combined, weights, _ = buf.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                                               config=epcomm.Config(sms))
            want_x, want_w = oracle.combine(xs, [i.layout[3] for i in inputs], rank, ws)
            errors += [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)]
            check(dist_env, errors, f"small ring seed {seed}")
    finally:
        torch.cuda.synchronize()
        dist_env.barrier()
        buf.destroy()


@pytest.mark.parametrize("sms, ns, route, ring_rows, combine_sms", [
    (2, (3000, 1000), "random", None, 2),     # one sending block takes every chunk, one block receives
    (2, (3000, 1000), "random", 400, 2),      # ... through rings reused ~8 times over
    (48, (4096, 37), "random", None, 10),     # 32 blocks claim 256 chunks; the other rank's are mostly empty
    (48, (2500, 900), "rank0", 30, 48),       # small rings, rank 1 receives nothing: ring waits across blocks
])
def test_dynamic_chunk_claims(dist_env, buffer, sms, ns, route, ring_rows, combine_sms):
    """Sending blocks take chunks from a rank-wide counter (intranode_protocol.cuh send_chunks): every
    chunk must go out exactly once, whichever block takes it, and the counter must be back at 0 for
    the next kernel. Dispatch, combine, cached dispatch and combine run back to back (no host sync
    between them), with different grids for dispatch and combine; a traced call then counts the
    chunks the sending blocks took."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    sms, combine_sms = dist_env.sms(sms), dist_env.sms(combine_sms)
    if world == 1:
        pytest.skip("needs 2 or more ranks")
    experts = _e(64)
    if ring_rows is not None:   # at least one chunk: the chunk count follows the SM count (MPS share)
        ring_rows = max(ring_rows, plan.tokens_per_chunk(max(n_by_rank(ns, world)), plan.num_chunks(sms, world)))
    buf = buffer if ring_rows is None else epcomm.Buffer(
        dist_env.group, num_nvl_bytes=small_buffer_bytes(world, ring_rows, 8, experts, sms), explicitly_destroy=True)
    try:
        inputs = all_inputs(dist_env, n_by_rank(ns, world), seed=111 + sms, hidden=HIDDEN, num_experts=experts,
                            num_topk=8, route=route)
        new_inputs = [make_inputs(211 + sms, r, len(i.x), HIDDEN, experts, 8, world, route=route)
                      for r, i in enumerate(inputs)]
        xs, ws = combine_inputs(inputs, world, experts)
        new_xs, _ = combine_inputs(inputs, world, experts, data=new_inputs)
        got = run_dispatch(buf, inputs[rank], device, False, config=epcomm.Config(sms))
        combined = buf.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                               config=epcomm.Config(combine_sms))
        cached = buf.dispatch(dev(new_inputs[rank].x, device), handle=got[4], config=epcomm.Config(sms))
        combined_again = buf.combine(dev(new_xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                                     config=epcomm.Config(combine_sms))
        layout = [i.layout[3] for i in inputs]
        want_x, want_w = oracle.combine(xs, layout, rank, ws)
        want_again, _ = oracle.combine(new_xs, layout, rank, ws)
        errors = dispatch_errors(got, expected_dispatch(inputs, rank, experts, False), False)
        errors += dispatch_errors(cached, expected_dispatch(inputs, rank, experts, False, data=new_inputs), False,
                                  use_topk=False)
        errors += [row_diff("combined_x", combined[0], want_x), row_diff("combined_topk_weights", combined[1], want_w),
                   row_diff("combined_x (second combine)", combined_again[0], want_again)]

        # Traced cached dispatch and combine: the chunks the sending blocks took add up to G exactly.
        from epcomm.ops import intranode
        chunks = plan.num_chunks(sms, world)
        intranode.set_tracing(True)
        try:
            for what, call in (("dispatch", lambda: buf.dispatch(dev(inputs[rank].x, device), handle=got[4],
                                                                  config=epcomm.Config(sms))),
                               ("combine", lambda: buf.combine(dev(xs[rank], device), got[4],
                                                                config=epcomm.Config(combine_sms)))):
                call()
                trace = intranode.last_trace(device.index)
                taken = trace[:, 0, plan.TRACE_SLOTS.index("chunks")]
                if int(taken.sum()) != chunks:
                    errors.append(f"traced {what}: sending blocks took {int(taken.sum())} chunks "
                                  f"({taken.tolist()}), want G = {chunks}")
        finally:
            intranode.set_tracing(False)
        check(dist_env, errors, f"dynamic claims sms={sms} ns={ns} ring_rows={ring_rows}")
    finally:
        if buf is not buffer:
            torch.cuda.synchronize()
            dist_env.barrier()
            buf.destroy()


def test_chunk_larger_than_ring_raises_before_launch(dist_env):
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world == 1:
        pytest.skip("needs 2 or more ranks")
    sms = dist_env.sms(8)
    buf = epcomm.Buffer(dist_env.group, num_nvl_bytes=small_buffer_bytes(world, 4, 8, _e(64), sms),
                        explicitly_destroy=True)
    try:
        inputs = all_inputs(dist_env, n_by_rank((4096,), world), seed=91, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
        with pytest.raises(ValueError, match="does not fit"):
            run_dispatch(buf, inputs[rank], device, False, config=epcomm.Config(sms))
        # Nothing half-done: the Buffer still works for a call that fits.
        small = all_inputs(dist_env, n_by_rank((16,), world), seed=92, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
        got = run_dispatch(buf, small[rank], device, False, config=epcomm.Config(sms))
        check(dist_env, dispatch_errors(got, expected_dispatch(small, rank, 64, False), False), "after the error")
    finally:
        torch.cuda.synchronize()
        dist_env.barrier()
        buf.destroy()


def test_peer_timeout_names_the_peer(dist_env, monkeypatch):
    """The last rank skips a dispatch: every other rank gets PeerTimeout naming it, within the
    Buffer's short timeout; the Buffer then says it is unusable and the process carries on."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    if world == 1:
        pytest.skip("needs 2 or more ranks")
    with monkeypatch.context() as env:
        env.setenv("EPCOMM_TIMEOUT_S", "3")
        buf = epcomm.Buffer(dist_env.group, num_nvl_bytes=hint_bytes(world), explicitly_destroy=True)
    skipper = world - 1
    inputs = all_inputs(dist_env, n_by_rank((256,), world), seed=101, hidden=HIDDEN, num_experts=_e(64), num_topk=8)
    # A correct call on every rank first, so the timeout below is the only thing that differs.
    got = run_dispatch(buf, inputs[rank], device, False)
    errors = dispatch_errors(got, expected_dispatch(inputs, rank, 64, False), False)
    torch.cuda.synchronize()
    dist_env.barrier()
    if rank != skipper:
        start = time.monotonic()
        try:
            run_dispatch(buf, inputs[rank], device, False)
            errors.append("dispatch returned although a peer never joined")
        except PeerTimeout as e:
            elapsed = time.monotonic() - start
            if e.peer != skipper or e.rank != rank or "dispatch" not in e.op:
                errors.append(f"PeerTimeout names op {e.op!r} rank {e.rank} peer {e.peer}; want peer {skipper}")
            if not 2.0 <= elapsed <= 60.0:
                errors.append(f"raised after {elapsed:.1f} s with a 3 s timeout")
            print(f"[rank {rank}] got the expected {e!r} after {elapsed:.1f} s", flush=True)
        try:
            run_dispatch(buf, inputs[rank], device, False)
            errors.append("the Buffer accepted a call after a peer timeout")
        except BufferUnusable:
            pass
    torch.cuda.synchronize()
    dist_env.barrier()
    check(dist_env, errors, "peer timeout")
    buf.destroy()   # every rank is alive: destroy's meeting finds them all, so it frees collectively
