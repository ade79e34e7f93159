"""The kernels a model's calls will build, for `python -m epcomm.jit --precompile` with shapes.

`ModelShapes` holds what a model fixes (hidden, top-k, experts, ranks, ranks per node, the
low-latency token bound, dtypes, modes); `kernel_sources` names every kernel the Buffer calls
compile for it, through the same name and source functions the ops modules call at run time, so a
cache warmed from this list serves those calls without a compile (tests/gpu/test_jit_precompile_gpu.py checks
that with EPCOMM_ASSERT_NO_COMPILE=1).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from .. import env
from ..runtime.compiler import KernelSource
from ._common import FP8_BLOCK, INDEX_TYPES, UE8M0_PER_INT
from . import internode, internode_plan, intranode, intranode_plan, layout, low_latency, poison

MODES = ("normal", "low_latency")
DTYPES = ("bf16", "fp8")
LL_SCALES = ("float", "pow2", "ue8m0")     # FP8 low-latency scales: plain, round_scale, use_ue8m0
INDEX_DTYPES = {"int64": torch.int64, "int32": torch.int32}


@dataclass(frozen=True)
class ModelShapes:
    hidden: int
    num_topk: int
    num_experts: int
    num_ranks: int
    num_local_ranks: Optional[int] = None          # ranks per node (NVLink domain); None: all
    num_max_dispatch_tokens_per_rank: Optional[int] = None   # low-latency T
    dtypes: Tuple[str, ...] = ("bf16",)            # dispatch payloads (combine is always BF16)
    modes: Tuple[str, ...] = MODES
    index_dtype: str = "int64"                     # topk_idx dtype (epcomm.topk_idx_t: int64)
    ll_scales: Tuple[str, ...] = ("float",)

    def __post_init__(self):
        for name in ("dtypes", "modes", "ll_scales"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if self.num_local_ranks is None:
            object.__setattr__(self, "num_local_ranks", self.num_ranks)
        self._check()

    def _check(self) -> None:
        def bad(message):
            raise ValueError(f"model shapes {self}: {message}")
        for name in ("hidden", "num_topk", "num_experts", "num_ranks", "num_local_ranks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(f"{name} must be a positive integer")
        if self.num_experts % self.num_ranks:
            bad(f"num_experts ({self.num_experts}) must be a multiple of num_ranks ({self.num_ranks})")
        if self.num_ranks % self.num_local_ranks:
            bad(f"num_ranks ({self.num_ranks}) must be a multiple of num_local_ranks "
                f"({self.num_local_ranks})")
        for name, allowed in (("modes", MODES), ("dtypes", DTYPES), ("ll_scales", LL_SCALES)):
            unknown = [v for v in getattr(self, name) if v not in allowed]
            if unknown or not getattr(self, name):
                bad(f"{name} must be a non-empty subset of {allowed}, got {getattr(self, name)}")
        if self.index_dtype not in INDEX_DTYPES:
            bad(f"index_dtype must be one of {tuple(INDEX_DTYPES)}")
        if "fp8" in self.dtypes and self.hidden % 128:
            bad("FP8 needs hidden to be a multiple of 128 (one scale per 128 channels)")
        if "low_latency" in self.modes:
            T = self.num_max_dispatch_tokens_per_rank
            if not isinstance(T, int) or T < 1:
                bad("low_latency mode needs num_max_dispatch_tokens_per_rank (a positive integer)")
            if self.num_topk > low_latency.MAX_TOPK:
                bad(f"low-latency top-k is at most {low_latency.MAX_TOPK}")
            if "ue8m0" in self.ll_scales and self.hidden % (FP8_BLOCK * UE8M0_PER_INT):
                bad(f"ue8m0 scales pack {UE8M0_PER_INT} per int32: hidden must be a multiple of "
                    f"{FP8_BLOCK * UE8M0_PER_INT}, as low_latency_dispatch(use_ue8m0=True) requires")

    @classmethod
    def from_dict(cls, entry: dict) -> "ModelShapes":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"unknown model shape field(s) {unknown}; known: {sorted(known)}")
        return cls(**entry)


def load_shapes(path) -> List[ModelShapes]:
    """Models from a JSON file (one object or a list of objects) or a TOML file (top-level fields,
    or a [[model]] array of tables)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() == ".toml":
        import tomllib
        document = tomllib.loads(text)
        entries = document["model"] if "model" in document else [document]
    else:
        document = json.loads(text)
        entries = document if isinstance(document, list) else [document]
    if not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: expected one model (an object of shape fields) or a list of them")
    return [ModelShapes.from_dict(e) for e in entries]


def kernel_sources(shapes: ModelShapes) -> List[KernelSource]:
    """Every kernel source the calls of `shapes` build, in call order, without duplicates: the
    poison fill first (every Buffer of the GPU backend queues it behind each call)."""
    out: List[KernelSource] = [poison.poison_source()]
    if "normal" in shapes.modes:
        out += _normal_sources(shapes)
    if "low_latency" in shapes.modes:
        out += _low_latency_sources(shapes)
    return list(dict.fromkeys(out))


def _normal_sources(s: ModelShapes) -> List[KernelSource]:
    R, L = s.num_ranks, s.num_local_ranks
    index_dtype = INDEX_DTYPES[s.index_dtype]
    index_type = INDEX_TYPES[index_dtype]
    # get_dispatch_layout on a tensor from the caching allocator (16-byte aligned rows).
    topk_row = s.num_topk * index_dtype.itemsize
    out = [layout.layout_source(s.num_topk, s.num_experts, R, L, index_dtype,
                                layout._load_bytes(topk_row, 0))]
    rows = [(s.hidden * (2 if d == "bf16" else 1), 0 if d == "bf16" else s.hidden // 128)
            for d in s.dtypes]
    combine_row = s.hidden * 2
    if R == L:
        trace, source = env.intranode_trace(), intranode.kernel_source
        names = [intranode_plan.notify_kernel(R)]
        for row_bytes, scales in rows:
            names += [intranode_plan.dispatch_kernel(R, row_bytes, scales, index_type, True),
                      intranode_plan.dispatch_kernel(R, row_bytes, scales, "int", False)]
        names.append(intranode_plan.combine_kernel(R, combine_row))
        return out + [source(name, trace) for name in names]
    names = [internode_plan.notify_kernel(R, L)]
    for row_bytes, scales in rows:
        names += [internode_plan.dispatch_kernel(R, L, row_bytes, scales, index_type, True),
                  internode_plan.dispatch_kernel(R, L, row_bytes, scales, "int", False)]
    names.append(internode_plan.combine_kernel(R, L, combine_row))
    return out + [internode.kernel_source(name) for name in names]


def _low_latency_sources(s: ModelShapes) -> List[KernelSource]:
    H, K, R, E, T = s.hidden, s.num_topk, s.num_ranks, s.num_experts, s.num_max_dispatch_tokens_per_rank
    index_dtype, trace = INDEX_DTYPES[s.index_dtype], env.ll_trace()
    variants = []
    for dtype in s.dtypes:
        if dtype == "bf16":
            variants.append((False, False, False))
        else:
            variants += [(True, scale != "float", scale == "ue8m0") for scale in s.ll_scales]
    out = [low_latency.dispatch_source(H, K, R, E, T, fp8, round_scale, ue8m0, index_dtype, trace)
           for fp8, round_scale, ue8m0 in variants]
    out.append(low_latency.combine_source(H, K, R, E, T, index_dtype, trace))
    return out
