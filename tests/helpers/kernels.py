"""Test-only kernels: a source file built beside a copy of cuda_src/ (so it can include the real
headers, common/ above all) through the runtime's own NVRTC path and module cache."""
from __future__ import annotations

import os
import shutil
import tempfile


def build_test_kernel(file_name: str, source: str, kernel_name: str, device_index: int):
    """The loaded Kernel `kernel_name` of `source`, compiled as cuda_src/`file_name`."""
    from epcomm.runtime import compiler
    from epcomm.runtime.module import get_kernel
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "cuda_src")
        shutil.copytree(compiler.cuda_src_dir(), root)
        with open(os.path.join(root, file_name), "w") as f:
            f.write(source)
        with compiler.cuda_src_override(root):
            return get_kernel(compiler.KernelSource(file_name, (kernel_name,)), 0, device_index)
