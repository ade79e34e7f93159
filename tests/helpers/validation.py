"""What the validation tests share: `expect` (a call raises the right type, naming the right words;
tests/cpu/test_validation.py, test_failure_semantics.py) and the size / index-dtype cases both
backends run (tests/cpu/test_validation_sizes.py on the CPU, tests/gpu/test_validation_sizes_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from epcomm.ops import intranode_plan as plan


def expect(call, exc, *words):
    """call() must raise exc whose message contains every word; -> the exception."""
    try:
        call()
    except Exception as e:  # checked below, so a wrong type fails with its message
        assert isinstance(e, exc), f"expected {exc.__name__} naming {words}, got {type(e).__name__}: {e}"
        for word in words:
            assert word in str(e), f"{exc.__name__} message should name {word!r}: {e}"
        return e
    raise AssertionError(f"expected {exc.__name__} naming {words}, nothing was raised")


H, K = 256, 2


def smallest_nvl_bytes(num_ranks: int, num_experts: int, rows: int = 1) -> int:
    """The least num_nvl_bytes (a multiple of 128) whose receive rings hold `rows` records of a
    fresh BF16 dispatch with top-k K per peer (1: the least any call needs)."""
    staging = plan.dispatch_staging_offset(num_ranks, num_experts // num_ranks)
    need = staging + (num_ranks - 1) * rows * plan.dispatch_record_bytes(H * 2, 0, K)
    return max(-(-need // 128) * 128, -(-plan.header_bytes(num_ranks) // 128) * 128)


def inputs(rank: int, num_experts: int, device):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, H, generator=gen).bfloat16()
    weights, idx = torch.rand(8, num_experts, generator=gen).topk(K, dim=-1)
    return x.to(device), idx.to(device), weights.to(device)


def size_and_dtype_cases(group, rank: int, device) -> None:
    """The cases, on whichever backend `group` selects (collective: every rank runs all)."""
    import epcomm
    world = group.size()
    num_experts = 4 * world
    x, idx, weights = inputs(rank, num_experts, device)
    least = smallest_nvl_bytes(world, num_experts)
    # rings of N rows: every chunk of every rank's tokens fits, whatever the GPU's chunking
    fits = smallest_nvl_bytes(world, num_experts, rows=x.shape[0])

    def round_trip(num_nvl_bytes, topk_idx):
        buffer = epcomm.Buffer(group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)
        try:
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
            recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
            return buffer.combine(recv_x, handle)[0]
        finally:
            buffer.destroy()

    want = round_trip(fits, idx)
    if world > 1:   # one rank has no peer records: only the header counts
        with pytest.raises(ValueError, match=r"Buffer.dispatch: num_nvl_bytes=\d+ is too small"):
            round_trip(least - 128, idx)
    # int32 top-k ids: accepted by both backends in normal mode, the same results
    assert torch.equal(round_trip(fits, idx.to(torch.int32)), want)
    ll_bytes = epcomm.Buffer.get_low_latency_rdma_size_hint(8, H, world, num_experts)
    ll = epcomm.Buffer(group, 0, ll_bytes, low_latency_mode=True, num_qps_per_rank=num_experts // world,
                       explicitly_destroy=True)
    try:   # low-latency mode takes topk_idx_t only, as DeepEP
        with pytest.raises(TypeError, match="Buffer.low_latency_dispatch: topk_idx must have dtype torch.int64"):
            ll.low_latency_dispatch(x, idx.to(torch.int32), 8, num_experts)
    finally:
        ll.destroy()
