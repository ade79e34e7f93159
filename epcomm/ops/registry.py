"""The kernel families, for `python -m epcomm.jit --precompile` and the compile tests.

Each module listed exposes `representative_sources() -> list[KernelSource]`: specialisations that
exercise every code path of its .cu file (typical shapes, both index types, intranode and
internode variants). Adding a family is one line here.
"""
from __future__ import annotations

import importlib
from typing import List, Tuple

from ..runtime.compiler import KernelSource

OPS_MODULES = (
    "epcomm.ops.layout",
    "epcomm.ops.intranode",
    "epcomm.ops.internode",
    "epcomm.ops.low_latency",
    "epcomm.ops.poison",
)


def representative_sources() -> List[Tuple[str, KernelSource]]:
    """(module name, source) for every registered family."""
    out = []
    for name in OPS_MODULES:
        module = importlib.import_module(name)
        out += [(name, src) for src in module.representative_sources()]
    return out
