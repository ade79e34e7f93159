"""`EventOverlap`: what normal-mode and low-latency calls return as their `event`; `EventHandle`:
DeepEP's event recorded on the current stream (what callers wrap in an EventOverlap themselves)."""
from __future__ import annotations

from typing import Any, Optional, Tuple


def stream_wait_event(stream, event) -> None:
    """Make `stream` (a torch.cuda.Stream, or None for the current stream) wait for `event`: a
    torch.cuda.Event / torch.Event, or any object with DeepEP's `current_stream_wait()` (which only
    knows the current stream)."""
    if hasattr(event, "wait"):
        event.wait(stream)
    elif stream is None and hasattr(event, "current_stream_wait"):
        event.current_stream_wait()
    else:
        raise TypeError(f"cannot make a stream wait for an event of type {type(event).__name__}")


class EventOverlap:
    """A CUDA event recorded after a call's kernels, for overlapping communication with compute.

    Attributes:
        event: the event (torch.cuda.Event), or None when there is nothing to wait for: synchronous
            calls, and every call on the CPU backend.
        extra_tensors: tensors kept alive until this object is dropped, so that memory the kernels
            still use is not reused; unlike `record_stream`, this works under CUDA-graph capture.

    Usage: `event.current_stream_wait()`, or `with event: ...` (the current stream waits on exit).
    """

    __slots__ = ("event", "extra_tensors", "check_errors")

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        # Set by the Buffer whose call recorded the event: waiting on it raises a failure that
        # Buffer recorded (PeerTimeout...), as any call of the Buffer would.
        self.check_errors = None

    def current_stream_wait(self) -> None:
        """Make `torch.cuda.current_stream()` wait for the event (nothing to do when it is None)."""
        if self.check_errors is not None:
            self.check_errors()
        if self.event is not None:
            stream_wait_event(None, self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        kept = 0 if self.extra_tensors is None else len(self.extra_tensors)
        return f"EventOverlap(event={self.event!r}, extra_tensors=<{kept} kept>)"


class EventHandle:
    """DeepEP's `EventHandle()`: an event recorded on `torch.cuda.current_stream()` when it is made.
    Without CUDA (the CPU backend, whose calls are all synchronous) there is nothing to record and
    waiting on it is a no-op.

    Usage: `EventOverlap(EventHandle())` as a previous_event, or `handle.current_stream_wait()`."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        import torch
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self) -> None:
        """Make `torch.cuda.current_stream()` wait for the event."""
        self.wait(None)

    def wait(self, stream=None) -> None:
        """Make `stream` (None: the current stream) wait for the event, as torch.cuda.Event.wait."""
        if self.event is not None:
            self.event.wait(stream)

    def __repr__(self) -> str:
        return f"EventHandle(event={self.event!r})"
