"""A region of the NVSHMEM symmetric heap: the same size at the same heap offset on every PE, so a
kernel can address any peer's copy (through `peer_ptrs` for NVLink loads/stores, or the local
pointer for NVSHMEM puts, which name the peer PE).

    buf = SymmetricBuffer(nvshmem, nbytes, device)      # collective
    buf.ptr, buf.nbytes, buf.peer_ptrs, buf.peer_table
    buf.view(torch.bfloat16, (n, h), offset_bytes)      # zero-copy view of the local copy
    buf.peer_view(pe, torch.int32, (n,), offset_bytes)   # zero-copy view of PE pe's copy (NVLink)
    buf.free()                                           # collective, idempotent

Views alias the heap: they are not valid after free() (or after NVSHMEM is finalised), whoever
still holds them.
"""
from __future__ import annotations

import math
from typing import List

import torch

from ..errors import BufferUnusable
from .dlpack import wrap_pointer


class SymmetricBuffer:
    def __init__(self, nvshmem, nbytes: int, device):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"SymmetricBuffer size must be a positive int, got {nbytes!r}")
        self.nvshmem = nvshmem
        self.nbytes = nbytes
        self.device = torch.device(device)
        self.rank = nvshmem.my_pe
        self.ptr = nvshmem.malloc(nbytes)
        nvshmem.track(self)
        # Host-side nvshmem_ptr gives the peer's copy mapped into this process: usable from kernels
        # and from torch ops on this device alike.
        self.peer_ptrs: List[int] = [nvshmem.peer_ptr(self.ptr, pe) for pe in range(nvshmem.n_pes)]
        self.peer_table = torch.tensor(self.peer_ptrs, dtype=torch.int64, device=self.device)

    @property
    def freed(self) -> bool:
        return self.ptr == 0

    def _region(self, dtype: torch.dtype, shape, offset_bytes: int, what: str) -> tuple:
        """Validate a typed region; return (shape tuple, nbytes)."""
        if self.freed:
            raise BufferUnusable(f"{what}: the symmetric buffer was freed")
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(not isinstance(d, int) or d < 0 for d in dims):
            raise ValueError(f"{what}: shape must be non-negative ints, got {dims}")
        itemsize = dtype.itemsize
        nbytes = math.prod(dims) * itemsize
        if not isinstance(offset_bytes, int) or offset_bytes < 0:
            raise ValueError(f"{what}: offset_bytes must be a non-negative int, got {offset_bytes!r}")
        if offset_bytes % itemsize:
            raise ValueError(f"{what}: offset_bytes {offset_bytes} is not a multiple of the {dtype} "
                             f"element size {itemsize}")
        if offset_bytes + nbytes > self.nbytes:
            raise ValueError(f"{what}: offset_bytes {offset_bytes} + {dims} x {dtype} ({nbytes} B) = "
                             f"{offset_bytes + nbytes} B exceeds the buffer size {self.nbytes} B")
        return dims, nbytes

    def view(self, dtype: torch.dtype, shape, offset_bytes: int = 0) -> torch.Tensor:
        """Zero-copy tensor over the local copy, starting offset_bytes into the buffer."""
        dims, _ = self._region(dtype, shape, offset_bytes, "view")
        return wrap_pointer(self.ptr + offset_bytes, dtype, dims, self.device, owner=self)

    def peer_view(self, pe: int, dtype: torch.dtype, shape, offset_bytes: int = 0) -> torch.Tensor:
        """Zero-copy tensor on this device over PE pe's copy (NVLink mapping). Writes land in the
        peer's memory; order them with the peer by a barrier or a signal."""
        dims, _ = self._region(dtype, shape, offset_bytes, "peer_view")
        if not 0 <= pe < len(self.peer_ptrs):
            raise ValueError(f"peer_view: pe must be in [0, {len(self.peer_ptrs)}), got {pe}")
        if not self.peer_ptrs[pe]:
            raise ValueError(f"peer_view: PE {pe} is not reachable by loads/stores from PE "
                             f"{self.rank} (no NVLink/P2P mapping; use NVSHMEM puts)")
        return wrap_pointer(self.peer_ptrs[pe] + offset_bytes, dtype, dims, self.device, owner=self)

    def free(self) -> None:
        """Collective: every PE frees its copy. Idempotent."""
        if self.freed:
            return
        ptr, self.ptr = self.ptr, 0
        self.peer_ptrs = [0] * len(self.peer_ptrs)
        self.nvshmem.free(ptr)

    def _forget(self) -> None:
        """NVSHMEM is being finalised: the heap goes away with it, nothing to free."""
        self.ptr = 0
        self.peer_ptrs = [0] * len(self.peer_ptrs)

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"ptr={self.ptr:#x}"
        return f"SymmetricBuffer({self.nbytes} B on {self.device}, PE {self.rank}, {state})"
