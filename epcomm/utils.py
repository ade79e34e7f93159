"""DeepEP's `deep_ep.utils` names that callers import directly (e.g. Megatron-LM's fused_a2a:
`from deep_ep.utils import EventHandle, EventOverlap`)."""
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
