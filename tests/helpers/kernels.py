"""Test-only kernels: a source file built beside a copy of cuda_src/ (so it can include the real
headers, common/ above all) through the runtime's own NVRTC path and module cache."""
from __future__ import annotations

import os
import shutil
import tempfile


def cuda_src_with(parent: str, file_name: str, source: str) -> str:
    """A copy of cuda_src/ under `parent` with `source` added as `file_name`; its path (for
    compiler.cuda_src_override)."""
    from epcomm.runtime import compiler
    root = os.path.join(parent, "cuda_src")
    shutil.copytree(compiler.cuda_src_dir(), root)
    with open(os.path.join(root, file_name), "w") as f:
        f.write(source)
    return root


def build_test_kernel(file_name: str, source: str, kernel_name: str, device_index: int):
    """The loaded Kernel `kernel_name` of `source`, compiled as cuda_src/`file_name`."""
    from epcomm.runtime import compiler
    from epcomm.runtime.module import get_kernel
    with tempfile.TemporaryDirectory() as tmp:
        with compiler.cuda_src_override(cuda_src_with(tmp, file_name, source)):
            return get_kernel(compiler.KernelSource(file_name, (kernel_name,)), 0, device_index)
