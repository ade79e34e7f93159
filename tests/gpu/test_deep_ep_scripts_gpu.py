"""What tests/deep_ep_scripts.py relies on when DeepEP's scripts run with N ranks on one GPU and
their NCCL group has become gloo: gloo's own CUDA paths for the collectives those scripts call on
CUDA tensors (all_reduce of int32 counts and a float32 scalar, all_gather of an int32 pair), and
all_gather_into_tensor of int64 top-k indices into a stacked (R, T, K) output through the shim
(gloo itself takes only the (R * T, K) form). Collective; any rank count R."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import shared_gpu_shim
from tests.conftest import on_all_ranks

pytestmark = pytest.mark.gpu


def test_gloo_collectives_on_cuda_tensors(dist_env):
    rank, world, dev = dist_env.rank, dist_env.world_size, dist_env.device
    group = dist.new_group(list(range(world)), backend="gloo")

    def check():
        counts = torch.arange(4, dtype=torch.int32, device=dev) + rank
        dist.all_reduce(counts, group=group)
        want = torch.arange(4, dtype=torch.int32) * world + world * (world - 1) // 2
        assert counts.device == dev and torch.equal(counts.cpu(), want)

        scalar = torch.ones(1, dtype=torch.float32, device=dev)
        dist.all_reduce(scalar, group=group)
        assert scalar.item() == world

        pair = torch.tensor([rank, 2 * rank], dtype=torch.int32, device=dev)
        gathered = [torch.zeros_like(pair) for _ in range(world)]
        dist.all_gather(gathered, pair, group=group)
        assert [g.tolist() for g in gathered] == [[r, 2 * r] for r in range(world)]

        idx = torch.full((3, 2), rank, dtype=torch.int64, device=dev)
        want = torch.arange(world).view(-1, 1, 1).expand(world, 3, 2)
        flat = torch.empty((world * 3, 2), dtype=torch.int64, device=dev)
        dist.all_gather_into_tensor(flat, idx, group=group)
        assert torch.equal(flat.cpu(), want.reshape(-1, 2))
        stacked = torch.empty((world, 3, 2), dtype=torch.int64, device=dev)
        shared_gpu_shim.wrap_all_gather_into_tensor(dist.all_gather_into_tensor)(stacked, idx, group=group)
        assert torch.equal(stacked.cpu(), want)

    try:
        on_all_ranks(dist_env, check)
    finally:
        dist.destroy_process_group(group)
