"""Sizes the GPU tests derive from the live topology, so one suite is meaningful at any rank count
R, any internode split M x L and any SM partition (several ranks per GPU under MPS)."""
from __future__ import annotations

from typing import List, Optional, Tuple


def experts(nominal: int, ranks: int) -> int:
    """An expert count near `nominal` that R divides (every rank holds E / R experts)."""
    return ranks * max(1, round(nominal / ranks))


def internode_splits(ranks: int) -> List[Tuple[int, int]]:
    """Every (nodes M >= 2, ranks per node L) with M x L = R, by L ascending."""
    return [(ranks // local, local) for local in range(1, ranks // 2 + 1) if ranks % local == 0]


def fit_sms(wanted: int, available: int) -> Optional[int]:
    """The SM count a normal-mode test asks for, capped to the rank's share of the device (every
    block of a call must be resident at once) and kept even (channels pair SMs); None if < 2."""
    sms = min(wanted, available)
    sms -= sms % 2
    return sms if sms >= 2 else None


def world_size() -> int:
    """The rank count of the running GPU session (torchrun / tests.gpu_session set WORLD_SIZE), so
    module-level test cases can be sized for it; 1 outside a session (the GPU tests skip there)."""
    import os
    return int(os.environ.get("WORLD_SIZE", "1"))
