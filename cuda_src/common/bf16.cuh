// bf16 <-> fp32 on raw bits (no cuda_bf16.h needed), shared by every combine.
#pragma once
#include <cuda/std/cstdint>

namespace epcomm {

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Eight bf16 values (one 16-byte unit) added into fp32 accumulators, in channel order.
__device__ __forceinline__ void add_bf16x8(float *acc, const int4 &v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                           static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        acc[2 * q] += bf16_lo(w[q]);
        acc[2 * q + 1] += bf16_hi(w[q]);
    }
}

}  // namespace epcomm
