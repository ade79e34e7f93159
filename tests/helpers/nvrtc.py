"""Compile a check unit (static_asserts against the kernels' headers) with NVRTC alone, no GPU."""
from __future__ import annotations

import pytest

from epcomm.runtime import compiler, options


def nvrtc_check(unit: str, name: str, uses_nvshmem: bool, what: str, arch_sm: int = 90,
                feature: int = 90) -> None:
    """Compile `unit` (as `name`) with the runtime's NVRTC options; fail the test with the log,
    prefixed by `what`. compiler has no public compile-only entry point (check_params_layout wraps
    the same stage for Params), so this is the one place the suite reaches for it."""
    target = options.Target.make(arch_sm, feature, uses_nvshmem)
    try:
        compiler._nvrtc_ltoir(unit, name, options.nvrtc_options(target, str(compiler.cuda_src_dir())), ())
    except compiler._StageFailed as e:
        pytest.fail(f"{what}:\n{e.log}", pytrace=False)
