"""Sizes the GPU tests derive from the live topology, so one suite is meaningful at any rank count
R, any internode split M x L and any SM partition (several ranks per GPU under MPS)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


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


# ---- internode token counts and what they need ---------------------------------------------------
# Tokens per rank of the internode scale cases: each profile gives N by rank for any rank count.
TOKEN_PROFILES = ("zero_on_one", "one", "n4096", "n16384", "differing")


def tokens_by_rank(profile: str, ranks: int) -> Tuple[int, ...]:
    """N of every rank for a profile: zero_on_one (the last rank sends nothing, the others 512),
    one (1 token each), n4096, n16384 (DeepEP's prefill scale and 4x it), differing (1, 4096,
    16384, 300 repeated over the ranks: chunk counts far apart in one call)."""
    if profile == "zero_on_one":
        return tuple(0 if r == ranks - 1 else 512 for r in range(ranks))
    if profile == "one":
        return (1,) * ranks
    if profile in ("n4096", "n16384"):
        return (int(profile[1:]),) * ranks
    if profile == "differing":
        cycle = (1, 4096, 16384, 300)
        return tuple(cycle[r % len(cycle)] for r in range(ranks))
    raise ValueError(f"unknown token profile {profile!r}; one of {TOKEN_PROFILES}")


def round_trip_device_bytes(ns: Sequence[int], hidden: int, fp8: bool) -> int:
    """Upper bound of one rank's device bytes in a dispatch (+ cached dispatch) + combine of `ns`
    tokens by rank: its inputs, at most every token of every rank received (fresh BF16 or FP8 rows
    with scales, a cached BF16 copy, combine's output), its top-k and handle tensors ignored."""
    mine, received = max(ns), sum(ns)
    row = 2 * hidden
    fp8_row = hidden + 4 * (hidden // 128)
    inputs = mine * (row + (fp8_row if fp8 else 0))
    outputs = received * (row + (fp8_row if fp8 else 0)) + mine * row
    return inputs + outputs


def round_trip_host_bytes(ns: Sequence[int], hidden: int, fp8: bool) -> int:
    """Upper bound of one rank process's host bytes for the same case: every rank's inputs rebuilt
    on the CPU (f32 draw of one rank at a time, BF16 and FP8 rows kept) and the oracle's expected
    rows of this rank (at most every token of every rank)."""
    total, largest = sum(ns), max(ns)
    fp8_row = hidden + 4 * (hidden // 128)
    kept = total * (2 * hidden + (fp8_row if fp8 else 0))
    return 4 * largest * hidden + kept + total * (2 * hidden + (fp8_row if fp8 else 0))


def memory_skip_reason(what: str, need: int, total: int, sharing: int, kind: str) -> Optional[str]:
    """None when `need` bytes per rank fit `sharing` ranks' equal share of `total` bytes of `kind`
    memory (90 % of it, the rest for contexts, the JIT and the allocator's slack); else the skip
    reason. `sharing`: ranks on one GPU (MPS) for device memory, ranks on the host for host memory."""
    share = int(0.9 * total) // max(1, sharing)
    if need <= share:
        return None
    gib = 1 << 30
    return (f"{what} needs {need / gib:.1f} GiB of {kind} memory per rank; {sharing} rank(s) share "
            f"{total / gib:.0f} GiB here ({share / gib:.1f} GiB each)")


def sm_holding_skip_reason(shared_gpu: bool, partitioned: bool, processes_per_gpu: int,
                           ranks_per_gpu: int) -> Optional[str]:
    """None when a rank of this session can hold all SMs of its share but a few and keep those few
    free (tests/gpu/test_sms_held_gpu.py); else the skip reason. Without an MPS partition every
    rank's holder takes the SMs the others' kernels were to run on; beside another job's processes
    an MPS share caps a process's SMs but reserves none, so their blocks may take the free ones."""
    if shared_gpu and not partitioned:
        return ("processes share this GPU without an MPS partition (tests.gpu_session --no-sm-partition): "
                "each rank's SM holder takes the SMs the others' kernels were to run on, so no rank "
                "keeps its free SMs")
    if processes_per_gpu > ranks_per_gpu:
        return (f"{processes_per_gpu // ranks_per_gpu} jobs share this GPU: their kernels may take the SMs "
                f"a rank leaves free (run with tests.gpu_session --jobs 1)")
    return None
