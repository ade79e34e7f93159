"""GPU: module loading and launches (plain, dynamic smem, cooperative, from a thread with
no current context), the Params size check, and arch.cuh's warp copy on both feature sets.
Run under torchrun (`make test-gpu`); each rank tests its own GPU and all ranks agree on the
verdict. Launch overhead is printed (run with -s to see it)."""
from __future__ import annotations

import ctypes
import tempfile
import threading
import time

import pytest

from tests.conftest import on_all_ranks
from tests.helpers.kernels import cuda_src_with

from epcomm.errors import EpcommError
from epcomm.runtime import compiler
from epcomm.runtime.compiler import KernelSource

pytestmark = pytest.mark.gpu

PROBE = r"""
#include <cooperative_groups.h>
#include "common/arch.cuh"
namespace epcomm {
struct FillParams { int *out; long long n; int value; };
template <int kAdd>
__global__ void fill(const __grid_constant__ FillParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x)
        p.out[i] = p.value + kAdd + kFeature;
}
// Uses all of its dynamic shared memory, so a launch above 48 KiB needs set_max_dynamic_smem.
__global__ void smem_sum(const __grid_constant__ FillParams p) {
    extern __shared__ int buf[];
    for (int i = threadIdx.x; i < p.n; i += blockDim.x) buf[i] = i;
    __syncthreads();
    if (threadIdx.x == 0) { long long s = 0; for (int i = 0; i < p.n; ++i) s += buf[i]; p.out[0] = (int)s; }
}
// Every block adds 1, the grid syncs, then block 0 reads the total: needs co-residency.
__global__ void grid_count(const __grid_constant__ FillParams p) {
    if (threadIdx.x == 0) atomicAdd(p.out, 1);
    cooperative_groups::this_grid().sync();
    if (blockIdx.x == 0 && threadIdx.x == 0) p.out[1] = atomicAdd(p.out, 0);
}
struct RowParams { int4 *dst; const int4 *src; int rows; int row_bytes; };
__global__ void copy16(const __grid_constant__ RowParams p) {
    if (blockIdx.x == 0 && warp_id() == 0)
        warp_copy(p.dst, p.rows * p.row_bytes / 16, lane_id(), [&](int i) { return p.src[i]; });
}
}
"""
SRC = KernelSource("probe.cu", ("epcomm::fill<5>", "epcomm::smem_sum", "epcomm::grid_count",
                                "epcomm::copy16"))


class FillParams(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("n", ctypes.c_longlong), ("value", ctypes.c_int)]


class RowParams(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("rows", ctypes.c_int),
                ("row_bytes", ctypes.c_int)]


@pytest.fixture(scope="module")
def probe():
    with tempfile.TemporaryDirectory() as tmp, compiler.cuda_src_override(cuda_src_with(tmp, "probe.cu", PROBE)):
        yield




def kernel(name, dist_env, feature=None):
    from epcomm.runtime.module import get_kernel
    return get_kernel(SRC, name, dist_env.device.index, feature)


def stream():
    import torch
    return torch.cuda.current_stream().cuda_stream


def test_launch_fill_and_attributes(dist_env, probe):
    import torch
    from epcomm.runtime.arch import device_arch

    def check():
        k = kernel("epcomm::fill<5>", dist_env)
        assert k is kernel(0, dist_env), "get_kernel is memoised by index and by name"
        out = torch.zeros(100_003, dtype=torch.int32, device=dist_env.device)
        params = FillParams(out.data_ptr(), out.numel(), 7)
        k.launch((8, 1, 1), (128, 1, 1), params, stream())
        torch.cuda.synchronize()
        assert (out == 7 + 5 + device_arch(dist_env.device.index).feature).all()
        assert 0 < k.num_regs <= 255 and k.max_threads_per_block >= 128 and k.local_bytes == 0
        n, handle = 2000, stream()
        raw_stream = torch._C._cuda_getCurrentRawStream
        t0 = time.perf_counter()
        for _ in range(n):
            k.launch((1, 1, 1), (32, 1, 1), params, handle)
        t1 = time.perf_counter()
        for _ in range(n):
            k.launch((1, 1, 1), (32, 1, 1), params, raw_stream(dist_env.device.index))
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"\nKernel.launch from Python: {(t1 - t0) / n * 1e6:.2f} us per launch; "
              f"{(t2 - t1) / n * 1e6:.2f} us with torch._C._cuda_getCurrentRawStream per launch")
    on_all_ranks(dist_env, check)


def test_wrong_params_class_is_refused(dist_env, probe):
    def check():
        with pytest.raises(TypeError, match="Params"):
            kernel("epcomm::fill<5>", dist_env).launch((1, 1, 1), (32, 1, 1), RowParams(), stream())
    on_all_ranks(dist_env, check)


def test_dynamic_smem_above_48k_needs_the_attribute(dist_env, probe):
    import torch

    def check():
        k = kernel("epcomm::smem_sum", dist_env)
        n = 30_000                                  # 120 KB of ints
        out = torch.zeros(1, dtype=torch.int32, device=dist_env.device)
        params = FillParams(out.data_ptr(), n, 0)
        with pytest.raises(EpcommError, match="smem_sum"):
            k.launch((1, 1, 1), (256, 1, 1), params, stream(), smem=4 * n)
        k.set_max_dynamic_smem(4 * n)
        k.launch((1, 1, 1), (256, 1, 1), params, stream(), smem=4 * n)
        torch.cuda.synchronize()
        assert out.item() == n * (n - 1) // 2
    on_all_ranks(dist_env, check)


def test_cooperative_launch(dist_env, probe):
    """A grid-syncing kernel launched cooperatively counts every block; one block more than can be
    co-resident is refused before launch. The grid fills this rank's share of the SMs only when no
    other process uses the GPU: MPS caps a process's SMs but reserves none, so such a grid waits
    until every SM of its share is idle, and beside another job whose ranks spin for each other
    that wait and theirs can hold each other up until their bound (EPCOMM_TIMEOUT_S) runs out.
    Beside other processes it syncs 2 blocks; the whole share is tested with the GPU to itself
    (task `alone1` of .ci/gpu-plan.example)."""
    import torch
    whole_share = not dist_env.shared_gpu

    def check():
        k = kernel("epcomm::grid_count", dist_env)
        most = k.max_active_blocks_per_sm(128) * k.num_sms
        blocks = most if whole_share else min(2, most)
        out = torch.zeros(2, dtype=torch.int32, device=dist_env.device)
        k.launch((blocks, 1, 1), (128, 1, 1), FillParams(out.data_ptr(), 0, 0), stream(),
                 cooperative=True)
        torch.cuda.synchronize()
        assert out.tolist() == [blocks, blocks]
        with pytest.raises(EpcommError, match="co-resident"):
            k.launch((most + 1, 1, 1), (128, 1, 1), FillParams(out.data_ptr(), 0, 0), stream(),
                     cooperative=True)
    on_all_ranks(dist_env, check)


def test_launch_from_a_thread_without_a_current_context(dist_env, probe):
    import torch

    def check():
        k = kernel("epcomm::fill<5>", dist_env)
        out = torch.zeros(1000, dtype=torch.int32, device=dist_env.device)
        handle, errors = stream(), []

        def worker():
            try:
                k.launch((1, 1, 1), (256, 1, 1), FillParams(out.data_ptr(), 1000, 1), handle)
            except Exception as e:
                errors.append(e)
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert not errors, errors
        torch.cuda.synchronize()
        assert (out > 1).all()
    on_all_ranks(dist_env, check)


def test_warp_copy_on_both_feature_sets(dist_env, probe):
    import torch
    from epcomm.runtime.arch import device_arch
    features = [80, 90] if device_arch(dist_env.device.index).cc >= 90 else [80]

    def check():
        rows, row_bytes = 1000, 4096
        src = torch.randint(-2**31, 2**31 - 1, (rows, row_bytes // 4), dtype=torch.int32,
                            device=dist_env.device)
        for feature in features:
            dst = torch.zeros_like(src)
            kernel("epcomm::copy16", dist_env, feature).launch((16, 1, 1), (128, 1, 1),
                                                  RowParams(dst.data_ptr(), src.data_ptr(), rows,
                                                            row_bytes), stream())
            torch.cuda.synchronize()
            assert torch.equal(dst, src), f"warp_copy with feature set {feature}"
    on_all_ranks(dist_env, check)
