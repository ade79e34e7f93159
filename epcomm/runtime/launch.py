"""Kernel launches through the CUDA driver (ctypes on libcuda.so.1; loaded on first use).

`Kernel.launch(grid, block, params, stream, smem=0, cooperative=False)` passes ONE
ctypes.Structure by value (the kernel's single Params argument). It is on every call's critical
path, so a plain launch is one ctypes call (cuLaunchKernel) with a per-thread, prebuilt
kernelParams array; cooperative launches are one cuLaunchCooperativeKernel call (same argument
list). `Kernel.launcher(grid, block, params, smem)` binds all but the stream once, for the per-call
fast paths that launch one prefilled Params object again and again.

The first launch with a given Params class checks it against the kernel: its size against the
kernel's parameter in the cubin (cuFuncGetParamInfo), and its name against the parameter type in
the kernel's mangled name (ctypes mirrors carry the C++ struct's name, e.g. LayoutParams for
epcomm::LayoutParams), so a drifted mirror, or another kernel's Params of the same size, fails
loudly instead of launching with garbage.
"""
from __future__ import annotations

import ctypes
import functools
import re
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_void_p
from typing import NamedTuple, Tuple

from ..errors import EpcommError

_CUDA_ERROR_INVALID_CONTEXT = 201
_CUDA_ERROR_INVALID_HANDLE = 400
_ATTR_MAX_THREADS_PER_BLOCK = 0
_ATTR_SHARED_SIZE_BYTES = 1
_ATTR_LOCAL_SIZE_BYTES = 3
_ATTR_NUM_REGS = 4
_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


_SIGNATURES = {
    "cuInit": [c_uint],
    "cuGetErrorName": [c_int, POINTER(c_char_p)],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
    "cuCtxPushCurrent_v2": [c_void_p],
    "cuCtxPopCurrent_v2": [POINTER(c_void_p)],
    "cuModuleLoadData": [POINTER(c_void_p), c_char_p],
    "cuModuleGetFunction": [POINTER(c_void_p), c_void_p, c_char_p],
    "cuFuncGetAttribute": [POINTER(c_int), c_int, c_void_p],
    "cuFuncSetAttribute": [c_void_p, c_int, c_int],
    "cuFuncGetParamInfo": [c_void_p, c_size_t, POINTER(c_size_t), POINTER(c_size_t)],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [POINTER(c_int), c_void_p, c_int, c_size_t],
    "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                       c_void_p, c_void_p],
    "cuLaunchCooperativeKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                                  c_void_p, c_void_p],
}
LIBCUDA = "libcuda.so.1"   # tests point this at a fake driver
_driver = None
_driver_lock = threading.Lock()
# kernelParams arrays, one per thread: the driver reads the array during the (GIL-releasing) launch
# call, so threads must not share one; per thread it is reused launch after launch (the driver
# copies the Params bytes at launch, so neither the array nor the struct must outlive the call).
_thread_args = threading.local()
_addressof = ctypes.addressof
_c_void_p = c_void_p


def _new_args_array():
    _thread_args.array = array = (c_void_p * 1)()
    return array


def driver() -> ctypes.CDLL:
    """libcuda.so.1 with the signatures above, cuInit done. Functions missing from an old driver
    (cuFuncGetParamInfo before 12.4) are left unset and their checks skipped."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL(LIBCUDA)
            except OSError as e:
                raise EpcommError(f"cannot load the CUDA driver ({LIBCUDA}): {e}") from e
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes, fn.restype = argtypes, c_int
            check(lib.cuInit(0), "cuInit")
            _driver = lib
    return _driver


def _untyped(lib: ctypes.CDLL, name: str):
    """A second function object for `name` with no argtypes (None if the driver lacks it)."""
    if getattr(lib, name, None) is None:
        return None
    fn = lib._FuncPtr((name, lib))
    fn.restype = c_int
    return fn


def error_name(rc: int) -> str:
    name = c_char_p()
    if _driver is None or _driver.cuGetErrorName(rc, byref(name)) != 0 or not name.value:
        return f"CUDA error {rc}"
    return f"{name.value.decode()} ({rc})"


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise EpcommError(f"{what} failed: {error_name(rc)}")


_SOURCE_NAME = re.compile(r"(?<![0-9])[1-9][0-9]*")


def param_type_names(lowered_name: str) -> set:
    """Names ending in "Params" that an Itanium-mangled kernel name spells out (as <length><name>):
    the kernel's parameter struct, e.g. {"LayoutParams"} for
    _ZN6epcomm13layout_kernelILi8E...EEvNS_12LayoutParamsE. Empty when there is none."""
    names = set()
    for m in _SOURCE_NAME.finditer(lowered_name):
        end = m.end() + int(m.group())
        name = lowered_name[m.end():end]
        if end <= len(lowered_name) and name.endswith("Params") and name.isidentifier():
            names.add(name)
    return names


class LaunchConfigEx(ctypes.Structure):
    """CUlaunchConfig (cuda.h), without launch attributes."""
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint), ("blockDimX", c_uint),
                ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", c_void_p), ("numAttrs", c_uint)]


class LaunchConfig(NamedTuple):
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    smem: int
    stream: int
    cooperative: bool


class Kernel:
    """One __global__ function of a loaded module (see module.get_kernel)."""

    def __init__(self, name: str, lowered_name: str, function: int, context: int, device_index: int,
                 num_sms: int):
        self.name, self.lowered_name, self.device_index = name, lowered_name, device_index
        self.function, self.context, self.num_sms = function, context, num_sms
        self._checked_params_type = None
        self._max_dynamic_smem = 0
        self._occupancy = {}                 # (threads, smem) -> max active blocks per SM
        self._coresident = {}                # (threads, smem) -> most blocks a cooperative grid may have
        lib = driver()
        # The launch entry points without argtypes: ctypes' default conversions (ints as C int,
        # pointers pre-wrapped in c_void_p) cost half of the argtypes path, and every value passed
        # fits: grid and block dims < 2**31, smem < 2**31.
        self._launch = _untyped(lib, "cuLaunchKernel")
        self._launch_cooperative = _untyped(lib, "cuLaunchCooperativeKernel")
        self._launch_ex = _untyped(lib, "cuLaunchKernelEx")   # for launcher(); None before CUDA 12.0
        self._handle = c_void_p(function)

    # ---- launch ------------------------------------------------------------------------------
    def launch(self, grid, block, params: ctypes.Structure, stream: int, smem: int = 0,
               cooperative: bool = False) -> None:
        """grid, block: 3-tuples; stream: CUstream handle (an int: torch's `.cuda_stream`, or
        torch._C._cuda_getCurrentRawStream(device)); smem: dynamic shared-memory bytes (call
        set_max_dynamic_smem first above 48 KiB); cooperative: all blocks co-resident (grid sync)."""
        if type(params) is not self._checked_params_type:
            self._check_params(params)
        try:
            args = _thread_args.array
        except AttributeError:
            args = _new_args_array()
        args[0] = _addressof(params)           # kernelParams: the address of the one Params struct
        if cooperative:
            return self._launch_cooperative_grid(grid, block, stream, smem, args)
        rc = self._launch(self._handle, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                          _c_void_p(stream), args, None)
        if rc:
            self._retry_in_context(self._launch, (self._handle, grid[0], grid[1], grid[2], block[0],
                                                  block[1], block[2], smem, c_void_p(stream), args, None),
                                   rc, LaunchConfig(tuple(grid), tuple(block), smem, stream, False))

    def launcher(self, grid, block, params: ctypes.Structure, smem: int = 0):
        """launch(stream) of this kernel with `params` (checked now), for a caller that launches one
        Params object over and over. Everything but the stream is bound once: with
        cuLaunchKernelEx (CUDA >= 12.0) a launch passes four prebuilt ctypes objects (the launch
        config, whose stream field changes only with the stream, the function, the kernelParams
        array), so no argument is converted per call; older drivers get cuLaunchKernel with the
        dims bound. The array belongs to `params`: like the struct itself, it must not be
        launched from two threads at once."""
        if type(params) is not self._checked_params_type:
            self._check_params(params)
        args = (c_void_p * 1)(_addressof(params))
        handle = self._handle
        dims = (grid[0], grid[1], grid[2], block[0], block[1], block[2], smem)

        def failed(rc: int, stream: int) -> None:
            self._retry_in_context(self._launch, (handle, *dims, c_void_p(stream), args, None), rc,
                                   LaunchConfig(tuple(grid), tuple(block), smem, stream, False))

        launch_ex = self._launch_ex
        if launch_ex is None:
            bound = functools.partial(self._launch, handle, *dims)

            def launch(stream: int) -> None:
                rc = bound(_c_void_p(stream), args, None)
                if rc:
                    failed(rc, stream)
        else:
            config = LaunchConfigEx(*dims, None, None, 0)
            config_ptr = c_void_p(_addressof(config))
            current = [None]   # the stream the config holds

            def launch(stream: int) -> None:
                if stream != current[0]:
                    config.hStream, current[0] = stream, stream
                rc = launch_ex(config_ptr, handle, args, None)
                if rc:
                    failed(rc, stream)
            launch.config = config
        launch.params = params   # the launch reads them: they live as long as the launcher
        return launch

    def _retry_in_context(self, fn, fn_args, rc: int, config: "LaunchConfig") -> None:
        """After a failed launch call: a wrong (or no) current context on this thread is retried in
        ours; any other error raises, naming the kernel and the launch."""
        if rc in (_CUDA_ERROR_INVALID_CONTEXT, _CUDA_ERROR_INVALID_HANDLE):
            with pushed_context(self.context):
                rc = fn(*fn_args)
        if rc:
            self._launch_failed(rc, config)

    def _launch_cooperative_grid(self, grid, block, stream, smem, args) -> None:
        config = LaunchConfig(tuple(grid), tuple(block), smem, stream, True)
        self._check_coresident(grid, block, smem, config)
        fn = self._launch_cooperative
        if fn is None:
            raise EpcommError(f"cooperative launch of {self.name}: the CUDA driver has no "
                              f"cuLaunchCooperativeKernel")
        fn_args = (self._handle, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                   c_void_p(stream), args)
        rc = fn(*fn_args)
        if rc:
            self._retry_in_context(fn, fn_args, rc, config)

    def _check_coresident(self, grid, block, smem, config) -> None:
        threads = block[0] * block[1] * block[2]
        limit = self._coresident.get((threads, smem))
        if limit is None:
            limit = self._coresident[(threads, smem)] = self.max_active_blocks_per_sm(threads, smem) * self.num_sms
        if grid[0] * grid[1] * grid[2] > limit:
            raise EpcommError(f"cooperative launch of {self.name}: grid {config.grid} has more "
                              f"blocks than can be co-resident ({limit}); {config}")

    def _launch_failed(self, rc: int, config: LaunchConfig):
        raise EpcommError(f"launch of {self.name} failed: {error_name(rc)}; {config}; "
                          f"num_regs={self.num_regs}, static smem={self.static_smem_bytes}, "
                          f"max dynamic smem={self._max_dynamic_smem}")

    def _check_params(self, params) -> None:
        """Once per Params class: is it this kernel's Params (by name and size)?"""
        if not isinstance(params, ctypes.Structure):
            raise TypeError(f"{self.name}: params must be a ctypes.Structure (the kernel's Params), "
                            f"got {type(params).__name__}")
        expected = param_type_names(self.lowered_name)
        mine = {cls.__name__ for cls in type(params).__mro__}
        if expected and not expected & mine:
            raise TypeError(f"{self.name} takes a {' / '.join(sorted(expected))} argument, got a "
                            f"{type(params).__name__} (the Params of another kernel?)")
        lib = driver()
        if getattr(lib, "cuFuncGetParamInfo", None) is not None:
            offset, size = c_size_t(), c_size_t()
            check(lib.cuFuncGetParamInfo(self.function, 0, byref(offset), byref(size)),
                  f"cuFuncGetParamInfo({self.name})")
            extra = lib.cuFuncGetParamInfo(self.function, 1, byref(offset), byref(c_size_t()))
            if size.value != ctypes.sizeof(params) or extra == 0:   # extra == 0: a 2nd parameter
                raise TypeError(f"{self.name} takes one {size.value}-byte Params argument"
                                f"{' (and more)' if extra == 0 else ''}; {type(params).__name__} "
                                f"has {ctypes.sizeof(params)} bytes")
        self._checked_params_type = type(params)

    # ---- attributes --------------------------------------------------------------------------
    def _attribute(self, attr: int) -> int:
        value = c_int()
        check(driver().cuFuncGetAttribute(byref(value), attr, self.function),
              f"cuFuncGetAttribute({self.name}, {attr})")
        return value.value

    @property
    def num_regs(self) -> int:
        return self._attribute(_ATTR_NUM_REGS)

    @property
    def local_bytes(self) -> int:
        """Local memory per thread (register spills, dynamically indexed arrays)."""
        return self._attribute(_ATTR_LOCAL_SIZE_BYTES)

    @property
    def static_smem_bytes(self) -> int:
        return self._attribute(_ATTR_SHARED_SIZE_BYTES)

    @property
    def max_threads_per_block(self) -> int:
        return self._attribute(_ATTR_MAX_THREADS_PER_BLOCK)

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Allow launches with up to `nbytes` of dynamic shared memory (needed above 48 KiB)."""
        if nbytes > self._max_dynamic_smem:
            check(driver().cuFuncSetAttribute(self.function, _ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                              int(nbytes)),
                  f"set_max_dynamic_smem({self.name}, {nbytes})")
            self._max_dynamic_smem = int(nbytes)

    def max_active_blocks_per_sm(self, threads: int, smem: int = 0) -> int:
        blocks = self._occupancy.get((threads, smem))
        if blocks is None:
            value = c_int()
            check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(byref(value), self.function,
                                                                       threads, smem),
                  f"occupancy of {self.name}")
            blocks = self._occupancy[(threads, smem)] = value.value
        return blocks

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, device={self.device_index})"


class pushed_context:
    """Make `context` current on this thread for a with-block (cuCtxPush/PopCurrent)."""

    def __init__(self, context: int):
        self.context = context

    def __enter__(self):
        check(driver().cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")

    def __exit__(self, *exc):
        check(driver().cuCtxPopCurrent_v2(byref(c_void_p())), "cuCtxPopCurrent")
