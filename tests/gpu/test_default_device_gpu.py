"""DeepEP's own test helpers (and frameworks) call `torch.set_default_device('cuda')` and
`torch.set_default_dtype(torch.bfloat16)`: the main calls of every mode must run under them and
give what they give under torch's defaults. Collective: every rank runs every test (`make test-gpu`).
Shapes derive from the rank count R; the internode case runs each rank as its own node (R >= 2)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import epcomm
from epcomm.ops import internode_plan
from tests.conftest import on_all_ranks

pytestmark = pytest.mark.gpu

HIDDEN, TOPK, TOKENS = 2048, 4, 96


@contextlib.contextmanager
def _framework_defaults():
    previous = torch.get_default_dtype()
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(previous)


def _inputs(dist_env, num_experts):
    gen = torch.Generator().manual_seed(11 + dist_env.rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float32, device="cpu")
    scores = torch.rand(TOKENS, num_experts, generator=gen, dtype=torch.float32, device="cpu")
    weights, idx = scores.topk(TOPK, dim=-1)
    dev = dist_env.device
    return (x.to(dev, torch.bfloat16), idx.to(dev, torch.int64), weights.to(dev, torch.float32))


def _normal_mode(buffer, x, idx, weights, num_experts):
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=weights)
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    torch.cuda.synchronize()
    return dict(per_rank=per_rank, per_expert=per_expert, in_rank=in_rank,
                num_recv=torch.tensor([recv_x.shape[0]] + per_expert_list, dtype=torch.int64,
                                      device="cpu"),
                combined=combined, combined_w=combined_w)


def _low_latency(buffer, x, idx, weights, num_experts):
    out = {}
    for use_fp8 in (True, False):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
            x, idx, TOKENS, num_experts, use_fp8=use_fp8)
        out[f"recv_count_fp8={use_fp8}"] = recv_count
    # BF16 rows went out last: combine them back
    out["combined"] = buffer.low_latency_combine(recv_x, idx, weights, handle)[0]
    torch.cuda.synchronize()
    return out


def _check_same(want, got):
    for name, expected in want.items():
        actual = got[name]
        assert actual.device == expected.device, (name, actual.device, expected.device)
        assert actual.dtype == expected.dtype, (name, actual.dtype, expected.dtype)
        assert torch.equal(actual, expected), name


def _run_twice(dist_env, make_buffer, mode):
    num_experts = 4 * dist_env.world_size
    inputs = _inputs(dist_env, num_experts)
    buffer = make_buffer()
    try:
        want = mode(buffer, *inputs, num_experts)
        with _framework_defaults():
            got = mode(buffer, *inputs, num_experts)
        on_all_ranks(dist_env, lambda: _check_same(want, got))
        with _framework_defaults():
            second = make_buffer()   # construction itself under the framework's defaults
        try:
            with _framework_defaults():
                again = mode(second, *inputs, num_experts)
            on_all_ranks(dist_env, lambda: _check_same(want, again))
        finally:
            dist_env.barrier()
            second.destroy()
    finally:
        dist_env.barrier()
        buffer.destroy()


def test_intranode_under_framework_defaults(dist_env):
    _run_twice(dist_env, lambda: epcomm.Buffer(dist_env.group, num_nvl_bytes=256 << 20,
                                               explicitly_destroy=True), _normal_mode)


def test_internode_under_framework_defaults(dist_env):
    world = dist_env.world_size
    if world < 2:
        pytest.skip("internode needs 2 ranks (each its own node); this run has 1")
    configs = [epcomm.Buffer.get_dispatch_config(world), epcomm.Buffer.get_combine_config(world)]
    rdma = internode_plan.rdma_bytes_for(configs, HIDDEN * 2, 0, TOPK, world, 1, 0)

    def make_buffer():
        with pytest.MonkeyPatch.context() as env:
            env.setenv("EPCOMM_NUM_LOCAL_RANKS", "1")
            return epcomm.Buffer(dist_env.group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma,
                                 explicitly_destroy=True)

    _run_twice(dist_env, make_buffer, _normal_mode)


def test_low_latency_under_framework_defaults(dist_env):
    world = dist_env.world_size
    num_experts = 4 * world
    rdma = epcomm.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, world, num_experts)
    _run_twice(dist_env, lambda: epcomm.Buffer(
        dist_env.group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world,
        explicitly_destroy=True), _low_latency)
