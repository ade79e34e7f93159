"""Compiled sources loaded into a device's primary context (the one torch uses), and their kernels.

get_kernel(src, kernel, device_index) is memoised per (device, feature set, source, kernel): after
the first call it is one dict lookup. A miss goes through the cubin cache (memo -> disk -> build),
cuModuleLoadData, and, for NVSHMEM sources, nvshmemx_cumodule_init (epcomm.runtime.nvshmem) so the
module's copy of NVSHMEM's device state is filled in. Modules stay loaded for the process's life.
"""
from __future__ import annotations

import threading
from ctypes import byref, c_int, c_void_p
from typing import Dict, Optional, Tuple, Union

from . import cache
from .arch import device_arch
from .compiler import KernelSource
from .launch import Kernel, check, driver, pushed_context

_KERNELS: Dict[tuple, Kernel] = {}
_MODULES: Dict[tuple, Tuple[int, Dict[str, str]]] = {}   # -> (CUmodule, lowered names)
_CONTEXTS: Dict[int, int] = {}
_lock = threading.Lock()


def get_kernel(src: KernelSource, kernel: Union[int, str], device_index: int,
               feature: Optional[int] = None) -> Kernel:
    """`kernel`: index into src.kernels or one of its name expressions. `feature`: 80 or 90 to
    override the device's feature set (EPCOMM_ARCH) for this call; None = the device's."""
    if feature is None:
        feature = device_arch(device_index).feature
    key = (device_index, feature, src, kernel)
    k = _KERNELS.get(key)
    if k is None:
        with _lock:
            name = _kernel_name(src, kernel)
            by_name = (device_index, feature, src, name)      # index and name share one Kernel
            k = _KERNELS.get(by_name) or _load_kernel(src, name, device_index, feature)
            _KERNELS[key] = _KERNELS[by_name] = k
    return k


def _kernel_name(src: KernelSource, kernel: Union[int, str]) -> str:
    if isinstance(kernel, int):
        return src.kernels[kernel]
    if kernel in src.kernels:
        return kernel
    raise KeyError(f"{kernel!r} is not one of {src.source}'s kernels {src.kernels}")


def _load_kernel(src: KernelSource, name: str, device_index: int, feature: int) -> Kernel:
    module, lowered = _load_module(src, device_index, feature)
    function = c_void_p()
    check(driver().cuModuleGetFunction(byref(function), module, lowered[name].encode()),
          f"cuModuleGetFunction({name} = {lowered[name]})")
    return Kernel(name, lowered[name], function.value, primary_context(device_index),
                  device_index, device_arch(device_index).num_sms)


def _load_module(src: KernelSource, device_index: int, feature: int):
    key = (device_index, feature, src)
    if key not in _MODULES:
        arch = device_arch(device_index)
        compiled = cache.get_cubin(src, arch.cc, feature)
        context = primary_context(device_index)
        module = c_void_p()
        with pushed_context(context):
            check(driver().cuModuleLoadData(byref(module), compiled.cubin),
                  f"cuModuleLoadData({src.source} for sm_{arch.cc}/f{feature})")
            if src.uses_nvshmem:
                from .nvshmem import cumodule_init
                cumodule_init(module.value)
        _MODULES[key] = (module.value, compiled.lowered)
    return _MODULES[key]


def primary_context(device_index: int) -> int:
    """The device's primary context, retained once (torch's runtime uses the same one)."""
    context = _CONTEXTS.get(device_index)
    if context is None:
        lib, device, ctx = driver(), c_int(), c_void_p()
        check(lib.cuDeviceGet(byref(device), device_index), f"cuDeviceGet({device_index})")
        check(lib.cuDevicePrimaryCtxRetain(byref(ctx), device), "cuDevicePrimaryCtxRetain")
        context = _CONTEXTS[device_index] = ctx.value
    return context
