"""epcomm: expert-parallel MoE dispatch / combine for GPUs in pure Python, a drop-in for DeepEP's
`deep_ep.Buffer` (`import epcomm as deep_ep`).

`import epcomm` loads nothing heavy (no torch, no CUDA, no NVRTC): the exports below are imported on
first access.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

_LAZY = {"Buffer": "epcomm.buffer", "Config": "epcomm.config", "EventOverlap": "epcomm.event"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name == "fp8":           # epcomm.fp8.per_token_cast / per_token_cast_back
        value = importlib.import_module("epcomm.fp8")
    elif name == "utils":
        value = importlib.import_module("epcomm.utils")
    elif name == "topk_idx_t":
        import torch
        value = torch.int64     # dtype of topk_idx everywhere
    else:
        raise AttributeError(f"module 'epcomm' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
