"""Zero-copy tensors over raw pointers, and framework interop for the public API.

`wrap_pointer(ptr, dtype, shape, device, owner)` makes a torch tensor over memory torch did not
allocate (the NVSHMEM heap, a peer's heap mapped into this process, host-mapped pinned memory).
It hands torch a DLPack capsule built here with ctypes rather than going through
`__cuda_array_interface__`, because:
  * torch places a CUDA-array-interface tensor on the device that *owns the physical memory*
    (cudaPointerGetAttributes), which for a peer mapping is the peer's GPU; DLPack names the device
    explicitly, so peer views stay on the local device (platform.md (d));
  * the capsule is always a flat uint8 buffer and the dtype is applied with `Tensor.view(dtype)`, so
    bf16, fp8 and bool work on every torch version, whatever its DLPack dtype table knows.
The `owner` object is kept alive until torch frees the last tensor sharing the storage.

`to_torch(obj)` / `from_torch(tensor, framework)` accept torch tensors and any DLPack producer (CuPy,
NumPy, ...) and give results back in the caller's framework, zero-copy. CuPy is imported only when
the caller handed us a CuPy array.
"""
from __future__ import annotations

import ctypes
import importlib
import math
from typing import Any, Sequence, Tuple, Union

import torch

_kDLCPU = 1
_kDLCUDA = 2
_kDLUInt = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _DELETER)]

# DLPack v0.x ABI (the "dltensor" capsule every torch since 1.10 accepts).
assert ctypes.sizeof(DLTensor) == 48 and ctypes.sizeof(DLManagedTensor) == 64

# What each live capsule needs until torch calls the deleter: the ctypes struct, its shape array
# and the caller's owner. Keyed by the struct's address (also stored in manager_ctx).
_LIVE: dict = {}


def _release(managed_ptr, _live=_LIVE):
    # Called by torch (any thread; ctypes takes the GIL) when the storage dies. `_live` is bound as a
    # default so the call still works while this module is being torn down at interpreter exit.
    _live.pop(ctypes.cast(managed_ptr, ctypes.c_void_p).value, None)


_release_c = _DELETER(_release)
# The C thunk must outlive every tensor, including tensors freed during interpreter shutdown after
# this module's globals are gone: give it one reference nobody ever drops.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_release_c))

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _byte_tensor(ptr: int, nbytes: int, device: torch.device, owner: Any) -> torch.Tensor:
    """A flat uint8 tensor of nbytes at ptr on device; owner lives as long as the storage."""
    if device.type == "cuda":
        dl_device = DLDevice(_kDLCUDA, device.index if device.index is not None
                             else torch.cuda.current_device())
    elif device.type == "cpu":
        dl_device = DLDevice(_kDLCPU, 0)
    else:
        raise ValueError(f"wrap_pointer: unsupported device {device} (cuda or cpu)")
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(ptr, dl_device, 1, DLDataType(_kDLUInt, 8, 1), shape, None, 0)
    key = ctypes.addressof(managed)
    managed.manager_ctx = key
    managed.deleter = _release_c
    _LIVE[key] = (managed, shape, owner)
    try:
        tensor = torch.from_dlpack(_PyCapsule_New(key, b"dltensor", None))
    except BaseException:
        _LIVE.pop(key, None)  # torch did not take the capsule, so it will never call the deleter
        raise
    return tensor


def _normalise_shape(shape: Union[int, Sequence[int], torch.Size]) -> Tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"shape must be non-negative ints, got {dims}")
    return dims


def wrap_pointer(ptr: int, dtype: torch.dtype, shape, device, owner: Any = None) -> torch.Tensor:
    """Contiguous tensor of `dtype` and `shape` over the memory at `ptr` on `device`, no copy.

    `ptr` must be valid on `device` (for CUDA: a device pointer usable from that device's context) and
    aligned to the element size. The memory is not freed by torch; `owner` is kept alive while any
    tensor over it exists (freeing the memory by other means still invalidates the tensor)."""
    device = torch.device(device)
    dims = _normalise_shape(shape)
    itemsize = dtype.itemsize
    nbytes = math.prod(dims) * itemsize
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype, device=device)
    if not ptr:
        raise ValueError("wrap_pointer: NULL pointer")
    if ptr % itemsize:
        raise ValueError(f"wrap_pointer: pointer {ptr:#x} is not aligned to {dtype} ({itemsize} B)")
    flat = _byte_tensor(ptr, nbytes, device, owner)
    return flat.view(dtype).view(dims)


# ---- framework interop --------------------------------------------------------------------------
def framework_of(obj: Any) -> str:
    """'torch' for torch tensors, else the top-level package of the object's type ('cupy', ...)."""
    if isinstance(obj, torch.Tensor):
        return "torch"
    return type(obj).__module__.partition(".")[0]


def to_torch(obj: Any) -> Tuple[torch.Tensor, str]:
    """(zero-copy torch tensor, framework name) for a torch tensor or any DLPack producer."""
    if isinstance(obj, torch.Tensor):
        return obj, "torch"
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"expected a torch.Tensor or a DLPack producer (CuPy array, ...), "
                        f"got {type(obj).__module__}.{type(obj).__qualname__}")
    # torch.from_dlpack passes torch's current stream, so the producer orders its pending work first.
    return torch.from_dlpack(obj), framework_of(obj)


def from_torch(tensor: torch.Tensor, framework: str) -> Any:
    """The tensor as an array of `framework` (what to_torch returned), zero-copy."""
    if framework == "torch":
        return tensor
    try:
        module = importlib.import_module(framework)
    except ImportError as e:
        raise TypeError(f"cannot return a {framework} array: {framework} is not importable ({e})") from e
    convert = getattr(module, "from_dlpack", None)
    if convert is None:
        raise TypeError(f"cannot return a {framework} array: {framework} has no from_dlpack()")
    return convert(tensor)
