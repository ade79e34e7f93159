"""tests/helpers/gpu.all_inputs on ranks of one host: each rank builds its own inputs and maps the
others' from files; every rank must end with exactly what building all of them itself gives, and
no file is left behind."""
from __future__ import annotations

import os
import types

import torch

from tests.conftest import run_ranks

KW = dict(seed=5, hidden=256, num_experts=12, num_topk=4, fp8=True)
NS = [7, 0, 33]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and \
        torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                    b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def _ranks_share_their_inputs(rank, world, group, folder):
    import dataclasses
    import tempfile
    import torch.distributed as dist
    from tests.helpers import gpu
    gpu.SHARED_INPUT_ELEMENTS = 0   # share even these small inputs
    tempfile.tempdir = folder
    env = types.SimpleNamespace(rank=rank, world_size=world, shared_gpu=True,
                                barrier=lambda: dist.barrier(group))
    got = gpu.all_inputs(env, NS, **KW)
    want = [gpu.make_inputs(rank=r, num_tokens=NS[r], num_ranks=world, **KW) for r in range(world)]
    for r, (g, w) in enumerate(zip(got, want)):
        for field in dataclasses.fields(w):
            assert _same(getattr(g, field.name), getattr(w, field.name)), (r, field.name)
    dist.barrier(group)
    left = [name for root, _, names in os.walk(folder) for name in names]
    assert left == [], left


def test_ranks_on_one_host_share_their_inputs(tmp_path):
    run_ranks(_ranks_share_their_inputs, len(NS), str(tmp_path))
