"""GPU: epcomm.fp8.per_token_cast gives, bit for bit, the FP8 rows and scales the low-latency
dispatch kernel writes (plain, round_scale and UE8M0 scales), on the GPU and on the CPU alike.
Run under torchrun (`make test-gpu`); collective, generic in R."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import on_all_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("round_scale, use_ue8m0", [(False, False), (True, False), (True, True)])
def test_cast_matches_the_low_latency_kernel(dist_env, round_scale, use_ue8m0):
    import epcomm
    from epcomm.fp8 import per_token_cast
    R, rank, device = dist_env.world_size, dist_env.rank, dist_env.device
    T, H, E, K = 32, 7168, 8 * R, 8
    gen = torch.Generator().manual_seed(5)   # every rank builds every rank's input
    xs = [(torch.randn(T, H, generator=gen) * torch.pow(10.0, torch.randint(-4, 4, (T, 1), generator=gen).float()))
          .bfloat16() for _ in range(R)]
    topks = [torch.rand(T, E, generator=gen).topk(K, dim=1).indices for _ in range(R)]
    buffer = epcomm.Buffer(dist_env.group, num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                           low_latency_mode=True, explicitly_destroy=True)
    try:
        def check():
            (values, scales), count, handle, _, _ = buffer.low_latency_dispatch(
                xs[rank].to(device), topks[rank].to(device), T, E, use_fp8=True, round_scale=round_scale,
                use_ue8m0=use_ue8m0)
            torch.cuda.synchronize()
            src_info, layout_range = handle[0].cpu(), handle[1].cpu()
            values, scales = values.cpu(), scales.cpu()
            compared = 0
            for e in range(E // R):
                for s in range(R):
                    begin, n = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
                    rows = slice(begin, begin + n)
                    tokens = xs[s][src_info[e, rows].long()]
                    want_v, want_s = per_token_cast(tokens.to(device), round_scale, use_ue8m0)
                    cpu_v, cpu_s = per_token_cast(tokens, round_scale, use_ue8m0)
                    assert torch.equal(want_v.cpu().view(torch.uint8), cpu_v.view(torch.uint8)), "GPU != CPU cast"
                    assert torch.equal(want_s.cpu(), cpu_s), "GPU != CPU scales"
                    got_v = values[e, rows].contiguous().view(torch.uint8)
                    assert torch.equal(got_v, cpu_v.view(torch.uint8)), f"expert {e} source {s}: values differ"
                    assert torch.equal(scales[e, rows].contiguous(), cpu_s), f"expert {e} source {s}: scales differ"
                    compared += n
            assert compared == int(count.sum()), (compared, count)
            total[0] = compared
        total = torch.zeros(1, dtype=torch.int64, device=device)
        on_all_ranks(dist_env, check)
        dist.all_reduce(total)     # outside check(): a failing rank must not leave the others here
        assert int(total) > 0, "no row was compared on any rank"
    finally:
        torch.cuda.synchronize()
        dist_env.barrier()
        buffer.destroy()
