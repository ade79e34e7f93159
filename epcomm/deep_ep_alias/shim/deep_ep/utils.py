"""`deep_ep.utils` resolved to epcomm.utils (the same classes, so isinstance checks hold)."""
from epcomm.utils import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
