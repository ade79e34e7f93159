"""Outputs of a failed GPU call cannot pass for data (cuda_src/poison.cu).

After the kernels of every dispatch / combine (and after a recv hook's receive kernel) one more
launch goes on the same stream: if the Buffer's ErrorRecord holds a failure (a wait ran out, a
device check failed), it overwrites the call's outputs: NaN in floating-point outputs (bf16, f32,
fp8 e4m3: the pattern 0x7f is its NaN), -1 in integer ones (recv_count, recv_topk_idx, packed
UE8M0 scales, whose 0xff bytes are UE8M0's NaN). No valid call produces a NaN from finite inputs
or a count of -1. The host learns of the failure only at its next look at the record (the next
Buffer call, check_errors, an event wait or hook), and by then the caller may already have queued
work reading the outputs: a fill ordered on the stream is the one that reaches every consumer.

Cost on success: one launch on the host (the Params and the launch are prebuilt per output set:
one cuLaunchKernel) and, on the GPU, one block that reads one int of host memory.
Handle tensors are not touched: a later combine with them must stay within bounds.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ..runtime import cuda_decls
from ..runtime.compiler import KernelSource
from ..runtime.module import get_kernel
from ._common import current_stream as _stream

THREADS = 1024
_DECLS = cuda_decls.header("poison.cu")
MAX_TARGETS = _DECLS.constant("kPoisonTargets")
PoisonTarget = _DECLS.struct("PoisonTarget")
PoisonParams = _DECLS.struct("PoisonParams")
_NAN_BF16, _NAN_F32, _NAN_FP8, _MINUS_ONE = 0x7FC07FC0, 0x7FC00000, 0x7F7F7F7F, 0xFFFFFFFF
_PATTERNS: Dict[torch.dtype, int] = {
    torch.bfloat16: _NAN_BF16, torch.float32: _NAN_F32, torch.float8_e4m3fn: _NAN_FP8,
    torch.int32: _MINUS_ONE, torch.int64: _MINUS_ONE,
}


def poison_source() -> KernelSource:
    return KernelSource("poison.cu", (f"epcomm::poison_kernel<{THREADS}>",))


def representative_sources():
    """For `python -m epcomm.jit --precompile`: the one specialisation there is."""
    return [poison_source()]


def pattern(dtype: torch.dtype) -> int:
    """The 4 bytes (as they lie in memory) that mark a failed output of `dtype`."""
    try:
        return _PATTERNS[dtype]
    except KeyError:
        raise ValueError(f"no failure pattern for outputs of dtype {dtype}") from None


class Poison:
    """The poison launch of one GpuBackend (its error record, its device). The launch is built once
    per set of outputs (data pointer, bytes, dtype) and kept: low-latency calls cycle through two
    pooled output sets, so their launches reuse a prebuilt struct; the per-signature fast paths hold
    the launch of their pooled outputs themselves (`prepared`)."""

    _CACHE_LIMIT = 64

    def __init__(self, gb):
        self._device_index = gb.device_index
        self._kernel = get_kernel(poison_source(), 0, gb.device_index, gb.arch.feature)
        self._err = gb.status.device_ptr
        self._launches: Dict[tuple, Optional[Callable[[int], None]]] = {}

    def after(self, *outputs: Optional[torch.Tensor]) -> None:
        """Queue the fill of `outputs` (None entries skipped) on the current stream, for a failure."""
        launch = self.prepared(*outputs)
        if launch is not None:
            launch(_stream(self._device_index))

    def prepared(self, *outputs: Optional[torch.Tensor]) -> Optional[Callable[[int], None]]:
        """launch(stream): the fill of `outputs` (None entries skipped), or None when none has bytes."""
        key = tuple([None if t is None else (t.data_ptr(), t.nbytes, t.dtype) for t in outputs])
        launch = self._launches.get(key, False)
        if launch is False:
            launch = self._build(outputs, key)
        return launch

    def _build(self, outputs, key) -> Optional[Callable[[int], None]]:
        targets = [t for t in outputs if t is not None and t.numel()]
        if len(targets) > MAX_TARGETS:
            raise ValueError(f"poison: at most {MAX_TARGETS} outputs per call, got {len(targets)}")
        launch = None
        if targets:
            p = PoisonParams()
            p.err, p.num_targets = self._err, len(targets)
            for slot, t in zip(p.targets, targets):
                if not t.is_contiguous() and 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) != t.numel():
                    raise ValueError(f"poison: an output of shape {list(t.shape)} with strides {t.stride()} does "
                                     f"not cover one dense block of memory")
                slot.data, slot.bytes, slot.pattern = t.data_ptr(), t.nbytes, pattern(t.dtype)
            launch = self._kernel.launcher((1, 1, 1), (THREADS, 1, 1), p)
        if len(self._launches) >= self._CACHE_LIMIT:
            self._launches.clear()
        self._launches[key] = launch
        return launch
