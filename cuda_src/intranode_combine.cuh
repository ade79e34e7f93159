// Intranode combine, device side: pusher and reducer warps (protocol: cuda_src/README.md).
#pragma once
#include "intranode_protocol.cuh"

namespace epcomm {
namespace intranode {

template <int kRanks, int kRowInt4>
struct Combine {
    using PushSplit = RowSplit<kRowInt4, kMaxUnroll>;
    // The reduction keeps one segment of every source in flight, <= kMaxUnroll int4 per lane: the
    // contributing ranks, plus bias0 and bias1 when the call has a bias (kBias).
    template <bool kBias>
    using ReduceSplit = RowSplit<kRowInt4, (kMaxUnroll / (kRanks + 2 * kBias) > 0 ? kMaxUnroll / (kRanks + 2 * kBias) : 1)>;
    // Up to 4 ranks the top-k weights load with the rows; at 8 the 8 extra registers spill (ptxas).
    static constexpr bool kWeightsWithRows = kRanks <= 4;

    // Warp-level pusher (chunk loop: send_chunks): for chunk g of every source s, the rows this
    // rank received from s's chunk g go back into s's ring of this rank, with their top-k weights.
    // Items go round-robin over the block's warps across chunks and sources.
    static __device__ void push(const CombineParams &p, BlockShared<kRanks> &sh, unsigned long long epoch,
                                const Guard &ctx) {
        const int lane = lane_id(), warp = warp_id(), rank = p.rank, stride = p.num_chunks + 1, k_top = p.num_topk;
        char *const *peers = sh.peers;
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;
        const int row_bytes = kRowInt4 * 16;
        int rotate = 0;   // items of this block's earlier (chunk, source) streams, mod kWarps
        send_chunks<kRanks>(p, p.recv_channel_prefix, sh, epoch, ctx, [&](int g) {
            for (int i = 1; i < kRanks; ++i) {
                const int s = (rank + i) % kRanks;
                const int begin = __ldg(p.recv_channel_prefix + s * stride + g);
                const int end = __ldg(p.recv_channel_prefix + s * stride + g + 1);
                const int base = rows_before(p.rank_prefix, kRanks, s, rank);
                char *ring = peers[s] + p.staging_offset + ring_index<kRanks>(rank, s) * ring_bytes;
                const int items = (end - begin) * PushSplit::kSegs;
                for (int item = (warp - rotate + kWarps) % kWarps; item < items; item += kWarps) {
                    const int k = begin + item / PushSplit::kSegs, seg = item % PushSplit::kSegs;
                    const long long pos = base + k;
                    const int4 *src = static_cast<const int4 *>(p.x) + pos * kRowInt4 + seg * PushSplit::kSegInt4;
                    char *record = ring + (long long)(k % p.ring_rows) * p.record_bytes;
                    int4 *dst = reinterpret_cast<int4 *>(record) + seg * PushSplit::kSegInt4;
                    int4 v[PushSplit::kUnroll];
#pragma unroll
                    for (int u = 0; u < PushSplit::kUnroll; ++u)
                        if (seg * PushSplit::kSegInt4 + u * 32 + lane < kRowInt4) v[u] = ld_nc_v4(src + u * 32 + lane);
#pragma unroll
                    for (int u = 0; u < PushSplit::kUnroll; ++u)
                        if (seg * PushSplit::kSegInt4 + u * 32 + lane < kRowInt4) dst[u * 32 + lane] = v[u];
                    if (seg == 0 && lane < k_top)
                        reinterpret_cast<float *>(record + row_bytes)[lane] = p.topk_weights[pos * k_top + lane];
                }
                rotate = (rotate + items) % kWarps;
            }
        });
    }

    // Warp-level reducer: claims (chunk, part) of this rank's own tokens; once every peer signalled
    // the chunk, sums bias0 + bias1 + the rows of ranks 0..R-1 (ascending, fp32) per token
    // (reduce_claim); the last part of a chunk to finish frees the chunk's ring rows.
    // (The two loops are separate so that each keeps its own registers: one loop with both claim
    // bodies spilled, ptxas.)
    static __device__ void reduce(const CombineParams &p, char *const *peers, unsigned long long epoch,
                                  const Guard &ctx) {
        if (p.bias0 != nullptr || p.bias1 != nullptr) reduce_claims<true>(p, peers, epoch, ctx);
        else reduce_claims<false>(p, peers, epoch, ctx);
        trace_set(p.trace, kTrReceived, trace_now());
    }

    template <bool kBias>
    static __device__ __forceinline__ void reduce_claims(const CombineParams &p, char *const *peers,
                                                         unsigned long long epoch, const Guard &ctx) {
        const int lane = lane_id(), rank = p.rank;
        char *local = peers[rank];
        auto *claim = reinterpret_cast<unsigned int *>(local + Header<kRanks>::kClaim);
        const unsigned int total = (unsigned int)p.num_chunks * kParts;
        const int self_base = rows_before(p.rank_prefix, kRanks, rank, rank);
        while (true) {
            const unsigned int c = warp_claim(claim);
            if (c >= total) break;
            trace_add(p.trace, kTrClaims, 1);
            const int g = c / kParts, part = c % kParts;
            if (!reduce_claim<kBias>(p, local, self_base, g, part, ctx)) return;
            __syncwarp();
            if (lane == 0) {
                __threadfence();
                int *parts = parts_ptr<kRanks>(local, 0, g);
                if (atomicAdd(parts, 1) == kParts - 1) {
                    __threadfence();
                    *reinterpret_cast<volatile int *>(parts) = 0;
                    for (int j = 0; j < kRanks; ++j)
                        if (j != rank) *reinterpret_cast<volatile int *>(ready_ptr<kRanks>(local, j, g)) = 0;
                    fence_acq_rel_sys();
                    for (int j = 0; j < kRanks; ++j)
                        if (j != rank) st_release_sys(consumed_ptr<kRanks>(peers[j], rank, g), epoch);
                }
            }
        }
    }

    // One claim: wait for every peer's chunk g, then reduce items part, part + kParts, ... of the
    // chunk's (token, segment) items. False on failure (nothing reduced).
    // An item should cost one memory latency (all its sources' loads in flight together), so every
    // other load is hoisted off that path: the claim's send_head loads before its ready wait, bias
    // rows as two more sources beside the ranks' rows (kBias), and up to 4 ranks the top-k weights
    // with the first segment's rows. (Taking the next claim ahead spills at 128 registers.)
    template <bool kBias>
    static __device__ __forceinline__ bool reduce_claim(const CombineParams &p, char *local, int self_base, int g,
                                                        int part, const Guard &ctx) {
        using S = ReduceSplit<kBias>;
        constexpr int kSources = kRanks + 2 * kBias;   // [bias0, bias1,] ranks 0..R-1
        const int lane = lane_id(), rank = p.rank, stride = p.num_chunks + 1, k_top = p.num_topk;
        const int t0 = min(g * p.tokens_per_chunk, p.num_tokens), t1 = min(t0 + p.tokens_per_chunk, p.num_tokens);
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;
        const int row_bytes = kRowInt4 * 16;
        // send_head of 32 tokens at a time, one token per lane: the rows' addresses depend on it, so
        // loading it per item would put a second memory latency before every row load.
        int cached_first = t0 + part / S::kSegs, lane_head[kRanks];
        const auto load_heads = [&] {
#pragma unroll
            for (int j = 0; j < kRanks; ++j)
                lane_head[j] = cached_first + lane < t1 ? __ldg(p.send_head + (long long)(cached_first + lane) * kRanks + j) : -1;
        };
        load_heads();   // local table: in flight during the wait below

        bool ok = true;
        const unsigned long long wait_start = trace_now();
        for (int j = lane; j < kRanks; j += 32) {
            if (j == rank) continue;
            ok = ok && wait_at_least(ctx, ready_ptr<kRanks>(local, j, g), kWarps, j, kPhaseData);
            if (part == 0 && __ldg(p.channel_prefix + j * stride + g + 1) - __ldg(p.channel_prefix + j * stride + g) > p.ring_rows)
                ctx.violation(j, kPhaseChunkTooBig);
        }
        if (!__all_sync(0xffffffffu, ok)) return false;
        __syncwarp();   // the lanes that acquired the peers' signals order every lane's reads below
        if (kTrace) {
            const unsigned long long now = trace_now();
            trace_add(p.trace, kTrWaitNs, now - wait_start);
            trace_first(p.trace, kTrFirstData, now);
        }

        for (int item = part; item < (t1 - t0) * S::kSegs; item += kParts) {
            const int t = t0 + item / S::kSegs, seg = item % S::kSegs;
            if (t - cached_first >= 32) {
                cached_first = t;
                load_heads();
            }
            int head[kRanks];
#pragma unroll
            for (int j = 0; j < kRanks; ++j) head[j] = __shfl_sync(0xffffffffu, lane_head[j], t - cached_first);
            // Source i: bias0, bias1 (with kBias; either may be absent), then rank j = i - 2 * kBias
            // (absent when the token did not go to j).
            const auto present = [&](int i) {
                if (kBias && i < 2) return (i == 0 ? p.bias0 : p.bias1) != nullptr;
                return head[i - 2 * kBias] >= 0;
            };
            const auto source = [&](int i) -> const int4 * {
                if (kBias && i < 2) return static_cast<const int4 *>(i == 0 ? p.bias0 : p.bias1) + (long long)t * kRowInt4;
                const int j = i - 2 * kBias;
                return j == rank ? static_cast<const int4 *>(p.x) + (long long)(self_base + head[j]) * kRowInt4
                                 : reinterpret_cast<const int4 *>(local + p.staging_offset + ring_index<kRanks>(j, rank) * ring_bytes +
                                                                  (long long)(head[j] % p.ring_rows) * p.record_bytes);
            };
            int4 v[kSources][S::kUnroll];
#pragma unroll
            for (int i = 0; i < kSources; ++i) {
                if (!present(i)) continue;
                const int4 *src = source(i) + seg * S::kSegInt4;
                // Peers' rows were written during this kernel: L2 (ld.cg); the rest is read-only input.
                const bool from_peer = i >= 2 * kBias && i - 2 * kBias != rank;
#pragma unroll
                for (int u = 0; u < S::kUnroll; ++u)
                    if (seg * S::kSegInt4 + u * 32 + lane < kRowInt4)
                        v[i][u] = from_peer ? ld_cg_v4(src + u * 32 + lane) : ld_nc_v4(src + u * 32 + lane);
            }
            // The token's top-k weight `lane` as rank j returned it.
            const auto weight_of = [&](int j) {
                return j == rank ? __ldg(p.topk_weights + (long long)(self_base + head[j]) * k_top + lane)
                                 : __ldcg(reinterpret_cast<const float *>(
                                       local + p.staging_offset + ring_index<kRanks>(j, rank) * ring_bytes +
                                       (long long)(head[j] % p.ring_rows) * p.record_bytes + row_bytes) + lane);
            };
            const bool weights = seg == 0 && lane < k_top;
            float weight[kWeightsWithRows ? kRanks : 1];
            if constexpr (kWeightsWithRows) {
                if (weights) {
#pragma unroll
                    for (int j = 0; j < kRanks; ++j)
                        if (head[j] >= 0) weight[j] = weight_of(j);
                }
            }
#pragma unroll
            for (int u = 0; u < S::kUnroll; ++u) {
                const int idx = seg * S::kSegInt4 + u * 32 + lane;
                if (idx >= kRowInt4) continue;
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < kSources; ++i)
                    if (present(i)) add_bf16x8(acc, v[i][u]);
                static_cast<int4 *>(p.combined_x)[(long long)t * kRowInt4 + idx] = pack_bf16x8(acc);
            }
            if (weights) {
                float w = 0.f;
#pragma unroll
                for (int j = 0; j < kRanks; ++j) {
                    if (head[j] < 0) continue;
                    if constexpr (kWeightsWithRows) w += weight[j];
                    else w += weight_of(j);
                }
                p.combined_weights[(long long)t * k_top + lane] = w;
            }
        }
        return true;
    }
};

}  // namespace intranode
}  // namespace epcomm
