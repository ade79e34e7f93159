"""The low-latency ops module's host path without a GPU: the kernel lookup and the launch are
replaced by a recorder, CPU tensors stand in for device memory, so every launched Params can be
checked against the call's tensors and the buffer layout, and the plans against the backend's
cache (epcomm/ops/low_latency.py, ops._common.plan_for)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epcomm.ops import _common, low_latency
from epcomm.ops.low_latency_layout import Layout, rdma_size_hint

R, T, H, E, K = 2, 8, 256, 8, 4


class _Recorder:
    def __init__(self):
        self.launched = []

    def launch(self, grid, block, params, stream, smem=0):
        self.launched.append((grid, type(params).from_buffer_copy(params), smem))

    def set_max_dynamic_smem(self, nbytes):
        pass


class _Rdma:
    """What the module reads of runtime.symmetric.SymmetricBuffer, over host memory."""

    def __init__(self, nbytes):
        self.memory = torch.zeros(nbytes, dtype=torch.uint8)
        self.nbytes, self.ptr = nbytes, self.memory.data_ptr()
        self.peer_ptrs = [self.ptr] * R
        self.peer_table = torch.tensor(self.peer_ptrs, dtype=torch.int64)

    def view(self, dtype, shape, offset):
        count = torch.Size(shape).numel() * dtype.itemsize
        return self.memory[offset:offset + count].view(dtype).view(shape)


@pytest.fixture
def setup(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(low_latency, "backend_kernel", lambda gb, source: recorder)
    monkeypatch.setattr(low_latency, "current_stream", lambda device_index: 0)
    monkeypatch.setattr(low_latency, "_capturing", lambda: False)
    gb = SimpleNamespace(rank=1, num_ranks=R, device_index=0, rdma=_Rdma(rdma_size_hint(T, H, R, E)),
                         arch=SimpleNamespace(num_sms=8, feature=90), status=SimpleNamespace(device_ptr=0xE00),
                         timeout_ns=77, options={}, plans={})
    return gb, low_latency.LowLatency(gb), recorder


def test_dispatch_and_combine_fill_params_from_the_call_and_cache_their_plans(setup):
    gb, ll, recorder = setup
    layout = Layout(T, H, R, E)
    x = torch.randn(5, H).bfloat16()
    topk_idx = torch.randint(0, E, (5, K))
    weights = torch.rand(5, K)
    results = []
    for fp8 in (True, False, True):
        results.append(ll.dispatch(x, topk_idx, T, E, None, None, fp8, False, False, False))
    assert [set(plans) for plans in gb.plans.values()] == [{
        low_latency.DispatchSpec(T, H, E, K, True, False, False, torch.int64, False),
        low_latency.DispatchSpec(T, H, E, K, False, False, False, torch.int64, False)}]
    assert all(type(spec) is low_latency.DispatchSpec for spec in gb.plans[low_latency.DispatchSpec])
    for (grid, params, smem), result, buffer_set in zip(recorder.launched, results, (0, 1, 0)):
        assert grid == (8, 1, 1) and smem > 0
        assert params.x == x.data_ptr() and params.topk_idx == topk_idx.data_ptr() and params.num_tokens == 5
        assert params.recv_x == result.recv_x.data_ptr() and params.recv_count == result.recv_count.data_ptr()
        assert (params.recv_scales or 0) == _common.ptr(result.recv_x_scales)   # a null c_void_p reads None
        assert params.phases == low_latency.SEND | low_latency.RECV
        assert params.messages == gb.rdma.ptr + layout.recv(buffer_set)
        assert not params.cumulative_recv_stats and not params.wait_recv_cost_stats
        assert (params.rank, params.timeout_ns, params.err) == (1, 77, 0xE00)
        assert tuple(result.handle) == (result.handle.src_info, result.handle.layout_range, T, H, E)
    assert results[1].recv_x_scales is None and results[0].recv_x.dtype == torch.float8_e4m3fn

    recv_x = torch.zeros(E // R, R * T, H).bfloat16()
    recorder.launched.clear()
    out, hook = ll.combine(recv_x, topk_idx, weights, results[2].handle, False, False, False, None, None)
    assert hook is None and out.shape == (5, H)
    (_, params, _), = recorder.launched
    assert params.x == recv_x.data_ptr() and params.out == out.data_ptr() and params.topk_weights == weights.data_ptr()
    assert params.src_info == results[2].handle.src_info.data_ptr()
    zero_copy, _ = ll.combine(recv_x, topk_idx, weights, results[2].handle, False, True, False, None, None)
    assert recorder.launched[-1][1].x == gb.rdma.ptr + layout.send(0)   # this call's buffer set
    assert zero_copy.shape == (5, H)
    assert low_latency.CombineSpec(T, H, E, K, torch.int64, False) in gb.plans[low_latency.CombineSpec]


def test_hook_launches_the_receive_part_when_called(setup):
    gb, ll, recorder = setup
    x, topk_idx = torch.randn(3, H).bfloat16(), torch.randint(0, E, (3, K))
    result = ll.dispatch(x, topk_idx, T, E, None, None, False, False, False, True)
    assert [params.phases for _, params, _ in recorder.launched] == [low_latency.SEND]
    result.hook()
    assert [params.phases for _, params, _ in recorder.launched] == [low_latency.SEND, low_latency.RECV]
    assert recorder.launched[1][1].recv_x == result.recv_x.data_ptr()


def test_pooled_outputs_come_back_only_when_nothing_outside_holds_them():
    """_Outputs hands a set out again only when no tensor object, view, detached alias or storage
    object of any of its tensors is held outside, and only on the stream it was made on."""
    pool = low_latency._Outputs()

    def fresh():
        tensors = (torch.empty(4, 8), None, torch.empty(3, dtype=torch.int32))
        pool.keep(7, tensors)
        return tensors

    holds = [lambda t: t[0], lambda t: t[2].view(3, 1), lambda t: t[0].detach(), lambda t: t[2].untyped_storage(),
             lambda t: t[0][1:]]
    for hold in holds:
        kept = fresh()
        held = hold(kept)
        del kept
        assert pool.take(7) is None, "a set with something held outside came back"
        del held
        assert pool.take(7) is not None and pool.take(8) is None
    kept = fresh()
    kept[0].set_(torch.empty(2))   # moved to other memory: its old storage is no longer its own
    del kept
    assert pool.take(7) is None
