"""What `make deps` installs: the requirements of the test suite that this environment lacks, in
the CUDA flavour it already has (CUDA 13 when it has none), so that `make test` never installs one
CUDA major's wheels over the other's.

    python .ci/deps.py flavour    # cu12 / cu13
    python .ci/deps.py missing    # the pip requirement specs to install (one line; may be empty)
"""
from __future__ import annotations

import sys
from importlib import metadata
from typing import Dict, List, Optional, Tuple

COMMON = [("torch", "torch==2.13.0"), ("numpy", "numpy"), ("pytest", "pytest"),
          ("cuda-pathfinder", "cuda-pathfinder"), ("matplotlib", "matplotlib")]   # matplotlib: bench plots
# (distribution, requirement) per flavour; the NVSHMEM pin is the GPU image's release.
FLAVOURS: Dict[str, List[Tuple[str, str]]] = {
    "cu13": [("cuda-bindings", "cuda-bindings>=13,<14"),
             ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc>=13,<14"),
             ("nvidia-nvjitlink", "nvidia-nvjitlink>=13,<14"),
             ("nvidia-cuda-runtime", "nvidia-cuda-runtime>=13,<14"),
             ("nvidia-cuda-cccl", "nvidia-cuda-cccl>=13,<14"),
             ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu13==3.4.5")],
    "cu12": [("cuda-bindings", "cuda-bindings>=12.8,<13"),
             ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc-cu12"),
             ("nvidia-nvjitlink-cu12", "nvidia-nvjitlink-cu12"),
             ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu12"),
             ("nvidia-cuda-cccl-cu12", "nvidia-cuda-cccl-cu12"),
             ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu12==3.4.5")],
}


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def flavour() -> str:
    """cu12 or cu13, from the CUDA wheels installed (cuda-bindings' major first)."""
    bindings = _version("cuda-bindings")
    if bindings is not None:
        return "cu12" if bindings.split(".")[0] == "12" else "cu13"
    for name, dists in FLAVOURS.items():
        if any(_version(dist) is not None for dist, _ in dists):
            return name
    return "cu13"


def missing() -> List[str]:
    return [req for dist, req in COMMON + FLAVOURS[flavour()] if _version(dist) is None]


def main(argv: List[str]) -> int:
    if argv[1:] == ["flavour"]:
        print(flavour())
    elif argv[1:] == ["missing"]:
        print(" ".join(f"'{r}'" for r in missing()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
