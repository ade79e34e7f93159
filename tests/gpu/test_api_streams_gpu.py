"""Stream semantics on a GPU (api.md, "Stream semantics"; epcomm/streams.py): the async scope
alone, then through a real Buffer (dispatch layout, the first GPU kernel), and what the host does
per synchronous call (counted with the torch profiler: no events, no stream switches, no
record_stream, no memset). Run with `make test-gpu` (torchrun).

The ordering checks can fail: the producer side is delayed with torch.cuda._sleep, so a missing
wait makes the consumer read the old value."""
from __future__ import annotations

import pytest
import torch

from epcomm import Buffer, EventOverlap
from epcomm.streams import AsyncScope, new_comm_stream

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 50_000_000   # tens of ms on any GPU: far longer than the host's next steps


def _filled_late(value: float, stream=None) -> torch.Tensor:
    """A tensor that becomes `value` only after a long sleep on `stream` (default: current)."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        t = torch.zeros(1 << 16, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(value)
    return t


def test_async_scope_runs_on_comm_stream_after_the_caller(dist_env):
    comm = new_comm_stream(dist_env.device)
    caller = torch.cuda.current_stream()
    for _ in range(2):                               # the second call reuses the comm's wait event
        source = _filled_late(1.0)                   # pending on the caller's stream
        with AsyncScope(comm, None) as scope:
            assert torch.cuda.current_stream() == comm.stream
            out = source * 2                         # comm waited for the caller: sees 1.0
            torch.cuda._sleep(SLEEP_CYCLES)
            out += 1
            event = scope.finish((source,), (out,))
        assert torch.cuda.current_stream() == caller
        assert isinstance(event.event, torch.cuda.Event)
        event.current_stream_wait()
        assert bool((out == 3).all()), "the comm stream did not wait for the caller, or the event is early"


def test_async_scope_waits_for_previous_event_and_returns_an_event(dist_env):
    comm = new_comm_stream(dist_env.device)
    side = torch.cuda.Stream()
    source = _filled_late(1.0, side)                 # pending on another stream
    previous = torch.cuda.Event()
    previous.record(side)
    with AsyncScope(comm, EventOverlap(previous)) as scope:
        out = source * 2
        torch.cuda._sleep(SLEEP_CYCLES)
        out += 1
        event = scope.finish((source,), (out,))
    assert isinstance(event.event, torch.cuda.Event)
    assert any(t is source for t in event.extra_tensors) and any(t is out for t in event.extra_tensors)
    event.current_stream_wait()
    assert bool((out == 3).all()), "previous_event or the returned event did not order the streams"


def test_async_scope_restores_the_stream_after_an_error(dist_env):
    comm = new_comm_stream(dist_env.device)
    caller = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="backend failed"):
        with AsyncScope(comm, None):
            raise RuntimeError("backend failed")
    assert torch.cuda.current_stream() == caller


def test_event_overlap_context_waits_for_the_comm_stream(dist_env):
    comm = new_comm_stream(dist_env.device).stream
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


def test_synchronous_call_with_previous_event_waits_for_it(dist_env):
    """A synchronous call runs on the caller's stream after previous_event (epcomm/streams.py):
    topk_idx is rewritten late on a side stream; only a wait for its event sees the new routing."""
    buf = Buffer(dist_env.group, 1 << 20)
    num_experts = 4 * dist_env.world_size
    n = 300
    topk_idx = torch.zeros(n, 2, dtype=torch.int64, device=dist_env.device)
    topk_idx[:, 1] = 1
    rewritten = topk_idx.clone()
    rewritten[:, 1] = num_experts - 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        topk_idx.copy_(rewritten)
    done = torch.cuda.Event()
    done.record(side)
    *outputs, event = buf.get_dispatch_layout(topk_idx, num_experts, previous_event=EventOverlap(done))
    assert event.event is None
    per_expert = outputs[2].cpu()
    assert per_expert[num_experts - 1] == n and per_expert[1] == 0, \
        f"the call did not wait for previous_event: per-expert counts {per_expert.tolist()}"
    dist_env.barrier()


def _host_profile(fn):
    """(host-side event names, device-side event names) of one fn() (torch profiler)."""
    from collections import Counter
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    host = Counter(e.name for e in events if e.device_type == DeviceType.CPU)
    device = [e.name for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("Activity")]
    return host, device


def test_synchronous_layout_call_adds_no_stream_work_on_the_host(dist_env):
    """Counts, not times: a synchronous get_dispatch_layout is output allocations plus one launch.
    No events, no stream waits or switches, no record_stream, no memset / fill kernel, no slices."""
    buf = Buffer(dist_env.group, 1 << 20)
    num_experts = 8 * dist_env.world_size
    for n in (100, 4096):                            # one block; a cooperative multi-block grid
        topk_idx = torch.randint(0, num_experts, (n, 4), device=dist_env.device)
        host, device = _host_profile(lambda: buf.get_dispatch_layout(topk_idx, num_experts))
        for forbidden in ("cudaEventRecord", "cudaEventRecordWithFlags", "cudaStreamWaitEvent", "aten::record_stream",
                          "aten::fill_", "aten::zero_", "aten::zeros", "aten::slice", "cudaMemsetAsync"):
            assert host[forbidden] == 0, f"N={n}: {forbidden} x{host[forbidden]} in a synchronous layout call"
        assert host["aten::empty"] <= 3, f"N={n}: {host['aten::empty']} allocations"
        assert len(device) == 1 and "layout_kernel" in device[0], f"N={n}: device work {device}"
    dist_env.barrier()
