// Dispatch message format and the per-message work of the low-latency dispatch kernel
// (cuda_src/low_latency.cu): the FP8 / BF16 cast of a token into shared memory, the
// shared-memory budget of the send part, and the receive-side copy into the packed layout.
#pragma once
#include "low_latency_protocol.cuh"

namespace epcomm {
namespace ll {

template <int kHidden, bool kFP8> struct Message {
    static constexpr int kScales = kFP8 ? kHidden / kScaleChannels : 0;
    static constexpr int kPayloadBytes = kFP8 ? kHidden : kHidden * 2;
    static constexpr int kBytes = kPayloadBytes + (kScales * 4 + 15) / 16 * 16;
};

// Casts token row `x_row` into `msg` (shared memory), by `threads` threads of which this is `tid`.
// FP8: amax over 16 lanes x 8 channels; the formulas are the oracle's (epcomm/reference/oracle.py
// fp8_cast), so the bytes match it exactly.
template <int kHidden, bool kFP8, bool kRoundScale>
__device__ void cast_token(const int4 *x_row, char *msg, int tid, int threads) {
    using M = Message<kHidden, kFP8>;
    constexpr int kChunks = kHidden / 8;
    const int lane = lane_id();
    for (int base = tid - lane; base < kChunks; base += threads) {   // warp-uniform trip count
        const int c = base + lane;
        const bool active = c < kChunks;
        const int4 v = active ? ld_nc_v4(x_row + c) : make_int4(0, 0, 0, 0);
        if constexpr (!kFP8) {
            if (active) reinterpret_cast<int4 *>(msg)[c] = v;
        } else {
            const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
            float f[8], amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                f[2 * i] = bf16_lo(w[i]);
                f[2 * i + 1] = bf16_hi(w[i]);
                amax = fmaxf(amax, fmaxf(fabsf(f[2 * i]), fabsf(f[2 * i + 1])));
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            amax = fmaxf(amax, kFp8AmaxFloor);
            float scale, scale_inv;
            if constexpr (kRoundScale) {   // 2^e with e = ceil(log2(amax / 448)), from the bits
                const uint32_t b = __float_as_uint(__fmul_rn(amax, kFp8MaxInv));
                const int e = static_cast<int>((b >> 23) & 0xffu) - 127 + ((b & 0x7fffffu) != 0);
                scale = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
                scale_inv = __uint_as_float(static_cast<uint32_t>(127 + e) << 23);
            } else {
                scale = __fdiv_rn(kFp8Max, amax);
                scale_inv = __fmul_rn(amax, kFp8MaxInv);
            }
            uint32_t q[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float g[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) g[j] = fminf(fmaxf(__fmul_rn(f[4 * i + j], scale), -kFp8Max), kFp8Max);
                q[i] = e4m3x2(g[0], g[1]) | (e4m3x2(g[2], g[3]) << 16);
            }
            if (active) {
                reinterpret_cast<uint2 *>(msg)[c] = make_uint2(q[0], q[1]);
                if ((lane & 15) == 0) reinterpret_cast<float *>(msg + M::kPayloadBytes)[c / 16] = scale_inv;
            }
        }
    }
}

// Most tokens a block casts at once (one group of warps each, the token's messages spread over
// the group), bounded so their messages fit kSmemBudget of shared memory. Mirrored by
// epcomm.ops.low_latency.dispatch_smem_bytes (checked by tests/test_low_latency_plan.py).
template <int kHidden, int kTopK, bool kFP8, int kThreads> struct DispatchShape {
    static constexpr int kSmemBudget = 96 * 1024;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kByWarps = kTopK < kWarps ? kWarps / kTopK : 1;
    static constexpr int kBySmem = kSmemBudget / Message<kHidden, kFP8>::kBytes;
    static constexpr int kTokensPerRound = kByWarps < kBySmem ? kByWarps : (kBySmem > 0 ? kBySmem : 1);
    static constexpr int kSmemBytes = kTokensPerRound * Message<kHidden, kFP8>::kBytes;
};


// Copies one received message (`msg`, in this rank's heap) into row `row` of local expert `el`:
// payload and scales are loaded in one batch (16 units per lane in flight), then stored; the scales
// go to column `row` of the column-major [E_l][S][R*T] (f32) or [E_l][S/4][R*T] (UE8M0 i32) array.
template <int kHidden, int kSlots, bool kFP8, bool kUE8M0>
__device__ __forceinline__ void copy_message(const char *msg, void *recv_x, void *recv_scales, int el, long long row,
                                             int lane) {
    using M = Message<kHidden, kFP8>;
    constexpr int kUnits = M::kBytes / 16, kPayloadUnits = M::kPayloadBytes / 16, kBatch = 16;
    int4 *dst = reinterpret_cast<int4 *>(static_cast<char *>(recv_x) + (static_cast<long long>(el) * kSlots + row) * M::kPayloadBytes);
    for (int base = 0; base < kUnits; base += kBatch * 32) {
        int4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = base + u * 32 + lane;
            if (i < kUnits) v[u] = ld_cg_v4(msg + 16 * i);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = base + u * 32 + lane;
            if (i < kPayloadUnits) {
                st_cg_v4(dst + i, v[u]);
            } else if (kFP8 && i < kUnits) {   // 4 scales per unit (the last one may hold padding)
                const int j = 4 * (i - kPayloadUnits);
                const uint32_t w[4] = {(uint32_t)v[u].x, (uint32_t)v[u].y, (uint32_t)v[u].z, (uint32_t)v[u].w};
                if constexpr (kUE8M0) {   // kScales % 4 == 0: one unit is one packed word
                    uint32_t word = 0;
#pragma unroll
                    for (int b = 0; b < 4; ++b) word |= ((w[b] >> 23) & 0xffu) << (8 * b);
                    static_cast<int *>(recv_scales)[(static_cast<long long>(el) * (M::kScales / 4) + j / 4) * kSlots + row] =
                        static_cast<int>(word);
                } else {
#pragma unroll
                    for (int b = 0; b < 4; ++b)
                        if (j + b < M::kScales)
                            static_cast<float *>(recv_scales)[(static_cast<long long>(el) * M::kScales + j + b) * kSlots + row] =
                                __uint_as_float(w[b]);
                }
            }
        }
    }
}

}  // namespace ll
}  // namespace epcomm
