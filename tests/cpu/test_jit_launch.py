"""Kernel.launch's driver plumbing without a GPU: a fake libcuda (built with the host C compiler)
records what it is handed, so the argument passing, the cooperative entry point, the Params size
check, the context retry and the error text are checked on the CPU."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import types

import pytest

from epcomm.errors import EpcommError
from epcomm.runtime import cache, launch, module
from epcomm.runtime.arch import Arch
from epcomm.runtime.compiler import CompiledCubin, KernelSource

FAKE_DRIVER = r"""
#include <stddef.h>
#include <string.h>
unsigned last_dims[7]; void *last_stream; unsigned char last_params[256];
int last_coop = -1, launches = 0, pushes = 0, param_size = 24, needs_context = 0, fail_with = 0;
static void *current;
char last_function_name[256]; int loads = 0;
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)(size_t)(0xC0 + d); return 0; }
int cuModuleLoadData(void **m, const void *image) { if (!current) return 201; ++loads; *m = (void *)0x3000; return 0; }
int cuModuleGetFunction(void **f, void *m, const char *name) { strncpy(last_function_name, name, 255); *f = (void *)0x4000; return 0; }
int cuInit(unsigned f) { return 0; }
int cuGetErrorName(int rc, const char **s) { *s = rc == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; return 0; }
int cuCtxPushCurrent_v2(void *c) { current = c; ++pushes; return 0; }
int cuCtxPopCurrent_v2(void **c) { *c = current; current = 0; return 0; }
int cuFuncGetParamInfo(void *f, size_t i, size_t *off, size_t *size) { if (i > 0) return 1; *off = 0; *size = param_size; return 0; }
int cuFuncGetAttribute(int *v, int attr, void *f) { *v = attr == 4 ? 40 : 0; return 0; }
int cuFuncSetAttribute(void *f, int attr, int v) { return 0; }
int cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *f, int threads, size_t smem) { *n = 2; return 0; }
static int record(const unsigned *dims, void *stream, void **params) {
    if (needs_context && !current) return 201;
    if (fail_with) return fail_with;
    memcpy(last_dims, dims, sizeof last_dims); last_stream = stream;
    memcpy(last_params, params[0], param_size); ++launches; return 0;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void *stream, void **params, void **extra) {
    unsigned dims[7] = {gx, gy, gz, bx, by, bz, smem}; last_coop = -1; return record(dims, stream, params);
}
typedef struct { unsigned dims[7]; void *stream; void *attrs; unsigned num_attrs; } LaunchConfigEx;
int ex_launches = 0;
int cuLaunchKernelEx(const LaunchConfigEx *c, void *f, void **params, void **extra) {
    last_coop = -2; if (c->attrs || c->num_attrs || extra) return 1; ++ex_launches; return record(c->dims, c->stream, params);
}
int cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned smem, void *stream, void **params) {
    unsigned dims[7] = {gx, gy, gz, bx, by, bz, smem}; last_coop = 2; return record(dims, stream, params);
}
"""


class Params(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("n", ctypes.c_longlong), ("value", ctypes.c_int)]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler to build the fake driver")
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    lib = tmp_path / "libcuda_fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(tmp_path / "fake.c")], check=True)
    monkeypatch.setattr(launch, "LIBCUDA", str(lib))
    monkeypatch.setattr(launch, "_driver", None)
    yield ctypes.CDLL(str(lib))
    launch._driver = None


def read(lib, name, ctype=ctypes.c_int):
    return ctype.in_dll(lib, name).value


def make_kernel():
    return launch.Kernel("epcomm::probe<1>", "_Z5probe", function=0x1000, context=0xC0, device_index=0,
                         num_sms=132)


def test_plain_launch_passes_dims_stream_and_params_by_value(fake):
    k = make_kernel()
    params = Params(0xABC, 12345, -7)
    k.launch((3, 2, 1), (128, 1, 1), params, 0x5555, smem=4096)
    assert read(fake, "launches") == 1 and read(fake, "last_coop") == -1
    assert list((ctypes.c_uint * 7).in_dll(fake, "last_dims")) == [3, 2, 1, 128, 1, 1, 4096]
    assert read(fake, "last_stream", ctypes.c_void_p) == 0x5555
    assert bytes((ctypes.c_ubyte * 24).in_dll(fake, "last_params")) == bytes(params)


def test_a_bound_launch_passes_dims_stream_and_the_params_as_they_are_at_launch(fake):
    """Kernel.launcher: cuLaunchKernelEx (marker -2) with the launch config built once; the stream
    field follows the stream passed; the Params bytes are read at each launch."""
    k = make_kernel()
    params = Params(0xABC, 1, 2)
    launch = k.launcher((5, 1, 1), (256, 1, 1), params, smem=1024)
    for stream, n in ((0x77, 1), (0x77, 2), (0x99, 3), (0, 4)):
        params.n = n
        launch(stream)
        assert read(fake, "last_coop") == -2 and read(fake, "ex_launches") == n
        assert list((ctypes.c_uint * 7).in_dll(fake, "last_dims")) == [5, 1, 1, 256, 1, 1, 1024]
        assert (read(fake, "last_stream", ctypes.c_void_p) or 0) == stream
        assert bytes((ctypes.c_ubyte * 24).in_dll(fake, "last_params")) == bytes(params)
    with pytest.raises(TypeError, match="24-byte Params"):
        class Wrong(ctypes.Structure):
            _fields_ = [("out", ctypes.c_void_p)]
        k.launcher((1, 1, 1), (32, 1, 1), Wrong())
    k._launch_ex = None   # a driver before CUDA 12.0: cuLaunchKernel with the dims bound
    k.launcher((2, 1, 1), (64, 1, 1), params)(0x55)
    assert read(fake, "last_coop") == -1 and read(fake, "ex_launches") == 4
    assert list((ctypes.c_uint * 7).in_dll(fake, "last_dims")) == [2, 1, 1, 64, 1, 1, 0]


def test_cooperative_launches(fake):
    """Cooperative: cuLaunchCooperativeKernel (marker 2 in the fake), the grid checked against
    co-residency first; a driver without that entry point raises instead of launching."""
    k = make_kernel()
    k.launch((264, 1, 1), (256, 1, 1), Params(0xA, 1, 2), 7, smem=64, cooperative=True)  # 2 per SM x 132 SMs
    assert read(fake, "last_coop") == 2 and read(fake, "launches") == 1
    assert list((ctypes.c_uint * 7).in_dll(fake, "last_dims")) == [264, 1, 1, 256, 1, 1, 64]
    assert bytes((ctypes.c_ubyte * 24).in_dll(fake, "last_params")) == bytes(Params(0xA, 1, 2))
    with pytest.raises(EpcommError, match=r"co-resident \(264\)"):
        k.launch((265, 1, 1), (256, 1, 1), Params(), 7, cooperative=True)
    k._launch_cooperative = None
    with pytest.raises(EpcommError, match="no cuLaunchCooperativeKernel"):
        k.launch((4, 1, 1), (64, 1, 1), Params(), 7, cooperative=True)
    assert read(fake, "launches") == 1


def test_params_size_is_checked_against_the_kernel(fake):
    class Wrong(ctypes.Structure):
        _fields_ = [("out", ctypes.c_void_p)]
    with pytest.raises(TypeError, match="24-byte Params"):
        make_kernel().launch((1, 1, 1), (32, 1, 1), Wrong(), 0)
    with pytest.raises(TypeError, match="ctypes.Structure"):
        make_kernel().launch((1, 1, 1), (32, 1, 1), 1234, 0)
    assert read(fake, "launches") == 0


class FillParams(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("n", ctypes.c_longlong), ("value", ctypes.c_int)]


class RowParams(ctypes.Structure):     # as large as FillParams: only the name tells them apart
    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("rows", ctypes.c_int),
                ("row_bytes", ctypes.c_int)]


def test_params_class_is_checked_against_the_mangled_parameter_type(fake):
    k = launch.Kernel("epcomm::fill<5>", "_ZN6epcomm4fillILi5EEEvNS_10FillParamsE", function=0x1000,
                      context=0xC0, device_index=0, num_sms=132)
    with pytest.raises(TypeError, match="takes a FillParams argument, got a RowParams"):
        k.launch((1, 1, 1), (32, 1, 1), RowParams(), 0)
    assert read(fake, "launches") == 0
    k.launch((1, 1, 1), (32, 1, 1), FillParams(1, 2, 3), 0)

    class Derived(FillParams):         # a subclass of the mirror is the mirror
        pass
    k.launch((1, 1, 1), (32, 1, 1), Derived(1, 2, 3), 0)
    assert read(fake, "launches") == 2
    with pytest.raises(TypeError, match="FillParams"):   # the check is per class, not first-only
        k.launch((1, 1, 1), (32, 1, 1), RowParams(), 0)


@pytest.mark.parametrize("lowered, names", [
    ("_ZN6epcomm13layout_kernelILi8ELi256ELi2ELi2ExLi16ELi512EEEvNS_12LayoutParamsE", {"LayoutParams"}),
    ("_ZN6epcomm2ll15dispatch_kernelILi7168ELi8ELi2ELi288ELi128ELb1ELb0ELb0ExLi512EEEvNS0_14DispatchParamsE",
     {"DispatchParams"}),
    ("_ZN6epcomm9intranode15dispatch_kernelILi2ELi896ELi0ExLb1EEEvNS0_14DispatchParamsE", {"DispatchParams"}),
    ("_ZN6epcomm2ll14combine_kernelILi7168ELi8ELi2ELi288ELi128ExLi512EEEvNS0_13CombineParamsE", {"CombineParams"}),
    ("_ZN6epcomm8smem_sumENS_10FillParamsE", {"FillParams"}),
    ("_Z5probe", set()), ("_Z1aILi1EEvv", set()), ("_Z3fooi", set())])
def test_param_type_names_from_mangled_kernel_names(lowered, names):
    assert launch.param_type_names(lowered) == names


def test_launch_retries_in_the_kernels_context(fake):
    ctypes.c_int.in_dll(fake, "needs_context").value = 1
    make_kernel().launch((1, 1, 1), (32, 1, 1), Params(), 0)
    assert read(fake, "launches") == 1 and read(fake, "pushes") == 1
    make_kernel().launch((4, 1, 1), (32, 1, 1), Params(), 0, cooperative=True)
    assert read(fake, "launches") == 2 and read(fake, "pushes") == 2 and read(fake, "last_coop") == 2


def test_failed_launch_names_kernel_error_and_config(fake):
    ctypes.c_int.in_dll(fake, "fail_with").value = 701
    with pytest.raises(EpcommError) as info:
        make_kernel().launch((9, 1, 1), (1024, 1, 1), Params(), 0x42, smem=100)
    text = str(info.value)
    assert "epcomm::probe<1>" in text and "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES" in text
    assert "grid=(9, 1, 1)" in text and "block=(1024, 1, 1)" in text and "num_regs=40" in text


def test_get_kernel_loads_once_in_the_primary_context(fake, monkeypatch):
    """get_kernel: cubin from the cache, cuModuleLoadData with the device's primary context pushed,
    nvshmemx_cumodule_init for NVSHMEM sources, functions by lowered name, memoised."""
    import epcomm.runtime.nvshmem as nvshmem
    src = KernelSource("layout.cu", ("epcomm::a<1>", "epcomm::b<2>"), uses_nvshmem=True)
    lowered = {"epcomm::a<1>": "_Z1aILi1EEvv", "epcomm::b<2>": "_Z1bILi2EEvv"}
    monkeypatch.setattr(cache, "get_cubin", lambda s, a, f: CompiledCubin(b"cubin", lowered))
    monkeypatch.setattr(module, "device_arch", lambda i: Arch.for_target(90, num_sms=132))
    for name in ("_KERNELS", "_MODULES", "_CONTEXTS"):
        monkeypatch.setattr(module, name, {})
    inits = []
    monkeypatch.setattr(nvshmem, "cumodule_init", inits.append)
    a = module.get_kernel(src, 0, 1)
    assert bytes((ctypes.c_char * 256).in_dll(fake, "last_function_name").value) == b"_Z1aILi1EEvv"
    assert a.context == 0xC1 and a.num_sms == 132 and a.lowered_name == "_Z1aILi1EEvv"
    assert module.get_kernel(src, "epcomm::a<1>", 1) is a
    b = module.get_kernel(src, "epcomm::b<2>", 1)
    assert b.lowered_name == "_Z1bILi2EEvv"
    assert read(fake, "loads") == 1 and inits == [0x3000], "one module per (device, feature, source)"
    module.get_kernel(src, 1, 1, feature=80)
    assert read(fake, "loads") == 2
    with pytest.raises(KeyError, match="epcomm::c"):
        module.get_kernel(src, "epcomm::c<3>", 1)


def test_layout_host_path_is_allocations_and_one_launch(fake, monkeypatch):
    """epcomm.ops.layout per call, counted: the outputs' allocations (one per output, no memset:
    the kernel zeroes what it accumulates into) and one launch, plain for one block, cooperative
    for more; the Params point at the outputs. CPU tensors stand in for device memory."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from epcomm.ops import layout

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ctypes.c_int.in_dll(fake, "param_size").value = ctypes.sizeof(layout.LayoutParams)
    k, e = 4, 64
    kernel = launch.Kernel("layout", "_ZN6epcomm13layout_kernelILi4ELi64ELi4ELi2ExLi16ELi512EEEvNS_12LayoutParamsE",
                           function=0x1000, context=0xC0, device_index=0, num_sms=132)
    monkeypatch.setattr(layout, "current_stream", lambda device_index: 0x77)
    backend = types.SimpleNamespace(plans={layout.LayoutSpec: {}})   # plans made here, for CPU tensors
    for n, ranks, local, blocks in ((100, 4, 2, 1), (4096, 4, 2, 8), (100_000, 4, 4, 132)):
        topk_idx = torch.zeros(n, k, dtype=torch.int64)
        spec = layout.LayoutSpec(k, e, ranks, local, torch.int64, -1, None, topk_idx.data_ptr() % 16)
        backend.plans[layout.LayoutSpec][spec] = layout._Plan(kernel, 4 * (e + ranks + ranks // local),
                                                              torch.device("cpu"), ranks // local, 132)
        launches = read(fake, "launches")
        with CountOps() as counted:
            per_rank, per_node, per_expert, in_rank = layout.get_dispatch_layout(topk_idx, e, ranks, local,
                                                                                 backend=backend)
        nodes = ranks // local
        assert counted.ops == ["aten.new_empty.default"] * (3 + (nodes > 1)), (n, counted.ops)
        assert read(fake, "launches") == launches + 1
        assert read(fake, "last_coop") == (-1 if blocks == 1 else 2), "plain launch for one block only"
        assert list((ctypes.c_uint * 7).in_dll(fake, "last_dims"))[:4] == [blocks, 1, 1, layout.THREADS]
        assert read(fake, "last_stream", ctypes.c_void_p) == 0x77
        sent = layout.LayoutParams.from_buffer_copy(bytes((ctypes.c_ubyte * 48).in_dll(fake, "last_params")))
        assert (sent.topk_idx, sent.num_tokens_per_rank, sent.num_tokens_per_expert, sent.is_token_in_rank,
                sent.num_tokens) == (topk_idx.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(),
                                     in_rank.data_ptr(), n)
        assert (sent.num_tokens_per_rdma_rank or 0) == (per_node.data_ptr() if nodes > 1 else 0)
        assert per_rank.shape == (ranks,) and per_expert.shape == (e,) and in_rank.shape == (n, ranks)
        assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
        assert per_node is None if nodes == 1 else per_node.shape == (nodes,)
