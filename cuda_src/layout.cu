// Dispatch layout: tokens per rank, node and expert and is_token_in_rank from topk_idx, one thread
// per token (method: cuda_src/README.md). Host side: epcomm/ops/layout.py.
#include <cooperative_groups.h>

#include "common/arch.cuh"
#include "common/limits.cuh"

namespace epcomm {

struct LayoutParams {
    const void *topk_idx;            // [N, K] IndexT
    int *num_tokens_per_rank;        // [R]
    int *num_tokens_per_rdma_rank;   // [R / L]; unused when R == L (one node)
    int *num_tokens_per_expert;      // [E]
    bool *is_token_in_rank;          // [N, R]
    long long num_tokens;            // N
};

namespace layout {

template <int kBytes> struct VecOf;
template <> struct VecOf<4> { using type = int; };
template <> struct VecOf<8> { using type = int2; };
template <> struct VecOf<16> { using type = int4; };

// The K expert ids of one token, loaded kVec bytes at a time (topk_idx is read-only for the
// kernel); ids outside [0, E) become -1.
template <int K, int E, class IndexT, int kVec>
__device__ __forceinline__ void load_experts(const IndexT *row, int (&experts)[K]) {
    constexpr int kBytes = K * static_cast<int>(sizeof(IndexT));
    static_assert(kBytes % kVec == 0, "the load width must divide the row");
    using Vec = typename VecOf<kVec>::type;
    Vec raw[kBytes / kVec];
#pragma unroll
    for (int i = 0; i < kBytes / kVec; ++i) raw[i] = __ldg(reinterpret_cast<const Vec *>(row) + i);
    IndexT ids[K];
    memcpy(ids, raw, kBytes);
#pragma unroll
    for (int k = 0; k < K; ++k) experts[k] = ids[k] >= 0 && ids[k] < E ? static_cast<int>(ids[k]) : -1;
}

// Bytes (0/1) of `bits` (its low U bits), as the 32-bit words of a U-byte store.
__device__ __forceinline__ uint32_t bits_to_bytes4(uint32_t bits) { return (bits * 0x00204081u) & 0x01010101u; }

template <int U> struct RowStore;  // U = bytes per store, U divides 64
template <> struct RowStore<1> {
    __device__ static void put(bool *dst, uint64_t bits) { *reinterpret_cast<uint8_t *>(dst) = bits & 1; }
};
template <> struct RowStore<2> {
    __device__ static void put(bool *dst, uint64_t bits) {
        *reinterpret_cast<uint16_t *>(dst) = static_cast<uint16_t>(bits_to_bytes4(bits & 3));
    }
};
template <> struct RowStore<4> {
    __device__ static void put(bool *dst, uint64_t bits) { *reinterpret_cast<uint32_t *>(dst) = bits_to_bytes4(bits & 15); }
};
template <> struct RowStore<8> {
    __device__ static void put(bool *dst, uint64_t bits) {
        *reinterpret_cast<int2 *>(dst) = make_int2(bits_to_bytes4(bits & 15), bits_to_bytes4((bits >> 4) & 15));
    }
};
template <> struct RowStore<16> {
    __device__ static void put(bool *dst, uint64_t bits) {
        *reinterpret_cast<int4 *>(dst) = make_int4(bits_to_bytes4(bits & 15), bits_to_bytes4((bits >> 4) & 15),
                                                   bits_to_bytes4((bits >> 8) & 15), bits_to_bytes4((bits >> 12) & 15));
    }
};

// Widest store (<= 16 bytes) that divides a row of R bytes, so row starts stay aligned.
template <int R> constexpr int kRowStoreBytes = R % 16 == 0 ? 16 : R % 8 == 0 ? 8 : R % 4 == 0 ? 4 : R % 2 == 0 ? 2 : 1;

// Adds, per warp, how many of its lanes have bit b set in `mask`, for b < kBits, to counts[b].
template <int kBits, int kWords>
__device__ __forceinline__ void count_bits_per_warp(const uint64_t (&mask)[kWords], int *counts, int lane) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
#pragma unroll
        for (int b = 0; b < 64; ++b) {
            const int bit = w * 64 + b;
            if (bit < kBits) {
                const unsigned voters = __ballot_sync(0xffffffffu, (mask[w] >> b) & 1);
                if (voters != 0 && lane == (bit & 31)) atomicAdd(counts + bit, __popc(voters));
            }
        }
    }
}

__device__ __forceinline__ void flush(int *out, int value, bool direct) {
    if (direct)
        *out = value;
    else if (value != 0)
        atomicAdd(out, value);
}

}  // namespace layout

// Dynamic shared memory: 4 * (E + R + R / L) bytes (epcomm.ops.layout computes the same).
template <int K, int E, int R, int L, class IndexT, int kVec, int kThreads>
__global__ void __launch_bounds__(kThreads) layout_kernel(const __grid_constant__ LayoutParams p) {
    static_assert(E % R == 0 && R % L == 0, "experts split evenly over ranks, ranks over nodes");
    static_assert(kThreads % 32 == 0, "whole warps");
    constexpr int kExpertsPerRank = E / R;
    constexpr int kNodes = R / L;
    constexpr int kRankWords = (R + 63) / 64;
    constexpr int kNodeWords = (kNodes + 63) / 64;
    constexpr int kStore = layout::kRowStoreBytes<R>;

    extern __shared__ int smem[];
    int *expert_counts = smem;
    int *rank_counts = smem + E;
    int *node_counts = rank_counts + R;
    for (int i = threadIdx.x; i < E + R + kNodes; i += kThreads) smem[i] = 0;
    const bool direct = gridDim.x == 1;
    if (!direct && blockIdx.x == 0) {   // made visible to the other blocks by the grid sync below
        for (int i = threadIdx.x; i < E; i += kThreads) p.num_tokens_per_expert[i] = 0;
        for (int i = threadIdx.x; i < R; i += kThreads) p.num_tokens_per_rank[i] = 0;
        if constexpr (kNodes > 1)
            for (int i = threadIdx.x; i < kNodes; i += kThreads) p.num_tokens_per_rdma_rank[i] = 0;
    }
    __syncthreads();

    const int lane = lane_id();
    const long long n = p.num_tokens;
    const IndexT *topk = static_cast<const IndexT *>(p.topk_idx);
    for (long long base = static_cast<long long>(blockIdx.x) * kThreads; base < n;
         base += static_cast<long long>(gridDim.x) * kThreads) {
        const long long token = base + threadIdx.x;
        uint64_t rank_mask[kRankWords], node_mask[kNodeWords];
#pragma unroll
        for (int w = 0; w < kRankWords; ++w) rank_mask[w] = 0;
#pragma unroll
        for (int w = 0; w < kNodeWords; ++w) node_mask[w] = 0;
        if (token < n) {
            int experts[K];
            layout::load_experts<K, E, IndexT, kVec>(topk + token * K, experts);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int e = experts[k];
                if (e < 0) continue;
                atomicAdd(expert_counts + e, 1);
                const int rank = e / kExpertsPerRank, node = rank / L;
                // Word index as a compile-time loop so the masks stay in registers.
#pragma unroll
                for (int w = 0; w < kRankWords; ++w) rank_mask[w] |= (rank >> 6) == w ? 1ull << (rank & 63) : 0;
#pragma unroll
                for (int w = 0; w < kNodeWords; ++w) node_mask[w] |= (node >> 6) == w ? 1ull << (node & 63) : 0;
            }
            bool *row = p.is_token_in_rank + token * R;
#pragma unroll
            for (int g = 0; g < R / kStore; ++g)
                layout::RowStore<kStore>::put(row + g * kStore, rank_mask[g * kStore / 64] >> (g * kStore % 64));
        }
        layout::count_bits_per_warp<R>(rank_mask, rank_counts, lane);
        if constexpr (kNodes > 1) layout::count_bits_per_warp<kNodes>(node_mask, node_counts, lane);
    }
    __syncthreads();
    if (!direct) cooperative_groups::this_grid().sync();   // the zeroed counts, before any add

    for (int i = threadIdx.x; i < E; i += kThreads) layout::flush(p.num_tokens_per_expert + i, expert_counts[i], direct);
    for (int i = threadIdx.x; i < R; i += kThreads) layout::flush(p.num_tokens_per_rank + i, rank_counts[i], direct);
    if constexpr (kNodes > 1)
        for (int i = threadIdx.x; i < kNodes; i += kThreads)
            layout::flush(p.num_tokens_per_rdma_rank + i, node_counts[i], direct);
}

}  // namespace epcomm
