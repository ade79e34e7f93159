"""Stream semantics of Buffer calls (api.md, "Stream semantics").

A call's kernels run on the Buffer's communication stream. The backend launches on
`torch.cuda.current_stream()` and allocates its outputs there, so `CommStreamScope` makes the comm
stream current for the duration of the backend call:

    scope = CommStreamScope(comm_stream, previous_event, async_finish)
    with scope:                      # comm waits for previous_event (or the current stream)
        outputs = backend.op(...)    # launched on, and allocated on, the comm stream
        event = scope.finish(inputs, outputs)

Outputs therefore always belong to the comm stream's memory pool (with or without
allocate_on_comm_stream, which only changes what the caller promises). Each output is
`record_stream`-ed on the caller's stream, so the pool does not hand its memory to later comm-stream
work while the caller still uses it. With async_finish, inputs are `record_stream`-ed on the comm
stream for the symmetric reason, and the returned EventOverlap also holds inputs and outputs.

With comm_stream None (CPU backend) everything is synchronous and the scope does nothing.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from .event import EventOverlap, stream_wait_event


def tensors_in(items: Iterable) -> Iterator[torch.Tensor]:
    """The tensors among `items`, looking into tuples and lists (FP8 pairs, handles); None skipped."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from tensors_in(item)


def new_comm_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """A high-priority stream on `device` for a Buffer's communication, or None for a CPU device."""
    if device.type != "cuda":
        return None
    # High priority, as communication kernels gate the compute that waits for them.
    return torch.cuda.Stream(device=device, priority=-1)


class CommStreamScope:
    __slots__ = ("comm", "previous_event", "async_finish", "compute", "restore_device")

    def __init__(self, comm_stream: Optional[torch.cuda.Stream], previous_event: Optional[EventOverlap],
                 async_finish: bool) -> None:
        self.comm = comm_stream
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.compute = None
        self.restore_device = None

    def __enter__(self) -> "CommStreamScope":
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
            stream_wait_event(comm, event)
        else:
            comm.wait_stream(self.compute)
        torch.cuda.set_stream(comm)
        return self

    def finish(self, inputs: Iterable, outputs: Iterable) -> EventOverlap:
        """Order the caller's stream after the call (or record the event of an async call)."""
        if self.comm is None:
            return EventOverlap()
        outputs = tuple(tensors_in(outputs))
        for t in outputs:
            t.record_stream(self.compute)
        if not self.async_finish:
            self.compute.wait_stream(self.comm)
            return EventOverlap()
        inputs = tuple(tensors_in(inputs))
        for t in inputs:
            t.record_stream(self.comm)
        event = torch.cuda.Event()
        event.record(self.comm)
        return EventOverlap(event, inputs + outputs)

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.comm is None:
            return
        torch.cuda.set_stream(self.compute)
        if self.restore_device is not None:
            torch.cuda.set_device(self.restore_device)
        if exc_type is not None:
            # A failed call may have queued work on the comm stream; keep the caller ordered after it.
            self.compute.wait_stream(self.comm)
