"""The host path of Buffer calls, counted rather than timed (single process, no GPU): with an
instant backend, a synchronous call with the default stream arguments must run no torch operator
of its own (validation reads attributes only; no events, no stream work, no record_stream: see
epcomm/streams.py), and must hand the backend exactly the validated arguments. A regression that
adds an allocation, a view or a copy to every call shows up here as a counted operator.

Tensors live on the meta device: the Buffer's device, so validation treats them as device tensors
(no value checks, which read the data)."""
from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import epcomm.buffer as buffer_module
from epcomm import Buffer, Config, EventOverlap
from tests.helpers.host_path import E, H, K, N, R, T, InstantBackend, instant_buffer, meta

class CountOps(TorchDispatchMode):
    """Every torch operator dispatched inside the with-block."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def instant(monkeypatch):
    return instant_buffer(monkeypatch)


def _inputs():
    x, topk_idx, weights = meta(N, H, dtype=torch.bfloat16), meta(N, K, dtype=torch.int64), meta(N, K)
    return x, topk_idx, weights


def test_synchronous_calls_run_no_torch_operator_of_their_own(instant):
    buf, backend = instant
    x, topk_idx, weights = _inputs()
    lay = backend.layout
    config = Config(8)
    bias, out = meta(N, H, dtype=torch.bfloat16), meta(N, H, dtype=torch.bfloat16)
    # the handles as calls return them (a rebuilt tuple takes the full check, with torch operators)
    handle = buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                          topk_idx=topk_idx, topk_weights=weights)[4]
    ll_handle = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)[2]
    calls = {
        "get_dispatch_layout": lambda: buf.get_dispatch_layout(topk_idx, E),
        "dispatch": lambda: buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                         num_tokens_per_expert=lay[2], topk_idx=topk_idx, topk_weights=weights,
                                         config=config),
        "cached dispatch": lambda: buf.dispatch(x, handle=handle),
        "combine": lambda: buf.combine(backend.dispatched.recv_x, handle, backend.dispatched.recv_topk_weights,
                                       bias=(bias, None)),
        "low_latency_dispatch": lambda: buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False),
        "low_latency_combine": lambda: buf.low_latency_combine(backend.ll_dispatched.recv_x, topk_idx, weights,
                                                               ll_handle, out=out),
    }
    for name, call in calls.items():
        call()                                   # first call: one-time checks (e.g. the RDMA size)
        with CountOps() as counted:
            result = call()
        assert not counted.ops, f"{name}: a synchronous call ran torch operators {dict(counted.ops)}"
        event = result[-2] if name.startswith("low_latency") else result[-1]
        assert isinstance(event, EventOverlap) and event.event is None, name


def test_the_backend_gets_the_validated_arguments(instant):
    buf, backend = instant
    x, topk_idx, weights = _inputs()
    backend.calls.clear()
    per_rank, per_node, per_expert, in_rank, event = buf.get_dispatch_layout(topk_idx, E)
    assert backend.calls == [("check_errors",), ("get_dispatch_layout", topk_idx, E)]
    assert (per_rank, per_node, per_expert, in_rank) == backend.layout

    backend.calls.clear()
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights, expert_alignment=2)
    args = backend.calls[1][1:]
    assert args[:2] == (x, None) and args[2] is None and args[3] is per_rank and args[5] is in_rank
    assert args[7] is topk_idx and args[8] is weights and args[9:11] == (2, 0)
    assert args[11] == Buffer.get_dispatch_config(R), "default config"
    assert recv_x is backend.dispatched.recv_x and counts == [3, 4, 5, 6]
    assert isinstance(handle, tuple) and len(handle) == 6 and all(a is b for a, b in zip(handle, backend.handle))

    backend.calls.clear()
    out = meta(N, H, dtype=torch.bfloat16)
    combined, event, hook = buf.low_latency_combine(backend.ll_dispatched.recv_x, topk_idx, weights,
                                                    backend.ll_handle, out=out)
    args = backend.calls[1][1:]
    assert args[3] == backend.ll_handle and args[4:7] == (False, False, False) and args[7] is out
    assert event.event is None and hook is None


def test_synchronous_call_with_previous_event_waits_on_the_current_stream(instant):
    """previous_event with async_finish=False: the event's wait runs once, before the backend call
    (on a GPU: the current stream waits for it; see epcomm/streams.py)."""
    buf, backend = instant
    _, topk_idx, _ = _inputs()
    order = []

    class Handle:
        def current_stream_wait(self):
            order.append("wait")

    backend.get_dispatch_layout = lambda *args: order.append("layout") or backend.layout
    *_, event = buf.get_dispatch_layout(topk_idx, E, previous_event=EventOverlap(Handle()))
    assert order == ["wait", "layout"] and event.event is None
    # async_finish without a comm stream (not a CUDA device): synchronous, nothing waited for
    order.clear()
    *_, event = buf.get_dispatch_layout(topk_idx, E, previous_event=EventOverlap(Handle()), async_finish=True)
    assert order == ["layout"] and event.event is None


def test_returned_handles_come_back_unchecked_only_to_their_buffer(instant, monkeypatch):
    """A handle from this Buffer's dispatch is passed on as it is (its tensors were made by the
    backend); a copy, or a handle of another Buffer, is checked in full."""
    from epcomm import validate
    buf, backend = instant
    x, topk_idx, weights = _inputs()
    lay = backend.layout
    *_, handle, _ = buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                 num_tokens_per_expert=lay[2], topk_idx=topk_idx, topk_weights=weights)
    checked, routed = [], []
    real_tensor = validate.Call.tensor
    monkeypatch.setattr(validate.Call, "tensor", lambda c, name, *a, **k: checked.append(name) or real_tensor(c, name, *a, **k))
    # the routing check reads values, which meta tensors lack: recorded here, tested on the CPU backend
    # (tests/cpu/test_failure_semantics.py)
    monkeypatch.setattr(validate, "handle_routing", lambda c, items, *a: routed.append(items))
    backend.calls.clear()
    buf.combine(backend.dispatched.recv_x, handle)
    assert backend.calls[1][2] is handle and not [n for n in checked if n.startswith("handle")] and not routed
    buf.combine(backend.dispatched.recv_x, tuple(handle))          # a copy: checked
    assert [n for n in checked if n.startswith("handle")] == ["handle[0] (rank_prefix_matrix)", "handle[3] (recv_src_idx)",
                                                             "handle[4] (is_token_in_rank)"]
    assert len(routed) == 1 and routed[0] == tuple(handle)
    other, _ = _other_buffer(monkeypatch)
    bad = validate.owned_handle((meta(3, 3, dtype=torch.int32),) + tuple(handle[1:]), other._handle_owner)
    with pytest.raises(ValueError, match="handle\\[0\\] \\(rank_prefix_matrix\\) must have shape"):
        buf.combine(backend.dispatched.recv_x, bad)

    # low-latency: the same for combine and get_next_low_latency_combine_buffer
    *_, ll_handle, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    checked.clear()
    buf.low_latency_combine(backend.ll_dispatched.recv_x, topk_idx, weights, ll_handle)
    assert not [n for n in checked if n.startswith("handle")]
    buf.low_latency_combine(backend.ll_dispatched.recv_x, topk_idx, weights, tuple(ll_handle))
    assert [n for n in checked if n.startswith("handle")] == ["handle[0] (src_info)", "handle[1] (layout_range)"]


def _other_buffer(monkeypatch):
    backend = InstantBackend()
    monkeypatch.setattr(buffer_module, "_make_backend", lambda *args: backend)
    return Buffer(dist.ProcessGroup(dist.HashStore(), 0, R), num_nvl_bytes=1 << 20), backend
