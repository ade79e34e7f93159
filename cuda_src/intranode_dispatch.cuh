// Intranode dispatch, device side: sender and receiver warps, padding (protocol: cuda_src/README.md).
#pragma once
#include "intranode_protocol.cuh"

namespace epcomm {
namespace intranode {

// ---- dispatch ---------------------------------------------------------------------------------
// A row's metadata as it sits in a ring record after the row bytes.
struct RecordMeta {
    float *scales;
    int *topk;
    float *weights;
    int *src;
    __device__ __forceinline__ RecordMeta(char *record, int row_bytes, int num_scales, int num_topk) {
        scales = reinterpret_cast<float *>(record + row_bytes);
        topk = reinterpret_cast<int *>(scales + num_scales);
        weights = reinterpret_cast<float *>(topk + num_topk);
        src = reinterpret_cast<int *>(weights + num_topk);
    }
};

// One token's metadata in registers, spread over the lanes: lane k < K holds top-k entry k, lane l
// holds scales l, l + 32, ...; src is the token's index (lane 0 stores it).
template <int kScales>
struct TokenMeta {
    static constexpr int kScalesPerLane = kScales > 0 ? (kScales + 31) / 32 : 1;
    long long expert = -1;   // global expert id (sender) / local id (receiver)
    float weight = 0.f;
    float scale[kScalesPerLane];
    int src = -1;
};

template <int kRanks, int kRowInt4, int kScales, typename IdxT, bool kFresh>
struct Dispatch {
    using Split = RowSplit<kRowInt4, kMaxUnroll>;
    using Meta = TokenMeta<kScales>;
    static constexpr int kRowBytes = kRowInt4 * 16;

    static __device__ __forceinline__ bool in_row(int seg, int u, int lane) {
        return seg * Split::kSegInt4 + u * 32 + lane < kRowInt4;
    }

    static __device__ __forceinline__ char *record_at(const DispatchParams &p, char *base, int ring, int k,
                                                      long long ring_bytes) {
        return base + p.staging_offset + ring * ring_bytes + (long long)(k % p.ring_rows) * p.record_bytes;
    }

    // Warp-level sender (chunk loop: send_chunks). The block's (token, segment) items, chunk after
    // chunk, go round-robin over its warps (so small chunks still spread over all warps); a warp
    // reads an item once and stores it to every destination.
    static __device__ void send(const DispatchParams &p, BlockShared<kRanks> &sh, unsigned long long epoch,
                                const Guard &ctx) {
        const int lane = lane_id(), warp = warp_id(), rank = p.rank;
        const int n = p.num_tokens, tpc = p.tokens_per_chunk;
        char *const *peers = sh.peers;
        const int self_base = rows_before(p.rank_prefix, kRanks, rank, rank);
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;
        int rotate = 0;   // items of this block's earlier chunks, mod kWarps

        send_chunks<kRanks>(p, p.channel_prefix, sh, epoch, ctx, [&](int g) {
            const int t0 = min(g * tpc, n), t1 = min(t0 + tpc, n), items = (t1 - t0) * Split::kSegs;
            for (int item = (warp - rotate + kWarps) % kWarps; item < items; item += kWarps) {
                const int t = t0 + item / Split::kSegs, seg = item % Split::kSegs;
                int head[kRanks];
#pragma unroll
                for (int j = 0; j < kRanks; ++j) head[j] = __ldg(p.send_head + (long long)t * kRanks + j);
                const int4 *src = static_cast<const int4 *>(p.x) + (long long)t * kRowInt4 + seg * Split::kSegInt4;
                int4 v[Split::kUnroll];
#pragma unroll
                for (int u = 0; u < Split::kUnroll; ++u)
                    if (in_row(seg, u, lane)) v[u] = ld_nc_v4(src + u * 32 + lane);
                Meta meta;
                if (seg == 0) load_meta(p, t, meta);
#pragma unroll
                for (int j = 0; j < kRanks; ++j) {
                    if (head[j] < 0) continue;
                    char *record = nullptr;
                    int4 *dst;
                    int pos = -1;
                    if (j == rank) {
                        pos = self_base + head[j];
                        if (pos >= p.num_out_rows) {   // num_worst_tokens too small
                            if (seg == 0 && lane == 0) ctx.violation(rank, kPhaseWorstTokens);
                            continue;
                        }
                        dst = static_cast<int4 *>(p.recv_x) + (long long)pos * kRowInt4;
                    } else {
                        record = record_at(p, peers[j], ring_index<kRanks>(rank, j), head[j], ring_bytes);
                        dst = reinterpret_cast<int4 *>(record);
                    }
                    dst += seg * Split::kSegInt4;
#pragma unroll
                    for (int u = 0; u < Split::kUnroll; ++u)
                        if (in_row(seg, u, lane)) dst[u * 32 + lane] = v[u];
                    if (seg == 0) store_meta(p, meta, j, pos, record);
                }
            }
            rotate = (rotate + items) % kWarps;
        });
    }

    static __device__ __forceinline__ void load_meta(const DispatchParams &p, int t, Meta &meta) {
        const int lane = lane_id();
        meta.src = t;
        if (kFresh && lane < p.num_topk) {
            meta.expert = static_cast<long long>(static_cast<const IdxT *>(p.topk_idx)[(long long)t * p.num_topk + lane]);
            meta.weight = p.topk_weights[(long long)t * p.num_topk + lane];
        }
#pragma unroll
        for (int i = 0; i < Meta::kScalesPerLane; ++i)
            if (i * 32 + lane < kScales)
                meta.scale[i] = p.x_scales[(long long)t * p.scale_stride_token + (long long)(i * 32 + lane) * p.scale_stride_group];
    }

    // Destination j's view of the token: its top-k ids made local to j (-1, weight 0 elsewhere).
    // Local rows (record == nullptr) go to the outputs at `pos`, others into the ring record.
    static __device__ __forceinline__ void store_meta(const DispatchParams &p, const Meta &meta, int j, int pos,
                                                      char *record) {
        const int lane = lane_id(), k_top = p.num_topk;
        const long long first = (long long)j * p.num_local_experts;
        const int local = meta.expert >= first && meta.expert < first + p.num_local_experts ? int(meta.expert - first) : -1;
        const float weight = local >= 0 ? meta.weight : 0.f;
        if (record == nullptr) {
#pragma unroll
            for (int i = 0; i < Meta::kScalesPerLane; ++i)
                if (i * 32 + lane < kScales) p.recv_x_scales[(long long)pos * kScales + i * 32 + lane] = meta.scale[i];
            if (kFresh) {
                if (lane < k_top) {
                    static_cast<IdxT *>(p.recv_topk_idx)[(long long)pos * k_top + lane] = static_cast<IdxT>(local);
                    p.recv_topk_weights[(long long)pos * k_top + lane] = weight;
                }
                if (lane == 0) p.recv_src_idx[pos] = meta.src;
            }
        } else {
            RecordMeta out(record, kRowBytes, kScales, k_top);
#pragma unroll
            for (int i = 0; i < Meta::kScalesPerLane; ++i)
                if (i * 32 + lane < kScales) out.scales[i * 32 + lane] = meta.scale[i];
            if (kFresh) {
                if (lane < k_top) {
                    out.topk[lane] = local;
                    out.weights[lane] = weight;
                }
                if (lane == 0) *out.src = meta.src;
            }
        }
    }

    // Warp-level receiver: claims (chunk, source, part) in chunk order from a rank-wide counter,
    // waits for the source's kWarps signals, copies its part of the chunk's rows out of the ring;
    // the last part to finish frees the chunk (reset ready, publish consumed).
    static __device__ void receive(const DispatchParams &p, char *const *peers, unsigned long long epoch,
                                   const Guard &ctx) {
        const int lane = lane_id(), rank = p.rank, stride = p.num_chunks + 1, k_top = p.num_topk;
        char *local = peers[rank];
        auto *claim = reinterpret_cast<unsigned int *>(local + Header<kRanks>::kClaim);
        const int per_chunk = (kRanks - 1) * kParts;
        const unsigned int total = (unsigned int)p.num_chunks * per_chunk;
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;
        while (true) {
            const unsigned int c = warp_claim(claim);
            if (c >= total) break;
            trace_add(p.trace, kTrClaims, 1);
            const int g = c / per_chunk, r = c % per_chunk, part = r % kParts;
            const int s = (rank + 1 + r / kParts) % kRanks;
            // Where the chunk's rows go: local tables, loaded before the wait so that their latency
            // is not added to the claim's (a claim is only ~8 items).
            const int begin = __ldg(p.recv_channel_prefix + s * stride + g);
            const int end = __ldg(p.recv_channel_prefix + s * stride + g + 1);
            const int base = rows_before(p.rank_prefix, kRanks, s, rank);
            bool ok = true;
            const unsigned long long wait_start = trace_now();
            if (lane == 0) ok = wait_at_least(ctx, ready_ptr<kRanks>(local, s, g), kWarps, s, kPhaseData);
            __syncwarp();
            if (!__shfl_sync(0xffffffffu, ok, 0)) return;
            if (kTrace) {
                const unsigned long long now = trace_now();
                trace_add(p.trace, kTrWaitNs, now - wait_start);
                trace_first(p.trace, kTrFirstData, now);
            }

            if (part == 0 && lane == 0 && end - begin > p.ring_rows)
                ctx.violation(s, kPhaseChunkTooBig);
            for (int item = part; item < (end - begin) * Split::kSegs; item += kParts) {
                const int k = begin + item / Split::kSegs, seg = item % Split::kSegs;
                const int pos = base + k;
                if (pos >= p.num_out_rows) {
                    if (lane == 0) ctx.violation(s, kPhaseWorstTokens);
                    continue;
                }
                char *record = record_at(p, local, ring_index<kRanks>(s, rank), k, ring_bytes);
                const int4 *src = reinterpret_cast<const int4 *>(record) + seg * Split::kSegInt4;
                int4 v[Split::kUnroll];
#pragma unroll
                for (int u = 0; u < Split::kUnroll; ++u)
                    if (in_row(seg, u, lane)) v[u] = ld_cg_v4(src + u * 32 + lane);
                Meta meta;
                const RecordMeta in(record, kRowBytes, kScales, k_top);
                if (seg == 0) {
#pragma unroll
                    for (int i = 0; i < Meta::kScalesPerLane; ++i)
                        if (i * 32 + lane < kScales) meta.scale[i] = __ldcg(in.scales + i * 32 + lane);
                    if (kFresh && lane < k_top) {
                        meta.expert = __ldcg(in.topk + lane);
                        meta.weight = __ldcg(in.weights + lane);
                    }
                    if (kFresh && lane == 0) meta.src = __ldcg(in.src);
                }
                int4 *dst = static_cast<int4 *>(p.recv_x) + (long long)pos * kRowInt4 + seg * Split::kSegInt4;
#pragma unroll
                for (int u = 0; u < Split::kUnroll; ++u)
                    if (in_row(seg, u, lane)) dst[u * 32 + lane] = v[u];
                if (seg == 0) {
#pragma unroll
                    for (int i = 0; i < Meta::kScalesPerLane; ++i)
                        if (i * 32 + lane < kScales) p.recv_x_scales[(long long)pos * kScales + i * 32 + lane] = meta.scale[i];
                    if (kFresh) {
                        if (lane < k_top) {
                            static_cast<IdxT *>(p.recv_topk_idx)[(long long)pos * k_top + lane] = static_cast<IdxT>(meta.expert);
                            p.recv_topk_weights[(long long)pos * k_top + lane] = meta.weight;
                        }
                        if (lane == 0) p.recv_src_idx[pos] = meta.src;
                    }
                }
            }
            __syncwarp();
            if (lane == 0) {
                __threadfence();
                int *parts = parts_ptr<kRanks>(local, s, g);
                if (atomicAdd(parts, 1) == kParts - 1) {
                    __threadfence();
                    *reinterpret_cast<volatile int *>(parts) = 0;
                    *reinterpret_cast<volatile int *>(ready_ptr<kRanks>(local, s, g)) = 0;
                    st_release_sys(consumed_ptr<kRanks>(peers[s], rank, g), epoch);
                }
            }
        }
        trace_set(p.trace, kTrReceived, trace_now());
    }

    // num_worst_tokens / cached worst-size outputs: rows past the received ones are zero, top-k -1.
    static __device__ void pad(const DispatchParams &p) {
        const int lane = lane_id(), k_top = p.num_topk;
        const int received = __ldg(p.rank_prefix + (kRanks - 1) * kRanks + p.rank);
        const int first_warp = blockIdx.x * kWarps + warp_id(), num_warps = gridDim.x * kWarps;
        for (int row = received + first_warp; row < p.num_out_rows; row += num_warps) {
            int4 *dst = static_cast<int4 *>(p.recv_x) + (long long)row * kRowInt4;
            for (int i = lane; i < kRowInt4; i += 32) dst[i] = make_int4(0, 0, 0, 0);
            for (int i = lane; i < kScales; i += 32) p.recv_x_scales[(long long)row * kScales + i] = 0.f;
            if (kFresh) {
                if (lane < k_top) {
                    static_cast<IdxT *>(p.recv_topk_idx)[(long long)row * k_top + lane] = static_cast<IdxT>(-1);
                    p.recv_topk_weights[(long long)row * k_top + lane] = 0.f;
                }
                if (lane == 0) p.recv_src_idx[row] = -1;
            }
        }
    }
};

}  // namespace intranode
}  // namespace epcomm
