"""CuPy in, CuPy out through the public API on GPUs (api.md: any DLPack producer is accepted wherever
a tensor is, and outputs come back in the caller's framework, zero-copy). Run with `make test-gpu`."""
from __future__ import annotations

import pytest
import torch

from tests import topology

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy", reason="cupy is not installed (the GPU image has cupy-cuda13x)")

N, H, K, E = 300, 1024, 4, topology.experts(16, topology.world_size())


def _inputs(rank):
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.randn(N, E, device="cuda", generator=g)
    w, idx = scores.softmax(-1).topk(K, dim=-1)
    idx[::7, 0] = -1                                   # some slots go nowhere
    return x, idx.to(torch.int64), w.float().contiguous()


def test_cupy_layout_dispatch_combine_round_trip(dist_env):
    import epcomm
    buffer = epcomm.Buffer(dist_env.group, num_nvl_bytes=64 << 20)
    x, idx, w = _inputs(dist_env.rank)
    # The same call with torch tensors is the expectation (the torch path is checked against the
    # reference elsewhere); the CuPy call must give equal results, as CuPy arrays.
    t_layout = buffer.get_dispatch_layout(idx, E)
    c_idx = cupy.from_dlpack(idx)
    c_layout = buffer.get_dispatch_layout(c_idx, E)
    ok = all(isinstance(c, cupy.ndarray) for c in (c_layout[0], c_layout[2], c_layout[3]))
    ok = ok and all(torch.equal(torch.from_dlpack(c), t) for c, t in
                    ((c_layout[0], t_layout[0]), (c_layout[2], t_layout[2]), (c_layout[3], t_layout[3])))
    assert dist_env.all_ok(ok), "get_dispatch_layout with CuPy input differs or is not CuPy"

    kw = dict(num_tokens_per_rank=t_layout[0], is_token_in_rank=t_layout[3],
              num_tokens_per_expert=t_layout[2], topk_idx=idx, topk_weights=w)
    t_recv_x, t_recv_idx, t_recv_w, t_counts, t_handle, _ = buffer.dispatch(x, **kw)
    c_kw = {k: cupy.from_dlpack(v) for k, v in kw.items()}
    c_recv_x, c_recv_idx, c_recv_w, c_counts, c_handle, _ = buffer.dispatch(cupy.from_dlpack(x), **c_kw)
    ok = isinstance(c_recv_x, cupy.ndarray) and isinstance(c_recv_idx, cupy.ndarray)
    ok = ok and torch.equal(torch.from_dlpack(c_recv_x), t_recv_x)
    ok = ok and torch.equal(torch.from_dlpack(c_recv_idx), t_recv_idx)
    ok = ok and torch.equal(torch.from_dlpack(c_recv_w), t_recv_w) and c_counts == t_counts
    assert dist_env.all_ok(ok), "dispatch with CuPy inputs differs from the torch call or is not CuPy"

    # zero-copy: the CuPy output is the memory epcomm wrote (no copy on the way out)
    back = torch.from_dlpack(c_recv_x)
    assert dist_env.all_ok(back.data_ptr() == c_recv_x.data.ptr)

    combined, combined_w, _ = buffer.combine(c_recv_x, c_handle, topk_weights=c_recv_w)
    t_combined, t_combined_w, _ = buffer.combine(t_recv_x, t_handle, topk_weights=t_recv_w)
    ok = isinstance(combined, cupy.ndarray) and torch.equal(torch.from_dlpack(combined), t_combined)
    ok = ok and torch.equal(torch.from_dlpack(combined_w), t_combined_w)
    assert dist_env.all_ok(ok), "combine with CuPy inputs differs from the torch call or is not CuPy"
