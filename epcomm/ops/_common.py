"""What every kernel family's launcher shares: tensor-to-Params conventions, the current stream, the
kernel lookup for a GpuBackend and the one-dimensional launch."""
from __future__ import annotations

from typing import List, Optional

import torch

from ..runtime.compiler import KernelSource
from ..runtime.module import get_kernel

FP8_BLOCK = 128        # channels per FP8 scale
UE8M0_PER_INT = 4      # packed UE8M0 exponents per int32 (low-latency use_ue8m0 scales)

# C++ index type of a topk_idx dtype, as the kernels' template arguments spell it.
INDEX_TYPES = {torch.int64: "long long", torch.int32: "int"}


def _public_current_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# torch's raw current-stream query (an int, no Stream object) where the build has it: a Stream
# object per call costs a few microseconds of host time.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _public_current_stream


def ptr(t: Optional[torch.Tensor]) -> int:
    """A tensor's address for a Params field; 0 (null) for None or an empty tensor, which the
    kernels read as "absent"."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """16-byte aligned rows for vector accesses (a view at an odd offset is copied)."""
    return t if t is None or t.data_ptr() % 16 == 0 else t.clone()


def host_ints(gb, ints: torch.Tensor) -> List[int]:
    """The values of a device int32 tensor once the stream got there (a GPU failure recorded by
    then raises first: PeerTimeout / DeviceCheckFailed)."""
    pinned = torch.empty(ints.shape, dtype=torch.int32, device="cpu", pin_memory=True)   # only CPU tensors pin
    pinned.copy_(ints, non_blocking=True)   # queued on gb.device's current stream
    torch.cuda.current_stream(gb.device_index).synchronize()
    gb.check_errors()
    return pinned.tolist()


def backend_kernel(gb, source: KernelSource):
    """The kernel of `source` for the Buffer's device and feature set (gb.arch: EPCOMM_ARCH as it
    was at construction)."""
    return get_kernel(source, 0, gb.device_index, gb.arch.feature)


def launch_1d(gb, kernel, grid: int, threads: int, params) -> None:
    """One launch of grid x threads on gb's device's current stream."""
    kernel.launch((grid, 1, 1), (threads, 1, 1), params, current_stream(gb.device_index))


def plan_for(gb, spec_type, values: tuple, build):
    """gb's plan for the spec spec_type(*values), made by build(gb, spec) at its first use. Every
    family plans this way: a spec is a NamedTuple of what a plan depends on besides the Buffer, a
    plan is the loaded kernel with its Params, the fields fixed for the spec already set. The cache
    belongs to the backend (gb.plans), one dict per spec type, keyed by the specs; a call looks its
    plan up with the plain tuple of the values (equal to the spec, and no Python-level NamedTuple
    construction on the per-call host path)."""
    plans = gb.plans.get(spec_type)
    if plans is None:
        plans = gb.plans[spec_type] = {}
    found = plans.get(values)
    if found is None:
        spec = spec_type._make(values)
        found = plans[spec] = build(gb, spec)
    return found
