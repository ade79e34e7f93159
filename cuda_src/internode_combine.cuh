// Internode combine, device side: push rows over NVLink to the RDMA peer of their source, reduce
// per node in fp32, put the partial sums over RDMA, sum the nodes at the source. Protocol:
// cuda_src/README.md.
#pragma once
#include "internode_protocol.cuh"

namespace epcomm {
namespace internode {

template <int kRanks, int kLocal, int kRowInt4>
struct Combine {
    static constexpr int kNodes = kRanks / kLocal;
    static constexpr int kRowBytes = kRowInt4 * 16;            // bf16 row
    static constexpr int kPartialRowBytes = 2 * kRowBytes;     // fp32 row, channels in PartialLayout order
    using Partial = PartialLayout<kRowInt4>;
    using H = Header<kRanks, kNodes>;

    // Pushed row: bf16 row | weights f32[kMaxTopk] | u64 tag; partial sum: fp32 row | weights
    // f32[kMaxTopk] | u64 tag. Both hold kMaxTopk weights whatever K is, so the tag sits at the same
    // place on every rank. Tag = mix(epoch) + K of the rank that wrote it: a pushed slot without
    // this call's mix was not pushed (the token does not go to that local rank); one with this
    // call's mix but another K (some ranks passed topk_weights, others not, or another K) is a
    // kPhaseConfigMismatch. The mix is 64-bit, not the epoch itself: the data region is shared with
    // notify and dispatch, whose small integers could otherwise sit where a tag is read (random
    // bytes land within kMaxTopk of it with probability ~2^-59).
    static constexpr long long kPushTag = kRowBytes + 4LL * kMaxTopk;
    static constexpr long long kPartialTag = kPartialRowBytes + 4LL * kMaxTopk;
    static __device__ __forceinline__ unsigned long long tag_of(unsigned long long epoch) { return mix_epoch(epoch); }
    // K of the writer of a tag from this call, or -1 (not written by this call).
    static __device__ __forceinline__ int tag_topk(unsigned long long tag, unsigned long long epoch) {
        const unsigned long long k = tag - tag_of(epoch);
        return k <= kMaxTopk ? static_cast<int>(k) : -1;
    }

    // Step 1: every received row goes to slot [this local rank][source node][record index] in the
    // buffer of its source's RDMA peer on this node. The last block to finish tells the local ranks.
    static __device__ void push(const CombineParams &p, char *const *peers, const Call &c) {
        const int node = c.node, local = c.local;
        const unsigned long long epoch = c.epoch;
        const int lane = lane_id(), k_top = p.num_topk;
        const int rows = __ldg(p.recv_gbl_rank_prefix_sum + kRanks - 1), num_warps = gridDim.x * kWarps;
        const long long cap = p.capacity;
        for (int r = blockIdx.x * kWarps + warp_id(); r < rows; r += num_warps) {
            const int s = __ldg(p.recv_src_meta + 3LL * r), i = __ldg(p.recv_src_meta + 3LL * r + 2);
            if (s < 0 || s >= kRanks || i < 0 || i >= cap) continue;   // never past the slots (fits_capacity)
            char *slot = peers[node * kLocal + s % kLocal] + p.push_offset +
                         ((long long)(local * kNodes + s / kLocal) * cap + i) * p.push_bytes;
            const int4 *row = reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + (long long)r * kRowBytes);
            warp_copy<4>(reinterpret_cast<int4 *>(slot), kRowInt4, lane, [&](int u) { return ld_nc_v4(row + u); });
            if (lane < k_top)
                reinterpret_cast<float *>(slot + kRowBytes)[lane] =
                    p.topk_weights != nullptr ? __ldg(p.topk_weights + (long long)r * k_top + lane) : 0.f;
            if (lane == 0) *reinterpret_cast<unsigned long long *>(slot + kPushTag) = tag_of(epoch) + k_top;
        }
        __syncthreads();
        if (threadIdx.x != 0) return;
        char *base = c.base;
        auto *ticket = reinterpret_cast<unsigned int *>(base + H::kPushTicket);
        fence_acq_rel_sys();   // this block's NVLink stores (ordered by the barrier) before its arrival
        if (atomicAdd(ticket, 1u) != gridDim.x - 1) return;
        fence_acq_rel_sys();
        *ticket = 0;
        for (int j = 0; j < kLocal; ++j)
            st_release_sys(signal_word(peers[node * kLocal + j], H::kPushDone, local), epoch);
    }

    // Step 2 (this rank as the RDMA peer of the sources (n, local)): per source node n, record i,
    // sum the pushed rows of local ranks 0..L-1 in that order in fp32, then put each chunk of
    // `chunk_records` partial sums to (n, local) with one signal (or, its buffer mapped, write them
    // there and release the signal). Blocks take (node, chunk) items.
    static __device__ void reduce(const CombineParams &p, char *const *peers, const Call &c) {
        const int lane = lane_id(), warp = warp_id(), k_top = p.num_topk, stride = p.num_chunks + 1;
        const int node = c.node, local = c.local;
        const unsigned long long epoch = c.epoch;
        const Guard &guard = c.guard;
        char *base = c.base;
        bool ok = true;
        if (warp == 0 && lane < kLocal)
            ok = wait_at_least(guard, signal_word(base, H::kPushDone, lane), epoch, node * kLocal + lane, kPhasePushes);
        if (!__syncthreads_and(ok)) return;
        const long long cap = p.capacity, pb = p.partial_bytes;
        const int chunks_per_node = (p.capacity + p.chunk_records - 1) / p.chunk_records;
        for (int item = blockIdx.x; item < kNodes * chunks_per_node; item += gridDim.x) {
            const int n = item / chunks_per_node, c = item % chunks_per_node;
            const int count = __ldg(p.recv_rdma_channel_prefix + (n * kLocal + local) * stride + p.num_chunks);
            // lo < capacity; hi never past it (count <= the source's N <= capacity: fits_capacity)
            const int lo = c * p.chunk_records, hi = min(min(count, lo + p.chunk_records), p.capacity);
            if (lo >= hi) continue;   // uniform over the block
            for (int i = lo + warp; i < hi; i += kWarps) {
                const char *slots[kLocal];
                unsigned present = 0;
#pragma unroll
                for (int j = 0; j < kLocal; ++j) {
                    slots[j] = base + p.push_offset + ((long long)(j * kNodes + n) * cap + i) * p.push_bytes;
                    const int k = tag_topk(ld_relaxed_sys(reinterpret_cast<const unsigned long long *>(slots[j] + kPushTag)), epoch);
                    if (k >= 0 && k != k_top && lane == 0) guard.violation(node * kLocal + j, kPhaseConfigMismatch);
                    present |= (k >= 0) << j;
                }
                char *holder = peers[n * kLocal + local];   // mapped: write the partial in place
                char *dst = holder != nullptr ? holder + p.partial_recv_offset + (node * cap + i) * pb
                                              : base + p.partial_stage_offset + (n * cap + i) * pb;
                for (int u = lane; u < kRowInt4; u += 32) {
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int j = 0; j < kLocal; ++j)
                        if (present >> j & 1u) add_bf16x8(acc, ld_cg_v4(slots[j] + 16 * u));
                    *reinterpret_cast<float4 *>(Partial::lo(dst, u)) = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    *reinterpret_cast<float4 *>(Partial::hi(dst, u)) = make_float4(acc[4], acc[5], acc[6], acc[7]);
                }
                if (lane < k_top) {
                    float w = 0.f;
                    for (int j = 0; j < kLocal; ++j)
                        if (present >> j & 1u) w += ld_cg(reinterpret_cast<const float *>(slots[j] + kRowBytes) + lane);
                    reinterpret_cast<float *>(dst + kPartialRowBytes)[lane] = w;
                }
                if (lane == 0) *reinterpret_cast<unsigned long long *>(dst + kPartialTag) = tag_of(epoch) + k_top;
            }
            __syncthreads();
            if (warp == 0) {
                char *holder = peers[n * kLocal + local];
                publish_run(base + p.partial_recv_offset + (node * cap + lo) * pb, base + p.partial_stage_offset + (n * cap + lo) * pb,
                            (size_t)(hi - lo) * pb,
                            signal_word(holder != nullptr ? holder : base, H::kPartialSignal, node * kMaxChunks + c),
                            epoch, n * kLocal + local, holder != nullptr);
            }
            __syncthreads();
        }
    }

    // Step 3 (this rank as the source): token t = bias0 + bias1 + the partial sums of the nodes it
    // reached, node ascending, in fp32; weights likewise (from 0).
    static __device__ void finish_tokens(const CombineParams &p, const Call &c) {
        char *base = c.base;
        const unsigned long long epoch = c.epoch;
        const Guard &guard = c.guard;
        const int lane = lane_id(), k_top = p.num_topk, num_warps = gridDim.x * kWarps;
        const long long cap = p.capacity, pb = p.partial_bytes;
        for (int t = blockIdx.x * kWarps + warp_id(); t < p.num_tokens; t += num_warps) {
            bool ok = true;
            for (int m = lane; m < kNodes && ok; m += 32) {
                const int i = __ldg(p.send_rdma_head + (long long)t * kNodes + m);
                if (i >= 0 && i < cap) {
                    ok = wait_at_least(guard, signal_word(base, H::kPartialSignal, m * kMaxChunks + i / p.chunk_records),
                                       epoch, m * kLocal + c.local, kPhasePartials);
                    const unsigned long long tag = __ldcg(reinterpret_cast<const unsigned long long *>(
                        base + p.partial_recv_offset + (m * cap + i) * pb + kPartialTag));
                    if (ok && tag_topk(tag, epoch) != k_top) guard.violation(m * kLocal + c.local, kPhaseConfigMismatch);
                }
            }
            if (!__all_sync(0xffffffffu, ok)) return;
            for (int u = lane; u < kRowInt4; u += 32) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                if (p.bias0 != nullptr) add_bf16x8(acc, __ldg(static_cast<const int4 *>(p.bias0) + (long long)t * kRowInt4 + u));
                if (p.bias1 != nullptr) add_bf16x8(acc, __ldg(static_cast<const int4 *>(p.bias1) + (long long)t * kRowInt4 + u));
                for (int m = 0; m < kNodes; ++m) {
                    const int i = __ldg(p.send_rdma_head + (long long)t * kNodes + m);
                    if (i < 0 || i >= cap) continue;
                    const char *partial = base + p.partial_recv_offset + (m * cap + i) * pb;
                    const int4 lo = ld_cg_v4(Partial::lo(partial, u)), hi = ld_cg_v4(Partial::hi(partial, u));
                    const int4 halves[2] = {lo, hi};
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        acc[4 * h] += __int_as_float(halves[h].x);
                        acc[4 * h + 1] += __int_as_float(halves[h].y);
                        acc[4 * h + 2] += __int_as_float(halves[h].z);
                        acc[4 * h + 3] += __int_as_float(halves[h].w);
                    }
                }
                static_cast<int4 *>(p.combined_x)[(long long)t * kRowInt4 + u] = pack_bf16x8(acc);
            }
            if (lane < k_top) {
                float w = 0.f;
                for (int m = 0; m < kNodes; ++m) {
                    const int i = __ldg(p.send_rdma_head + (long long)t * kNodes + m);
                    if (i >= 0 && i < cap) w += ld_cg(reinterpret_cast<const float *>(base + p.partial_recv_offset + (m * cap + i) * pb + kPartialRowBytes) + lane);
                }
                p.combined_weights[(long long)t * k_top + lane] = w;
            }
        }
    }
};

}  // namespace internode
}  // namespace epcomm
