"""One bf16 NaN everywhere: the oracle (and so the CPU backend) rounds every NaN to
oracle.BF16_NAN_BITS, the value cuda_src/common/bf16.cuh declares for the kernels' rounding
(tests/gpu/test_bf16_gpu.py checks the kernels' rounding against torch on the GPU)."""
import re
import struct

import torch

from epcomm.reference import oracle
from epcomm.runtime import compiler


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


NANS = [_f32(b) for b in (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF)]


def _bits(t: torch.Tensor):
    return [v & 0xFFFF for v in t.view(torch.int16).flatten().tolist()]


def test_every_nan_rounds_to_the_one_pattern():
    acc = torch.tensor(NANS, dtype=torch.float32)
    assert _bits(oracle.to_bf16(acc)) == [oracle.BF16_NAN_BITS] * len(NANS)
    assert _bits(oracle.to_bf16(acc[1])) == [oracle.BF16_NAN_BITS]   # 0-d: torch's scalar path


def test_other_values_round_as_torch_does():
    gen = torch.Generator().manual_seed(0)
    specials = [0.0, -0.0, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38, 1e-40, -1e-45,
                _f32(0x3F808000), _f32(0x3F818000), _f32(0x3F80FFFF)]   # ties to even, just below
    acc = torch.cat([torch.randn(4096, generator=gen) * 1e3, torch.tensor(specials)])
    assert _bits(oracle.to_bf16(acc)) == _bits(acc.to(torch.bfloat16))


def test_combines_return_the_pattern_for_a_nan_row():
    rows = torch.ones(2, 16, dtype=torch.bfloat16)
    rows.view(torch.int16)[0, 3] = -1   # 0xffff: a negative NaN
    in_rank = torch.ones(2, 1, dtype=torch.bool)
    out, _ = oracle.combine([rows], [in_rank], 0)
    assert _bits(out[0, 3:4]) == [oracle.BF16_NAN_BITS]
    assert not out[1].isnan().any() and not out[0, :3].isnan().any()


def test_kernels_declare_the_same_nan():
    text = (compiler.cuda_src_dir() / "common" / "bf16.cuh").read_text()
    declared = re.search(r"constexpr uint32_t kBf16NaN = (0x[0-9a-fA-F]+)u;", text)
    assert declared is not None, "common/bf16.cuh declares kBf16NaN"
    assert int(declared.group(1), 16) == oracle.BF16_NAN_BITS
    assert "return kBf16NaN;" in text, "bf16_bits returns kBf16NaN for NaN"
