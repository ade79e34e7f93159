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
// The last block of each launch part (ticket counter) stores the new count and resets its counters.
// The combine's top-k records go to NVLink peers as stamped words instead (protocol: stamped()):
// each 64-bit word carries a 32-bit mix of the count beside its value, so it needs neither a tag
// nor the fence before one. They live in the signal region (zeroed by clean_low_latency_buffer,
// never shared with another phase's data), and every call rewrites every slot it reads.
//
// Buffer-set reuse. A receiver that has finished with a set writes its receive count into every
// sender's `acks[receiver]` (the last block, after all blocks stopped reading). A sender's n-th send
// on a set first waits (bounded) until each destination acknowledged n-1 receives there, so a slow
// peer's unread data is never overwritten, whatever order sends and hooks are called in.
//
// Dispatch. Send part: each block casts its first tokens (FP8 e4m3 with per-128-channel scales, or
// BF16) into shared memory (before waiting for the release, so that round trip overlaps the loads).
// Then, per expert, one warp writes the ascending list of this rank's tokens routed there (a token
// appears once per top-k slot naming the expert) and its length: the list tells the receiver which
// tokens each expert takes and where each row goes. The lists go first, so that they do not queue
// behind the messages on the link. Then each token is written ONCE per destination rank holding any
// of its top-k experts, into the destination's slot [source rank][token] (a token with 4 experts on
// a peer crosses NVLink once, not 4 times). Receive part: for every (local expert, source) pair a
// group of warps waits for the lists of sources <= that source (prefix = first row), then for each
// listed token's message tag, and copies the message (payload and scales in one batch of loads)
// into the packed output.
//
// Combine. A token's rows on one expert rank are summed THERE, so one fp32 partial sum per (token,
// expert rank) crosses the link instead of one bf16 row per (token, expert): with K=8 of 288 experts
// on 2 ranks ~4 rows per token and rank, so half the bytes (fp32 keeps the oracle's fp32
// accumulation; only the order of the additions changes, and the oracle describes the new order).
// Send part, after the release wait, its work claimed from per-set counters in this order (so the
// running blocks, however few, finish everything the others wait for before waiting themselves):
// source side, every other live rank gets this rank's top-k record (K expert ids, K weights) of
// every token slot t < T; expert side, for each (source, token) whose ids (the source's record, or
// this rank's own top-k) name one of this rank's experts, one group of warps (kItemGroups per
// block) finds the token's row under each of them in the handle (find_rows: the rows of a (local
// expert, source) pair hold ascending tokens) and sums w_k * row_k in fp32, k ascending over the
// local experts, into the source's slot [expert rank][token]. Receive part: one
// block per token waits for the partial sum of each rank holding one of its experts and adds them
// in fp32, ranks ascending, then rounds to bf16, exactly as epcomm.reference.oracle.ll_combine_rows.
// An ack now also covers the send part's reads of the records (finish_recv waits for its end).
//
// Fault tolerance. Waits go through a Guard (common/timeout.cuh). With enable_shrink a peer that
// times out is masked (mask[peer] = 1) and treated as sending nothing; without it the wait records a
// PeerTimeout (host-mapped record, once) and raises this rank's sticky flag (device memory, `failed`),
// which every other wait polls, so the kernel and later ones wind down. Masked peers are neither
// sent to nor waited for.
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
    unsigned int *tickets;             // [kCounters]: send / receive tickets of this launch (enum Counter)
    int *mask;                         // [R] nonzero = masked rank
    unsigned int *failed;              // nonzero once a wait of this rank failed (Guard's sticky flag)
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
    unsigned long long *trace;         // [blocks][warps][kTraceSlots] in EPCOMM_LL_TRACE builds, else null
};
static_assert(sizeof(DispatchParams) == 232, "mirrored by epcomm.ops.low_latency.DispatchParams");

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
    unsigned int *tickets;             // [kCounters]: tickets, then the send part's claims (enum Counter)
    int *mask;
    unsigned int *failed;
    unsigned long long *record_tags;   // [R][T]: one per (source rank, token), put sources only
    unsigned long long *partial_tags;  // [R][T]: one per (expert rank, token)
    char *records;                     // [R][T][kRecordBytes] stamped words, by source rank (signal region)
    char *partials;                    // [R][T][H] f32, by expert rank, channels in PartialLayout order (protocol)
    char *record_stage;                // [T][kRecordBytes], source of puts
    char *partial_stage;               // [R][T][H] f32, by source rank, source of puts
    ErrorRecord *err;
    unsigned long long timeout_ns;
    int num_tokens;
    int rank;
    int phases;
    int use_nvlink;
    int enable_shrink;
    int op;
    unsigned long long *trace;         // [blocks][warps][kTraceSlots] in EPCOMM_LL_TRACE builds, else null
};
static_assert(sizeof(CombineParams) == 208, "mirrored by epcomm.ops.low_latency.CombineParams");
// A combine top-k record: per top-k slot two stamped words (protocol: stamped()), the expert id and
// the weight's bits; sized for MAX_TOPK = 32.
constexpr int kRecordBytes = 512;
// epcomm.ops.low_latency.COMBINE_PHASES
enum CombinePhase { kPhaseRelease, kPhaseRecord, kPhasePartial, kPhaseSendEnd };

// ==== dispatch ===================================================================================
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
    const Guard ctx = Guard::make(p.failed, p.err, p.timeout_ns, p.op, p.rank);
    trace_stamp(p.trace, kTrStart);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile_u64(p.epochs) + 1;   // in flight with the block state loads
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
        dispatch_send<kHidden, kTopK, kRanks, kExperts, kMaxTokens, kFP8, kRoundScale, TopkT, kThreads>(p, s, ctx, epoch, smem);
        finish_send<kRanks, kThreads / 32, false>(s, p.tickets, p.epochs, epoch);   // per warp: see dispatch_send's end
        trace_stamp(p.trace, kTrSendDone);
    } else {
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    }
    if (p.phases & kRecv) {
        const unsigned long long epoch = ld_volatile_u64(p.epochs + 1) + 1;
        trace_stamp(p.trace, kTrRecvStart);
        dispatch_recv<kHidden, kRanks, kExperts, kMaxTokens, kFP8, kUE8M0, kThreads>(p, s, ctx, epoch);
        trace_stamp(p.trace, kTrRecvDone);
        finish_recv(s, ctx, p.tickets + kTicketRecv, p.epochs + 1, epoch, nullptr, 0, p.acks, p.mask, p.heap, p.rank);
        trace_stamp(p.trace, kTrEnd);
    }
}

// ==== combine ====================================================================================
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
// two groups of 8 warps take them in one. Measured (bench/NOTES.md "Session 3"): hook send 30.7 ->
// 28.9 us, the fused kernel unchanged. Each group syncs on its own named barrier.
constexpr int kItemGroups = 2;

// Barrier of `threads` threads (a group of whole warps) on hardware barrier `id` (1..15; 0 is
// __syncthreads's).
__device__ __forceinline__ void group_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
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
                float acc[kPerThread][8];
#pragma unroll
                for (int q = 0; q < kPerThread; ++q)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[q][j] = 0.0f;
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
            float acc[kPerThread][8];
#pragma unroll
            for (int q = 0; q < kPerThread; ++q)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[q][j] = 0.0f;
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

template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
    static_assert(kExperts % kRanks == 0 && kThreads % 32 == 0 && kRanks <= kThreads, "shape");
    static_assert(kHidden % 8 == 0 && kTopK >= 1 && kTopK <= 32 && 16 * kTopK <= kRecordBytes,
                  "hidden % 8 == 0, 1 <= top-k <= 32");
    __shared__ BlockState<kRanks> s;
    __shared__ CombineItem<kTopK> items[kItemGroups];
    __shared__ int ranks[kThreads / 32][32];
    const Guard ctx = Guard::make(p.failed, p.err, p.timeout_ns, p.op, p.rank);
    trace_stamp(p.trace, kTrStart);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile_u64(p.epochs) + 1;   // in flight with the block state loads
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
        // The first record, claimed and loaded during the release wait, by as many warps per block
        // as give every block's share of T one record each (one warp at T=128 on 132 SMs), not by
        // all of them: 32 claims per block put ~4200 atomics on one counter right at the start,
        // which the release wait then waits for. Fewer resident blocks still send every record:
        // each claiming warp goes on claiming until the counter passes T.
        const int claimers = min(kThreads / 32, static_cast<int>((kMaxTokens + gridDim.x - 1) / gridDim.x));
        int t = warp_id() < claimers ? warp_claim(p.tickets + kClaimRecords) : kMaxTokens, e;
        float w;
        load_record<kTopK, kExperts, TopkT>(p, t, e, w);
        wait_released(s, ctx, p.acks, epoch, p.mask, p.enable_shrink != 0);
        trace_stamp(p.trace, kTrReleased);
        if (!s.abort) {   // block-uniform: the item groups below sync on barriers
            combine_send_records<kTopK, kRanks, kExperts, kMaxTokens, TopkT>(p, s, epoch, t, e, w);
            trace_stamp(p.trace, kTrSendA);
            combine_send_partials<kHidden, kTopK, kRanks, kExperts, kMaxTokens, TopkT, kThreads>(p, s, ctx, epoch, items);
            trace_stamp(p.trace, kTrSendC);
        }
        finish_send<kRanks, kThreads / 32, true>(s, p.tickets, p.epochs, epoch);
        trace_stamp(p.trace, kTrSendDone);
    } else {
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    }
    if (p.phases & kRecv) {
        const unsigned long long epoch = ld_volatile_u64(p.epochs + 1) + 1;
        trace_stamp(p.trace, kTrRecvStart);
        combine_recv<kHidden, kTopK, kRanks, kExperts, kMaxTokens, TopkT, kThreads>(p, s, ctx, epoch, ranks);
        trace_stamp(p.trace, kTrRecvDone);
        finish_recv(s, ctx, p.tickets + kTicketRecv, p.epochs + 1, epoch, p.epochs, kPhaseSendEnd, p.acks, p.mask, p.heap, p.rank);
        trace_stamp(p.trace, kTrEnd);
    }
}

}  // namespace ll
}  // namespace epcomm
