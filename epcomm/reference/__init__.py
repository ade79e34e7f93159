"""CPU reference: `oracle` (single-process definitions of every operation, used by the GPU tests)
and `ReferenceBackend` (the Buffer API over a gloo group, computed with the oracle)."""
from . import oracle
from .backend import ReferenceBackend

__all__ = ["ReferenceBackend", "oracle"]
