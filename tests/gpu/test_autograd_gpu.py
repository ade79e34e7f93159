"""epcomm.autograd on GPUs: the scenarios of tests/cpu/test_autograd.py (tests/helpers/autograd.py:
exact analytic gradients from the routing, forward outputs equal to the Buffer's own calls) on the
GPU backend, intranode.

Collective: run under torchrun (`make test-gpu`, or torchrun --nproc_per_node=R -m pytest -q -rs -m gpu
tests/gpu/test_autograd_gpu.py); every rank runs every test, and all fail together (on_all_ranks).
Generic in R: experts (2 per rank), token counts and the second case's size come from R and the
device's SM count. The backward calls exercise narrow payloads the forward never uses: the combine
of the weights alone (8-column rows) and the cached dispatch of float32 weight gradients as BF16
lanes.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import autograd as scenarios
from tests.helpers.gpu import BufferPool
from tests.conftest import on_all_ranks

pytestmark = pytest.mark.gpu

_POOL = BufferPool()


def _sm_count(dist_env) -> int:
    return torch.cuda.get_device_properties(dist_env.device).multi_processor_count


def _cases(dist_env):
    """(name, hidden, tokens(rank, world)): the CPU test's small case, and one with enough tokens
    per rank to fill every channel of the normal-mode kernels (a few per SM)."""
    many = 3 * _sm_count(dist_env)
    return [("small", scenarios.HIDDEN, scenarios.default_tokens),
            ("channels", 1024, lambda rank, world: 0 if world > 2 and rank == world - 1 else many + 7 * rank)]


def _buffer(dist_env, low_latency: bool, max_tokens: int = 0, hidden: int = 0):
    import epcomm
    r = dist_env.world_size

    def build():
        if low_latency:
            e = scenarios.LOCAL_EXPERTS * r
            size = epcomm.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, r, e)
            return epcomm.Buffer(dist_env.group, 0, size, low_latency_mode=True,
                                 num_qps_per_rank=scenarios.LOCAL_EXPERTS, explicitly_destroy=True)
        hidden_bytes = 1024 * 2   # the largest case
        size = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, r) for cfg in
                   (epcomm.Buffer.get_dispatch_config(r), epcomm.Buffer.get_combine_config(r)))
        return epcomm.Buffer(dist_env.group, size, explicitly_destroy=True)
    return _POOL.get((low_latency, max_tokens, hidden), build)


@pytest.fixture(scope="module", autouse=True)
def _destroy_buffers():
    yield
    _POOL.destroy_all()


@pytest.mark.parametrize("case", ["small", "channels"])
def test_autograd_normal_mode(dist_env, case):
    from epcomm import autograd as ep
    _, hidden, tokens = next(c for c in _cases(dist_env) if c[0] == case)
    w = scenarios.World(dist_env.rank, dist_env.world_size, dist_env.device, hidden, tokens)
    buf = _buffer(dist_env, low_latency=False)
    scenarios.normal_mode_scenarios(w, buf, ep, check=lambda fn: on_all_ranks(dist_env, fn))
    torch.cuda.synchronize()


def test_autograd_low_latency_inference_only(dist_env):
    from epcomm import autograd as ep
    r = dist_env.world_size
    w = scenarios.World(dist_env.rank, r, dist_env.device)
    max_tokens = max(max(scenarios.default_tokens(s, r) for s in range(r)), 1)
    buf = _buffer(dist_env, low_latency=True, max_tokens=max_tokens, hidden=w.hidden)
    buf.clean_low_latency_buffer(max_tokens, w.hidden, w.num_experts)
    on_all_ranks(dist_env, lambda: scenarios.low_latency_inference_only(w, buf, ep, max_tokens))
    torch.cuda.synchronize()
