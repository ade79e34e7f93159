"""NVSHMEM host API through ctypes on libnvshmem_host.so.3 (no compiled extension, no nvshmem4py).

One NVSHMEM world per process (`Nvshmem`, a singleton): initialised with the unique-ID bootstrap over
a torch.distributed group of any backend, or adopted when something else in the process already
initialised NVSHMEM. Finalised once, at exit, after the Buffers that use it.

Environment defaults. NVSHMEM reads its environment at initialisation; `Nvshmem.init` sets each of
these only where the variable is unset or empty, so a user's value always wins:
  NVSHMEM_DISABLE_NVLS=1          no NVLink multicast: forbidden on the GPU machines epcomm is
                                  tested on, and epcomm's kernels do not use it.
  NVSHMEM_REMOTE_TRANSPORT=none   only when every rank of the group is on this host: NVLink / P2P
                                  only, no InfiniBand transport probing (slow init, warnings).
  NVSHMEM_SYMMETRIC_SIZE=1G       initial symmetric heap per GPU. The heap grows past it on demand
                                  (CUDA VMM), so larger Buffers need no pre-sizing; where VMM is off
                                  (NVSHMEM_DISABLE_CUDA_VMM=1) this is the hard limit.
The library: $EPCOMM_NVSHMEM_HOME/lib, else the nvidia-nvshmem-cu13 / -cu12 wheel (toolchain.py).
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import warnings
import weakref
from typing import Callable, Dict, List, MutableMapping, Optional, Tuple

from .. import env
from ..errors import NvshmemError, ToolchainError
from . import toolchain
from .rendezvous import group_rendezvous
from .topology import host_key

_LIBRARY = "libnvshmem_host.so.3"
_INSTALL_HINT = ("install the nvidia-nvshmem-cu13 (CUDA 13) or nvidia-nvshmem-cu12 (CUDA 12) pip "
                 "package, e.g. `pip install epcomm[cu13]`, or set EPCOMM_NVSHMEM_HOME to an NVSHMEM "
                 "install (with lib/libnvshmem_host.so.3)")

# nvshmemx_init_status_t (device_host_transport/nvshmem_constants.h)
STATUS_NOT_INITIALIZED, STATUS_IS_BOOTSTRAPPED, STATUS_IS_INITIALIZED = 0, 1, 2
_INIT_WITH_UNIQUEID = 1 << 3  # NVSHMEMX_INIT_WITH_UNIQUEID (host/nvshmemx_api.h)


def env_defaults(single_host: bool) -> Dict[str, str]:
    """The NVSHMEM variables epcomm fills in (see the module docstring)."""
    defaults = {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_SYMMETRIC_SIZE": "1G"}
    if single_host:
        defaults["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    return defaults


def apply_env_defaults(single_host: bool,
                       environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set each default that is unset or empty in `environ` (os.environ); return what was set."""
    environ = os.environ if environ is None else environ
    applied = {k: v for k, v in env_defaults(single_host).items() if not environ.get(k)}
    environ.update(applied)
    return applied


# ---- ABI (bootstrap_device_host/nvshmem_uniqueid.h, device_host/nvshmem_types.h) -----------------
class UniqueId(ctypes.Structure):  # nvshmemx_uniqueid_v1
    _fields_ = [("version", ctypes.c_int), ("internal", ctypes.c_char * 124)]


class UniqueIdArgs(ctypes.Structure):  # nvshmemx_uniqueid_args_v1
    _fields_ = [("version", ctypes.c_int), ("id", ctypes.POINTER(UniqueId)),
                ("myrank", ctypes.c_int), ("nranks", ctypes.c_int)]


class InitArgsV1(ctypes.Structure):  # nvshmemx_init_args_v1 (nvshmemx_init_args_t up to 3.4)
    _fields_ = [("version", ctypes.c_int), ("uid_args", UniqueIdArgs),
                ("content", ctypes.c_char * 96)]


class InitArgsV2(ctypes.Structure):  # nvshmemx_init_args_v2 (nvshmemx_init_args_t from 3.5)
    _fields_ = [("version", ctypes.c_int), ("uid_args", UniqueIdArgs),
                ("cuda_device_id", ctypes.c_int), ("content", ctypes.c_char * 92)]


class InitAttrV1(ctypes.Structure):  # nvshmemx_init_attr_v1 as 3.4 defines it
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", InitArgsV1)]


class InitAttrV2(ctypes.Structure):  # nvshmemx_init_attr_v2 (nvshmemx_init_attr_t from 3.5)
    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", InitArgsV2)]


OLDEST_SUPPORTED = (3, 4)
# The first release whose nvshmemx_init_args_t / _attr_t are the v2 structs (read in the 3.4.5,
# 3.5.21, 3.6.5, 3.7.2 and 3.8.0 wheels' headers).
INIT_V2_SINCE = (3, 5)


def init_layout(version: Tuple[int, ...]) -> Tuple[type, int]:
    """(nvshmemx_init_attr_t's ctypes mirror, its struct revision) for NVSHMEM `version`."""
    if tuple(version[:2]) < OLDEST_SUPPORTED:
        raise NvshmemError(f"NVSHMEM {'.'.join(map(str, version))} is too old: epcomm needs "
                           f"{'.'.join(map(str, OLDEST_SUPPORTED))} or newer ({_INSTALL_HINT})")
    return (InitAttrV2, 2) if tuple(version[:2]) >= INIT_V2_SINCE else (InitAttrV1, 1)


def _struct_version(struct, revision: int = 1) -> int:
    # The convention of the headers' *_INITIALIZER macros: (revision << 16) + sizeof(struct).
    return (revision << 16) + ctypes.sizeof(struct)


_SIGNATURES = {
    "nvshmemx_get_uniqueid": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    # The attr's layout depends on the library's version (init_layout): any struct, by reference.
    "nvshmemx_set_attr_uniqueid_args": (ctypes.c_int, [ctypes.c_int, ctypes.c_int,
                                                       ctypes.POINTER(UniqueId), ctypes.c_void_p]),
    # nvshmemx_init_attr is a static inline calling nvshmemi_init_thread from libnvshmem_device.a;
    # the .so exports this one (platform.md (a)).
    "nvshmemx_hostlib_init_attr": (ctypes.c_int, [ctypes.c_uint, ctypes.c_void_p]),
    "nvshmemx_hostlib_finalize": (None, []),
    "nvshmemx_init_status": (ctypes.c_int, []),
    "nvshmem_my_pe": (ctypes.c_int, []),
    "nvshmem_n_pes": (ctypes.c_int, []),
    "nvshmem_malloc": (ctypes.c_void_p, [ctypes.c_size_t]),
    "nvshmem_free": (None, [ctypes.c_void_p]),
    "nvshmem_ptr": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int]),
    "nvshmem_barrier_all": (None, []),
    "nvshmemx_cumodule_init": (ctypes.c_int, [ctypes.c_void_p]),
    "nvshmemx_vendor_get_version_info": (None, [ctypes.POINTER(ctypes.c_int)] * 3),
}


def library_path() -> str:
    """libnvshmem_host.so.3 of the NVSHMEM install the JIT compiles against (toolchain.nvshmem_home:
    EPCOMM_NVSHMEM_HOME, else the pip wheel): host library and device headers must match."""
    try:
        home = toolchain.nvshmem_home()
    except ToolchainError as e:
        raise NvshmemError(f"{e} ({_INSTALL_HINT})") from e
    path = home / "lib" / _LIBRARY
    if not path.is_file():
        raise NvshmemError(f"{path} does not exist: the NVSHMEM install at {home} has no host "
                           f"library; {_INSTALL_HINT}")
    return str(path)


_lib: Optional[ctypes.CDLL] = None


def library() -> ctypes.CDLL:
    """libnvshmem_host, loaded once. Works without a GPU (version and status queries only)."""
    global _lib
    if _lib is None:
        path = library_path()
        try:
            # RTLD_GLOBAL: the transports and bootstrap plugins it dlopens resolve symbols from it.
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise NvshmemError(f"cannot load {path}: {e}; {_INSTALL_HINT}") from e
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        _lib = lib
    return _lib


def new_init_attr(version: Tuple[int, ...]) -> ctypes.Structure:
    """An nvshmemx_init_attr_t for NVSHMEM `version`, filled as its NVSHMEMX_INIT_ATTR_INITIALIZER
    would: hostlib_init_attr does not fill the version fields (the inline nvshmemx_init_attr does)."""
    attr_type, revision = init_layout(version)
    attr = attr_type()
    attr.version = _struct_version(attr_type, revision)
    attr.args.version = _struct_version(type(attr.args), revision)
    attr.args.uid_args.version = _struct_version(UniqueIdArgs)
    attr.args.uid_args.myrank = attr.args.uid_args.nranks = -1
    if revision >= 2:
        attr.args.cuda_device_id = -1   # the initializer's value: the current device
    return attr


def library_version() -> Tuple[int, int, int]:
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    library().nvshmemx_vendor_get_version_info(ctypes.byref(major), ctypes.byref(minor),
                                               ctypes.byref(patch))
    return major.value, minor.value, patch.value


def init_status() -> int:
    return library().nvshmemx_init_status()


def cumodule_init(module_handle: int) -> None:
    """Fill the NVSHMEM device state of a loaded CUmodule (needed once per module that contains
    NVSHMEM device code, before its first launch)."""
    if init_status() < STATUS_IS_INITIALIZED:
        raise NvshmemError("nvshmemx_cumodule_init: NVSHMEM is not initialised in this process; "
                           "a kernel using NVSHMEM device code needs Nvshmem.init first "
                           "(GpuBackend does it)")
    rc = library().nvshmemx_cumodule_init(module_handle)
    if rc != 0:
        raise NvshmemError(f"nvshmemx_cumodule_init(module={module_handle:#x}) returned {rc}")


def _make_context_current(device_index: int) -> None:
    """NVSHMEM binds to the current device's current context: make that torch's primary context."""
    import torch
    torch.cuda.set_device(device_index)
    torch.zeros(1, dtype=torch.uint8, device=torch.device("cuda", device_index))


def _all_gather(group, obj) -> list:
    import torch.distributed as dist
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class Nvshmem:
    """The process's NVSHMEM world. Obtain it with `Nvshmem.init(group, device_index)`; every method
    named collective must be called by all PEs in the same order."""

    _instance: Optional["Nvshmem"] = None

    def __init__(self, group, device_index: int, owns_world: bool):
        self._lib = library()
        self.group = group
        self.device_index = device_index
        self.owns_world = owns_world  # False: adopted; whoever initialised it also finalises it
        self.my_pe = self._lib.nvshmem_my_pe()
        self.n_pes = self._lib.nvshmem_n_pes()
        self.version = library_version()
        # A teardown meeting (Buffer.destroy, finalize) found a rank missing: it did not come to
        # free what every rank must free together, so it is taken for gone. The meeting's outcome
        # is one decision that every rank taking part follows, so all of them know, and no later
        # teardown meets again or attempts anything collective (each would wait out its bound).
        self.peer_missing = False
        self._teardown = None   # the finalize meeting (a Rendezvous), for a world this process owns
        self._finalized = False
        self._owners: List[Callable[[], None]] = []  # teardown callbacks, run before finalize
        self._buffers: "weakref.WeakSet" = weakref.WeakSet()

    # ---- world setup --------------------------------------------------------------------------
    @classmethod
    def init(cls, group, device_index: int) -> "Nvshmem":
        """Collective over `group`: initialise NVSHMEM (PE i = group rank i) on `device_index`, or
        return the existing world after checking that it matches the group. Every rank decides
        from the same gathered facts, so a failure raises on all ranks instead of hanging some."""
        import torch.distributed as dist
        group = dist.group.WORLD if group is None else group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        _make_context_current(device_index)
        bound = cls._instance.device_index if cls._instance is not None else None
        fact = {"host": host_key(), "error": None, "status": None, "pe": None, "n_pes": None,
                "device": device_index, "bound_device": bound}
        try:
            fact["status"] = init_status()
            if fact["status"] >= STATUS_IS_INITIALIZED:
                fact["pe"], fact["n_pes"] = library().nvshmem_my_pe(), library().nvshmem_n_pes()
        except NvshmemError as e:
            fact["error"] = str(e)
        facts = _all_gather(group, fact)
        errors = [f"rank {r}: {f['error']}" for r, f in enumerate(facts) if f["error"]]
        if errors:
            raise NvshmemError("NVSHMEM unavailable on some ranks:\n  " + "\n  ".join(errors))
        if all(f["status"] >= STATUS_IS_INITIALIZED for f in facts):
            return cls._adopt(group, device_index, facts, size)
        if any(f["status"] != STATUS_NOT_INITIALIZED for f in facts):
            states = ", ".join(f"rank {r}: {f['status']}" for r, f in enumerate(facts))
            raise NvshmemError(f"NVSHMEM is not fully initialised on every rank of the group, nor on "
                               f"none (nvshmemx_init_status {states}; 2 = initialised)")
        if cls._instance is not None:  # ours, finalised (status went back to 0)
            raise NvshmemError("NVSHMEM was finalised in this process; it cannot be initialised again")

        apply_env_defaults(single_host=len({f["host"] for f in facts}) == 1)
        lib = library()
        uid = UniqueId()
        uid.version = _struct_version(UniqueId)
        box: list = [None]
        if rank == 0:  # a failure is broadcast too, so the other ranks raise instead of waiting
            rc = lib.nvshmemx_get_uniqueid(ctypes.byref(uid))
            box[0] = bytes(uid) if rc == 0 else f"nvshmemx_get_uniqueid on rank 0 returned {rc}"
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        if isinstance(box[0], str):
            raise NvshmemError(box[0])
        ctypes.memmove(ctypes.addressof(uid), box[0], ctypes.sizeof(uid))

        attr = new_init_attr(library_version())
        # The attr keeps a pointer to uid: both stay alive (locals) until init returns.
        _check(lib.nvshmemx_set_attr_uniqueid_args(rank, size, ctypes.byref(uid), ctypes.byref(attr)),
               "nvshmemx_set_attr_uniqueid_args")
        _check(lib.nvshmemx_hostlib_init_attr(_INIT_WITH_UNIQUEID, ctypes.byref(attr)),
               f"nvshmemx_hostlib_init_attr (rank {rank} of {size}; NVSHMEM_DEBUG=INFO tells more)")
        world = cls(group, device_index, owns_world=True)
        world._teardown = group_rendezvous(group, f"nvshmem-{hashlib.sha1(box[0]).hexdigest()[:16]}")
        if (world.my_pe, world.n_pes) != (rank, size):
            raise NvshmemError(f"NVSHMEM initialised as PE {world.my_pe} of {world.n_pes}, expected "
                               f"group rank {rank} of {size}")
        cls._instance = world
        atexit.register(world.finalize)
        return world

    @classmethod
    def _adopt(cls, group, device_index, facts, size) -> "Nvshmem":
        wrong = [f"rank {r} is PE {f['pe']} of {f['n_pes']}" for r, f in enumerate(facts)
                 if (f["pe"], f["n_pes"]) != (r, size)]
        if wrong:
            raise NvshmemError("NVSHMEM is already initialised in this process with a world that does "
                               f"not match the group (group of {size} ranks, group rank i must be PE "
                               f"i): {'; '.join(wrong)}")
        world = cls._instance
        if world is None:  # initialised by someone else in this process (nvshmem4py, another lib)
            world = cls._instance = cls(group, device_index, owns_world=False)
        elif world._finalized:
            raise NvshmemError("NVSHMEM was finalised in this process; it cannot be used again")
        moved = [f"rank {r} initialised it on cuda:{f['bound_device']}, now asks for "
                 f"cuda:{f['device']}" for r, f in enumerate(facts)
                 if f["bound_device"] is not None and f["bound_device"] != f["device"]]
        if moved:
            raise NvshmemError("NVSHMEM serves one GPU per process: " + "; ".join(moved))
        world.group = group  # later collective allocations agree over the newest Buffer's group
        return world

    # ---- memory -----------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Collective: nbytes (equal on every PE) of symmetric memory on this GPU. Raises on every
        PE if any PE got NULL."""
        self._require_live()
        if nbytes <= 0:
            raise ValueError(f"symmetric allocation size must be > 0, got {nbytes}")
        ptr = self._lib.nvshmem_malloc(nbytes) or 0
        failed = [r for r, ok in enumerate(_all_gather(self.group, ptr != 0)) if not ok]
        if failed:
            # Blocks other PEs got stay allocated: the heap is asymmetric now, so do not free them.
            raise NvshmemError(
                f"nvshmem_malloc({nbytes} B = {nbytes / 2**30:.2f} GiB) returned NULL on rank(s) "
                f"{failed}: out of GPU memory, or the heap cannot grow (NVSHMEM_DISABLE_CUDA_VMM=1 "
                f"needs NVSHMEM_SYMMETRIC_SIZE >= all Buffers together; now "
                f"{os.environ.get('NVSHMEM_SYMMETRIC_SIZE', 'unset')})")
        return ptr

    def free(self, ptr: int) -> None:
        """Collective: every PE frees the same block, in the same order (a barrier on entry)."""
        self._require_live()
        self._lib.nvshmem_free(ptr)

    def peer_ptr(self, ptr: int, pe: int) -> int:
        """Address in this process of PE `pe`'s copy of symmetric `ptr`; 0 when that PE is not
        reachable by loads/stores (no NVLink/P2P path)."""
        self._require_live()
        if not 0 <= pe < self.n_pes:
            raise ValueError(f"pe must be in [0, {self.n_pes}), got {pe}")
        return self._lib.nvshmem_ptr(ptr, pe) or 0

    def barrier_all(self) -> None:
        """Collective host barrier for setup and teardown. Synchronises this GPU first, so every
        kernel queued before the call, on any stream, has finished on every PE when it returns."""
        import torch
        self._require_live()
        torch.cuda.synchronize(self.device_index)
        self._lib.nvshmem_barrier_all()

    # ---- lifetime -------------------------------------------------------------------------------
    def add_teardown(self, callback: Callable[[], None]) -> None:
        """Run callback (a Buffer's destroy) in finalize, before NVSHMEM goes away. Callbacks run
        in registration order, which is the same on every rank."""
        self._owners.append(callback)

    def remove_teardown(self, callback: Callable[[], None]) -> None:
        if callback in self._owners:
            self._owners.remove(callback)

    def track(self, buffer) -> None:
        """Symmetric buffers still alive at finalize are marked released (their memory goes with
        the heap), so a later free() is a no-op instead of a call into a finalised library."""
        self._buffers.add(buffer)

    @property
    def live(self) -> bool:
        return not self._finalized

    def _require_live(self) -> None:
        if self._finalized:
            raise NvshmemError("NVSHMEM has been finalised in this process")

    def finalize(self) -> None:
        """Idempotent. Destroys registered Buffers, then releases NVSHMEM if this process
        initialised it. That is collective, so it follows a bounded meeting of every PE; if one is
        missing from it (or a teardown meeting found one missing before), nothing collective is
        attempted: a barrier with a PE that is gone would hang the exit."""
        if self._finalized:
            return
        try:
            for callback in list(self._owners):
                callback()
        finally:
            self._owners.clear()
            for buffer in list(self._buffers):
                buffer._forget()
            self._finalized = True
        if self.owns_world and not self.peer_missing and self._every_pe_finalizes():
            self._lib.nvshmemx_hostlib_finalize()

    def _every_pe_finalizes(self) -> bool:
        import torch
        torch.cuda.synchronize(self.device_index)
        try:
            self._teardown.meet("NVSHMEM finalize", "every PE reached finalize", 2 * env.timeout_s())
            return True
        except Exception as e:   # PeerTimeout, or the store gone with the process that served it
            self.peer_missing = True
            warnings.warn(f"NVSHMEM left to process exit, not finalised ({e})", RuntimeWarning, stacklevel=2)
            return False


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise NvshmemError(f"{what} failed with status {rc}")
