"""Internode kernels without a GPU: they compile and link for both feature sets (the profiling
builds too), and the ctypes Params, the RDMA header layout, the constants and the trace slot names
mirror the C++ (NVRTC static_asserts)."""
from __future__ import annotations

import pytest

from epcomm.ops import internode
from epcomm.ops import internode_plan as plan
from epcomm.runtime import compiler
from epcomm.runtime.compiler import KernelSource
from tests.helpers.nvrtc import nvrtc_check

# The template paths beyond internode.representative_sources() (which test_jit_compile's precompile
# run builds for the same targets): 2 x 2, 3 x 2, cached FP8 dispatch, an odd row (H = 2056 BF16 =
# 257 units), 2 x 8 at H = 4096 with int indices.
KERNELS = (
    plan.notify_kernel(4, 2), plan.notify_kernel(6, 2),
    plan.dispatch_kernel(2, 1, 7168, 56, "int", False),
    plan.dispatch_kernel(6, 2, 2056 * 2, 0, "long long", True),
    plan.dispatch_kernel(16, 8, 4096 * 2, 0, "int", True),
    plan.combine_kernel(6, 2, 2056 * 2), plan.combine_kernel(16, 8, 4096 * 2),
)


@pytest.mark.parametrize("arch_sm, feature", [(80, 80), (90, 90), (90, 80)])
def test_kernels_compile_and_link(arch_sm, feature):
    built = compiler.compile_cubin(KernelSource("internode.cu", KERNELS, uses_nvshmem=True), arch_sm, feature)
    assert built.cubin[:4] == b"\x7fELF"
    assert set(built.lowered) == set(KERNELS)


@pytest.mark.parametrize("arch_sm, feature", [(80, 80), (90, 90)])
def test_trace_builds_compile_and_link(arch_sm, feature):
    """The profiling builds (EPCOMM_INTERNODE_TRACE: bench/internode_trace.py) of the data kernels,
    one rank per node and several."""
    names = (plan.dispatch_kernel(4, 1, 7168 * 2, 0, "long long", True), plan.dispatch_kernel(2, 1, 7168, 56, "int", False),
             plan.combine_kernel(4, 1, 7168 * 2), plan.dispatch_kernel(16, 8, 4096 * 2, 0, "int", True),
             plan.combine_kernel(16, 8, 4096 * 2))
    source = internode.kernel_source(names[0], trace=True)
    assert source.defines == (("EPCOMM_TRACE", 1),) and internode.kernel_source(names[0]).defines == ()
    built = compiler.compile_cubin(KernelSource("internode.cu", names, source.defines, uses_nvshmem=True),
                                   arch_sm, feature)
    assert built.cubin[:4] == b"\x7fELF"
    assert set(built.lowered) == set(names)


def test_trace_slot_names_come_from_the_enum():
    assert plan.TRACE_SLOTS[:5] == ["start", "idle", "rdma_send_first", "rdma_send_last", "rdma_send_chunks"]
    assert plan.TRACE_SLOTS[-1] == "done"
    for role in ("nvl_recv", "push", "reduce"):   # first, last, count: the order trace_chunk writes
        i = plan.TRACE_SLOTS.index(f"{role}_first")
        assert plan.TRACE_SLOTS[i + 1:i + 3] == [f"{role}_last", f"{role}_chunks"]
    i = plan.TRACE_SLOTS.index("finish_first")
    assert plan.TRACE_SLOTS[i + 1:i + 3] == ["finish_last", "finish_rounds"]


def test_representative_sources_are_internode_kernels():
    sources = internode.representative_sources()
    assert sources and all(s.source == "internode.cu" and s.uses_nvshmem for s in sources)
    names = {k for s in sources for k in s.kernels}
    assert any("notify_kernel" in k for k in names) and any("combine_kernel" in k for k in names)
    assert any("true>" in k for k in names) and any("false>" in k for k in names)


@pytest.mark.parametrize("struct", sorted(plan.PARAMS))
def test_params_mirror_cpp(struct):
    compiler.check_params_layout("internode.cu", f"epcomm::internode::{struct}", plan.PARAMS[struct],
                                 uses_nvshmem=True)


def test_header_and_constants_mirror_cpp():
    lines = ['#include "internode.cu"']
    for ranks, nodes in ((2, 2), (4, 2), (16, 2), (72, 9), (8, 8)):
        lines.append(f"static_assert(epcomm::internode::Header<{ranks}, {nodes}>::kBytes == "
                     f"{plan.header_bytes(ranks, nodes)}, \"header bytes R={ranks} M={nodes}\");")
    for name, value in (("kThreads", plan.THREADS), ("kNotifyThreads", plan.NOTIFY_THREADS),
                        ("kMaxChannels", plan.MAX_CHANNELS), ("kMaxTopk", plan.MAX_TOPK),
                        ("kMaxLocalExperts", plan.MAX_LOCAL_EXPERTS), ("kNotifyHead", plan.NOTIFY_HEAD),
                        ("kPhaseConfigMismatch", len(plan.PHASES) - 2), ("kPhaseRingRoom", len(plan.PHASES) - 1),
                        ("kTraceSlots", len(plan.TRACE_SLOTS)), ("kTraceWarps", plan.TRACE_WARPS)):
        # Unqualified inside the namespace: the family's names and common/'s (kMaxTopk) are both found.
        lines.append(f"namespace epcomm {{ namespace internode {{ static_assert({name} == {value}, \"{name}\"); }} }}")
    for i, name in enumerate(plan.TRACE_SLOTS):   # "rdma_send_first" -> kTrRdmaSendFirst
        enum = "kTr" + "".join(part.capitalize() for part in name.split("_"))
        lines.append(f'static_assert(epcomm::internode::{enum} == {i}, "trace slot {name}");')
    nvrtc_check("\n".join(lines) + "\n", "internode_check.cu", True, "layout mirror mismatch")
