"""Intranode kernels without a GPU: they compile and link for both feature sets, and the ctypes
Params, the NVL header layout and the constants mirror the C++ (NVRTC static_asserts)."""
from __future__ import annotations

import pytest

from epcomm.ops import intranode
from epcomm.ops import intranode_plan as plan
from epcomm.runtime import compiler
from epcomm.runtime.compiler import KernelSource
from tests.helpers.nvrtc import nvrtc_check

# The template parameter paths beyond intranode.representative_sources() (which test_jit_compile's
# precompile run builds for the same targets): 1 and 3 ranks, cached FP8 dispatch, an odd row
# (H = 2056 BF16 = 257 16-byte units), a tiny one, 8 ranks at H = 4096 with int indices.
KERNELS = (
    plan.notify_kernel(1), plan.notify_kernel(3),
    plan.dispatch_kernel(2, 7168, 56, "int", False),
    plan.dispatch_kernel(3, 2056 * 2, 0, "long long", True),
    plan.dispatch_kernel(8, 4096 * 2, 0, "int", True),
    plan.dispatch_kernel(1, 16, 0, "int", True),
    plan.combine_kernel(1, 16), plan.combine_kernel(3, 2056 * 2), plan.combine_kernel(8, 4096 * 2),
)


@pytest.mark.parametrize("arch_sm, feature", [(80, 80), (90, 90), (90, 80)])
def test_kernels_compile_and_link(arch_sm, feature):
    built = compiler.compile_cubin(KernelSource("intranode.cu", KERNELS), arch_sm, feature)
    assert built.cubin[:4] == b"\x7fELF"
    assert set(built.lowered) == set(KERNELS)


def test_representative_sources_are_intranode_kernels():
    sources = intranode.representative_sources()
    assert sources and all(s.source == "intranode.cu" and not s.uses_nvshmem for s in sources)
    names = {k for s in sources for k in s.kernels}
    assert any("notify_kernel" in k for k in names) and any("combine_kernel" in k for k in names)
    assert any("true>" in k for k in names) and any("false>" in k for k in names)


@pytest.mark.parametrize("struct", sorted(plan.PARAMS))
def test_params_mirror_cpp(struct):
    compiler.check_params_layout("intranode.cu", f"epcomm::intranode::{struct}", plan.PARAMS[struct])


def test_header_and_constants_mirror_cpp():
    lines = ['#include "intranode.cu"']
    for ranks in (1, 2, 3, 8, 72):
        lines.append(f"static_assert(epcomm::intranode::Header<{ranks}>::kBytes == {plan.header_bytes(ranks)}, "
                     f"\"header bytes R={ranks}\");")
    for name, value in (("kThreads", plan.THREADS), ("kNotifyThreads", plan.NOTIFY_THREADS),
                        ("kMaxChunks", plan.MAX_CHUNKS), ("kParts", plan.PARTS_PER_CHUNK),
                        ("kPhaseConfigMismatch", len(plan.PHASES) - 1),
                        ("kTraceSlots", len(plan.TRACE_SLOTS)), ("kTraceWarps", plan.TRACE_WARPS)):
        lines.append(f"static_assert(epcomm::intranode::{name} == {value}, \"{name}\");")
    nvrtc_check("\n".join(lines) + "\n", "intranode_check.cu", False, "layout mirror mismatch")
