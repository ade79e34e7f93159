"""`deep_ep.buffer` resolved to epcomm.buffer."""
from epcomm.buffer import Buffer

__all__ = ["Buffer"]
