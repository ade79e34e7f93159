"""The per-signature fast path on GPUs (epcomm/buffer.py `_remember`, the ops modules' runners):
calls repeated with one signature (the first validated in full, the later ones through the runner,
with new data each time) against epcomm.reference.oracle, bit for bit as in the mode's own GPU
tests; a changed signature in between takes the full checks again. Collective: run every rank
under torchrun (`make test-gpu`)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import epcomm
from epcomm.reference import oracle
from tests import topology
from tests.helpers.low_latency import FP8_TARGET, checked_round_trip, shared_buffer, verdict
from tests.helpers.gpu import (all_inputs, check, combine_inputs, dev, dispatch_errors, expected_dispatch, make_inputs,
                               row_diff, run_dispatch)

pytestmark = pytest.mark.gpu
_R = topology.world_size()


def _runner_kinds(runs: dict) -> set:
    """Which runners a Buffer holds: the backend's own ("run") or its method (a Buffer lambda)."""
    return {getattr(run, "__name__", "") for run in runs.values()}


def test_low_latency_repeated_calls_match_oracle(dist_env):
    """Five checked dispatch + combine pairs per signature, FP8 then BF16 then FP8 again: every call
    after the first of its signature runs through the runner (and the pooled outputs)."""
    buf = shared_buffer(dist_env)
    problems = []
    for i, case in enumerate([FP8_TARGET] * 5 + [replace(FP8_TARGET, fp8=False)] * 3 + [FP8_TARGET] * 2):
        problems += checked_round_trip(dist_env, buf, case, seed=40 + i, clean=i == 0)
        if i == 0 and not buf._ll_dispatch_runs:
            problems.append("no low-latency dispatch runner after the first call")
    if _runner_kinds(buf._ll_dispatch_runs) != {"run"} or _runner_kinds(buf._ll_combine_runs) != {"run"}:
        problems.append(f"runners: {buf._ll_dispatch_runs} / {buf._ll_combine_runs}")
    verdict(dist_env, problems, "repeated low-latency calls")


def test_low_latency_fast_path_rejects_a_changed_signature(dist_env):
    """After the fast path of one signature, a call whose topk_idx has another dtype raises the
    full check's TypeError on every rank, and the next good call still matches the oracle."""
    buf = shared_buffer(dist_env)
    case = FP8_TARGET
    problems = checked_round_trip(dist_env, buf, case, seed=60) + checked_round_trip(dist_env, buf, case, seed=61, clean=False)
    x = torch.randn(case.tokens(dist_env.rank), case.H, device=dist_env.device).to(torch.bfloat16)
    bad_idx = torch.zeros(x.shape[0], case.K, dtype=torch.int32, device=dist_env.device)
    with pytest.raises(TypeError, match="topk_idx must have dtype torch.int64"):
        buf.low_latency_dispatch(x, bad_idx, case.T, case.E)
    problems += checked_round_trip(dist_env, buf, case, seed=62, clean=False)
    verdict(dist_env, problems, "changed signature")


def _intranode_buffer(dist_env):
    config = epcomm.Buffer.get_dispatch_config(dist_env.world_size)
    return epcomm.Buffer(dist_env.group, num_nvl_bytes=config.get_nvl_buffer_size_hint(7168 * 2, dist_env.world_size),
                         explicitly_destroy=True)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_intranode_cached_dispatch_and_combine_repeated_match_oracle(dist_env, fp8):
    """Cached dispatch and combine four times each with one handle and new data each time."""
    rank, world, device = dist_env.rank, dist_env.world_size, dist_env.device
    hidden, topk, experts, sms = 7168, 8, topology.experts(256, _R), dist_env.sms(24)
    buf = _intranode_buffer(dist_env)
    try:
        config = epcomm.Config(sms)
        inputs = all_inputs(dist_env, [512 + 64 * (r % 3) for r in range(world)], seed=80, hidden=hidden,
                            num_experts=experts, num_topk=topk, fp8=fp8)
        got = run_dispatch(buf, inputs[rank], device, fp8, config=config)
        errors = []
        for i in range(4):
            data = [make_inputs(81 + i, r, len(inp.x), hidden, experts, topk, world, fp8) for r, inp in enumerate(inputs)]
            new_x = (dev(data[rank].x_fp8, device), dev(data[rank].scales, device)) if fp8 else dev(data[rank].x, device)
            cached = buf.dispatch(new_x, handle=got[4], config=config)
            want = expected_dispatch(inputs, rank, experts, fp8, data=data)
            errors += [f"cached dispatch {i}: {e}" for e in dispatch_errors(cached, want, fp8, use_topk=False) if e]

            xs, ws = combine_inputs(inputs, world, experts, data=data)
            combined, weights, _ = buf.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                                               config=config)
            want_x, want_w = oracle.combine(xs, [inp.layout[3] for inp in inputs], rank, ws, (None, None))
            errors += [f"combine {i}: {e}" for e in (row_diff("combined_x", combined, want_x),
                                                     row_diff("combined_topk_weights", weights, want_w)) if e]
        if _runner_kinds(buf._dispatch_runs) != {"run"} or _runner_kinds(buf._combine_runs) != {"run"}:
            errors.append(f"runners: {buf._dispatch_runs} / {buf._combine_runs}")
        check(dist_env, errors, "repeated cached dispatch / combine")
    finally:
        torch.cuda.synchronize()
        dist_env.barrier()
        buf.destroy()
