"""Stream semantics of Buffer calls (api.md, "Stream semantics"), at the lowest host cost.

The backend launches its kernels on, and allocates its outputs on, `torch.cuda.current_stream()`.

Synchronous calls (async_finish=False) run on the caller's current stream. DeepEP runs them on
the comm stream fenced on both sides (the comm stream waits for the current stream, the current
stream waits for the comm stream before the call returns); for the caller's stream the order is
the same: the call's kernels start after all of its earlier work and its later work starts after
them. Running them in place costs no events, no stream switches and no record_stream (outputs and
inputs are only ever used in the caller's stream order, so the caching allocator's per-stream
reuse is already safe). With previous_event, the current stream first waits for that event (one
cudaStreamWaitEvent): the kernels then start after previous_event AND the caller's earlier work,
an order at least as strict as DeepEP's (which waits for previous_event alone).

Asynchronous calls (async_finish=True) run on the Buffer's comm stream (`AsyncScope`):

    with AsyncScope(comm, previous_event) as scope:   # comm waits for previous_event or the caller
        outputs = backend.op(...)                      # launched on, and allocated on, comm
        event = scope.finish(inputs, outputs)

The outputs belong to the comm stream's memory pool (with or without allocate_on_comm_stream,
which only changes what the caller promises). Each output is `record_stream`-ed on the caller's
stream, so the pool does not hand its memory to later comm-stream work while the caller still
uses it; inputs are `record_stream`-ed on the comm stream for the symmetric reason; the returned
EventOverlap holds inputs and outputs as well (record_stream does not work under graph capture).

With comm None (CPU backend) everything is synchronous and the scopes do nothing.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch

from .event import EventOverlap, stream_wait_event


def tensors_in(items: Iterable) -> Iterator[torch.Tensor]:
    """The tensors among `items`, looking into tuples and lists (FP8 pairs, handles); None skipped."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from tensors_in(item)


class CommStream:
    """A Buffer's communication stream and the event its async calls reuse to wait for the caller."""

    __slots__ = ("stream", "device_index", "ready")

    def __init__(self, device: torch.device) -> None:
        # High priority, as communication kernels gate the compute that waits for them.
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.device_index = self.stream.device_index
        # Re-recorded by every async call: a stream wait binds to the record made before it, so
        # one event serves all calls (and stays valid under graph capture).
        self.ready = torch.cuda.Event()


def new_comm_stream(device: torch.device) -> Optional[CommStream]:
    """The comm stream of a Buffer on `device`, or None for a CPU device."""
    return CommStream(device) if device.type == "cuda" else None


def wait_previous(previous_event: Optional[EventOverlap]) -> None:
    """Synchronous call with previous_event: the current stream waits for it (see module doc)."""
    if previous_event is not None and previous_event.event is not None:
        stream_wait_event(None, previous_event.event)


class AsyncScope:
    """An async_finish=True call on the comm stream (module doc); with comm None it does nothing
    and returns an EventOverlap without event."""

    __slots__ = ("comm", "previous_event", "compute", "restore_device", "check_errors")

    def __init__(self, comm: Optional[CommStream], previous_event: Optional[EventOverlap],
                 check_errors: Optional[Callable[[], None]] = None) -> None:
        """check_errors: the Buffer's failure check, run when the returned event is waited for."""
        self.comm = comm
        self.previous_event = previous_event
        self.check_errors = check_errors
        self.compute = None
        self.restore_device = None

    def __enter__(self) -> "AsyncScope":
        comm = self.comm
        if comm is None:
            return self
        # torch.cuda.set_stream also makes the stream's device current: remember the caller's.
        current_device = torch.cuda.current_device()
        if current_device != comm.device_index:
            self.restore_device = current_device
        self.compute = torch.cuda.current_stream(comm.device_index)
        event = None if self.previous_event is None else self.previous_event.event
        if event is not None:
            stream_wait_event(comm.stream, event)
        else:
            comm.ready.record(self.compute)
            comm.stream.wait_event(comm.ready)
        torch.cuda.set_stream(comm.stream)
        return self

    def finish(self, inputs: Iterable, outputs: Iterable) -> EventOverlap:
        """Record the call's event; keep inputs and outputs safe from the allocator meanwhile."""
        if self.comm is None:
            return EventOverlap()
        stream = self.comm.stream
        outputs = tuple(tensors_in(outputs))
        for t in outputs:
            t.record_stream(self.compute)
        inputs = tuple(tensors_in(inputs))
        for t in inputs:
            t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        overlap = EventOverlap(event, inputs + outputs)
        overlap.check_errors = self.check_errors
        return overlap

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.comm is None:
            return
        torch.cuda.set_stream(self.compute)
        if self.restore_device is not None:
            torch.cuda.set_device(self.restore_device)
        if exc_type is not None:
            # A failed call may have queued work on the comm stream; keep the caller ordered after it.
            self.compute.wait_stream(self.comm.stream)
