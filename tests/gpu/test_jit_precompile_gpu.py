"""GPU: a cache warmed by the precompile plan for a model's shapes serves that model's Buffer calls
with no compile (EPCOMM_ASSERT_NO_COMPILE=1 turns any kernel the plan missed into a CompileError).
Shapes are unusual on purpose (derived from R), so no earlier test in the session has loaded these
kernels. Run under torchrun (`make test-gpu`); collective."""
from __future__ import annotations

import shutil
import tempfile
import traceback

import pytest
import torch

from tests.conftest import on_all_ranks

pytestmark = pytest.mark.gpu


def _shapes(R: int, L: int, modes):
    from epcomm.ops.model_kernels import ModelShapes
    # hidden a multiple of 512: the ue8m0 low-latency scales pack four 128-channel scales per int32.
    return ModelShapes(hidden=512 * (2 + R), num_topk=3, num_experts=3 * R, num_ranks=R, num_local_ranks=L,
                       num_max_dispatch_tokens_per_rank=24 + R, dtypes=("bf16", "fp8"), modes=modes,
                       ll_scales=("float", "pow2", "ue8m0"))


def _warm(dist_env, monkeypatch, device, shapes):
    """Build the model's kernels as a user does (`python -m epcomm.jit --precompile`: epcomm.jit.
    precompile, parallel builds) into a fresh cache that the ranks of this host share (local rank 0
    builds it), forget them in-process, forbid compiles. Collective."""
    import os
    from epcomm import jit
    from epcomm.runtime import cache
    from epcomm.runtime.arch import device_arch
    folder = os.path.join(tempfile.gettempdir(), f"epcomm-precompile-{os.environ.get('MASTER_PORT', 'local')}-"
                                                 f"{shapes.hidden}-{'-'.join(shapes.modes)}")
    monkeypatch.setenv("EPCOMM_CACHE_DIR", folder)
    monkeypatch.delenv("EPCOMM_ASSERT_NO_COMPILE", raising=False)
    built = True
    if int(os.environ.get("LOCAL_RANK", dist_env.rank)) == 0:
        # this host's share of the cores for every rank of it (the other ranks wait meanwhile)
        jobs = int(os.environ.get("OMP_NUM_THREADS") or 1) * int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        shutil.rmtree(folder, ignore_errors=True)
        try:
            built = jit.precompile([device_arch(device.index).cc], min(jobs, os.cpu_count() or 1), [shapes]) == 0
        except Exception:   # raised after every rank's meeting below, never before it
            traceback.print_exc()
            built = False
    assert dist_env.all_ok(built), "the precompile plan's builds failed on local rank 0 (its output above)"
    cache.clear_memo()
    monkeypatch.setenv("EPCOMM_ASSERT_NO_COMPILE", "1")


def _run_then_destroy(dist_env, buffer, calls) -> None:
    """calls() on every rank (a failure on one fails all), then the Buffer destroyed once all are done."""
    try:
        on_all_ranks(dist_env, calls)
    finally:
        torch.cuda.synchronize()
        dist_env.barrier()
        buffer.destroy()


def _routing(shapes, num_tokens, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(num_tokens, shapes.hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(num_tokens, shapes.num_experts, generator=gen)
    topk_idx = torch.topk(scores, shapes.num_topk, dim=1).indices
    return x.to(device), topk_idx.to(device), torch.rand(num_tokens, shapes.num_topk, generator=gen).to(device)


def test_normal_mode_calls_hit_the_precompiled_cache(dist_env, monkeypatch):
    import epcomm
    R, device = dist_env.world_size, dist_env.device
    from epcomm.ops.internode_plan import rdma_bytes_for
    probe = _shapes(R, R, ("normal",))
    # RDMA bytes for any ranks per node the machine gives (1 per node needs the most)
    nvl = epcomm.Config().get_nvl_buffer_size_hint(probe.hidden * 2, R)
    configs = [epcomm.Buffer.get_dispatch_config(R), epcomm.Buffer.get_combine_config(R)]
    rdma = rdma_bytes_for(configs, probe.hidden * 2, probe.hidden // 128, probe.num_topk, R, 1, nvl)
    buffer = epcomm.Buffer(dist_env.group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, explicitly_destroy=True)
    shapes = _shapes(R, R // buffer.runtime.get_num_rdma_ranks(), ("normal",))

    def calls():
        _warm(dist_env, monkeypatch, device, shapes)
        x, topk_idx, weights = _routing(shapes, 64 + dist_env.rank, device, 11 + dist_env.rank)
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, shapes.num_experts)
        for fp8 in (False, True):
            payload = x
            if fp8:
                from epcomm.fp8 import per_token_cast
                payload = per_token_cast(x)
            recv = buffer.dispatch(payload, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                   topk_idx=topk_idx, topk_weights=weights)
            handle = recv[4]
            buffer.dispatch(payload, handle=handle)                     # cached dispatch
        recv_x = recv[0][0] if isinstance(recv[0], tuple) else recv[0]
        buffer.combine(torch.zeros(recv_x.shape, dtype=torch.bfloat16, device=device), handle)
        torch.cuda.synchronize()
    _run_then_destroy(dist_env, buffer, calls)


def test_low_latency_calls_hit_the_precompiled_cache(dist_env, monkeypatch):
    import epcomm
    R, device = dist_env.world_size, dist_env.device
    shapes = _shapes(R, R, ("low_latency",))
    T, H, E = shapes.num_max_dispatch_tokens_per_rank, shapes.hidden, shapes.num_experts
    buffer = epcomm.Buffer(dist_env.group, num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                           low_latency_mode=True, explicitly_destroy=True)

    def calls():
        _warm(dist_env, monkeypatch, device, shapes)
        x, topk_idx, weights = _routing(shapes, T - 1, device, 21 + dist_env.rank)
        for use_fp8, round_scale, use_ue8m0 in ((False, False, False), (True, False, False),
                                                (True, True, False), (True, True, True)):
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
                x, topk_idx, T, E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
        data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        rows = torch.zeros(data.shape, dtype=torch.bfloat16, device=device)
        buffer.low_latency_combine(rows, topk_idx, weights, handle)
        torch.cuda.synchronize()
    _run_then_destroy(dist_env, buffer, calls)
