// The low-latency dispatch's device side: the message format, the FP8 / BF16 cast of a token into
// shared memory and the send part's shared-memory budget, the send part (lists, then messages) and
// the receive part (copies into the packed layout). Protocol: cuda_src/README.md.
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
// epcomm.ops.low_latency.dispatch_smem_bytes (checked by tests/compile/test_low_latency_compile.py).
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

// ---- the send and receive parts -------------------------------------------------------------
// The send part. A token goes once to each rank that holds one of its experts (not once per
// expert: with K=8 of 288 experts on 2 ranks that is ~1 message per rank instead of ~4), into the
// destination's slot [source rank][token]; the lists tell the receiver which experts want it.
template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, bool kFP8, bool kRoundScale,
          class TopkT, int kThreads>
__device__ void dispatch_send(const DispatchParams &p, BlockState<kRanks> &s, const Guard &ctx,
                              unsigned long long epoch, char *smem) {
    using M = Message<kHidden, kFP8>;
    using Shape = DispatchShape<kHidden, kTopK, kFP8, kThreads>;
    constexpr int kLocalExperts = kExperts / kRanks, kWarps = kThreads / 32;
    constexpr int kListBytes = kListHeaderBytes + 4 * kMaxTokens;
    constexpr unsigned kAll = 0xffffffffu;
    const int warp = warp_id(), lane = lane_id();

    // A group of warps casts one token into shared memory, then its warps send it to the ranks it
    // goes to, one warp per rank. Blocks take one token each while there are fewer tokens than
    // blocks (all warps cast it), up to kTokensPerRound otherwise.
    const int per_round = min(Shape::kTokensPerRound, max(1, (p.num_tokens + gridDim.x - 1) / gridDim.x));
    const int warps_per_token = kWarps / per_round;
    const int group = warp / warps_per_token, in_group = warp % warps_per_token;
    const int first_round = blockIdx.x * per_round, token_stride = gridDim.x * per_round;
    auto load_round = [&](int first, int &expert) {   // lane k < K: the token's k-th expert; then the cast
        const int t = first + group;
        expert = -1;
        if (group >= per_round || t >= p.num_tokens) return;
        if (lane < kTopK) expert = expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + lane);
        cast_token<kHidden, kFP8, kRoundScale>(
            reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + static_cast<long long>(t) * kHidden * 2),
            smem + group * M::kBytes, in_group * 32 + lane, warps_per_token * 32);
    };
    // The first round is read and cast before the release wait (no remote write yet), so that
    // round trip overlaps the loads of x. The last warp first pulls this block's share of the top-k
    // table into L2 (prefetches do not stall the warp): the list scans after the release, on the
    // critical path (all but the first step below), then read L2 (a scan of 128 tokens took 2.7 us cold).
    if (warp == kWarps - 1) {
        const int lines = (p.num_tokens * kTopK * static_cast<int>(sizeof(TopkT)) + 127) / 128;
        for (int i = blockIdx.x * 32 + lane; i < lines; i += gridDim.x * 32)
            prefetch_l2(static_cast<const char *>(p.topk_idx) + 128ll * i);
    }
    // Token lists: one expert per warp (the warps without messages first). A list is built from
    // scans of kScanRounds x 32 tokens, their top-k loads all in flight at once (one memory round
    // trip per step instead of one per 32 tokens); hits[r] = how often token first + 32r + lane
    // names expert e.
    constexpr int kScanRounds = kTopK <= 8 ? 4 : kTopK <= 16 ? 2 : 1;
    auto scan = [&](int e, int first, int (&hits)[kScanRounds]) {
#pragma unroll
        for (int r = 0; r < kScanRounds; ++r) {
            const int t = first + 32 * r + lane;
            hits[r] = 0;
            if (t < p.num_tokens) {
#pragma unroll
                for (int k = 0; k < kTopK; ++k)
                    hits[r] += expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + k) == e;
            }
        }
    };
    const int total = kWarps * gridDim.x, first_expert = (kWarps - 1 - warp) * gridDim.x + blockIdx.x;
    int expert, sent = 0, first_hits[kScanRounds];
    load_round(first_round, expert);
    // The first scan step of the warp's first expert reads only inputs: it runs before the release
    // wait too (a scan took 2.7 us after it, traced), so with N <= 32 x kScanRounds every list is
    // ready to leave at the release.
    if (first_expert < kExperts) scan(first_expert, 0, first_hits);
    wait_released(s, ctx, p.acks, epoch, p.mask, p.enable_shrink != 0);   // ends with __syncthreads
    trace_stamp(p.trace, kTrReleased);
    if (s.abort) return;
    // The lists go before the messages. A store to a peer waits behind every store the SM issued
    // to it before, so lists written after (or beside) the messages reached the receivers only once
    // the link had drained the messages (traced on 2 x H200: lists seen ~9 us after the release,
    // the messages' own tags ~6).
    for (int e = first_expert; e < kExperts; e += total) {
        const int dst = e / kLocalExperts;
        if (s.masked[dst]) continue;
        const long long pair = static_cast<long long>(e % kLocalExperts) * kRanks + p.rank;
        char *local_list = p.lists + pair * kListBytes;
        const bool direct = dst == p.rank || s.peer_base[dst] != 0;
        char *list = direct ? on_peer(p.heap, s.peer_base, p.rank, dst, local_list)
                            : p.list_stage + static_cast<long long>(e) * kListBytes;
        int *entries = reinterpret_cast<int *>(list + kListHeaderBytes);
        int count = 0;
        for (int first = 0; first < p.num_tokens; first += 32 * kScanRounds) {
            int hits[kScanRounds];
            if (e == first_expert && first == 0) {
#pragma unroll
                for (int r = 0; r < kScanRounds; ++r) hits[r] = first_hits[r];
            } else {
                scan(e, first, hits);
            }
#pragma unroll
            for (int r = 0; r < kScanRounds; ++r) {
                int inclusive = hits[r];
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const int v = __shfl_up_sync(kAll, inclusive, o);
                    if (lane >= o) inclusive += v;
                }
                for (int pos = count + inclusive - hits[r], end = count + inclusive; pos < end && pos < kMaxTokens; ++pos)
                    entries[pos] = first + 32 * r + lane;
                count += __shfl_sync(kAll, inclusive, 31);
            }
        }
        count = min(count, kMaxTokens);   // only reachable with repeated experts (validated on the host)
        if (lane == 0) reinterpret_cast<int *>(list)[0] = count;
        __syncwarp();
        trace_stamp(p.trace, kTrAuxC);
        if (!direct) {
            __threadfence_system();
            nvshmemx_putmem_signal_nbi_warp(local_list, list, kListHeaderBytes + 4 * count,
                                            reinterpret_cast<uint64_t *>(p.list_tags + pair), epoch, NVSHMEM_SIGNAL_SET, dst);
        }
    }
    __syncthreads();   // every list store of the block is issued before its first message store
    trace_stamp(p.trace, kTrSendB);
    // The direct lists' tags (each release store waits only for its warp's list stores, ahead of
    // the messages); then, each warp on its own, the messages.
    for (int e = first_expert; e < kExperts; e += total) {
        const int dst = e / kLocalExperts;
        if (s.masked[dst] || !(dst == p.rank || s.peer_base[dst] != 0) || lane != 0) continue;
        const long long pair = static_cast<long long>(e % kLocalExperts) * kRanks + p.rank;
        st_release_sys(reinterpret_cast<unsigned long long *>(on_peer(p.heap, s.peer_base, p.rank, dst, p.list_tags + pair)), epoch);
    }
    for (int first = first_round; first < p.num_tokens; first += token_stride) {
        if (first != first_round) {
            __syncthreads();   // the previous round's messages have left shared memory
            load_round(first, expert);
            __syncthreads();
        }
        const int t = first + group;
        const bool mine = group < per_round && t < p.num_tokens;
        const char *msg = smem + group * M::kBytes;
        char *stage = p.message_stage + static_cast<long long>(t) * M::kBytes;
        if (p.stage_for_puts) {   // puts read the symmetric heap: the group copies the message there
            if (mine)
                for (int i = in_group * 32 + lane; i < M::kBytes / 16; i += warps_per_token * 32)
                    reinterpret_cast<int4 *>(stage)[i] = reinterpret_cast<const int4 *>(msg)[i];
            __syncthreads();
        }
        if (!mine) continue;
        const long long slot = static_cast<long long>(p.rank) * kMaxTokens + t;
        char *local_msg = p.messages + slot * M::kBytes;
        unsigned long long *local_tag = p.token_tags + slot;
        for (int dst = in_group; dst < kRanks; dst += warps_per_token) {
            if (!__any_sync(kAll, expert >= 0 && expert / kLocalExperts == dst) || s.masked[dst]) continue;
            if (dst == p.rank || s.peer_base[dst] != 0) {
                const int4 *src = reinterpret_cast<const int4 *>(msg);
                warp_copy<16>(reinterpret_cast<int4 *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_msg)),
                              M::kBytes / 16, lane, [&](int i) { return src[i]; });
                __syncwarp();
                trace_first(p.trace, kTrAuxA);
                if (lane == 0)
                    st_release_sys(reinterpret_cast<unsigned long long *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_tag)), epoch);
                trace_first(p.trace, kTrAuxB);
            } else {
                __threadfence_system();   // the stage (written by the group) before the transport reads it
                nvshmemx_putmem_signal_nbi_warp(local_msg, stage, M::kBytes, reinterpret_cast<uint64_t *>(local_tag),
                                                epoch, NVSHMEM_SIGNAL_SET, dst);
            }
            ++sent;
        }
    }
    trace_count(p.trace, sent);
    trace_stamp(p.trace, kTrSendA);
}

template <int kHidden, int kRanks, int kExperts, int kMaxTokens, bool kFP8, bool kUE8M0, int kThreads>
__device__ void dispatch_recv(const DispatchParams &p, const BlockState<kRanks> &s, const Guard &ctx,
                              unsigned long long epoch) {
    using M = Message<kHidden, kFP8>;
    constexpr int kLocalExperts = kExperts / kRanks, kSlots = kRanks * kMaxTokens, kWarps = kThreads / 32;
    constexpr int kListBytes = kListHeaderBytes + 4 * kMaxTokens;
    constexpr unsigned kAll = 0xffffffffu;
    const int warp = warp_id(), lane = lane_id();
    const bool shrink = p.enable_shrink != 0;
    const PairSplit split(blockIdx.x * kWarps + warp, gridDim.x * kWarps, kLocalExperts * kRanks);
    for (int pair = split.p0; pair < kLocalExperts * kRanks; pair += split.step) {
        const int el = pair / kRanks, src = pair % kRanks;
        // This pair's rows start after those of the sources before it: wait for their lists too.
        int begin = 0, count = 0;
        bool failed = false;
        for (int first = 0; first <= src; first += 32) {
            const int r = first + lane;
            int n = 0;
            unsigned long long waited = 0;
            if (r <= src && !s.masked[r]) {
                const long long q = static_cast<long long>(el) * kRanks + r;
                const unsigned long long t0 = globaltimer_ns();
                const Wait w = wait_tag(ctx, p.list_tags + q, epoch, p.mask, shrink, r, kDispatchList);
                waited = globaltimer_ns() - t0;
                if (w == kReady) n = min(ld_cg(reinterpret_cast<const int *>(p.lists + q * kListBytes)), kMaxTokens);
                failed |= w == kFailed;
            }
            begin += warp_sum(r < src ? n : 0);
            if (src - first < 32) count = __shfl_sync(kAll, n, src - first);
            if (r == src && split.j0 == 0 && p.wait_recv_cost_stats != nullptr)
                atomicAdd(reinterpret_cast<unsigned long long *>(p.wait_recv_cost_stats) + src, waited);
        }
        if (__any_sync(kAll, failed)) return;
        if (pair == split.p0) trace_stamp(p.trace, kTrRecvReady);
        __syncwarp();   // the lanes' acquires before every lane reads the list
        if (split.j0 == 0 && lane == 0) {
            p.recv_layout_range[pair] = (static_cast<long long>(begin) << 32) | count;
            if (p.cumulative_recv_stats != nullptr) atomicAdd(p.cumulative_recv_stats + el, count);
            if (src == kRanks - 1) p.recv_count[el] = begin + count;
        }
        const int *entries = reinterpret_cast<const int *>(p.lists + static_cast<long long>(pair) * kListBytes + kListHeaderBytes);
        for (int i = split.j0; i < count; i += split.stride) {
            const int t = ld_cg(entries + i);
            if (t < 0 || t >= kMaxTokens) continue;
            const long long slot = static_cast<long long>(src) * kMaxTokens + t;   // messages are [source][token]
            int w = kReady;
            if (lane == 0) w = wait_tag(ctx, p.token_tags + slot, epoch, p.mask, shrink, src, kDispatchMessage);
            w = __shfl_sync(kAll, w, 0);
            if (w == kFailed) return;
            if (w == kMasked) break;   // the source went silent: its remaining rows stay unfilled
            __syncwarp();
            copy_message<kHidden, kSlots, kFP8, kUE8M0>(p.messages + slot * M::kBytes, p.recv_x, p.recv_scales, el,
                                                        begin + i, lane);
            if (lane == 0) p.recv_src_info[static_cast<long long>(el) * kSlots + begin + i] = t;
        }
    }
}

}  // namespace ll
}  // namespace epcomm
