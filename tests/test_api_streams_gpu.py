"""Stream semantics on a GPU (api.md, "Stream semantics"): the comm-stream scope alone, then through
a real Buffer (dispatch layout, the first GPU kernel). Run with `make test-gpu` (torchrun).

The ordering checks can fail: the producer side is delayed with torch.cuda._sleep, so a missing
wait makes the consumer read the old value."""
from __future__ import annotations

import pytest
import torch

from epcomm import Buffer, EventOverlap
from epcomm.streams import CommStreamScope, new_comm_stream

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 50_000_000   # tens of ms on any GPU: far longer than the host's next steps


def _filled_late(value: float, stream=None) -> torch.Tensor:
    """A tensor that becomes `value` only after a long sleep on `stream` (default: current)."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        t = torch.zeros(1 << 16, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(value)
    return t


def test_scope_runs_on_comm_stream_and_orders_the_caller(dist_env):
    comm = new_comm_stream(dist_env.device)
    caller = torch.cuda.current_stream()
    source = _filled_late(1.0)                       # pending on the caller's stream
    with CommStreamScope(comm, None, async_finish=False) as scope:
        assert torch.cuda.current_stream() == comm
        out = source * 2                             # comm waited for the caller: sees 1.0
        torch.cuda._sleep(SLEEP_CYCLES)
        out += 1
        event = scope.finish((source,), (out,))
    assert torch.cuda.current_stream() == caller
    assert event.event is None
    assert bool((out == 3).all()), "the caller's stream did not wait for the comm stream"


def test_scope_waits_for_previous_event_and_returns_an_event_when_async(dist_env):
    comm = new_comm_stream(dist_env.device)
    source = _filled_late(1.0)
    previous = Buffer.capture()                      # recorded after the fill
    assert isinstance(previous.event, torch.cuda.Event)
    with CommStreamScope(comm, previous, async_finish=True) as scope:
        out = source * 2
        torch.cuda._sleep(SLEEP_CYCLES)
        out += 1
        event = scope.finish((source,), (out,))
    assert isinstance(event.event, torch.cuda.Event)
    assert any(t is source for t in event.extra_tensors) and any(t is out for t in event.extra_tensors)
    event.current_stream_wait()
    assert bool((out == 3).all()), "previous_event or the returned event did not order the streams"


def test_scope_restores_the_stream_after_an_error(dist_env):
    comm = new_comm_stream(dist_env.device)
    caller = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="backend failed"):
        with CommStreamScope(comm, None, async_finish=True):
            raise RuntimeError("backend failed")
    assert torch.cuda.current_stream() == caller


def test_event_overlap_context_waits_for_the_comm_stream(dist_env):
    comm = new_comm_stream(dist_env.device)
    late = _filled_late(5.0, comm)
    event = torch.cuda.Event()
    event.record(comm)
    with EventOverlap(event):
        pass
    assert bool((late * 1 == 5).all())


def _layout_oracle(topk_idx, num_experts, buf):
    from epcomm.reference import oracle
    num_local_ranks = buf.group_size // buf.runtime.get_num_rdma_ranks()
    return oracle.layout(topk_idx.cpu(), num_experts, buf.group_size, num_local_ranks)


@pytest.mark.parametrize("async_finish, allocate_on_comm_stream, with_event",
                         [(False, False, False), (False, False, True), (True, False, False), (True, True, True)])
def test_buffer_layout_in_every_stream_mode(dist_env, async_finish, allocate_on_comm_stream, with_event):
    buf = Buffer(dist_env.group, 1 << 20)
    num_experts = 8 * dist_env.world_size
    g = torch.Generator().manual_seed(dist_env.rank)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=g)[:4] for _ in range(512)])
    topk_idx = topk_idx.to(dist_env.device)
    caller = torch.cuda.current_stream()
    previous = Buffer.capture() if with_event else None
    *outputs, event = buf.get_dispatch_layout(topk_idx, num_experts, previous_event=previous,
                                              async_finish=async_finish,
                                              allocate_on_comm_stream=allocate_on_comm_stream)
    assert torch.cuda.current_stream() == caller
    assert (event.event is not None) == async_finish
    event.current_stream_wait()
    for got, want in zip(outputs, _layout_oracle(topk_idx, num_experts, buf)):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.device == dist_env.device and torch.equal(got.cpu(), want)
    # bad input on the GPU backend: a CPU tensor; the buffer stays usable
    with pytest.raises(ValueError, match="Buffer.get_dispatch_layout: topk_idx must be on the Buffer's device"):
        buf.get_dispatch_layout(topk_idx.cpu(), num_experts)
    again = buf.get_dispatch_layout(topk_idx, num_experts)
    assert torch.equal(again[3].cpu(), outputs[3].cpu())
    dist_env.barrier()
