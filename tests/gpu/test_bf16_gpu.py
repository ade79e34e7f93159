"""GPU: the kernels' bf16 rounding (cuda_src/common/bf16.cuh bf16_bits / pack_bf16x8) gives the
bits torch's .to(torch.bfloat16) gives on the same GPU, NaNs included, and that NaN is the oracle's
BF16_NAN_BITS. Collective: every rank checks its own GPU."""
from __future__ import annotations

import ctypes
import struct

import pytest

from tests.conftest import on_all_ranks
from tests.helpers.kernels import cuda_src_with

from epcomm.reference import oracle
from epcomm.runtime import compiler
from epcomm.runtime.compiler import KernelSource

pytestmark = pytest.mark.gpu

PROBE = r"""
#include "common/bf16.cuh"
namespace epcomm {
struct RoundParams { const float *in; int4 *out; int units; };
// Unit i: the eight floats in[8i .. 8i+7] rounded and packed, as every combine stores its sums.
__global__ void round_bf16x8(const __grid_constant__ RoundParams p) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.units; i += gridDim.x * blockDim.x)
        p.out[i] = pack_bf16x8(p.in + 8 * i);
}
}
"""
SRC = KernelSource("bf16_probe.cu", ("epcomm::round_bf16x8",))


class RoundParams(ctypes.Structure):
    _fields_ = [("in_", ctypes.c_void_p), ("out", ctypes.c_void_p), ("units", ctypes.c_int)]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    with compiler.cuda_src_override(cuda_src_with(str(tmp_path_factory.mktemp("bf16")), "bf16_probe.cu", PROBE)):
        yield


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def test_bf16_rounding_matches_torch_on_the_gpu(dist_env, probe):
    import torch
    from epcomm.runtime.module import get_kernel

    def check():
        gen = torch.Generator().manual_seed(dist_env.rank)
        specials = [_f32(b) for b in (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF,
                                      0xFFFFFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00000001,
                                      0x807FFFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000)]
        values = torch.cat([torch.randn(8 * 4096 - len(specials), generator=gen) * 1e3,
                            torch.tensor(specials, dtype=torch.float32)]).to(dist_env.device)
        out = torch.zeros(values.numel(), dtype=torch.bfloat16, device=dist_env.device)
        kernel = get_kernel(SRC, "epcomm::round_bf16x8", dist_env.device.index)
        kernel.launch((16, 1, 1), (256, 1, 1), RoundParams(values.data_ptr(), out.data_ptr(), values.numel() // 8),
                      torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        want = values.to(torch.bfloat16)
        assert torch.equal(out.view(torch.int16).cpu(), want.view(torch.int16).cpu())
        nan_bits = want.view(torch.int16)[values.isnan()].cpu() & 0xFFFF
        assert nan_bits.numel() == 6 and (nan_bits == oracle.BF16_NAN_BITS).all(), nan_bits
    on_all_ranks(dist_env, check)
