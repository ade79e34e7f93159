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
// into shared memory once and writes one message per (token, top-k expert) into the destination's
// slot [local expert][source rank][token]. Then, per expert, one warp writes the ascending list of
// this rank's tokens routed there (a token appears once per top-k slot naming the expert) and its
// length: the list tells the receiver where each row goes. Receive part: for every (local expert,
// source) pair a group of warps waits for the lists of sources <= that source (prefix = first row),
// then for each listed token's message tag, and copies it into the packed output.
//
// Combine. Send part: every valid row of every (local expert, source) pair goes back to the
// source's slot [global expert][token]. Receive part: one block per token waits for the rows of its
// top-k experts and sums w_k * row in fp32, k ascending, exactly as epcomm.reference.oracle does.
//
// Fault tolerance. Waits go through WaitContext. With enable_shrink a peer that times out is masked
// (mask[peer] = 1) and treated as sending nothing; without it the wait records a PeerTimeout and the
// kernel winds down. Masked peers are neither sent to nor waited for.
#include "low_latency_protocol.cuh"

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
    unsigned long long *token_tags;    // [E_l][R][T]
    unsigned long long *list_tags;     // [E_l][R]
    char *lists;                       // [E_l][R][16 + 4T]
    char *messages;                    // [E_l][R][T][message bytes]
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
template <int kHidden, bool kFP8> struct Message {
    static constexpr int kScales = kFP8 ? kHidden / kScaleChannels : 0;
    static constexpr int kPayloadBytes = kFP8 ? kHidden : kHidden * 2;
    static constexpr int kBytes = kPayloadBytes + (kScales * 4 + 15) / 16 * 16;
};

// Casts token row `x_row` into `msg` (shared) and, when given, `stage` (global), by `threads`
// threads of which this is `tid`. FP8: amax over 16 lanes x 8 channels; the formulas are the
// oracle's (epcomm/reference/oracle.py fp8_cast), so the bytes match it exactly.
template <int kHidden, bool kFP8, bool kRoundScale>
__device__ void cast_token(const int4 *x_row, char *msg, char *stage, int tid, int threads) {
    using M = Message<kHidden, kFP8>;
    constexpr int kChunks = kHidden / 8;
    const int lane = lane_id();
    for (int base = tid - lane; base < kChunks; base += threads) {   // warp-uniform trip count
        const int c = base + lane;
        const bool active = c < kChunks;
        const int4 v = active ? ld_nc_v4(x_row + c) : make_int4(0, 0, 0, 0);
        if constexpr (!kFP8) {
            if (active) {
                reinterpret_cast<int4 *>(msg)[c] = v;
                if (stage) reinterpret_cast<int4 *>(stage)[c] = v;
            }
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
                if (stage) reinterpret_cast<uint2 *>(stage)[c] = make_uint2(q[0], q[1]);
                if ((lane & 15) == 0) {
                    reinterpret_cast<float *>(msg + M::kPayloadBytes)[c / 16] = scale_inv;
                    if (stage) reinterpret_cast<float *>(stage + M::kPayloadBytes)[c / 16] = scale_inv;
                }
            }
        }
    }
}

// Most tokens a block casts at once (one group of warps each, K messages per token spread over
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

template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, bool kFP8, bool kRoundScale,
          class TopkT, int kThreads>
__device__ void dispatch_send(const DispatchParams &p, const BlockState<kRanks> &s, unsigned long long epoch,
                              char *smem) {
    using M = Message<kHidden, kFP8>;
    using Shape = DispatchShape<kHidden, kTopK, kFP8, kThreads>;
    constexpr int kLocalExperts = kExperts / kRanks, kWarps = kThreads / 32;
    constexpr int kListBytes = kListHeaderBytes + 4 * kMaxTokens;
    const int warp = warp_id(), lane = lane_id();

    // Messages: a group of warps casts one token into shared memory, then each of its warps sends
    // the copies of some of the token's top-k slots. Blocks take one token each while there are
    // fewer tokens than blocks (all warps cast it), up to kTokensPerRound otherwise.
    const int per_round = min(Shape::kTokensPerRound, max(1, (p.num_tokens + gridDim.x - 1) / gridDim.x));
    const int warps_per_token = kWarps / per_round;
    const int group = warp / warps_per_token, in_group = warp % warps_per_token;
    for (int first = blockIdx.x * per_round; first < p.num_tokens; first += gridDim.x * per_round) {
        const int t = first + group;
        const bool mine = group < per_round && t < p.num_tokens;
        char *msg = smem + group * M::kBytes;
        char *stage = p.stage_for_puts ? p.message_stage + static_cast<long long>(t) * M::kBytes : nullptr;
        __syncthreads();   // the previous round's messages have left shared memory
        if (mine)
            cast_token<kHidden, kFP8, kRoundScale>(
                reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + static_cast<long long>(t) * kHidden * 2),
                msg, stage, in_group * 32 + lane, warps_per_token * 32);
        __syncthreads();
        if (!mine) continue;
        for (int k = in_group; k < kTopK; k += warps_per_token) {
            const int e = expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + k);
            if (e < 0) continue;
            const int dst = e / kLocalExperts;
            if (s.masked[dst]) continue;
            const long long slot = static_cast<long long>((e % kLocalExperts) * kRanks + p.rank) * kMaxTokens + t;
            char *local_msg = p.messages + slot * M::kBytes;
            unsigned long long *local_tag = p.token_tags + slot;
            if (dst == p.rank || s.peer_base[dst] != 0) {
                const int4 *src = reinterpret_cast<const int4 *>(msg);
                warp_copy(reinterpret_cast<int4 *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_msg)), M::kBytes / 16,
                          lane, [&](int i) { return src[i]; });
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

    // Token lists, one expert per warp, the warps without messages first.
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
        int count = 0;
        for (int first = 0; first < p.num_tokens; first += 32) {
            const int t = first + lane;
            int hits = 0;
            if (t < p.num_tokens) {
#pragma unroll
                for (int k = 0; k < kTopK; ++k)
                    hits += expert_at<TopkT, kExperts>(p.topk_idx, static_cast<long long>(t) * kTopK + k) == e;
            }
            int inclusive = hits;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
                if (lane >= o) inclusive += v;
            }
            for (int pos = count + inclusive - hits, end = count + inclusive; pos < end && pos < kMaxTokens; ++pos)
                entries[pos] = t;
            count += __shfl_sync(0xffffffffu, inclusive, 31);
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
            const long long slot = static_cast<long long>(pair) * kMaxTokens + t;
            int w = kReady;
            if (lane == 0) w = wait_tag(ctx, p.token_tags + slot, epoch, p.mask, shrink, src, 2);
            w = __shfl_sync(kAll, w, 0);
            if (w == kFailed) return;
            if (w == kMasked) break;   // the source went silent: its remaining rows stay unfilled
            __syncwarp();
            const char *msg = p.messages + slot * M::kBytes;
            const long long row = static_cast<long long>(el) * kSlots + begin + i;
            warp_copy(reinterpret_cast<int4 *>(static_cast<char *>(p.recv_x) + row * M::kPayloadBytes),
                      M::kPayloadBytes / 16, lane, [&](int j) { return ld_cg_v4(msg + 16 * j); });
            if constexpr (kFP8) {
                const float *scales = reinterpret_cast<const float *>(msg + M::kPayloadBytes);
                const long long column = begin + i;   // scales are column-major: [E_l][S][R*T]
                if constexpr (!kUE8M0) {
                    for (int j = lane; j < M::kScales; j += 32)
                        static_cast<float *>(p.recv_scales)[(static_cast<long long>(el) * M::kScales + j) * kSlots + column] = ld_cg(scales + j);
                } else {
                    for (int j = lane; j < M::kScales / 4; j += 32) {
                        uint32_t word = 0;
#pragma unroll
                        for (int b = 0; b < 4; ++b) word |= ((__float_as_uint(ld_cg(scales + 4 * j + b)) >> 23) & 0xffu) << (8 * b);
                        static_cast<int *>(p.recv_scales)[(static_cast<long long>(el) * (M::kScales / 4) + j) * kSlots + column] = static_cast<int>(word);
                    }
                }
            }
            if (lane == 0) p.recv_src_info[row] = t;
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
    extern __shared__ __align__(16) char smem[];
    __shared__ BlockState<kRanks> s;
    const WaitContext ctx = WaitContext::make(p.err, p.timeout_ns, p.op, p.rank);
    load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile(p.epochs) + 1;
        wait_released(s, ctx, p.acks, epoch, p.mask, p.enable_shrink != 0);
        if (!s.abort)
            dispatch_send<kHidden, kTopK, kRanks, kExperts, kMaxTokens, kFP8, kRoundScale, TopkT, kThreads>(p, s, epoch, smem);
        finish_part(s, p.tickets, p.epochs, epoch, p.acks, p.mask, p.heap, p.rank, false);
    }
    if (p.phases & kRecv) {
        const unsigned long long epoch = ld_volatile(p.epochs + 1) + 1;
        dispatch_recv<kHidden, kRanks, kExperts, kMaxTokens, kFP8, kUE8M0, kThreads>(p, s, ctx, epoch);
        finish_part(s, p.tickets + 1, p.epochs + 1, epoch, p.acks, p.mask, p.heap, p.rank, true);
    }
}

// ==== combine ====================================================================================
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
        const bool direct = dst == p.rank || s.peer_base[dst] != 0;
        for (long long i = split.j0; i < count; i += split.stride) {
            const long long row = el * static_cast<long long>(kSlots) + begin + i;
            const int t = __ldg(p.src_info + row);
            if (t < 0 || t >= kMaxTokens) continue;
            // A token listed twice (an expert named in two top-k slots) gets its last row, as in
            // the oracle; the earlier copy would race for the same slot.
            if (i + 1 < count && __ldg(p.src_info + row + 1) == t) continue;
            const char *src_row = static_cast<const char *>(p.x) + row * kRowBytes;
            char *local_slot = p.rows + (expert * kMaxTokens + t) * kRowBytes;
            unsigned long long *local_tag = p.row_tags + expert * kMaxTokens + t;
            if (direct) {
                warp_copy(reinterpret_cast<int4 *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_slot)), kRowBytes / 16,
                          lane, [&](int i) { return ld_nc_v4(reinterpret_cast<const int4 *>(src_row) + i); });
                __syncwarp();
                if (lane == 0)
                    st_release_sys(reinterpret_cast<unsigned long long *>(on_peer(p.heap, s.peer_base, p.rank, dst, local_tag)), epoch);
            } else {
                const char *source = src_row;
                if (!zero_copy) {   // puts read from the symmetric heap (registered for every transport)
                    char *stage = p.row_stage + row * kRowBytes;
                    warp_copy(reinterpret_cast<int4 *>(stage), kRowBytes / 16, lane,
                              [&](int i) { return ld_nc_v4(reinterpret_cast<const int4 *>(src_row) + i); });
                    source = stage;
                }
                __threadfence_system();
                nvshmemx_putmem_signal_nbi_warp(local_slot, source, kRowBytes, reinterpret_cast<uint64_t *>(local_tag),
                                                epoch, NVSHMEM_SIGNAL_SET, dst);
            }
        }
    }
}

template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT, int kThreads>
__device__ void combine_recv(const CombineParams &p, const BlockState<kRanks> &s, const WaitContext &ctx,
                             unsigned long long epoch, int (*experts)[kTopK], float (*weights)[kTopK]) {
    constexpr int kLocalExperts = kExperts / kRanks;
    constexpr int kRowBytes = kHidden * 2, kChunks = kHidden / 8, kBatch = 8;
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
        for (int c = warp * 32 + lane; c < kChunks; c += kThreads) {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
#pragma unroll
            for (int k0 = 0; k0 < kTopK; k0 += kBatch) {
                int4 v[kBatch];
#pragma unroll
                for (int b = 0; b < kBatch; ++b) {
                    const int k = k0 + b;
                    v[b] = make_int4(0, 0, 0, 0);
                    if (k < kTopK && ((valid >> k) & 1u))
                        v[b] = ld_cg_v4(p.rows + (static_cast<long long>(experts[warp][k]) * kMaxTokens + t) * kRowBytes + 16 * c);
                }
#pragma unroll
                for (int b = 0; b < kBatch; ++b) {
                    const int k = k0 + b;
                    if (k >= kTopK) break;
                    const bool used = (valid >> k) & 1u;
                    const uint32_t u[4] = {(uint32_t)v[b].x, (uint32_t)v[b].y, (uint32_t)v[b].z, (uint32_t)v[b].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {   // unused slots add +0, as the oracle's where(...)
                        acc[2 * j] = __fadd_rn(acc[2 * j], used ? __fmul_rn(bf16_lo(u[j]), weights[warp][k]) : 0.0f);
                        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], used ? __fmul_rn(bf16_hi(u[j]), weights[warp][k]) : 0.0f);
                    }
                }
            }
            int4 packed;
            packed.x = static_cast<int>(bf16_bits(acc[0]) | (bf16_bits(acc[1]) << 16));
            packed.y = static_cast<int>(bf16_bits(acc[2]) | (bf16_bits(acc[3]) << 16));
            packed.z = static_cast<int>(bf16_bits(acc[4]) | (bf16_bits(acc[5]) << 16));
            packed.w = static_cast<int>(bf16_bits(acc[6]) | (bf16_bits(acc[7]) << 16));
            reinterpret_cast<int4 *>(static_cast<char *>(p.out) + static_cast<long long>(t) * kRowBytes)[c] = packed;
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
    load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile(p.epochs) + 1;
        wait_released(s, ctx, p.acks, epoch, p.mask, p.enable_shrink != 0);
        if (!s.abort) combine_send<kHidden, kRanks, kExperts, kMaxTokens, kThreads>(p, s, epoch);
        finish_part(s, p.tickets, p.epochs, epoch, p.acks, p.mask, p.heap, p.rank, false);
    }
    if (p.phases & kRecv) {
        const unsigned long long epoch = ld_volatile(p.epochs + 1) + 1;
        combine_recv<kHidden, kTopK, kRanks, kExperts, kMaxTokens, TopkT, kThreads>(p, s, ctx, epoch, experts, weights);
        finish_part(s, p.tickets + 1, p.epochs + 1, epoch, p.acks, p.mask, p.heap, p.rank, true);
    }
}

}  // namespace ll
}  // namespace epcomm
