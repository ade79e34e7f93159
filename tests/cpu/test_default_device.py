"""Frameworks (and DeepEP's own test helpers) change torch's default device and dtype; epcomm must
name the device and dtype of every tensor it creates. On 2 gloo processes, the main calls of every
mode run once with torch's defaults and once under `set_default_device('meta')` +
`set_default_dtype(float64)`: the outputs must be the same CPU tensors, bit for bit."""
import os

import torch

from tests.conftest import run_ranks

HIDDEN, TOPK, TOKENS = 256, 2, 6


def _inputs(rank, num_experts):
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float32, device="cpu").bfloat16()
    scores = torch.rand(TOKENS, num_experts, generator=gen, dtype=torch.float32, device="cpu")
    weights, idx = scores.topk(TOPK, dim=-1)
    return x, idx.to(torch.int64), weights.to(torch.float32)


def _normal_mode(group, x, idx, weights, num_experts):
    import epcomm
    buffer = epcomm.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 20,
                           explicitly_destroy=True)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=weights)
    cached_x = buffer.dispatch(x, handle=handle)[0]
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    local = buffer.get_local_buffer_tensor(torch.int32, offset=128)
    out = dict(per_rank=per_rank, per_expert=per_expert, in_rank=in_rank, recv_x=recv_x,
               recv_idx=recv_idx, recv_w=recv_w, cached_x=cached_x, combined=combined,
               combined_w=combined_w, local=local,
               per_expert_list=torch.tensor(per_expert_list, dtype=torch.int64, device="cpu"))
    if per_rdma is not None:
        out["per_rdma"] = per_rdma
    buffer.destroy()
    return out


def _low_latency(group, x, idx, weights, num_experts):
    import epcomm
    ranks = group.size()
    tokens_per_rank = TOKENS
    buffer = epcomm.Buffer(group, 0, epcomm.Buffer.get_low_latency_rdma_size_hint(
        tokens_per_rank, HIDDEN, ranks, num_experts), low_latency_mode=True,
        num_qps_per_rank=num_experts // ranks, explicitly_destroy=True)
    out = {}
    for use_fp8 in (False, True):
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            x, idx, tokens_per_rank, num_experts, use_fp8=use_fp8, return_recv_hook=True)
        hook()
        if use_fp8:
            values, scales = recv_x
            out.update(fp8_x=values.view(torch.uint8), fp8_scales=scales)
            continue
        out.update(recv_x=recv_x, recv_count=recv_count, src_info=handle[0],
                   layout_range=handle[1])
        combined, _, _ = buffer.low_latency_combine(recv_x, idx, weights, handle)
        out["combined"] = combined
        zero_copy = buffer.get_next_low_latency_combine_buffer(handle)
        zero_copy.copy_(recv_x)
        out["zero_copy"] = buffer.low_latency_combine(recv_x, idx, weights, handle,
                                                      zero_copy=True)[0]
    buffer.destroy()
    return out


def _every_mode(group, inputs, num_experts):
    out = {"intranode": _normal_mode(group, *inputs, num_experts)}
    os.environ["EPCOMM_NUM_LOCAL_RANKS"] = "1"   # each rank its own node: internode mode
    try:
        out["internode"] = _normal_mode(group, *inputs, num_experts)
    finally:
        del os.environ["EPCOMM_NUM_LOCAL_RANKS"]
    out["low_latency"] = _low_latency(group, *inputs, num_experts)
    return out


def _under_other_defaults(rank, world, group):
    num_experts = 4 * world
    inputs = _inputs(rank, num_experts)
    want = _every_mode(group, inputs, num_experts)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_device("meta")
    torch.set_default_dtype(torch.float64)
    try:
        got = _every_mode(group, inputs, num_experts)
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(previous_dtype)
    assert got.keys() == want.keys()
    for mode in want:
        assert got[mode].keys() == want[mode].keys(), mode
        for name, expected in want[mode].items():
            actual = got[mode][name]
            assert actual.device.type == "cpu", (mode, name, actual.device)
            assert actual.dtype == expected.dtype, (mode, name, actual.dtype, expected.dtype)
            assert torch.equal(actual, expected), (mode, name)


def test_outputs_do_not_follow_default_device_or_dtype():
    run_ranks(_under_other_defaults, 2)
