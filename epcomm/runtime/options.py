"""The only place NVRTC and nvJitLink option lists are built.

A build is described by a `Target` (what changes the binary and is not the source text); the lists
follow from it and from the toolchain's directories. Callers never pass flags.

NVRTC compiles to LTO-IR for the virtual arch (compute_XX, -rdc -dlto) so that nvJitLink can do
whole-program optimisation and, in link mode "lib", pull NVSHMEM's device code from its archive.
The feature set (EPCOMM_FEATURE_SM90 / SM80) is separate from the compile target so that an H200 can
run the Ampere code paths: the target stays sm_90 (so the cubin loads) while the macros say SM80.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from .. import env
from . import toolchain

FEATURES = (80, 90)


@dataclass(frozen=True)
class Target:
    arch_sm: int                 # compile target, e.g. 90 -> sm_90 (the device's compute capability)
    feature: int                 # 80 or 90: which code paths the kernels select
    uses_nvshmem: bool = False
    link_mode: str = "inline"    # "inline" (NVSHMEM from headers) or "lib" (libnvshmem_device.a)
    lineinfo: bool = False       # -lineinfo for profilers
    defines: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"feature set must be one of {FEATURES}, got {self.feature}")
        if self.arch_sm < self.feature:
            raise ValueError(f"feature set sm{self.feature} cannot run on sm_{self.arch_sm}")
        if self.link_mode not in ("inline", "lib"):
            raise ValueError(f"link mode must be inline or lib, got {self.link_mode!r}")

    @classmethod
    def make(cls, arch_sm: int, feature: int, uses_nvshmem: bool = False,
             defines: Tuple[Tuple[str, object], ...] = ()) -> "Target":
        """A target with the link mode and debug knobs taken from the environment (epcomm.env)."""
        return cls(arch_sm=int(arch_sm), feature=int(feature), uses_nvshmem=bool(uses_nvshmem),
                   link_mode=env.nvshmem_link_mode() if uses_nvshmem else "inline",
                   lineinfo=env.jit_lineinfo(),
                   defines=tuple((str(k), str(v)) for k, v in defines))

    @property
    def label(self) -> str:
        """sm_90/f80 style: compile target and feature set, for logs and file names."""
        return f"sm_{self.arch_sm}/f{self.feature}"


def nvrtc_options(target: Target, cuda_src: str) -> List[str]:
    opts = [
        f"-arch=compute_{target.arch_sm}",
        "-rdc=true",          # relocatable: NVSHMEM device symbols resolve at link time
        "-dlto",              # emit LTO-IR; nvJitLink optimises the whole program
        "-std=c++17",
        "-default-device",    # NVSHMEM headers have unannotated helpers; NVRTC has no host code
        f"-I{cuda_src}",
    ]
    opts += [f"-I{d}" for d in toolchain.cuda_include_dirs()]
    if target.uses_nvshmem:
        opts.append(f"-I{toolchain.nvshmem_include_dir()}")
        opts.append("-DEPCOMM_NVSHMEM_INLINE=1" if target.link_mode == "inline"
                    else "-DEPCOMM_NVSHMEM_LIB=1")
    opts.append(f"-DEPCOMM_FEATURE_SM{target.feature}=1")
    if target.lineinfo:
        opts.append("-lineinfo")
    opts += [f"-D{k}={v}" for k, v in target.defines]
    return opts


def nvjitlink_options(target: Target, ptx: bool = False) -> List[str]:
    """ptx=True asks for PTX instead of a cubin (EPCOMM_JIT_DUMP only)."""
    opts = [f"-arch=sm_{target.arch_sm}", "-lto", "-O3"]
    if target.lineinfo:
        opts.append("-lineinfo")
    if ptx:
        opts.append("-ptx")
    return opts


def link_libraries(target: Target) -> List[str]:
    """Device libraries nvJitLink links after our LTO-IR (archives of relocatable device code)."""
    if target.uses_nvshmem and target.link_mode == "lib":
        return [toolchain.nvshmem_device_library(target.arch_sm)]
    return []
