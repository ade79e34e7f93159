"""Low-latency kernels without a GPU: the ctypes Params and the shared-memory / message formulas
mirror the C++ (NVRTC static_asserts), and the representative and trace builds compile and link."""
from __future__ import annotations

import itertools

import pytest

from epcomm.ops import low_latency as ll
from epcomm.ops import low_latency_layout as lay
from epcomm.runtime import compiler
from tests.helpers.nvrtc import nvrtc_check


@pytest.mark.parametrize("struct, mirror", [("epcomm::ll::DispatchParams", ll.DispatchParams),
                                            ("epcomm::ll::CombineParams", ll.CombineParams)])
def test_params_mirror_cpp(struct, mirror):
    compiler.check_params_layout("low_latency.cu", struct, mirror, uses_nvshmem=True)


def test_shapes_mirror_cpp():
    """message_bytes / dispatch_smem_bytes equal the kernel's Message / DispatchShape constants, and
    TRACE_SLOTS names the kernels' trace slots in order."""
    lines = ['#include "low_latency.cu"',
             f'static_assert(4 * epcomm::ll::kCounters == {lay.TICKET_BYTES}, "per-set u32 counters");',
             f'static_assert(epcomm::ll::kTraceSlots == {len(ll.TRACE_SLOTS)}, "trace slots");',
             f'static_assert(epcomm::ll::kRecordBytes == {lay.RECORD_BYTES}, "combine record bytes");',
             f'static_assert(epcomm::ll::kListHeaderBytes == {lay.LIST_HEADER_BYTES}, "dispatch list header");']
    for i, name in enumerate(ll.TRACE_SLOTS):   # "send_a" -> kTrSendA
        enum = "kTr" + "".join(part.capitalize() for part in name.split("_"))
        lines.append(f'static_assert(epcomm::ll::{enum} == {i}, "trace slot {name}");')
    for hidden, topk, fp8 in itertools.product((128, 1032 * 8, 2176, 7168, 8192, 32768), (1, 4, 8, 9, 16, 32),
                                               (True, False)):
        if fp8 and hidden % 128:
            continue
        b = "true" if fp8 else "false"
        lines.append(f"static_assert(epcomm::ll::Message<{hidden}, {b}>::kBytes == {lay.message_bytes(hidden, fp8)}, "
                     f"\"message bytes H={hidden} fp8={b}\");")
        lines.append(f"static_assert(epcomm::ll::DispatchShape<{hidden}, {topk}, {b}, {lay.THREADS}>::kSmemBytes == "
                     f"{lay.dispatch_smem_bytes(hidden, topk, fp8)}, \"smem H={hidden} K={topk} fp8={b}\");")
    nvrtc_check("\n".join(lines) + "\n", "ll_check.cu", True, "NVRTC rejected the check unit")


@pytest.mark.slow
@pytest.mark.parametrize("arch_sm, feature", [(90, 90), (80, 80)])
def test_representative_kernels_compile_and_link(arch_sm, feature):
    """Every representative specialisation, in one unit per target (NVRTC + nvJitLink, no GPU)."""
    kernels = tuple(k for src in ll.representative_sources() for k in src.kernels)
    built = compiler.compile_cubin(compiler.KernelSource("low_latency.cu", kernels, uses_nvshmem=True),
                                   arch_sm, feature)
    assert built.cubin[:4] == b"\x7fELF"
    assert set(built.lowered) == set(kernels)


@pytest.mark.slow
def test_trace_builds_compile_and_link():
    """The profiling builds (EPCOMM_LL_TRACE: bench/low_latency_trace.py) of both kernels, sm_90."""
    sources = (ll.dispatch_source(7168, 8, 2, 288, 128, True, False, False, trace=True),
               ll.combine_source(7168, 8, 2, 288, 128, trace=True))
    kernels = tuple(k for src in sources for k in src.kernels)
    built = compiler.compile_cubin(compiler.KernelSource("low_latency.cu", kernels, sources[0].defines,
                                                         uses_nvshmem=True), 90, 90)
    assert set(built.lowered) == set(kernels)
