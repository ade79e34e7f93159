"""Operation names and the host-mapped error record of bounded GPU waits.

Kernels wait on peers through epcomm::Guard (cuda_src/common/timeout.cuh). A wait that runs
out records (op, rank, peer, phase) in an ErrorRecord and the kernel winds down; the host reads the
record with `StatusRecord.check()` and raises epcomm.errors.PeerTimeout naming them.

Ops modules register their op once, with the names of its phases, and pass the id to kernels as a
*runtime* parameter (ids follow registration order, which may differ between processes, so an id
must not be baked into a cached cubin):

    DISPATCH = register_op("dispatch", ["wait layout counts", "wait data", ...])

Memory: the record lives in pinned host memory from cuMemHostAlloc(PORTABLE | DEVICEMAP), with the
device address from cuMemHostGetDevicePointer. It is mapped explicitly rather than relying on a torch
pinned tensor being reachable under UVA, because torch may pin with cudaHostRegister (the
`pinned_use_cuda_host_register` allocator option) and caches and rounds its pinned blocks. The host
reads the record with plain loads: check() never synchronises the GPU.
"""
from __future__ import annotations

import ctypes
import time
from typing import Dict, List, Optional

from .. import env
from ..errors import BufferUnusable, DeviceCheckFailed, EpcommError, PeerFailed, PeerTimeout
from . import cuda_decls

# ---- op registry --------------------------------------------------------------------------------
_UNKNOWN_OP = "unknown op"
_OP_NAMES: List[str] = [_UNKNOWN_OP]  # id 0: a record whose op field was never set
_OP_PHASES: Dict[str, List[str]] = {_UNKNOWN_OP: []}


def register_op(name: str, phases: List[str]) -> int:
    """Id of op `name` with its phase names (phase i of a record = phases[i]). Registering the
    same name again with the same phases returns the same id."""
    phases = list(phases)
    if name in _OP_PHASES:
        if _OP_PHASES[name] != phases:
            raise ValueError(f"op {name!r} is already registered with phases {_OP_PHASES[name]}, "
                             f"not {phases}")
        return _OP_NAMES.index(name)
    _OP_NAMES.append(name)
    _OP_PHASES[name] = phases
    return len(_OP_NAMES) - 1


def op_id(name: str) -> int:
    if name not in _OP_PHASES:
        raise KeyError(f"op {name!r} is not registered (known: {_OP_NAMES[1:]})")
    return _OP_NAMES.index(name)


def op_name(op: int) -> str:
    return _OP_NAMES[op] if 0 <= op < len(_OP_NAMES) else f"op {op}"


def phase_name(op: int, phase: int) -> str:
    phases = _OP_PHASES.get(op_name(op), [])
    if phase < 0:
        return "between waits"   # a peer's failure seen by a check that is not a wait
    return phases[phase] if phase < len(phases) else f"phase {phase}"


# ---- ErrorRecord ----------------------------------------------------------------------------------
_CODES = cuda_decls.header("common/timeout.cuh")
ErrorRecord = _CODES.struct("ErrorRecord")   # epcomm::ErrorRecord, read from the header
assert ctypes.sizeof(ErrorRecord) == 32, "ErrorRecord must match timeout.cuh (32 bytes)"

CODE_OK = _CODES.constant("kOk")
CODE_PEER_TIMEOUT = _CODES.constant("kPeerTimeout")
CODE_DEVICE_CHECK_FAILED = _CODES.constant("kDeviceCheckFailed")
CODE_PEER_REPORTED_TIMEOUT = _CODES.constant("kPeerReportedTimeout")
CODE_PEER_REPORTED_VIOLATION = _CODES.constant("kPeerReportedViolation")
# reset() fills the detail fields with this; no real op/rank/peer/phase takes it. The kernel sets
# `code` (the atomic that elects the first failure) before the details, so check() waits until the
# details are written, instead of reporting a half-written record.
_UNSET = -(2 ** 31)
_DETAIL_WAIT_S = 0.5


def error_from_record(record: ErrorRecord, timeout_s: float) -> Optional[EpcommError]:
    """The exception a record describes, or None when it says all is well."""
    if record.code == CODE_OK:
        return None
    op, phase = op_name(record.op), phase_name(record.op, record.phase)
    if record.code == CODE_DEVICE_CHECK_FAILED:
        return DeviceCheckFailed(op, record.rank, record.peer, phase)
    if record.code == CODE_PEER_TIMEOUT:
        return PeerTimeout(op, record.rank, record.peer, phase, timeout_s)
    if record.code == CODE_PEER_REPORTED_TIMEOUT:
        return PeerTimeout(op, record.rank, record.peer, phase, timeout_s, reported_by=record.reporter)
    if record.code == CODE_PEER_REPORTED_VIOLATION:
        culprit = f"the data of rank {record.peer}" if record.peer >= 0 else "its data"
        return PeerFailed(op, record.rank, record.reporter,
                          f"a device-side check of {culprit} failed there (its DeviceCheckFailed "
                          f"names the rule; this rank stopped {phase})")
    return EpcommError(f"GPU error record holds unknown code {record.code} "
                       f"(op {op}, rank {record.rank}, peer {record.peer})")


def _details_written(record: ErrorRecord) -> bool:
    return _UNSET not in (record.op, record.rank, record.peer, record.phase, record.reporter)


# ---- CUDA driver calls for mapped pinned memory --------------------------------------------------
_CU_MEMHOSTALLOC_PORTABLE, _CU_MEMHOSTALLOC_DEVICEMAP = 0x01, 0x02
_cuda: Optional[ctypes.CDLL] = None


def _driver() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                     ctypes.c_uint]
        lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _cuda = lib
    return _cuda


def _cu_check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise EpcommError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


def _alloc_mapped(nbytes: int, device) -> tuple:
    """(host pointer, device pointer, release callable) of mapped pinned memory for `device`."""
    import torch
    with torch.cuda.device(device):
        torch.zeros(1, dtype=torch.uint8, device=device)  # makes torch's primary context current on this thread
        lib = _driver()
        host = ctypes.c_void_p()
        _cu_check(lib.cuMemHostAlloc(ctypes.byref(host), nbytes,
                                     _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP),
                  f"cuMemHostAlloc({nbytes} B, mapped)")
        dev = ctypes.c_uint64()
        _cu_check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0),
                  "cuMemHostGetDevicePointer")
    return host.value, dev.value, lambda: lib.cuMemFreeHost(host)


class StatusRecord:
    """One ErrorRecord per Buffer. `device_ptr` goes into kernel Params; `check()` raises the
    recorded failure the first time and BufferUnusable afterwards."""

    def __init__(self, device, timeout_s: Optional[float] = None):
        self.timeout_s = env.timeout_s() if timeout_s is None else timeout_s
        self.host_ptr, self.device_ptr, self._release = _alloc_mapped(ctypes.sizeof(ErrorRecord),
                                                                      device)
        self._record: Optional[ErrorRecord] = ErrorRecord.from_address(self.host_ptr)
        # check() runs at the start of every call: it reads `code` through this c_int alone.
        self._code: Optional[ctypes.c_int] = ctypes.c_int.from_address(self.host_ptr + ErrorRecord.code.offset)
        self.error: Optional[EpcommError] = None
        self.reset()

    def reset(self) -> None:
        """Clear the record and the remembered failure. Only while no kernel using it runs."""
        record = self._live_record("reset")
        record.op = record.rank = record.peer = record.phase = record.reporter = _UNSET
        record.code = CODE_OK
        self.error = None

    def check(self) -> None:
        """Raise if a kernel recorded a failure. One read of host memory; never waits for the GPU."""
        code = self._code
        if code is not None and code.value == CODE_OK and self.error is None:
            return
        self._check_failed()

    def _check_failed(self) -> None:
        if self.error is not None:
            raise BufferUnusable(f"unusable after an earlier failure: {self.error} (Buffer.recover() "
                                 f"on every rank makes it usable again)") from self.error
        record = self._live_record("check")
        if record.code == CODE_OK:
            return
        deadline = time.monotonic() + _DETAIL_WAIT_S
        while not _details_written(record) and time.monotonic() < deadline:
            time.sleep(1e-4)
        self.error = error_from_record(record, self.timeout_s)
        raise self.error

    def _live_record(self, what: str) -> ErrorRecord:
        if self._record is None:
            raise BufferUnusable(f"status record {what}: the record was released (Buffer destroyed)")
        return self._record

    def free(self) -> None:
        """Release the pinned memory. Idempotent; kernels must no longer write the record."""
        if self._record is None:
            return
        self._record = self._code = None
        self._release()
