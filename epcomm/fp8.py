"""FP8 helpers next to epcomm's FP8 outputs: the per-token e4m3 cast the kernels do, and its inverse.

    x_fp8, scales = epcomm.fp8.per_token_cast(x)                  # [..., H] e4m3, [..., H/128] f32
    x_fp8, packed = epcomm.fp8.per_token_cast(x, round_scale=True, use_ue8m0=True)  # int32 [..., H/512]
    y = epcomm.fp8.per_token_cast_back(x_fp8, scales)             # bf16 [..., H]

One scale per token per 128 channels: amax = max(|x|, 1e-4) over the group, scale = amax / 448
(round_scale: rounded up to a power of two; use_ue8m0: those powers packed as exponent bytes, four
per int32, as low_latency_dispatch returns them). The values are bit for bit what the low-latency
dispatch kernel writes for the same BF16 input (the definition lives in epcomm.reference.oracle,
the GPU tests' reference; tests/gpu/test_fp8_gpu.py compares the two on the GPU). Works on CPU and
CUDA tensors of any leading shape; scales come back row-major (the kernels accept any strides).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .reference import oracle

__all__ = ["per_token_cast", "per_token_cast_back", "CHANNELS_PER_SCALE"]

CHANNELS_PER_SCALE = oracle.CHANNELS_PER_SCALE


def per_token_cast(x: torch.Tensor, round_scale: bool = False,
                   use_ue8m0: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] floating (BF16 as the kernels read it), H % 128 == 0 ->
    (float8_e4m3fn [..., H], float32 scales [..., H/128], or with use_ue8m0 int32 [..., ceil(H/512)])."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"per_token_cast: x must be a floating tensor [..., H], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if x.shape[-1] % CHANNELS_PER_SCALE:
        raise ValueError(f"per_token_cast: the last dimension ({x.shape[-1]}) must be a multiple of "
                         f"{CHANNELS_PER_SCALE} (one scale per 128 channels)")
    if use_ue8m0 and not round_scale:
        raise ValueError("per_token_cast: use_ue8m0 needs round_scale=True (UE8M0 holds powers of two only)")
    lead, hidden = x.shape[:-1], x.shape[-1]
    values, scales = oracle.fp8_cast(x.reshape(-1, hidden), round_scale, use_ue8m0)
    return values.reshape(*lead, hidden), scales.reshape(*lead, scales.shape[-1])


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of per_token_cast: e4m3 [..., H] times its scales (float32 [..., H/128], or packed
    UE8M0 int32 [..., ceil(H/512)]), in fp32, then rounded to `dtype`. Scales may have any strides
    (the column-major ones low_latency_dispatch returns included)."""
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype != torch.float8_e4m3fn or x_fp8.dim() < 1:
        raise TypeError(f"per_token_cast_back: x_fp8 must be a float8_e4m3fn tensor [..., H], got "
                        f"{getattr(x_fp8, 'dtype', type(x_fp8).__name__)}")
    hidden = x_fp8.shape[-1]
    if hidden % CHANNELS_PER_SCALE:
        raise ValueError(f"per_token_cast_back: the last dimension ({hidden}) must be a multiple of "
                         f"{CHANNELS_PER_SCALE}")
    num_scales = hidden // CHANNELS_PER_SCALE
    if scales.dtype == torch.int32:
        want = -(-num_scales // 4)
        if scales.shape != (*x_fp8.shape[:-1], want):
            raise ValueError(f"per_token_cast_back: packed UE8M0 scales must be {(*x_fp8.shape[:-1], want)} "
                             f"int32, got {tuple(scales.shape)}")
        scales = oracle.unpack_ue8m0(scales, num_scales)
    elif scales.dtype != torch.float32 or scales.shape != (*x_fp8.shape[:-1], num_scales):
        raise ValueError(f"per_token_cast_back: scales must be float32 {(*x_fp8.shape[:-1], num_scales)} "
                         f"(or packed UE8M0 int32), got {scales.dtype} {tuple(scales.shape)}")
    if scales.device != x_fp8.device:
        raise ValueError(f"per_token_cast_back: scales are on {scales.device}, x_fp8 on {x_fp8.device}")
    return oracle.fp8_dequant(x_fp8, scales).to(dtype)
