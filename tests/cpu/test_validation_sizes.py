"""Both backends accept and reject the same inputs: size rules the GPU kernels have (the NVL
buffer must hold the signal header and one record per peer) and index dtypes are checked in
epcomm.validate, before either backend runs. CPU backend on 2 gloo processes here; the same cases
run on the GPU in tests/gpu/test_validation_sizes_gpu.py (both from tests/helpers/validation.py)."""
from __future__ import annotations

import torch

from tests.conftest import run_ranks
from tests.helpers.validation import size_and_dtype_cases


def _cpu_cases(rank, world, group):
    size_and_dtype_cases(group, rank, torch.device("cpu"))


def test_sizes_and_index_dtypes_cpu():
    run_ranks(_cpu_cases, 2)
