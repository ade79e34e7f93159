"""Where the JIT toolchain lives: NVRTC and nvJitLink (through cuda.bindings), the CUDA headers, and
NVSHMEM. Everything is looked up on first use and memoised; nothing here needs a GPU.

Search order
  CUDA headers  EPCOMM_CUDA_HOME/include (+ include/cccl), else the pip wheels matching NVRTC's major
                (CUDA 13: nvidia/cu13/include + include/cccl; CUDA 12: nvidia/cuda_runtime/include +
                nvidia/cuda_cccl/include), else /usr/local/cuda/include (+ cccl).
  NVSHMEM       EPCOMM_NVSHMEM_HOME, else the nvidia-nvshmem-cu1x wheel (nvidia/nvshmem).
A missing piece raises ToolchainError naming the pip package or variable that fixes it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
from pathlib import Path
from typing import Tuple

from .. import env
from ..errors import ToolchainError

_PIP_HINT = ("pip install 'epcomm[cu13]' (or for CUDA 12: 'epcomm[cu12]'); "
             "the pieces are cuda-bindings, nvidia-cuda-nvrtc, nvidia-nvjitlink, "
             "nvidia-cuda-runtime, nvidia-cuda-cccl, nvidia-nvshmem-cu13")


@functools.lru_cache(maxsize=None)
def nvrtc():
    """The cuda.bindings.nvrtc module, checked to load libnvrtc."""
    try:
        from cuda.bindings import nvrtc as module
        err, _, _ = module.nvrtcVersion()
    except Exception as e:  # ImportError, or pathfinder's "library not found"
        raise ToolchainError(f"NVRTC is not usable ({e}); {_PIP_HINT}") from e
    return module


@functools.lru_cache(maxsize=None)
def nvjitlink():
    """The cuda.bindings.nvjitlink module, checked to load libnvJitLink."""
    try:
        from cuda.bindings import nvjitlink as module
        module.version()
    except Exception as e:
        raise ToolchainError(f"nvJitLink is not usable ({e}); {_PIP_HINT}") from e
    return module


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> Tuple[int, int]:
    err, major, minor = nvrtc().nvrtcVersion()
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def nvjitlink_version() -> Tuple[int, int]:
    major, minor = nvjitlink().version()
    return int(major), int(minor)


def _nvidia_wheel_roots() -> list[Path]:
    """The site-packages/nvidia directories (a namespace package spread over sys.path)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _cccl_dir(include: Path) -> Path | None:
    """The directory that holds cuda/std/ for a CUDA include dir (CUDA 13 moved it to cccl/)."""
    for cand in (include / "cccl", include):
        if (cand / "cuda" / "std" / "type_traits").exists():
            return cand
    return None


def _header_layouts(major: int) -> list[tuple[str, Path, Path | None]]:
    """(description, include dir, cccl dir or None to derive) candidates in search order."""
    wheels13 = [(f"wheel {r / 'cu13'}", r / "cu13" / "include", None) for r in _nvidia_wheel_roots()]
    wheels12 = [(f"wheel {r / 'cuda_runtime'}", r / "cuda_runtime" / "include",
                 r / "cuda_cccl" / "include") for r in _nvidia_wheel_roots()]
    wheels = wheels13 + wheels12 if major >= 13 else wheels12 + wheels13
    return wheels + [("toolkit /usr/local/cuda", Path("/usr/local/cuda/include"), None)]


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> Tuple[str, ...]:
    """Include dirs for the CUDA headers (cuda_runtime.h, cuda_bf16.h, ...) and CCCL (cuda/std)."""
    home = env.cuda_home()
    if home is not None:
        include = Path(home) / "include"
        cccl = _cccl_dir(include)
        if not (include / "cuda_runtime.h").exists() or cccl is None:
            raise ToolchainError(f"EPCOMM_CUDA_HOME={home}: expected {include}/cuda_runtime.h and "
                                 f"cuda/std/ under {include}/cccl or {include}")
        return tuple(dict.fromkeys([str(include), str(cccl)]))
    # Prefer one layout that has both; a wheel set without the CCCL wheel (as on images that ship
    # a toolkit beside the wheels) borrows cuda/std from the next layout that has it.
    tried, headers, cccls = [], [], []
    for what, include, cccl in _header_layouts(nvrtc_version()[0]):
        tried.append(f"{what} ({include})")
        if cccl is None or not (cccl / "cuda" / "std").is_dir():
            cccl = _cccl_dir(include)
        if (include / "cuda_runtime.h").exists():
            if cccl is not None:
                return tuple(dict.fromkeys([str(include), str(cccl)]))
            headers.append(include)
        elif cccl is not None:
            cccls.append(cccl)
    if headers and cccls:
        return tuple(dict.fromkeys([str(headers[0]), str(cccls[0])]))
    if headers:
        raise ToolchainError(f"CUDA headers found at {headers[0]} but not CCCL (cuda/std/...): "
                             f"pip install nvidia-cuda-cccl (CUDA 13) / nvidia-cuda-cccl-cu12")
    raise ToolchainError("CUDA headers (cuda_runtime.h) not found; tried " + ", ".join(tried)
                         + ". pip install nvidia-cuda-runtime nvidia-cuda-cccl (CUDA 13; "
                         "-cu12 for CUDA 12) or set EPCOMM_CUDA_HOME to a CUDA toolkit")


@functools.lru_cache(maxsize=None)
def nvshmem_home() -> Path:
    """Root of the NVSHMEM install: include/ (device headers) and lib/ (libnvshmem_host.so.3, ...)."""
    home = env.nvshmem_home()
    if home is not None:
        if not (Path(home) / "include" / "nvshmem.h").exists():
            raise ToolchainError(f"EPCOMM_NVSHMEM_HOME={home} has no include/nvshmem.h")
        return Path(home)
    for root in _nvidia_wheel_roots():
        if (root / "nvshmem" / "include" / "nvshmem.h").exists():
            return root / "nvshmem"
    raise ToolchainError("NVSHMEM not found: pip install nvidia-nvshmem-cu13 (or -cu12), "
                         "or set EPCOMM_NVSHMEM_HOME to an NVSHMEM install (include/, lib/)")


def nvshmem_include_dir() -> str:
    return str(nvshmem_home() / "include")


def nvshmem_device_library(arch_sm: int) -> str:
    """libnvshmem_device.a for link mode "lib" (3.8+ wheels ship one per arch)."""
    lib = nvshmem_home() / "lib"
    for name in (f"libnvshmem_device_sm_{arch_sm}.a", "libnvshmem_device.a"):
        if (lib / name).exists():
            return str(lib / name)
    raise ToolchainError(f"EPCOMM_NVSHMEM_LINK=lib needs {lib}/libnvshmem_device.a, which is "
                         f"missing; use EPCOMM_NVSHMEM_LINK=inline or a full NVSHMEM install")


@functools.lru_cache(maxsize=None)
def nvshmem_version() -> Tuple[int, int, int] | None:
    """NVSHMEM's version from its headers, or None when NVSHMEM is not installed."""
    try:
        header = nvshmem_home() / "include" / "non_abi" / "nvshmem_version.h"
    except ToolchainError:
        return None
    text = header.read_text() if header.exists() else ""
    parts = [re.search(rf"#define\s+NVSHMEM_VENDOR_{p}_VERSION\s+(\d+)", text)
             for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ToolchainError(f"cannot read NVSHMEM's version from {header}")
    return tuple(int(m.group(1)) for m in parts)


def _define(header: Path, name: str) -> int | None:
    text = header.read_text(errors="replace") if header.is_file() else ""
    m = re.search(rf"#define\s+{name}\s+(\d+)", text)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=None)
def cuda_header_versions() -> dict:
    """CUDA runtime and CCCL versions of the headers kernels include (None where a header lacks it)."""
    dirs = cuda_include_dirs()    # (include, cccl), or one dir that holds both
    include, cccl = Path(dirs[0]), Path(dirs[-1])
    return {"cudart": _define(include / "cuda_runtime_api.h", "CUDART_VERSION"),
            "cccl": _define(cccl / "cuda" / "std" / "__cccl" / "version.h", "CCCL_VERSION")}


def fingerprint() -> dict:
    """Everything about the toolchain that changes a binary; part of every cache key. Versions
    only, no install paths: the same versions elsewhere (another venv, a container) share entries."""
    return {"nvrtc": nvrtc_version(), "nvjitlink": nvjitlink_version(),
            "nvshmem": nvshmem_version(), "cuda_headers": cuda_header_versions()}


def install_paths() -> dict:
    """Toolchain directories as they appear in option lists -> the placeholder a cache key uses."""
    paths = {d: f"<cuda_include_{i}>" for i, d in enumerate(cuda_include_dirs())}
    with contextlib.suppress(ToolchainError):
        paths[nvshmem_include_dir()] = "<nvshmem_include>"
    return paths


def describe() -> str:
    """One line for logs and --precompile."""
    nv = nvshmem_version()
    return (f"NVRTC {'.'.join(map(str, nvrtc_version()))}, "
            f"nvJitLink {'.'.join(map(str, nvjitlink_version()))}, "
            f"NVSHMEM {'.'.join(map(str, nv)) if nv else 'absent'}, "
            f"CUDA headers {os.pathsep.join(cuda_include_dirs())}")
