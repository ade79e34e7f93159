"""epcomm.fp8: the public per-token FP8 cast and its inverse (CPU; tests/gpu/test_fp8_gpu.py compares
the cast with the low-latency kernel's output)."""
from __future__ import annotations

import pytest
import torch

import epcomm
from epcomm.fp8 import per_token_cast, per_token_cast_back


def _x(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.pow(10.0, torch.randint(-3, 4, shape[:-1], generator=gen)
                                                       .float())[..., None]
    return x.bfloat16()


def test_values_and_scales_bit_patterns():
    x = torch.zeros(1, 256)
    x[0, :128] = torch.linspace(-3.0, 3.0, 128)       # amax 3: scale 3/448, 3 -> 448 exactly
    values, scales = per_token_cast(x.bfloat16())
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales[0, 0].item() == (torch.tensor(3.0) * torch.tensor(1 / 448, dtype=torch.float32)).item()
    assert values[0, 127].float().item() == 448.0 and values[0, 0].float().item() == -448.0
    assert scales[0, 1].item() == pytest.approx(1e-4 / 448)   # an all-zero group: the 1e-4 floor
    assert (values[0, 128:].float() == 0).all()
    _, pow2 = per_token_cast(x.bfloat16(), round_scale=True)
    assert pow2[0, 0].item() == 2.0 ** -7                     # smallest power of two >= 3/448


def test_leading_dims_cast_like_rows():
    x = _x((3, 4, 512), seed=1)
    values, scales = per_token_cast(x)
    flat_v, flat_s = per_token_cast(x.reshape(12, 512))
    assert values.shape == (3, 4, 512) and scales.shape == (3, 4, 4)
    assert torch.equal(values.view(torch.uint8).reshape(12, 512), flat_v.view(torch.uint8))
    assert torch.equal(scales.reshape(12, 4), flat_s)


def test_ue8m0_packs_the_power_of_two_scales():
    x = _x((6, 128 * 7), seed=2)                           # 7 groups: the last word holds 3 bytes
    values, packed = per_token_cast(x, round_scale=True, use_ue8m0=True)
    plain_values, pow2 = per_token_cast(x, round_scale=True)
    assert packed.dtype == torch.int32 and packed.shape == (6, 2)
    assert torch.equal(values.view(torch.uint8), plain_values.view(torch.uint8))
    words = packed.long() & 0xFFFFFFFF
    for j in range(7):   # byte j % 4 of word j // 4 is group j's biased exponent; unused bytes 0
        byte = (words[:, j // 4] >> (8 * (j % 4))) & 0xFF
        assert torch.equal(byte, (pow2[:, j].view(torch.int32) >> 23).long() & 0xFF)
    assert ((words[:, 1] >> 24) == 0).all()
    assert torch.equal(per_token_cast_back(values, packed), per_token_cast_back(plain_values, pow2))


@pytest.mark.parametrize("round_scale", [False, True])
def test_cast_back_inverts_within_e4m3_precision(round_scale):
    x = _x((64, 1024), seed=3)
    values, scales = per_token_cast(x, round_scale=round_scale)
    back = per_token_cast_back(values, scales, dtype=torch.float32)
    step = scales.repeat_interleave(128, dim=-1)            # one e4m3 unit at exponent 0, times the scale
    bound = x.float().abs() / 16 + step * 2.0 ** -9         # half an ulp (3 mantissa bits), subnormals
    assert ((back - x.float()).abs() <= bound).all()
    col_major = scales.t().contiguous().t()                 # as low_latency_dispatch stores them
    assert torch.equal(per_token_cast_back(values, col_major), per_token_cast_back(values, scales))
    assert per_token_cast_back(values, scales).dtype == torch.bfloat16


def test_module_is_reachable_from_the_package():
    assert epcomm.fp8.per_token_cast is per_token_cast


def test_bad_input_raises():
    with pytest.raises(TypeError, match="floating"):
        per_token_cast(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 128"):
        per_token_cast(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="round_scale"):
        per_token_cast(torch.zeros(2, 128), use_ue8m0=True)
    values, scales = per_token_cast(torch.zeros(2, 256))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        per_token_cast_back(values.float(), scales)
    with pytest.raises(ValueError, match="scales must be float32"):
        per_token_cast_back(values, scales[:, :1])
    with pytest.raises(ValueError, match="packed UE8M0"):
        per_token_cast_back(values, torch.zeros(2, 3, dtype=torch.int32))
