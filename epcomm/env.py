"""Every EPCOMM_* knob, read in this one module (no other module reads os.environ for them).

Knob                      default              meaning
EPCOMM_BACKEND            auto                 auto: CPU reference backend for a gloo group, GPU otherwise;
                                               cpu / gpu force one.
EPCOMM_ARCH               (detected)           sm80 / sm90: feature set for the JIT (sm80 on an H200 tests
                                               the Ampere path); a Buffer reads it when it is created.
EPCOMM_CACHE_DIR          ~/.cache/epcomm      where compiled cubins are cached.
EPCOMM_TIMEOUT_S          20                   bound of every wait on a peer (GPU kernels, CPU backend), seconds.
EPCOMM_SYNC_CALLS         0                    1: every GPU Buffer call synchronises the device and raises a
                                               failure (PeerTimeout...) at the call itself (debugging; slow).
EPCOMM_NVSHMEM_HOME       (nvidia-nvshmem wheel) root of an NVSHMEM install (include/, lib/).
EPCOMM_CUDA_HOME          (wheels, then /usr/local/cuda) root of a CUDA toolkit (include/, include/cccl).
EPCOMM_NVSHMEM_LINK       inline               inline: NVSHMEM device code from headers (no IBGDA);
                                               lib: link libnvshmem_device.a (keeps IBGDA).
EPCOMM_JIT_VERBOSE        0                    1: print every compile / link command and its time.
EPCOMM_JIT_DUMP           (unset)              directory: dump the generated unit, PTX and cubin of each build.
EPCOMM_JIT_LINEINFO       0                    1: compile with -lineinfo (for profilers).
EPCOMM_ASSERT_NO_COMPILE  0                    1: a cache miss raises instead of compiling (proves warm paths).
EPCOMM_NUM_LOCAL_RANKS    (from host names)    ranks per node (NVLink domain); must divide the group size and
                                               be equal on every rank. Fewer than the ranks of a host make
                                               it several "nodes" that talk through NVSHMEM puts (e.g. 1 on
                                               a 2-GPU host tests internode mode).
EPCOMM_INTRANODE_TRACE    0                    1: intranode kernels built to stamp their phases (profiling;
                                               read at import; bench/intranode_trace.py).
EPCOMM_LL_TRACE           0                    1: the same for the low-latency kernels (bench/low_latency_trace.py).
EPCOMM_INTERNODE_TRACE    0                    1: the same for the internode normal-mode data kernels
                                               (bench/internode_trace.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def _get(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _flag(name: str) -> bool:
    return (_get(name) or "0").lower() not in ("0", "false", "no", "off")


def backend() -> str:
    value = (_get("EPCOMM_BACKEND") or "auto").lower()
    if value not in ("auto", "cpu", "gpu"):
        raise ValueError(f"EPCOMM_BACKEND must be auto, cpu or gpu, got {value!r}")
    return value


def arch_override() -> Optional[int]:
    """Feature set forced by EPCOMM_ARCH (80 or 90), or None to use the device's."""
    value = _get("EPCOMM_ARCH")
    if value is None:
        return None
    digits = value.lower().replace("sm_", "").replace("sm", "")
    if digits not in ("80", "90"):
        raise ValueError(f"EPCOMM_ARCH must be sm80 or sm90, got {value!r}")
    return int(digits)


def cache_dir() -> Path:
    return Path(_get("EPCOMM_CACHE_DIR") or Path.home() / ".cache" / "epcomm")


def timeout_s() -> float:
    value = float(_get("EPCOMM_TIMEOUT_S") or 20.0)
    if value <= 0:
        raise ValueError(f"EPCOMM_TIMEOUT_S must be > 0, got {value}")
    return value


def sync_calls() -> bool:
    return _flag("EPCOMM_SYNC_CALLS")


def nvshmem_home() -> Optional[str]:
    return _get("EPCOMM_NVSHMEM_HOME")


def cuda_home() -> Optional[str]:
    return _get("EPCOMM_CUDA_HOME")


def nvshmem_link_mode() -> str:
    value = (_get("EPCOMM_NVSHMEM_LINK") or "inline").lower()
    if value not in ("inline", "lib"):
        raise ValueError(f"EPCOMM_NVSHMEM_LINK must be inline or lib, got {value!r}")
    return value


def jit_verbose() -> bool:
    return _flag("EPCOMM_JIT_VERBOSE")


def jit_dump_dir() -> Optional[Path]:
    value = _get("EPCOMM_JIT_DUMP")
    return Path(value) if value else None


def jit_lineinfo() -> bool:
    return _flag("EPCOMM_JIT_LINEINFO")


def assert_no_compile() -> bool:
    return _flag("EPCOMM_ASSERT_NO_COMPILE")


def intranode_trace() -> bool:
    return _flag("EPCOMM_INTRANODE_TRACE")


def ll_trace() -> bool:
    return _flag("EPCOMM_LL_TRACE")


def internode_trace() -> bool:
    return _flag("EPCOMM_INTERNODE_TRACE")


def num_local_ranks() -> Optional[int]:
    """Ranks per node forced by EPCOMM_NUM_LOCAL_RANKS, or None (derive it from the hosts)."""
    value = _get("EPCOMM_NUM_LOCAL_RANKS")
    if value is None:
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"EPCOMM_NUM_LOCAL_RANKS must be a positive int, got {value!r}") from None
    if count < 1:
        raise ValueError(f"EPCOMM_NUM_LOCAL_RANKS must be a positive int, got {value!r}")
    return count
