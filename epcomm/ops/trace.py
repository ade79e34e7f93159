"""Device rows for the profiling builds of a kernel family (EPCOMM_INTRANODE_TRACE, EPCOMM_LL_TRACE):
the kernels stamp %globaltimer into [blocks][warps][slots] int64; one buffer per device, zeroed
before each traced launch, read back by `last`."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


def trace_defines(trace: bool) -> tuple:
    """The KernelSource defines of a family's profiling build (-DEPCOMM_TRACE), or none."""
    return (("EPCOMM_TRACE", 1),) if trace else ()


class TraceRows:
    """`on`: whether the family's calls use its profiling builds; read by every call, so the
    environment switch is read once (at import: a read per call costs ~2.5 us) and set_on()
    switches it (the bench's trace scripts)."""

    def __init__(self, warps: int, slots: int, on: bool):
        self.warps, self.slots, self.on = warps, slots, bool(on)
        self._buffers: Dict[int, Tuple[torch.Tensor, int]] = {}   # device index -> (buffer, blocks of the last launch)

    def set_on(self, on: bool) -> None:
        """Use the profiling builds from the next call on (or not)."""
        self.on = bool(on)

    def zeroed(self, device_index: int, blocks: int) -> int:
        """Zeroed rows for a launch of `blocks` blocks on this device (queued on its current
        stream); returns the device pointer for the kernel's Params."""
        need = blocks * self.warps * self.slots
        buf = self._buffers.get(device_index, (None, 0))[0]
        if buf is None or buf.numel() < need:
            buf = torch.zeros(need, dtype=torch.int64, device=torch.device("cuda", device_index))
        buf[:need].zero_()
        self._buffers[device_index] = (buf, blocks)
        return buf.data_ptr()

    def last(self, device_index: int) -> Optional[torch.Tensor]:
        """[blocks, warps, slots] int64 on the CPU (0 = not stamped) of the latest traced launch on
        this device (synchronises the device), or None when nothing was traced."""
        if device_index not in self._buffers:
            return None
        buf, blocks = self._buffers[device_index]
        torch.cuda.synchronize(device_index)
        return buf[:blocks * self.warps * self.slots].view(blocks, self.warps, self.slots).cpu()
