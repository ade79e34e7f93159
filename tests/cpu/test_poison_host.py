"""The poison launch's host side without a GPU (epcomm/ops/poison.py): one launch per call whatever
the outputs, Params built once per set of outputs and filled with each output's address, size and
failure pattern; and bench/poison_host.py, which times that path, runs and reports both cases."""
from __future__ import annotations

import math

import pytest
import torch

from bench import poison_host
from epcomm.ops import poison as poison_module


class _CountingLaunch:
    """Kernel.launcher's stand-in: records the Params of every launch made through a bound launch."""
    def __init__(self):
        self.params = []

    def launcher(self, grid, block, params, smem=0):
        assert (grid, block) == ((1, 1, 1), (poison_module.THREADS, 1, 1))
        return lambda stream: self.params.append(params)


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(poison_module, "_stream", lambda device_index: 0)
    p = poison_host.poison_without_driver()
    p._kernel = _CountingLaunch()
    return p


def test_one_launch_per_call_with_params_built_once(poison):
    recv_x, idx, weights = torch.empty(4, 16, dtype=torch.bfloat16), torch.empty(4, 2, dtype=torch.int64), torch.empty(4, 2)
    for _ in range(3):
        poison.after(recv_x, None, idx, weights)
    launched = poison._kernel.params
    assert len(launched) == 3 and launched[0] is launched[1] is launched[2], "Params rebuilt for the same outputs"
    p = launched[0]
    assert p.num_targets == 3
    got = [(p.targets[i].data, p.targets[i].bytes, p.targets[i].pattern) for i in range(3)]
    assert got == [(t.data_ptr(), t.nbytes, poison_module.pattern(t.dtype)) for t in (recv_x, idx, weights)]
    poison.after(recv_x.clone(), None, idx, weights)   # another buffer: new Params
    assert len(launched) == 4 and launched[3] is not p and launched[3].targets[0].data != recv_x.data_ptr()


def test_empty_outputs_launch_nothing_and_too_many_are_refused(poison):
    poison.after(None, torch.empty(0, 8))
    assert poison._kernel.params == []
    many = [torch.empty(2) for _ in range(poison_module.MAX_TARGETS + 1)]
    with pytest.raises(ValueError, match=f"at most {poison_module.MAX_TARGETS} outputs"):
        poison.after(*many)


def test_bench_reports_both_cases():
    result = poison_host.measure(calls=200)
    assert set(result) == {"hit_us", "miss_us"}
    assert all(0 < v < math.inf for v in result.values()), result
    assert poison_module._stream is not None and poison_module._stream.__name__ != "<lambda>", "stream query not restored"
