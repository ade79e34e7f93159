// Internode dispatch, device side: the RDMA stage (records to the RDMA peer of each destination
// node) and the NVLink stage (local ranks pull their rows), padding. Protocol: cuda_src/README.md.
#pragma once
#include "internode_protocol.cuh"

namespace epcomm {
namespace internode {

template <int kRanks, int kLocal, int kRowInt4, int kScales, typename IdxT, bool kFresh>
struct Dispatch {
    static constexpr int kNodes = kRanks / kLocal;
    static constexpr int kRowBytes = kRowInt4 * 16;
    using H = Header<kRanks, kNodes>;

    // One warp writes token t's record for node m (row read from x; the metadata by lanes).
    static __device__ __forceinline__ void write_record(const DispatchParams &p, char *record, int t, int m,
                                                        const RecordFields &f) {
        const int lane = lane_id(), k_top = p.num_topk;
        const int4 *row = reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + (long long)t * kRowBytes);
        warp_copy<4>(reinterpret_cast<int4 *>(record), kRowInt4, lane, [&](int u) { return ld_nc_v4(row + u); });
        for (int s = lane; s < kScales; s += 32)
            reinterpret_cast<float *>(record + f.scales)[s] =
                __ldg(p.x_scales + t * p.scale_stride_token + s * p.scale_stride_group);
        if (kFresh && lane < k_top) {
            reinterpret_cast<int *>(record + f.topk)[lane] =
                static_cast<int>(__ldg(static_cast<const IdxT *>(p.topk_idx) + (long long)t * k_top + lane));
            reinterpret_cast<float *>(record + f.weights)[lane] =
                p.topk_weights != nullptr ? __ldg(p.topk_weights + (long long)t * k_top + lane) : 0.f;
        }
        if (lane == 0) reinterpret_cast<int *>(record + f.src)[0] = t;
        for (int j = lane; j < kLocal; j += 32)
            reinterpret_cast<int *>(record + f.pos)[j] = __ldg(p.send_nvl_head + (long long)t * kRanks + m * kLocal + j);
    }

    // RDMA stage. Block b packs token chunks b, b + B, ...: each token once per destination node it
    // reaches, at its index among the tokens this rank sends to that node (send_rdma_head). Records
    // go straight to the receive slots of the RDMA peer when its buffer is mapped here (this rank's
    // own node; other nodes with allow_mnnvl, whose peers entries are otherwise null); the others
    // to the stage, then one put-with-signal per (node, chunk) moves the chunk's contiguous run.
    // (A put is one warp's copy when NVSHMEM's transport is P2P: slow for MB-sized runs.)
    static __device__ void send(const DispatchParams &p, char *const *peers, const Call &c) {
        char *base = c.base;
        const int node = c.node, local = c.local;
        const unsigned long long epoch = c.epoch;
        const int lane = lane_id(), warp = warp_id(), n = p.num_tokens, tpc = p.tokens_per_chunk;
        const int stride = p.num_chunks + 1;
        const long long rec = p.record_bytes, cap = p.capacity;
        const RecordFields f(kRowBytes, kScales, p.num_topk);
        for (int g = blockIdx.x; g < p.num_chunks; g += gridDim.x) {
            const int t0 = min(g * tpc, n), t1 = min(t0 + tpc, n);
            for (int t = t0 + warp; t < t1; t += kWarps) {
                for (int m = 0; m < kNodes; ++m) {
                    const int i = __ldg(p.send_rdma_head + (long long)t * kNodes + m);
                    if (i < 0 || i >= cap) continue;   // i < N <= capacity (fits_capacity); never past the slots
                    char *holder = peers[m * kLocal + local];   // this rank itself when m == node
                    char *record = holder != nullptr ? holder + p.recv_offset + (node * cap + i) * rec
                                                     : base + p.stage_offset + (m * cap + i) * rec;
                    write_record(p, record, t, m, f);
                }
            }
            __syncthreads();
            for (int m = warp; m < kNodes; m += kWarps) {
                const int lo = min((long long)__ldg(p.rdma_channel_prefix + m * stride + g), cap);
                const int hi = min((long long)__ldg(p.rdma_channel_prefix + m * stride + g + 1), cap);
                // On the receiver: slot [this node][lo..hi), signal [this node][g].
                char *holder = peers[m * kLocal + local];
                publish_run(base + p.recv_offset + (node * cap + lo) * rec, base + p.stage_offset + (m * cap + lo) * rec,
                            (size_t)(hi - lo) * rec,
                            signal_word(holder != nullptr ? holder : base, H::kRecordSignal, node * kMaxChunks + g),
                            epoch, m * kLocal + local, holder != nullptr);
            }
        }
    }

    // NVLink stage. Warps of the grid take (chunk g, source s) items, g-major so that early chunks
    // are drained first; the records of s sit in the buffer of s's RDMA peer on this node. A record
    // with a row for this rank is copied to that row (its position in the contract's order).
    static __device__ void receive(const DispatchParams &p, char *const *peers, const Call &c) {
        const int node = c.node, local = c.local;
        const Guard &guard = c.guard;
        const int lane = lane_id(), stride = p.num_chunks + 1, k_top = p.num_topk;
        const int first_le = p.rank * p.num_local_experts;
        const long long rec = p.record_bytes, cap = p.capacity;
        const RecordFields f(kRowBytes, kScales, k_top);
        const int items = kRanks * p.num_chunks, num_warps = gridDim.x * kWarps;
        for (int item = blockIdx.x * kWarps + warp_id(); item < items; item += num_warps) {
            const int g = item / kRanks, s = item % kRanks, src_node = s / kLocal;
            const int lo = min((long long)__ldg(p.recv_rdma_channel_prefix + s * stride + g), cap);
            const int hi = min((long long)__ldg(p.recv_rdma_channel_prefix + s * stride + g + 1), cap);
            if (lo >= hi) continue;
            char *holder = peers[node * kLocal + s % kLocal];
            bool ok = true;
            if (lane == 0)
                ok = wait_at_least(guard, signal_word(holder, H::kRecordSignal, src_node * kMaxChunks + g), c.epoch, s,
                                   kPhaseRecords);
            if (!__shfl_sync(0xffffffffu, ok, 0)) return;
            for (int i = lo; i < hi; ++i) {
                const char *record = holder + p.recv_offset + (src_node * cap + i) * rec;
                const int row = ld_cg(reinterpret_cast<const int *>(record + f.pos) + local);
                if (row < 0) continue;
                if (row >= p.num_out_rows) {   // only num_worst_tokens can make this happen
                    if (lane == 0) guard.violation(s, kPhaseWorstTokens);
                    continue;
                }
                warp_copy(static_cast<int4 *>(p.recv_x) + (long long)row * kRowInt4, kRowInt4, lane,
                              [&](int u) { return ld_cg_v4(record + 16 * u); });
                for (int q = lane; q < kScales; q += 32)
                    p.recv_x_scales[(long long)row * kScales + q] = ld_cg(reinterpret_cast<const float *>(record + f.scales) + q);
                if (!kFresh) continue;
                if (lane < k_top) {
                    const int e = ld_cg(reinterpret_cast<const int *>(record + f.topk) + lane);
                    const bool mine = e >= first_le && e < first_le + p.num_local_experts;
                    static_cast<IdxT *>(p.recv_topk_idx)[(long long)row * k_top + lane] = static_cast<IdxT>(mine ? e - first_le : -1);
                    p.recv_topk_weights[(long long)row * k_top + lane] =
                        mine ? ld_cg(reinterpret_cast<const float *>(record + f.weights) + lane) : 0.f;
                }
                if (lane < 3) {
                    const int meta[3] = {s, lane == 1 ? ld_cg(reinterpret_cast<const int *>(record + f.src)) : 0, i};
                    p.recv_src_meta[(long long)row * 3 + lane] = meta[lane];
                }
            }
        }
    }

    // Rows past the received ones (num_worst_tokens): zero data and scales, top-k -1 / 0, meta -1.
    static __device__ void pad(const DispatchParams &p) {
        const int lane = lane_id(), k_top = p.num_topk;
        const int received = __ldg(p.recv_gbl_rank_prefix_sum + kRanks - 1);
        const int num_warps = gridDim.x * kWarps;
        for (int row = received + blockIdx.x * kWarps + warp_id(); row < p.num_out_rows; row += num_warps) {
            int4 *dst = static_cast<int4 *>(p.recv_x) + (long long)row * kRowInt4;
            for (int u = lane; u < kRowInt4; u += 32) dst[u] = make_int4(0, 0, 0, 0);
            for (int q = lane; q < kScales; q += 32) p.recv_x_scales[(long long)row * kScales + q] = 0.f;
            if (!kFresh) continue;
            if (lane < k_top) {
                static_cast<IdxT *>(p.recv_topk_idx)[(long long)row * k_top + lane] = static_cast<IdxT>(-1);
                p.recv_topk_weights[(long long)row * k_top + lane] = 0.f;
            }
            if (lane < 3) p.recv_src_meta[(long long)row * 3 + lane] = -1;
        }
    }
};

}  // namespace internode
}  // namespace epcomm
