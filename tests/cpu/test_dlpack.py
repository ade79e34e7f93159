"""CPU checks of the DLPack layer: raw-pointer views (the same code path as GPU views, with kDLCPU),
owner lifetime, dtypes DLPack itself may not know, and framework round trips."""
from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

from epcomm.runtime.dlpack import _LIVE, framework_of, from_torch, to_torch, wrap_pointer
from tests.conftest import ROOT


class Owner:
    pass


def test_wrap_pointer_aliases_memory_with_any_dtype():
    base = torch.arange(64, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.int64):
        t = wrap_pointer(base.data_ptr() + 16, dtype, (2, 3), "cpu")
        assert t.dtype == dtype and t.shape == (2, 3) and t.is_contiguous()
        assert t.data_ptr() == base.data_ptr() + 16
    t = wrap_pointer(base.data_ptr(), torch.int32, (4,), "cpu")
    t.fill_(-1)
    assert torch.all(base[:16] == 255) and base[16] == 16


def test_owner_lives_until_the_last_tensor_over_the_storage():
    base = torch.zeros(32, dtype=torch.uint8)
    owner = Owner()
    alive = weakref.ref(owner)
    before = len(_LIVE)
    t = wrap_pointer(base.data_ptr(), torch.float32, (8,), "cpu", owner=owner)
    del owner
    view = t[2:]
    del t
    gc.collect()
    assert alive() is not None  # a view still uses the storage
    del view
    gc.collect()
    assert alive() is None and len(_LIVE) == before


def test_wrap_pointer_rejects_bad_input():
    base = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not aligned"):
        wrap_pointer(base.data_ptr() + 1, torch.float32, (2,), "cpu")
    with pytest.raises(ValueError, match="NULL"):
        wrap_pointer(0, torch.float32, (2,), "cpu")
    with pytest.raises(ValueError, match="non-negative"):
        wrap_pointer(base.data_ptr(), torch.float32, (-2,), "cpu")
    assert wrap_pointer(0, torch.float32, (0, 5), "cpu").shape == (0, 5)


def test_torch_passes_through():
    t = torch.ones(3)
    out, fw = to_torch(t)
    assert out is t and fw == "torch" and from_torch(out, fw) is t


def test_numpy_round_trip_is_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t, fw = to_torch(a)
    assert fw == "numpy" == framework_of(a) and t.data_ptr() == a.ctypes.data and t.shape == (3, 4)
    back = from_torch(t * 0 + t, fw)  # a new torch result goes back as a numpy array
    assert isinstance(back, np.ndarray) and np.array_equal(back, a)
    same = from_torch(t, fw)
    assert same.ctypes.data == a.ctypes.data


def test_non_dlpack_input_is_a_type_error():
    with pytest.raises(TypeError, match="DLPack producer"):
        to_torch([1, 2, 3])
    with pytest.raises(TypeError, match="not importable"):
        from_torch(torch.ones(1), "no_such_framework_xyz")
    with pytest.raises(TypeError, match="no from_dlpack"):
        from_torch(torch.ones(1), "json")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")
def test_torch_only_use_does_not_import_cupy():
    code = ("import sys, torch; from epcomm.runtime import dlpack; "
            "t, fw = dlpack.to_torch(torch.ones(2)); dlpack.from_torch(t, fw); "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
