// Low-latency dispatch / combine over the NVSHMEM symmetric heap. Host side, buffer layout and the
// sizes of every region: epcomm/ops/low_latency.py.
//
// Transfers. A peer whose heap is mapped (NVLink, `peer_bases[r] != 0`, when allowed) is written with
// plain vector stores, then one release store of a 64-bit tag; any other peer gets
// nvshmemx_putmem_signal_nbi_warp with a SET of the same tag (NVSHMEM's P2P transport does the same
// stores + fence + signal; its proxy transport carries it across nodes). Either way the sending
// kernel finishes the transfer itself: nothing is left for a resident kernel, so with
// return_recv_hook no SM is held between the send launch and the hook's receive launch.
//
// Tags and CUDA graphs. Every rank counts the calls it sent and received on each of the two buffer
// sets (`epochs`, device memory). A sender tags its messages with its send count; a receiver waits
// for a tag equal to its receive count. Both advance once per call on every rank, so they agree
// without any host-provided sequence number, and a replayed graph simply advances them again.
// The last block of each launch part (ticket counter) stores the new count.
//
// Buffer-set reuse. A receiver that has finished with a set writes its receive count into every
// sender's `acks[receiver]` (the last block, after all blocks stopped reading). A sender's n-th send
// on a set first waits (bounded) until each destination acknowledged n-1 receives there, so a slow
// peer's unread data is never overwritten, whatever order sends and hooks are called in.
//
// Dispatch. Send part: each block casts its tokens (FP8 e4m3 with per-128-channel scales, or BF16)
// into shared memory once (before waiting for the release, so that round trip overlaps the loads)
// and writes each token ONCE per destination rank holding any of its top-k experts, into the
// destination's slot [source rank][token] (a token with 4 experts on a peer crosses NVLink once, not
// 4 times). Then, per expert, one warp writes the ascending list of this rank's tokens routed there
// (a token appears once per top-k slot naming the expert) and its length: the list tells the
// receiver which tokens each expert takes and where each row goes. Receive part: for every (local
// expert, source) pair a group of warps waits for the lists of sources <= that source (prefix =
// first row), then for each listed token's message tag, and copies the message (payload and scales
// in one batch of loads) into the packed output.
//
// Combine. Send part: every valid row of every (local expert, source) pair goes back to the
// source's slot [global expert][token]. Receive part: one block per token waits for the rows of its
// top-k experts and sums w_k * row in fp32, k ascending, exactly as epcomm.reference.oracle does.
//
// Fault tolerance. Waits go through WaitContext. With enable_shrink a peer that times out is masked
// (mask[peer] = 1) and treated as sending nothing; without it the wait records a PeerTimeout and the
// kernel winds down. Masked peers are neither sent to nor waited for.
#include "low_latency_dispatch.cuh"

namespace epcomm {
namespace ll {

struct DispatchParams {
    const void *x;                     // [N, H] bf16
    const void *topk_idx;              // [N, K] TopkT
    void *recv_x;                      // [E_l, R*T, H] e4m3 or bf16
    void *recv_scales;                 // [E_l, S, R*T] f32 or [E_l, S/4, R*T] i32 (UE8M0); null for bf16
    int *recv_src_info;                // [E_l, R*T]
    long long *recv_layout_range;      // [E_l, R]
    int *recv_count;                   // [E_l]
    int *cumulative_recv_stats;        // [E_l] or null
    long long *wait_recv_cost_stats;   // [R] or null
    char *heap;                        // this rank's base of the symmetric buffer
    const long long *peer_bases;       // [R] NVLink mapping of each rank's buffer, 0 = none
    unsigned long long *acks;          // [R] this set's acknowledgements (see the top of this file)
    unsigned long long *epochs;        // [2] calls this rank sent / received on this set
    unsigned int *tickets;             // [2] blocks done with the send / receive part of this launch
    int *mask;                         // [R] nonzero = masked rank
    unsigned long long *token_tags;    // [R][T]: one per (source rank, token)
    unsigned long long *list_tags;     // [E_l][R]
    char *lists;                       // [E_l][R][16 + 4T]
    char *messages;                    // [R][T][message bytes]
    char *message_stage;               // [T][message bytes], source of puts
    char *list_stage;                  // [E][16 + 4T], source of puts
    ErrorRecord *err;
    unsigned long long timeout_ns;
    int num_tokens;
    int rank;
    int phases;
    int use_nvlink;                    // 0: every other rank through NVSHMEM puts
    int stage_for_puts;                // some destination needs puts: fill the stages
    int enable_shrink;                 // mask a peer that times out instead of failing
    int op;                            // epcomm.runtime.status op id
    int pad;
};
static_assert(sizeof(DispatchParams) == 216, "mirrored by epcomm.ops.low_latency.DispatchParams");

struct CombineParams {
    const void *x;                     // [E_l, R*T, H] bf16
    const int *src_info;               // [E_l, R*T]
    const long long *layout_range;     // [E_l, R]
    const void *topk_idx;              // [N, K] TopkT
    const float *topk_weights;         // [N, K]
    void *out;                         // [N, H] bf16
    long long *wait_recv_cost_stats;   // [R] or null
    char *heap;
    const long long *peer_bases;
    unsigned long long *acks;
    unsigned long long *epochs;
    unsigned int *tickets;
    int *mask;
    unsigned long long *row_tags;      // [E][T]
    char *rows;                        // [E][T][H] bf16
    char *row_stage;                   // [E_l][R*T][H] bf16: the zero-copy buffer, source of puts
    ErrorRecord *err;
    unsigned long long timeout_ns;
    int num_tokens;
    int rank;
    int phases;
    int use_nvlink;
    int enable_shrink;
    int op;
};
static_assert(sizeof(CombineParams) == 168, "mirrored by epcomm.ops.low_latency.CombineParams");

// ==== dispatch ===================================================================================
// The send part. A token goes once to each rank that holds one of its experts (not once per
// expert: with K=8 of 288 experts on 2 ranks that is ~1 message per rank instead of ~4), into the
// destination's slot [source rank][token]; the lists tell the receiver which experts want it.
template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, bool kFP8, bool kRoundScale,
          class TopkT, int kThreads>
__device__ void dispatch_send(const DispatchParams &p, BlockState<kRanks> &s, const WaitContext &ctx,
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
    // round trip overlaps the loads of x.
    int expert;
    load_round(first_round, expert);
    wait_released(s, ctx, p.acks, epoch, p.mask, p.enable_shrink != 0);   // ends with __syncthreads
    if (s.abort) return;
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
                if (lane == 0)
                    st_release_sys(reinterpret_cast<unsigned long long *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_tag)), epoch);
            } else {
                __threadfence_system();   // the stage (written by the group) before the transport reads it
                nvshmemx_putmem_signal_nbi_warp(local_msg, stage, M::kBytes, reinterpret_cast<uint64_t *>(local_tag),
                                                epoch, NVSHMEM_SIGNAL_SET, dst);
            }
        }
    }

    // Token lists, one expert per warp, the warps without messages first. Each warp then ends the
    // send part on its own (finish_send) and, in a fused launch, starts receiving.
    const int total = kWarps * gridDim.x;
    for (int e = (kWarps - 1 - warp) * gridDim.x + blockIdx.x; e < kExperts; e += total) {
        const int dst = e / kLocalExperts;
        if (s.masked[dst]) continue;
        const long long pair = static_cast<long long>(e % kLocalExperts) * kRanks + p.rank;
        char *local_list = p.lists + pair * kListBytes;
        const bool direct = dst == p.rank || s.peer_base[dst] != 0;
        char *list = direct ? on_peer(p.heap, s.peer_base, p.rank, dst, local_list)
                            : p.list_stage + static_cast<long long>(e) * kListBytes;
        int *entries = reinterpret_cast<int *>(list + kListHeaderBytes);
        // kScanRounds x 32 tokens per step: their top-k loads are all in flight at once (one L2
        // round trip per step instead of one per 32 tokens).
        constexpr int kScanRounds = kTopK <= 8 ? 4 : kTopK <= 16 ? 2 : 1;
        int count = 0;
        for (int first = 0; first < p.num_tokens; first += 32 * kScanRounds) {
            int hits[kScanRounds];
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
        unsigned long long *local_tag = p.list_tags + pair;
        if (direct) {
            if (lane == 0)
                st_release_sys(reinterpret_cast<unsigned long long *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_tag)), epoch);
        } else {
            __threadfence_system();
            nvshmemx_putmem_signal_nbi_warp(local_list, list, kListHeaderBytes + 4 * count,
                                            reinterpret_cast<uint64_t *>(local_tag), epoch, NVSHMEM_SIGNAL_SET, dst);
        }
    }
}

template <int kHidden, int kRanks, int kExperts, int kMaxTokens, bool kFP8, bool kUE8M0, int kThreads>
__device__ void dispatch_recv(const DispatchParams &p, const BlockState<kRanks> &s, const WaitContext &ctx,
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
                const Wait w = wait_tag(ctx, p.list_tags + q, epoch, p.mask, shrink, r, 1);
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
            if (lane == 0) w = wait_tag(ctx, p.token_tags + slot, epoch, p.mask, shrink, src, 2);
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

// Dynamic shared memory: DispatchShape::kSmemBytes.
template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, bool kFP8, bool kRoundScale,
          bool kUE8M0, class TopkT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
    static_assert(kExperts % kRanks == 0 && kThreads % 32 == 0 && kRanks <= kThreads, "shape");
    static_assert(!kFP8 || kHidden % kScaleChannels == 0, "FP8 needs hidden % 128 == 0");
    static_assert(kHidden % 8 == 0 && (!kUE8M0 || (kFP8 && kRoundScale && kHidden % 512 == 0)), "hidden / UE8M0");
    static_assert(kTopK >= 1 && kTopK <= 32, "one lane per top-k slot");
    extern __shared__ __align__(16) char smem[];
    __shared__ BlockState<kRanks> s;
    const WaitContext ctx = WaitContext::make(p.err, p.timeout_ns, p.op, p.rank);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile(p.epochs) + 1;   // in flight with the block state loads
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
        dispatch_send<kHidden, kTopK, kRanks, kExperts, kMaxTokens, kFP8, kRoundScale, TopkT, kThreads>(p, s, ctx, epoch, smem);
        finish_send<kRanks, kThreads / 32>(s, p.tickets, p.epochs, epoch);   // per warp: see dispatch_send's end
    } else {
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    }
    if (p.phases & kRecv) {
        const unsigned long long epoch = ld_volatile(p.epochs + 1) + 1;
        dispatch_recv<kHidden, kRanks, kExperts, kMaxTokens, kFP8, kUE8M0, kThreads>(p, s, ctx, epoch);
        finish_recv(s, ctx, p.tickets + 1, p.epochs + 1, epoch, nullptr, 0, p.acks, p.mask, p.heap, p.rank);
    }
}

// ==== combine ====================================================================================
// The first row each warp will send is pulled into L2 before the release wait, so that round trip
// overlaps the row's first loads from HBM (no remote access here).
template <int kHidden, int kRanks, int kExperts, int kMaxTokens, int kThreads>
__device__ void combine_prefetch(const CombineParams &p, const BlockState<kRanks> &s) {
    constexpr int kLocalExperts = kExperts / kRanks, kSlots = kRanks * kMaxTokens, kWarps = kThreads / 32;
    constexpr int kRowBytes = kHidden * 2, kLines = (kRowBytes + 127) / 128;
    const PairSplit split(blockIdx.x * kWarps + warp_id(), gridDim.x * kWarps, kLocalExperts * kRanks);
    if (split.p0 >= kLocalExperts * kRanks || s.masked[split.p0 % kRanks]) return;
    const long long range = __ldg(p.layout_range + split.p0);
    const long long begin = range >> 32, count = range & 0xffffffffll;
    if (begin < 0 || begin + count > kSlots || split.j0 >= count) return;
    const char *row = static_cast<const char *>(p.x) + ((split.p0 / kRanks) * static_cast<long long>(kSlots) + begin + split.j0) * kRowBytes;
    for (int l = lane_id(); l < kLines; l += 32) prefetch_l2(row + 128 * l);
}

// The row of pair position `i` (relative to the pair's begin) to send, or -1: a token listed twice
// (an expert named in two top-k slots) gets its last row, as in the oracle; the earlier copy would
// race for the same slot.
template <int kMaxTokens>
__device__ __forceinline__ int combine_token(const int *src_info, long long row, long long i, long long count) {
    const int t = __ldg(src_info + row);
    if (t < 0 || t >= kMaxTokens) return -1;
    if (i + 1 < count && __ldg(src_info + row + 1) == t) return -1;
    return t;
}

template <int kHidden, int kRanks, int kExperts, int kMaxTokens, int kThreads>
__device__ void combine_send(const CombineParams &p, const BlockState<kRanks> &s, unsigned long long epoch) {
    constexpr int kLocalExperts = kExperts / kRanks, kSlots = kRanks * kMaxTokens, kWarps = kThreads / 32;
    constexpr int kRowBytes = kHidden * 2;
    const int warp = warp_id(), lane = lane_id();
    const bool zero_copy = p.x == p.row_stage;
    const PairSplit split(blockIdx.x * kWarps + warp, gridDim.x * kWarps, kLocalExperts * kRanks);
    for (int pair = split.p0; pair < kLocalExperts * kRanks; pair += split.step) {
        const int el = pair / kRanks, dst = pair % kRanks;
        if (s.masked[dst]) continue;
        const long long range = __ldg(p.layout_range + pair);
        const long long begin = range >> 32, count = range & 0xffffffffll;
        if (begin < 0 || begin + count > kSlots) continue;   // not a handle of this shape
        const long long expert = static_cast<long long>(p.rank) * kLocalExperts + el;
        const long long first_row = el * static_cast<long long>(kSlots) + begin;
        if (dst == p.rank || s.peer_base[dst] != 0) {
            // Stores: every row of this warp in the pair first (16 loads per lane in flight: a 14 KB
            // row in two rounds), then ONE fence and all their tags, one lane each, so a warp with
            // several rows does not wait a full NVLink drain per row before starting the next.
            for (long long i = split.j0; i < count; i += split.stride) {
                const int t = combine_token<kMaxTokens>(p.src_info, first_row + i, i, count);
                if (t < 0) continue;
                const int4 *src_row = reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + (first_row + i) * kRowBytes);
                char *local_slot = p.rows + (expert * kMaxTokens + t) * kRowBytes;
                warp_copy<16>(reinterpret_cast<int4 *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_slot)), kRowBytes / 16,
                              lane, [&](int u) { return ld_nc_v4(src_row + u); });
            }
            __syncwarp();
            fence_acq_rel_sys();   // the rows above before any of their tags
            for (long long i = split.j0 + static_cast<long long>(lane) * split.stride; i < count; i += 32ll * split.stride) {
                const int t = combine_token<kMaxTokens>(p.src_info, first_row + i, i, count);
                if (t >= 0)
                    st_relaxed_sys(reinterpret_cast<unsigned long long *>(
                                       on_peer(p.heap, s.peer_base, p.rank, dst, p.row_tags + expert * kMaxTokens + t)), epoch);
            }
        } else {
            for (long long i = split.j0; i < count; i += split.stride) {
                const int t = combine_token<kMaxTokens>(p.src_info, first_row + i, i, count);
                if (t < 0) continue;
                const char *src_row = static_cast<const char *>(p.x) + (first_row + i) * kRowBytes;
                const char *source = src_row;
                if (!zero_copy) {   // puts read from the symmetric heap (registered for every transport)
                    char *stage = p.row_stage + (first_row + i) * kRowBytes;
                    warp_copy(reinterpret_cast<int4 *>(stage), kRowBytes / 16, lane,
                              [&](int u) { return ld_nc_v4(reinterpret_cast<const int4 *>(src_row) + u); });
                    source = stage;
                }
                __threadfence_system();
                nvshmemx_putmem_signal_nbi_warp(p.rows + (expert * kMaxTokens + t) * kRowBytes, source, kRowBytes,
                                                reinterpret_cast<uint64_t *>(p.row_tags + expert * kMaxTokens + t),
                                                epoch, NVSHMEM_SIGNAL_SET, dst);
            }
        }
    }
}

template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT, int kThreads>
__device__ void combine_recv(const CombineParams &p, const BlockState<kRanks> &s, const WaitContext &ctx,
                             unsigned long long epoch, int (*experts)[kTopK], float (*weights)[kTopK]) {
    constexpr int kLocalExperts = kExperts / kRanks;
    // Each thread sums kPerThread chunks (kThreads apart) at once, kBatch top-k rows per step:
    // 16 row loads in flight per thread.
    constexpr int kRowBytes = kHidden * 2, kChunks = kHidden / 8, kBatch = 8, kPerThread = 2;
    constexpr unsigned kAll = 0xffffffffu;
    const int warp = warp_id(), lane = lane_id();
    const bool shrink = p.enable_shrink != 0;
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        // Lane k waits for the row of top-k slot k (every warp of the block, independently).
        int e = -1, w = kMasked;
        float weight = 0.0f;
        if (lane < kTopK) {
            e = expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + lane);
            weight = __ldg(p.topk_weights + static_cast<long long>(t) * kTopK + lane);
            if (e >= 0 && !s.masked[e / kLocalExperts]) {
                const unsigned long long t0 = globaltimer_ns();
                w = wait_tag(ctx, p.row_tags + static_cast<long long>(e) * kMaxTokens + t, epoch, p.mask, shrink,
                             e / kLocalExperts, 1);
                if (warp == 0 && w == kReady && p.wait_recv_cost_stats != nullptr)
                    atomicAdd(reinterpret_cast<unsigned long long *>(p.wait_recv_cost_stats) + e / kLocalExperts,
                              globaltimer_ns() - t0);
            }
        }
        if (__any_sync(kAll, w == kFailed)) return;
        const unsigned valid = __ballot_sync(kAll, lane < kTopK && w == kReady);
        if (lane < kTopK) {
            experts[warp][lane] = e;
            weights[warp][lane] = weight;
        }
        __syncwarp();   // the lanes' acquires and the shared table before the row loads
        for (int c0 = warp * 32 + lane; c0 < kChunks; c0 += kPerThread * kThreads) {
            float acc[kPerThread][8];
#pragma unroll
            for (int q = 0; q < kPerThread; ++q)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[q][j] = 0.0f;
#pragma unroll
            for (int k0 = 0; k0 < kTopK; k0 += kBatch) {
                int4 v[kPerThread][kBatch];
#pragma unroll
                for (int q = 0; q < kPerThread; ++q) {
                    const int c = c0 + q * kThreads;
#pragma unroll
                    for (int b = 0; b < kBatch; ++b) {
                        const int k = k0 + b;
                        v[q][b] = make_int4(0, 0, 0, 0);
                        if (c < kChunks && k < kTopK && ((valid >> k) & 1u))
                            v[q][b] = ld_cg_v4(p.rows + (static_cast<long long>(experts[warp][k]) * kMaxTokens + t) * kRowBytes + 16 * c);
                    }
                }
#pragma unroll
                for (int q = 0; q < kPerThread; ++q) {
#pragma unroll
                    for (int b = 0; b < kBatch; ++b) {
                        const int k = k0 + b;
                        if (k >= kTopK) break;
                        const bool used = (valid >> k) & 1u;
                        const uint32_t u[4] = {(uint32_t)v[q][b].x, (uint32_t)v[q][b].y, (uint32_t)v[q][b].z, (uint32_t)v[q][b].w};
#pragma unroll
                        for (int j = 0; j < 4; ++j) {   // unused slots add +0, as the oracle's where(...)
                            acc[q][2 * j] = __fadd_rn(acc[q][2 * j], used ? __fmul_rn(bf16_lo(u[j]), weights[warp][k]) : 0.0f);
                            acc[q][2 * j + 1] = __fadd_rn(acc[q][2 * j + 1], used ? __fmul_rn(bf16_hi(u[j]), weights[warp][k]) : 0.0f);
                        }
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < kPerThread; ++q) {
                const int c = c0 + q * kThreads;
                if (c >= kChunks) break;
                int4 packed;
                packed.x = static_cast<int>(bf16_bits(acc[q][0]) | (bf16_bits(acc[q][1]) << 16));
                packed.y = static_cast<int>(bf16_bits(acc[q][2]) | (bf16_bits(acc[q][3]) << 16));
                packed.z = static_cast<int>(bf16_bits(acc[q][4]) | (bf16_bits(acc[q][5]) << 16));
                packed.w = static_cast<int>(bf16_bits(acc[q][6]) | (bf16_bits(acc[q][7]) << 16));
                reinterpret_cast<int4 *>(static_cast<char *>(p.out) + static_cast<long long>(t) * kRowBytes)[c] = packed;
            }
        }
        __syncwarp();   // the shared table is rewritten for the next token
    }
}

template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
    static_assert(kExperts % kRanks == 0 && kThreads % 32 == 0 && kRanks <= kThreads, "shape");
    static_assert(kHidden % 8 == 0 && kTopK >= 1 && kTopK <= 32, "hidden % 8 == 0, 1 <= top-k <= 32");
    __shared__ BlockState<kRanks> s;
    __shared__ int experts[kThreads / 32][kTopK];
    __shared__ float weights[kThreads / 32][kTopK];
    const WaitContext ctx = WaitContext::make(p.err, p.timeout_ns, p.op, p.rank);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile(p.epochs) + 1;   // in flight with the block state loads
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
        combine_prefetch<kHidden, kRanks, kExperts, kMaxTokens, kThreads>(p, s);
        wait_released(s, ctx, p.acks, epoch, p.mask, p.enable_shrink != 0);
        if (!s.abort) combine_send<kHidden, kRanks, kExperts, kMaxTokens, kThreads>(p, s, epoch);
        finish_send<kRanks, kThreads / 32>(s, p.tickets, p.epochs, epoch);
    } else {
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    }
    if (p.phases & kRecv) {
        const unsigned long long epoch = ld_volatile(p.epochs + 1) + 1;
        combine_recv<kHidden, kTopK, kRanks, kExperts, kMaxTokens, TopkT, kThreads>(p, s, ctx, epoch, experts, weights);
        finish_recv(s, ctx, p.tickets + 1, p.epochs + 1, epoch, nullptr, 0, p.acks, p.mask, p.heap, p.rank);
    }
}

}  // namespace ll
}  // namespace epcomm
