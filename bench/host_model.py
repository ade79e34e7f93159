"""The host path of the GPU backend's calls, run on a machine without a GPU:
    python -m bench.host_model [--calls N] [--profile]
The real Buffer, validation, GpuBackend, ops modules and Kernel.launch run; only what needs a GPU
is replaced: CPU tensors stand in for device memory, the buffers and the error record are host
memory, and libcuda is a C library whose cuLaunchKernel returns at once (built with the host C
compiler), so every ctypes call of a launch is paid, the driver's own work is not. Shapes as in
bench/host_profile.py at 1 rank. Prints, per call, the median us of the whole Buffer call and of
its layers (the same call with its checks on every call, GpuBackend call, ops module alone, one
bare Kernel.launch, one poison launch) and, with
--profile, cProfile's largest own times. CPU allocations stand in for the caching allocator's."""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import io
import os
import pstats
import shutil
import statistics
import subprocess
import tempfile
import time
from types import SimpleNamespace
from typing import Callable, Dict, Iterator

import torch

_FAKE_DRIVER = r"""
#include <stddef.h>
#include <string.h>
/* launches counts every launch; the Params of launches of `watch_f` are copied into `watched`
   (watch_size bytes), for tests that compare what two paths launch */
int launches = 0, watch_size = 0, watched_count = 0;
void *watch_f = 0;
unsigned char watched[4096];
static int seen(void *f, void **params) {
    ++launches;
    if (f == watch_f && watch_size > 0 && watch_size <= (int)sizeof watched) {
        memcpy(watched, params[0], watch_size); ++watched_count;
    }
    return 0;
}
int cuInit(unsigned flags) { return 0; }
int cuGetErrorName(int rc, const char **s) { *s = "CUDA_ERROR_FAKE"; return 0; }
int cuFuncSetAttribute(void *f, int attr, int v) { return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void *stream, void **params, void **extra) { return seen(f, params); }
int cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) { return seen(f, params); }
int cuLaunchCooperativeKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned smem, void *stream, void **params) { return seen(f, params); }
"""

# Intranode as bench/host_profile.py but N = 1024 (the host path does not depend on N; the CPU
# allocator maps blocks of N = 4096 afresh each call, which the caching allocator does not).
N, H, K, E, SMS = 1024, 7168, 8, 256, 24
T, E_LL = 128, 288                              # low-latency
CPU = torch.device("cpu")


def build_fake_driver(folder: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("bench.host_model needs a host C compiler (cc) to build the stand-in libcuda")
    source, lib = os.path.join(folder, "fake_cuda.c"), os.path.join(folder, "libcuda_fake.so")
    with open(source, "w") as f:
        f.write(_FAKE_DRIVER)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", lib, source], check=True)
    return lib


class _HostBuffer:
    """What the ops modules read of runtime.symmetric.SymmetricBuffer: addresses and sizes; only the
    first bytes (the control region that views touch) are real memory."""

    def __init__(self, nbytes: int, num_ranks: int):
        self.memory = torch.zeros(1 << 20, dtype=torch.uint8)
        self.nbytes, self.ptr = nbytes, self.memory.data_ptr()
        self.peer_ptrs = [self.ptr] * num_ranks
        self.peer_table = torch.tensor(self.peer_ptrs, dtype=torch.int64)

    def view(self, dtype, shape, offset):
        count = torch.Size(shape).numel() * dtype.itemsize
        return self.memory[offset:offset + count].view(dtype).view(shape)


def _backend(nvl_bytes: int, rdma_bytes: int, low_latency_mode: bool):
    from epcomm.gpu import GpuBackend
    gb = GpuBackend.__new__(GpuBackend)
    gb._destroyed, gb.group = False, None
    gb.rank, gb.num_ranks, gb.num_local_ranks = 0, 1, 1
    gb.device, gb.device_index, gb.low_latency_mode = CPU, 0, low_latency_mode
    gb.options, gb.timeout_ns, gb.plans = {}, 10 ** 11, {}
    gb._ll = gb._normal_ops = gb._poison = None
    gb._unrecoverable = None
    gb.arch = SimpleNamespace(num_sms=132, feature=90)
    record = ctypes.c_int64(0)
    gb.status = SimpleNamespace(device_ptr=ctypes.addressof(record), error=None, check=lambda: None, _keep=record)
    gb.nvl = _HostBuffer(nvl_bytes, 1) if nvl_bytes else None
    gb.rdma = _HostBuffer(rdma_bytes, 1) if rdma_bytes else None
    return gb


@contextlib.contextmanager
def model() -> Iterator[Callable]:
    """Patch the GPU-only pieces; yields make(**buffer kwargs) -> Buffer on the stand-in backend
    (make.driver: the stand-in libcuda, for its counters)."""
    import torch.distributed as dist
    import epcomm.buffer as buffer_module
    from epcomm.ops import _common, intranode, low_latency, poison
    from epcomm.runtime import launch
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    kernels: Dict[object, launch.Kernel] = {}

    def kernel_of(source, *_):
        k = kernels.get(source)
        if k is None:
            k = kernels[source] = launch.Kernel(str(source), "", 0x1000 + len(kernels), 0, 0, 132)
            k._checked_params_type = None
            k._check_params = lambda p, k=k: setattr(k, "_checked_params_type", type(p))
        return k

    with tempfile.TemporaryDirectory() as folder:
        lib = build_fake_driver(folder)
        patch(launch, "LIBCUDA", lib)
        patch(launch, "_driver", None)
        raw_stream = lambda device_index: 0x5000
        for module, name in ((_common, "current_stream"), (low_latency, "current_stream"), (intranode, "current_stream"),
                             (poison, "_stream")):
            patch(module, name, raw_stream)
        patch(low_latency, "_capturing", lambda: False)
        patch(low_latency, "backend_kernel", lambda gb, source: kernel_of(source))
        patch(intranode, "backend_kernel", lambda gb, source: kernel_of(source))
        patch(poison, "get_kernel", lambda source, *a: kernel_of(source))
        made = []

        def make(**kwargs):
            gb = _backend(kwargs.get("num_nvl_bytes", 0), kwargs.get("num_rdma_bytes", 0),
                          kwargs.get("low_latency_mode", False))
            patch(buffer_module, "_make_backend", lambda *args: gb)
            buf = buffer_module.Buffer(dist.ProcessGroup(dist.HashStore(), 0, 1), **kwargs)
            buf._check_values = False   # as on a GPU device (validation reads no values there)
            buf._fast_path = True
            made.append(buf)
            return buf
        make.driver = ctypes.CDLL(lib)   # its counters (see _FAKE_DRIVER)
        try:
            yield make
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)


def median_us(fn: Callable[[], object], calls: int, rounds: int = 3) -> float:
    """The lowest of `rounds` medians over `calls` calls (the machine is shared: other work only adds)."""
    for _ in range(20):
        fn()
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        medians.append(statistics.median(times))
    return min(medians) / 1e3


def calls_of(make) -> Dict[str, Dict[str, Callable[[], object]]]:
    """For each profiled call: the whole Buffer call and its layers, ready to time."""
    from epcomm import Config, validate
    from epcomm.backend import IntranodeHandle
    from epcomm.ops import intranode, low_latency
    from bench.intranode import fp8_cast

    normal = make(num_nvl_bytes=10 ** 9 // 128 * 128)
    gb = normal._backend
    x = torch.randn(N, H).bfloat16()
    x8 = fp8_cast(x)
    chunks = 2 * SMS   # any positive count: the host path does not depend on it
    i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32)
    handle = validate.owned_handle(
        IntranodeHandle(i32(1, 1), i32(1, chunks + 1), i32(1, chunks + 1), i32(N), torch.ones(N, 1, dtype=torch.bool),
                        i32(N, 1)), normal._handle_owner)
    recv_w = torch.rand(N, K)
    config = Config(SMS)
    ll = make(num_rdma_bytes=normal.get_low_latency_rdma_size_hint(T, H, 1, E_LL), low_latency_mode=True)
    lb = ll._backend
    xl = torch.randn(T, H).bfloat16()
    ti = torch.randn(T, E_LL).abs().topk(K, dim=1).indices
    tw = torch.rand(T, K)
    recv, _, ll_handle, _, _ = ll.low_latency_dispatch(xl, ti, T, E_LL, use_fp8=True)
    expert_out = torch.randn(E_LL, T, H).bfloat16()
    del recv
    ll_ops = lb._low_latency()
    poison = gb._poisoned()
    bound = poison.prepared(x, recv_w)
    out = {
        "intranode FP8 cached dispatch": {
            "Buffer call": lambda: normal.dispatch(x8, handle=handle, config=config),
            "GpuBackend call": lambda: gb.dispatch(x8[0], x8[1], handle, None, None, None, None, None, None, 1, 0, config),
            "ops module": lambda: intranode.dispatch(gb, x8[0], x8[1], handle, None, None, None, None, None, None, 1,
                                                     0, config),
        },
        "intranode combine": {
            "Buffer call": lambda: normal.combine(x, handle, topk_weights=recv_w, config=config),
            "GpuBackend call": lambda: gb.combine(x, handle, recv_w, (None, None), config),
            "ops module": lambda: intranode.combine(gb, x, handle, recv_w, (None, None), config),
        },
        "low-latency dispatch": {
            "Buffer call": lambda: ll.low_latency_dispatch(xl, ti, T, E_LL, use_fp8=True),
            "GpuBackend call": lambda: lb.low_latency_dispatch(xl, ti, T, E_LL, None, None, True, False, False, False),
            "ops module": lambda: ll_ops.dispatch(xl, ti, T, E_LL, None, None, True, False, False, False),
        },
        "low-latency combine": {
            "Buffer call": lambda: ll.low_latency_combine(expert_out, ti, tw, ll_handle),
            "GpuBackend call": lambda: lb.low_latency_combine(expert_out, ti, tw, ll_handle, False, False, False, None,
                                                              None),
            "ops module": lambda: ll_ops.combine(expert_out, ti, tw, ll_handle, False, False, False, None, None),
        },
    }
    del low_latency
    for name, layers in out.items():   # the same Buffer call with the checks on every call
        buf = ll if name.startswith("low-latency") else normal
        whole = layers["Buffer call"]
        layers["Buffer call, checked in full"] = lambda buf=buf, whole=whole: _checked_in_full(buf, whole)
    return out, (poison._kernel, bound), poison, (x, recv_w)


def _checked_in_full(buf, call):
    buf._fast_path = False
    try:
        return call()
    finally:
        buf._fast_path = True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.host_model", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true", help="cProfile's 15 largest own times per call")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with model() as make:
        calls, (kernel, bound), poison, (x, recv_w) = calls_of(make)
        print(f"host path on this CPU (stand-in driver), median us of {args.calls} calls")
        grid, block, params = (1, 1, 1), (1024, 1, 1), bound.params
        print(f"  Kernel.launch: {median_us(lambda: kernel.launch(grid, block, params, 0x5000), args.calls):.2f}, "
              f"a bound launch (Kernel.launcher): {median_us(lambda: bound(0x5000), args.calls):.2f}")
        print(f"  poison launch (poison.after, 2 outputs): "
              f"{median_us(lambda: poison.after(x, recv_w), args.calls):.2f}")
        print(f"  torch.empty [{N}, {H}] bf16: "
              f"{median_us(lambda: torch.empty((N, H), dtype=torch.bfloat16, device=CPU), args.calls):.2f}")
        for name, layers in calls.items():
            figures = ", ".join(f"{layer} {median_us(fn, args.calls):.2f}" for layer, fn in layers.items())
            print(f"{name}: {figures}")
            if args.profile:
                profiler = cProfile.Profile()
                fn = layers["Buffer call"]
                profiler.enable()
                for _ in range(args.calls):
                    fn()
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
                print(text.getvalue())


if __name__ == "__main__":
    main()
