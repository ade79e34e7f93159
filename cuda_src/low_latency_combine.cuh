// The low-latency combine's send part (top-k records, partial sums per (token, expert rank)) and
// receive part (one block per token adds the partials); protocol: cuda_src/README.md.
#pragma once
#include "low_latency_protocol.cuh"

namespace epcomm {
namespace ll {

// The send part takes its work from the set's claim counters (warp_claim): first the records of every
// token slot, then the (source, token) items; the launch's last block resets the counters
// (finish_send). So the warps that are running, however few blocks (another kernel may hold SMs:
// hook mode, a second micro-batch on another stream), send every record before any of them waits
// for a record, and no wait ever depends on a block that is not resident.

// Source side: every other live rank gets this rank's top-k record of every token slot t < T (slots
// t >= N name no expert), so each expert rank knows exactly which partial sums to make, with the
// combine-time weights, whatever the routing was (this rank's own items read topk_idx and
// topk_weights directly). One token per warp and claim; the claiming warps (combine_kernel) take
// and load their first one before the release wait (load_record), so those loads overlap it.
// Direct ranks: the record as stamped words (per slot: expert id, weight bits), no tag and no
// fence, so it is on its way as soon as the release is seen; other ranks: a put with signal from
// the record stage.
template <int kTopK, int kExperts, class TopkT>
__device__ __forceinline__ void load_record(const CombineParams &p, int t, int &e, float &w) {
    e = -1;
    w = 0.0f;
    if (lane_id() < kTopK && t < p.num_tokens) {
        e = expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + lane_id());
        w = __ldg(p.topk_weights + static_cast<long long>(t) * kTopK + lane_id());
    }
}

template <int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT>
__device__ void combine_send_records(const CombineParams &p, const BlockState<kRanks> &s, unsigned long long epoch,
                                     int t, int e, float w) {   // t, e, w: the first claim, loaded
    const int lane = lane_id();
    const uint32_t stamp = call_stamp(epoch);
    unsigned int *counter = p.tickets + kClaimRecords;
    while (t < kMaxTokens) {
        const long long slot = static_cast<long long>(p.rank) * kMaxTokens + t;
        char *local_record = p.records + slot * kRecordBytes;
        auto write = [&](char *record) {
            if (lane < kTopK) {
                unsigned long long *words = reinterpret_cast<unsigned long long *>(record) + 2 * lane;
                st_relaxed_sys(words, stamped(stamp, static_cast<uint32_t>(e)));
                st_relaxed_sys(words + 1, stamped(stamp, __float_as_uint(w)));
            }
        };
        char *stage = nullptr;
        for (int dst = 0; dst < kRanks; ++dst) {
            if (dst == p.rank || s.masked[dst]) continue;
            if (s.peer_base[dst] != 0) {
                write(on_peer(p.heap, s.peer_base, p.rank, dst, local_record));
                continue;
            }
            if (stage == nullptr) {   // puts read the symmetric heap: the record once into the stage
                stage = p.record_stage + static_cast<long long>(t) * kRecordBytes;
                write(stage);
                __syncwarp();
                __threadfence_system();   // the stage before the transport reads it
            }
            nvshmemx_putmem_signal_nbi_warp(local_record, stage, 16 * kTopK, reinterpret_cast<uint64_t *>(p.record_tags + slot),
                                            epoch, NVSHMEM_SIGNAL_SET, dst);
        }
        t = warp_claim(counter);
        load_record<kTopK, kExperts, TopkT>(p, t, e, w);
    }
}

// Expert side: the packed row of token t under each top-k slot (lane k < kTopK) naming a local
// expert, from the handle alone: the rows of (local expert el, source) are [begin, begin + count)
// of layout_range, and src_info there holds their tokens in ascending order (the source's list
// order; a token named by two slots twice in a row: the last one is taken, as in the oracle).
// Warp-collective. Lane k gives el and the pair's range (count 0: none); it gets
// el * R*T + begin + i for the last i with src_info == t, or -1. While the ranges together hold at
// most 64 rows (K=8 of 288 experts at N=128: ~14) the warp reads them all at once, one memory
// round trip; beyond that each lane searches its own range by bisection. It replaced a row map
// that other warps built in the buffer, with a flag per (local expert, source): each item waited
// for its maps' flags, then read the map (traced: the first items were ready 7.4-12 us into the
// kernel, gated by the slowest map warp of each group).
template <int kTopK, int kSlots>
__device__ __forceinline__ long long find_rows(const int *src_info, int el, long long begin, int count, int t) {
    constexpr unsigned kAll = 0xffffffffu;
    constexpr int kFlat = 64, kRounds = kFlat / 32;
    const int lane = lane_id();
    int inclusive = count;   // prefix sums of the lanes' counts
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(kAll, inclusive, o);
        if (lane >= o) inclusive += v;
    }
    const int total = __shfl_sync(kAll, inclusive, 31), exclusive = inclusive - count;
    const int *rows = src_info + static_cast<long long>(el) * kSlots + begin;   // lane k's pair
    int found = -1;
    if (total <= kFlat) {   // flat index j = (exclusive prefix of slot k) + i: lane j % 32, round j / 32
        int token[kRounds], owner[kRounds];
        const int *at[kRounds];
#pragma unroll
        for (int r = 0; r < kRounds; ++r) owner[r] = token[r] = -1;
#pragma unroll
        for (int k = 0; k < kTopK; ++k) {   // which slot's rows hold flat index j
            const int first = __shfl_sync(kAll, exclusive, k), n = __shfl_sync(kAll, count, k);
            const int *base = reinterpret_cast<const int *>(
                __shfl_sync(kAll, reinterpret_cast<unsigned long long>(rows), k));
#pragma unroll
            for (int r = 0; r < kRounds; ++r) {
                const int j = 32 * r + lane;
                if (j >= first && j < first + n) {
                    owner[r] = k;
                    at[r] = base + (j - first);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < kRounds; ++r)   // all loads in flight before the first use
            if (owner[r] >= 0) token[r] = __ldg(at[r]);
#pragma unroll
        for (int k = 0; k < kTopK; ++k) {   // each slot's highest matching flat index
#pragma unroll
            for (int r = kRounds - 1; r >= 0; --r) {
                const unsigned hit = __ballot_sync(kAll, owner[r] == k && token[r] == t);
                if (hit != 0u && lane == k && found < 0) found = 32 * r + 31 - __clz(hit) - exclusive;
            }
        }
    } else if (count > 0) {   // bisection: the first row whose token is > t, then one step back
        int lo = 0, hi = count;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (__ldg(rows + mid) <= t) lo = mid + 1; else hi = mid;
        }
        if (lo > 0 && __ldg(rows + lo - 1) == t) found = lo - 1;
    }
    return found >= 0 ? static_cast<long long>(el) * kSlots + begin + found : -1;
}

// What one group of warps knows about the (source, token) item it works on, its latest claim,
// and its items whose tags are not sent yet.
template <int kTopK> struct CombineItem {
    long long row[kTopK];   // the rows in x (local expert * R*T + packed row) of the top-k slots naming a
    float weight[kTopK];    // local expert that has one, slots ascending, and their weights
    int rows;               // how many
    int state;
    int claim;
    int pending[32];
};
// Groups of warps per block that take partial-sum items on their own: with one item per block, the
// 256 items at N=128 ran in two rounds on 132 blocks (a claim, two dependent lookups, the sum);
// two groups of 8 warps take them in one. Each group syncs on its own named barrier.
constexpr int kItemGroups = 2;

enum ItemState { kItemSkip, kItemSend, kItemFailed };

// Expert side: for each (source, token) item, one per group of warps and claim (kItemGroups per
// block), remote sources first, the group takes the top-k ids and weights (a remote source's
// record, once its tag arrived; this rank's own topk_idx / topk_weights), finds the rows of the local experts they name (find_rows)
// and stores the partial sum sum_k w_k * row_k (fp32, k ascending) into the source's slot
// [this rank][token] (a direct store, or the stage of a put). Every 32 items and at the end: one
// fence, then all their tags. An item whose ids name no local expert sends nothing: the source does
// not wait for it. Only the slots with a row here are summed (the oracle's +0 for the others leaves
// an fp32 sum that starts at +0 unchanged), so with up to kBatch of them a thread's loads are all
// in flight at once: one memory round trip per item.
template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT, int kThreads>
__device__ void combine_send_partials(const CombineParams &p, BlockState<kRanks> &s, const Guard &ctx,
                                      unsigned long long epoch, CombineItem<kTopK> *items) {
    constexpr int kLocalExperts = kExperts / kRanks, kSlots = kRanks * kMaxTokens;
    // A group of kGroupThreads threads per item. Each thread sums kPerThread chunks of 8 channels
    // (kGroupThreads apart), kBatch rows per step: 16 row loads in flight per thread (H=7168: every
    // chunk of a row in one step).
    constexpr int kGroupThreads = kThreads / kItemGroups, kGroupWarps = kGroupThreads / 32;
    static_assert(kThreads % (32 * kItemGroups) == 0 && kItemGroups < 16, "whole warps per group, hardware barriers 1..15");
    constexpr int kRowBytes = kHidden * 2, kChunks = kHidden / 8, kBatch = 4, kPerThread = 4;
    constexpr long long kPartialBytes = PartialLayout<kChunks>::kBytes;
    constexpr unsigned kAll = 0xffffffffu;
    const int lane = lane_id(), group = warp_id() / kGroupWarps, warp = warp_id() % kGroupWarps;
    const int tid = threadIdx.x % kGroupThreads;   // within the group
    CombineItem<kTopK> &item = items[group];
    auto sync = [&] { group_barrier(1 + group, kGroupThreads); };
    const bool shrink = p.enable_shrink != 0;
    auto source_of = [&](int i) { return (p.rank + 1 + i / kMaxTokens) % kRanks; };   // own tokens last
    auto direct = [&](int src) { return src == p.rank || s.peer_base[src] != 0; };
    const uint32_t stamp = call_stamp(epoch);
    int pending = 0, sent = 0;   // group-uniform
    auto flush = [&] {   // after a group barrier
        if (warp == 0 && pending > 0) {
            fence_acq_rel_sys();   // (every lane) the group's stores, ordered before this by the barrier, before tags / puts
            if (lane < pending) {
                const int i = item.pending[lane], src = source_of(i);
                if (direct(src))
                    st_relaxed_sys(reinterpret_cast<unsigned long long *>(on_peer(
                                       p.heap, s.peer_base, p.rank, src,
                                       p.partial_tags + static_cast<long long>(p.rank) * kMaxTokens + i % kMaxTokens)),
                                   epoch);
            }
            for (int j = 0; j < pending; ++j) {
                const int i = item.pending[j], src = source_of(i), t = i % kMaxTokens;
                if (direct(src)) continue;
                const long long slot = static_cast<long long>(p.rank) * kMaxTokens + t;
                nvshmemx_putmem_signal_nbi_warp(p.partials + slot * kPartialBytes,
                                                p.partial_stage + (static_cast<long long>(src) * kMaxTokens + t) * kPartialBytes,
                                                kPartialBytes, reinterpret_cast<uint64_t *>(p.partial_tags + slot), epoch,
                                                NVSHMEM_SIGNAL_SET, src);
            }
            __syncwarp();
        }
        pending = 0;
    };
    unsigned int *counter = p.tickets + kClaimItems;
    auto claim_item = [&] {   // as warp_claim, for the group
        sync();   // every thread has read the previous claim
        if (tid == 0) item.claim = static_cast<int>(atomicAdd(counter, 1u));
        sync();
        return item.claim;
    };
    for (int i = claim_item(); i < kRanks * kMaxTokens; i = claim_item()) {
        const int src = source_of(i), t = i % kMaxTokens;
        if (s.masked[src]) continue;
        if (warp == 0) {
            const bool own = src == p.rank;
            int w = kReady;
            if (!own && !direct(src) && lane == 0)   // a put: its signal says the whole record is here
                w = wait_tag(ctx, p.record_tags + static_cast<long long>(src) * kMaxTokens + t, epoch, p.mask, shrink, src,
                             kPhaseRecord);
            w = __shfl_sync(kAll, w, 0);
            int e = -1;
            float weight = 0.0f;
            if (!own && w == kReady && lane < kTopK) {   // lane k: slot k's stamped words
                const unsigned long long *words = reinterpret_cast<const unsigned long long *>(
                    p.records + (static_cast<long long>(src) * kMaxTokens + t) * kRecordBytes) + 2 * lane;
                unsigned long long id = 0, wt = 0;
                w = wait_until(ctx, [&] {
                    id = ld_relaxed_sys(words);
                    wt = ld_relaxed_sys(words + 1);
                    return has_stamp(id, stamp) && has_stamp(wt, stamp);
                }, p.mask, shrink, src, kPhaseRecord);
                e = static_cast<int>(static_cast<uint32_t>(id));
                weight = __uint_as_float(static_cast<uint32_t>(wt));
            }
            w = __any_sync(kAll, w == kFailed) ? kFailed : __any_sync(kAll, w == kMasked) ? kMasked : kReady;
            bool local = false, failed = w == kFailed;
            int el = 0, count = 0;
            long long begin = 0;
            if (w == kReady && lane < kTopK) {
                if (own && t < p.num_tokens) {
                    e = expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + lane);
                    weight = __ldg(p.topk_weights + static_cast<long long>(t) * kTopK + lane);
                }
                local = e >= 0 && e < kExperts && e / kLocalExperts == p.rank;
                if (local) {
                    el = e % kLocalExperts;
                    const long long range = __ldg(p.layout_range + el * kRanks + src);
                    begin = range >> 32;
                    count = static_cast<int>(range & 0xffffffffll);
                    if (begin < 0 || count < 0 || begin + count > kSlots) begin = count = 0;   // not a handle of this shape
                }
            }
            const long long row = find_rows<kTopK, kSlots>(p.src_info, el, begin, count, t);
            const unsigned with_row = __ballot_sync(kAll, row >= 0);   // lanes >= kTopK have none
            if (row >= 0) {
                const int j = __popc(with_row & ((1u << lane) - 1u));   // slots ascending
                item.row[j] = row;
                item.weight[j] = weight;
            }
            failed = __any_sync(kAll, failed);
            local = __any_sync(kAll, local);
            if (lane == 0) {
                item.rows = __popc(with_row);
                item.state = failed ? kItemFailed : local ? kItemSend : kItemSkip;
            }
            if (local) trace_first(p.trace, kTrAuxA);
        }
        sync();
        const int state = item.state;
        if (state == kItemFailed) break;   // group-uniform; the failure is recorded, the kernel winds down
        if (state == kItemSend) {
            const long long slot = static_cast<long long>(p.rank) * kMaxTokens + t;
            char *dst = direct(src) ? on_peer(p.heap, s.peer_base, p.rank, src, p.partials + slot * kPartialBytes)
                                    : p.partial_stage + (static_cast<long long>(src) * kMaxTokens + t) * kPartialBytes;
            const int rows = item.rows;
            for (int c0 = tid; c0 < kChunks; c0 += kPerThread * kGroupThreads) {
                float acc[kPerThread][8] = {};   // +0, as the oracle starts
                for (int j0 = 0; j0 < rows; j0 += kBatch) {
                    int4 v[kPerThread][kBatch];
#pragma unroll
                    for (int q = 0; q < kPerThread; ++q) {
                        const int c = c0 + q * kGroupThreads;
#pragma unroll
                        for (int b = 0; b < kBatch; ++b)
                            if (c < kChunks && j0 + b < rows)
                                v[q][b] = ld_nc_v4(reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + item.row[j0 + b] * kRowBytes) + c);
                    }
#pragma unroll
                    for (int q = 0; q < kPerThread; ++q) {
#pragma unroll
                        for (int b = 0; b < kBatch; ++b) {
                            if (j0 + b >= rows) break;
                            const float wk = item.weight[j0 + b];
                            const uint32_t u[4] = {(uint32_t)v[q][b].x, (uint32_t)v[q][b].y, (uint32_t)v[q][b].z, (uint32_t)v[q][b].w};
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                acc[q][2 * j] = __fadd_rn(acc[q][2 * j], __fmul_rn(bf16_lo(u[j]), wk));
                                acc[q][2 * j + 1] = __fadd_rn(acc[q][2 * j + 1], __fmul_rn(bf16_hi(u[j]), wk));
                            }
                        }
                    }
                }
#pragma unroll
                for (int q = 0; q < kPerThread; ++q) {
                    const int c = c0 + q * kGroupThreads;
                    if (c >= kChunks) break;
                    st_cg_v4(PartialLayout<kChunks>::lo(dst, c), make_int4(__float_as_int(acc[q][0]), __float_as_int(acc[q][1]),
                                                                           __float_as_int(acc[q][2]), __float_as_int(acc[q][3])));
                    st_cg_v4(PartialLayout<kChunks>::hi(dst, c), make_int4(__float_as_int(acc[q][4]), __float_as_int(acc[q][5]),
                                                                           __float_as_int(acc[q][6]), __float_as_int(acc[q][7])));
                }
            }
            trace_first(p.trace, kTrAuxB);
            if (tid == 0) item.pending[pending] = i;
            ++pending;
            ++sent;
        }
        sync();   // the item table is rewritten next; the pending list before a flush
        if (pending == 32) flush();
    }
    trace_stamp(p.trace, kTrAuxC);
    flush();
    if (warp == 0) trace_count(p.trace, sent);
}

// Source side: one block per token; in each warp the first lane naming each live expert rank waits
// for that rank's partial sum, the ranks are put in ascending order, and the sums are added in
// fp32 in that order, then rounded to bf16.
template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT, int kThreads>
__device__ void combine_recv(const CombineParams &p, const BlockState<kRanks> &s, const Guard &ctx,
                             unsigned long long epoch, int (*ranks)[32]) {
    constexpr int kLocalExperts = kExperts / kRanks;
    // Each thread sums kPerThread chunks of 8 channels (kThreads apart), kBatch ranks per step:
    // 2 x 16-byte loads per partial and chunk, 16 loads in flight per thread.
    constexpr int kRowBytes = kHidden * 2, kChunks = kHidden / 8, kBatch = 4, kPerThread = 2;
    constexpr long long kPartialBytes = PartialLayout<kChunks>::kBytes;
    constexpr unsigned kAll = 0xffffffffu;
    const int warp = warp_id(), lane = lane_id();
    const bool shrink = p.enable_shrink != 0;
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        int dst = -1;   // lane k: the live rank holding top-k slot k's expert
        if (lane < kTopK) {
            const int e = expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + lane);
            if (e >= 0 && !s.masked[e / kLocalExperts]) dst = e / kLocalExperts;
        }
        // The first lane naming each rank waits for it. Found with shuffles, not __match_any_sync:
        // on 2 x H200 (driver 580, CUDA 13.0) every warp of this loop stalled for good at the
        // match (traced: no lane reached the wait after it), so no bounded wait could end it.
        bool first = dst >= 0;
#pragma unroll
        for (int j = 0; j < kTopK; ++j) {
            const int other = __shfl_sync(kAll, dst, j);
            first = first && !(j < lane && other == dst);
        }
        int w = kMasked;
        if (first) {
            const unsigned long long t0 = globaltimer_ns();
            w = wait_tag(ctx, p.partial_tags + static_cast<long long>(dst) * kMaxTokens + t, epoch, p.mask, shrink, dst,
                         kPhasePartial);
            if (warp == 0 && w == kReady && p.wait_recv_cost_stats != nullptr)
                atomicAdd(reinterpret_cast<unsigned long long *>(p.wait_recv_cost_stats) + dst, globaltimer_ns() - t0);
        }
        if (__any_sync(kAll, w == kFailed)) return;
        if (t == blockIdx.x) trace_stamp(p.trace, kTrRecvReady);
        const unsigned ready = __ballot_sync(kAll, first && w == kReady);
        int position = 0;   // among the ready ranks, ascending
        for (int j = 0; j < 32; ++j) {
            const int other = __shfl_sync(kAll, dst, j);
            position += ((ready >> j) & 1u) && other < dst;
        }
        if ((ready >> lane) & 1u) ranks[warp][position] = dst;
        const int count = __popc(ready);
        __syncwarp();   // the lanes' acquires and the rank table before the partial loads
        for (int c0 = warp * 32 + lane; c0 < kChunks; c0 += kPerThread * kThreads) {
            float acc[kPerThread][8] = {};   // +0, as the oracle starts
            for (int j0 = 0; j0 < count; j0 += kBatch) {
                int4 v[kPerThread][kBatch][2];
#pragma unroll
                for (int q = 0; q < kPerThread; ++q) {
                    const int c = c0 + q * kThreads;
#pragma unroll
                    for (int b = 0; b < kBatch; ++b) {
                        v[q][b][0] = v[q][b][1] = make_int4(0, 0, 0, 0);
                        if (c < kChunks && j0 + b < count) {
                            char *partial = p.partials + (static_cast<long long>(ranks[warp][j0 + b]) * kMaxTokens + t) * kPartialBytes;
                            v[q][b][0] = ld_cg_v4(PartialLayout<kChunks>::lo(partial, c));
                            v[q][b][1] = ld_cg_v4(PartialLayout<kChunks>::hi(partial, c));
                        }
                    }
                }
#pragma unroll
                for (int q = 0; q < kPerThread; ++q) {
#pragma unroll
                    for (int b = 0; b < kBatch; ++b) {
                        if (j0 + b >= count) break;
                        const int f[8] = {v[q][b][0].x, v[q][b][0].y, v[q][b][0].z, v[q][b][0].w,
                                          v[q][b][1].x, v[q][b][1].y, v[q][b][1].z, v[q][b][1].w};
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[q][j] = __fadd_rn(acc[q][j], __int_as_float(f[j]));
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < kPerThread; ++q) {
                const int c = c0 + q * kThreads;
                if (c >= kChunks) break;
                reinterpret_cast<int4 *>(static_cast<char *>(p.out) + static_cast<long long>(t) * kRowBytes)[c] =
                    pack_bf16x8(acc[q]);
            }
        }
        __syncwarp();   // the rank table is rewritten for the next token
    }
}

}  // namespace ll
}  // namespace epcomm
