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

// Every NaN rounds to this one, whatever its sign and payload: what torch's .to(torch.bfloat16)
// gives on a CUDA device (CUDA's canonical NaN); epcomm.reference.oracle.BF16_NAN_BITS is the same.
constexpr uint32_t kBf16NaN = 0x7fffu;

// fp32 -> bf16 bits, round to nearest even.
__device__ __forceinline__ uint32_t bf16_bits(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return kBf16NaN;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Eight fp32 sums rounded to bf16 and packed into one 16-byte unit, in channel order.
__device__ __forceinline__ int4 pack_bf16x8(const float *acc) {
    int4 out;
    out.x = static_cast<int>(bf16_bits(acc[0]) | (bf16_bits(acc[1]) << 16));
    out.y = static_cast<int>(bf16_bits(acc[2]) | (bf16_bits(acc[3]) << 16));
    out.z = static_cast<int>(bf16_bits(acc[4]) | (bf16_bits(acc[5]) << 16));
    out.w = static_cast<int>(bf16_bits(acc[6]) | (bf16_bits(acc[7]) << 16));
    return out;
}

// Channel order of an fp32 row of partial sums (the low-latency and internode combines). A thread
// sums a chunk of 8 channels and writes its 32 bytes as two 16-byte halves: channels 8c..8c+3 go
// to unit c, 8c+4..8c+7 to unit kChunks + c, so each of a warp's two store instructions covers 512
// contiguous bytes (whole sectors); a store to a peer crosses NVLink sector by sector.
template <int kChunks> struct PartialLayout {
    static constexpr long long kBytes = 32ll * kChunks;
    __device__ static int4 *lo(char *row, int c) { return reinterpret_cast<int4 *>(row) + c; }
    __device__ static int4 *hi(char *row, int c) { return reinterpret_cast<int4 *>(row) + kChunks + c; }
    __device__ static const int4 *lo(const char *row, int c) { return reinterpret_cast<const int4 *>(row) + c; }
    __device__ static const int4 *hi(const char *row, int c) { return reinterpret_cast<const int4 *>(row) + kChunks + c; }
};

}  // namespace epcomm
