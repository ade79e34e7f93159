"""Device capability -> compile target and feature set.

The compile target is always the device's own compute capability (so the cubin loads); the feature
set (EPCOMM_FEATURE_SM90 / SM80 in the kernels) is 90 from Hopper on, 80 on Ampere/Ada, and can be
forced down to 80 with EPCOMM_ARCH=sm80 to run the Ampere code paths on an H200.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Tuple

from .. import env


@dataclass(frozen=True)
class Arch:
    cc: int         # compute capability as an int: 90 for 9.0
    feature: int    # 80 or 90
    sm: str         # "sm_90": the compile target
    num_sms: int

    @classmethod
    def for_target(cls, cc: int, feature: int | None = None, num_sms: int = 0) -> "Arch":
        """An Arch without a device (precompile, tests)."""
        native = native_feature(cc)
        feature = native if feature is None else int(feature)
        if feature > native:
            raise ValueError(f"feature set sm{feature} needs an sm_{feature}+ device; this is sm_{cc}")
        return cls(cc=cc, feature=feature, sm=f"sm_{cc}", num_sms=num_sms)


def native_feature(cc: int) -> int:
    if cc >= 90:
        return 90
    if cc >= 80:
        return 80
    raise ValueError(f"epcomm needs compute capability 8.0 or newer, got sm_{cc}")


@functools.lru_cache(maxsize=None)
def _device_properties(device_index: int) -> Tuple[int, int]:
    import torch
    props = torch.cuda.get_device_properties(device_index)
    return props.major * 10 + props.minor, props.multi_processor_count


def device_arch(device_index: int) -> Arch:
    """The Arch of CUDA device `device_index`, with EPCOMM_ARCH applied (read on every call)."""
    return _device_arch(int(device_index), env.arch_override())


@functools.lru_cache(maxsize=None)
def _device_arch(device_index: int, override: int | None) -> Arch:
    cc, num_sms = _device_properties(device_index)
    try:
        return Arch.for_target(cc, override, num_sms)
    except ValueError as e:
        raise ValueError(f"EPCOMM_ARCH=sm{override}: {e}") from None
