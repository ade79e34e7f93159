// Shared pieces of the low-latency kernels (protocol: cuda_src/README.md): the Params structs (read
// by the host through epcomm.runtime.cuda_decls), phases, e4m3 conversion, bounded waits on tags,
// stamped words, the per-block peer state, buffer-set release (acks) and the end-of-launch tickets.
#pragma once
#include "common/nvshmem.cuh"
#include "common/arch.cuh"
#include "common/bf16.cuh"
#include "common/epoch.cuh"
#include "common/limits.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "common/trace.cuh"

namespace epcomm {
namespace ll {

constexpr int kSend = 1, kRecv = 2;          // Params::phases bits
constexpr int kScaleChannels = 128;
constexpr int kListHeaderBytes = 16;         // count (int) + padding, then the token indices
constexpr float kFp8Max = 448.0f;
constexpr float kFp8MaxInv = static_cast<float>(1.0 / 448.0);
constexpr float kFp8AmaxFloor = 1e-4f;

// ---- Params (mirrored by epcomm/ops/low_latency.py) ------------------------------------------
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
    unsigned long long *acks;          // [R] this set's acknowledgements (README: buffer-set reuse)
    unsigned long long *epochs;        // [2] calls this rank sent / received on this set
    unsigned int *tickets;             // [kCounters]: send / receive tickets of this launch (enum Counter)
    int *mask;                         // [R] nonzero = masked rank
    unsigned int *failed;              // nonzero once a wait of this rank failed (Guard's sticky flag)
    unsigned int *wait_notes;          // [R] Guard::notes
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
    unsigned long long *trace;         // [blocks][warps][kTraceSlots] in EPCOMM_TRACE builds, else null
};

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
    unsigned int *wait_notes;
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
    unsigned long long *trace;         // [blocks][warps][kTraceSlots] in EPCOMM_TRACE builds, else null
};
// A combine top-k record: per top-k slot two stamped words (protocol: stamped()), the expert id and
// the weight's bits; sized for kMaxTopk slots.
constexpr int kRecordBytes = 16 * kMaxTopk;
// Phases recorded in ErrorRecord.phase; each comment is the phase's name in the host's errors
// (epcomm.ops.low_latency reads them). Both kernels' send parts start with the release wait.
enum DispatchPhase : int {
    kDispatchRelease = 0,   // wait for a peer to release the buffer set
    kDispatchList = 1,      // wait for a source's token list
    kDispatchMessage = 2    // wait for a token's message
};
enum CombinePhase : int {
    kPhaseRelease = 0,      // wait for a peer to release the buffer set
    kPhaseRecord = 1,       // wait for a source's top-k record
    kPhasePartial = 2,      // wait for an expert rank's partial sum
    kPhaseSendEnd = 3       // wait for this rank's send part to end
};
static_assert(kPhaseRelease == kDispatchRelease, "wait_released records one phase for both kernels");

// ---- small device helpers -------------------------------------------------------------------
// Pull a line into L2 without waiting for it (a later load then hits L2 instead of HBM).
__device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

template <class T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// fp32 -> e4m3fn byte, round to nearest even, saturating to +-448 (NaN stays NaN).
#if defined(EPCOMM_FEATURE_SM90)
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {   // hardware cvt (sm_89+)
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
#else
__device__ __forceinline__ uint32_t e4m3(float f) {   // bit-exact software conversion
    const uint32_t u = __float_as_uint(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;                         // NaN
    const float af = __uint_as_float(a);
    if (af >= kFp8Max) return sign | 0x7eu;                            // satfinite
    if (af < 0.015625f) return sign | static_cast<uint32_t>(__float2int_rn(af * 512.0f));  // subnormal: m * 2^-9
    const uint32_t c = (a - (120u << 23));                             // rebias 127 -> 7
    return sign | ((c + 0x7ffffu + ((c >> 20) & 1u)) >> 20);
}
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) { return e4m3(lo) | (e4m3(hi) << 8); }
#endif

// Where `local` (an address in this rank's heap) lives on rank `dst` for direct stores.
__device__ __forceinline__ char *on_peer(char *heap, const long long *bases, int rank, int dst, const void *local) {
    const char *l = static_cast<const char *>(local);
    return dst == rank ? const_cast<char *>(l) : reinterpret_cast<char *>(bases[dst]) + (l - heap);
}

// ---- trace (profiling builds: common/trace.cuh) -------------------------------------------------
// Rows [block][warp][kTraceSlots] of Params::trace; the slot meanings are TRACE_SLOTS in
// epcomm/ops/low_latency.py.
constexpr int kTraceSlots = 14;
// Dispatch: start, released, messages sent, lists sent, send part done, receive start, first
// pair's lists ready, receive copies done, end; then the first message's stores issued (before its
// tag's release store), that release store done, a list's scan done (before its tag), and the
// number of messages the warp sent. Combine: start, released, records sent, (send_b unused),
// items done, send part done, receive start, first token's partials ready, receive done, end;
// then the group's first item ready (record seen, rows found), its sum stored, the last flush
// started (its fence before the tags), and the number of items the group sent (slot numbers
// below; unused slots stay 0; `count` holds a number, not a time).
enum TraceSlot : int {
    kTrStart = 0, kTrReleased = 1, kTrSendA = 2, kTrSendB = 3, kTrSendC = 4, kTrSendDone = 5,
    kTrRecvStart = 6, kTrRecvReady = 7, kTrRecvDone = 8, kTrEnd = 9, kTrAuxA = 10, kTrAuxB = 11, kTrAuxC = 12,
    kTrCount = 13
};
__device__ __forceinline__ TraceRow trace_row(unsigned long long *trace) {
    return TraceRow(trace, blockDim.x / 32, kTraceSlots);
}
__device__ __forceinline__ void trace_stamp(unsigned long long *trace, int slot) {
    if constexpr (kTrace) trace_row(trace).set(slot, globaltimer_ns());
}
// The first stamp of a slot this warp reaches more than once.
__device__ __forceinline__ void trace_first(unsigned long long *trace, int slot) {
    if constexpr (kTrace) trace_row(trace).first(slot, globaltimer_ns());
}
__device__ __forceinline__ void trace_count(unsigned long long *trace, unsigned long long n) {
    if constexpr (kTrace) trace_row(trace).set(kTrCount, n);
}

enum Wait { kReady, kMasked, kFailed };

// Bounded spin until `ready()`. A masked peer (now, or after a timeout under shrink) ends the wait,
// and so does a failure any wait of this rank recorded (the Guard's device-memory flag; the
// host-mapped record is only written).
template <class Ready>
__device__ __forceinline__ Wait wait_until(const Guard &g, Ready ready, int *mask, bool shrink, int peer, int phase) {
    Wait result = kReady;
    spin_until(ready, [&] {
        if (*reinterpret_cast<volatile int *>(mask + peer) != 0) {
            result = kMasked;
        } else if (g.past_deadline(peer)) {
            if (shrink) {
                atomicExch(mask + peer, 1);
                result = kMasked;
            } else {
                g.timeout(peer, phase);
                result = kFailed;
            }
        } else if (g.failed(phase)) {
            result = kFailed;
        }
        return result != kReady;
    });
    return result;
}

// Bounded spin on a 64-bit tag. Polls are relaxed loads: an acquire load per poll compiles to a
// strong load plus an L1 invalidation (CCTL.IVALL) of the SM, which would slow every warp of the
// block still sending. Once the tag is seen, one acquire load of the same word synchronises with
// the writer's release (its value cannot change before this rank acknowledges the call).
__device__ __forceinline__ Wait wait_tag(const Guard &g, const unsigned long long *tag, unsigned long long want,
                                         int *mask, bool shrink, int peer, int phase) {
    return wait_until(g, [&] { return ld_relaxed_sys(tag) == want && ld_acquire_sys(tag) == want; }, mask, shrink, peer, phase);
}

// A stamped word: (stamp << 32) | a 32-bit value, stored and read as one 64-bit access, so a reader
// that sees this call's stamp has the value with no fence between them and no separate tag (a fence
// after stores to a peer waits for all of them: 2.5-4 us on 2 x H200 once bulk data is on the link).
__device__ __forceinline__ uint32_t call_stamp(unsigned long long epoch) { return static_cast<uint32_t>(mix_epoch(epoch) >> 32); }
__device__ __forceinline__ unsigned long long stamped(uint32_t stamp, uint32_t value) {
    return (static_cast<unsigned long long>(stamp) << 32) | value;
}
__device__ __forceinline__ bool has_stamp(unsigned long long word, uint32_t stamp) {
    return static_cast<uint32_t>(word >> 32) == stamp;
}

// Shared state of one block: peer bases and mask snapshot, the abort flag, and how many of its
// warps finished the send part (finish_send).
template <int kRanks> struct BlockState {
    long long peer_base[kRanks];
    int masked[kRanks];
    int abort;
    int send_done;
};

// The u32 counters of a buffer set (Params::tickets, epcomm.ops.low_latency_layout.Layout.tickets):
// the grid tickets of a launch's send and receive parts, then the combine send part's work claims.
// finish_send's last block resets the send ticket (and the combine's claims), finish_recv's the
// receive ticket.
enum Counter { kTicketSend, kTicketRecv, kClaimRecords, kClaimItems, kCounters = 8 };

template <int kRanks>
__device__ void load_block_state(BlockState<kRanks> &s, const long long *peer_bases, const int *mask, int use_nvlink) {
    for (int r = threadIdx.x; r < kRanks; r += blockDim.x) {
        s.peer_base[r] = use_nvlink ? peer_bases[r] : 0;
        s.masked[r] = *reinterpret_cast<const volatile int *>(mask + r);
    }
    if (threadIdx.x == 0) s.abort = s.send_done = 0;
    __syncthreads();
}

// Before the n-th send on a set: every destination must have acknowledged n-1 receives there.
template <int kRanks>
__device__ void wait_released(BlockState<kRanks> &s, const Guard &g, const unsigned long long *acks,
                              unsigned long long send_epoch, int *mask, bool shrink) {
    for (int r = threadIdx.x; r < kRanks; r += blockDim.x) {
        if (s.masked[r]) continue;
        const unsigned long long want = send_epoch - 1;   // relaxed polls, then one acquire (wait_tag)
        const bool released = spin_until([&] { return ld_relaxed_sys(acks + r) >= want && ld_acquire_sys(acks + r) >= want; },
                                         [&] { return g.past_deadline(r) || g.failed(kPhaseRelease); });
        if (!released) {
            if (shrink && !g.failed()) {
                atomicExch(mask + r, 1);
                s.masked[r] = 1;
            } else {
                if (!g.failed()) g.timeout(r, kPhaseRelease);
                s.abort = 1;
            }
        }
    }
    __syncthreads();
}

// End of a launch's send part, warp by warp: no block barrier, so in a fused launch a warp with
// nothing (left) to send starts receiving at once. The block's last warp to get here takes the
// grid ticket for its block; the grid's last one resets the ticket and stores the new send count,
// which the next launch reads (a kernel boundary orders it). kCombine (the combine's send part)
// also resets the claims, and orders everything the part wrote and read before the count, which
// the same launch's finish_recv waits for (the records may be overwritten once it acknowledges):
// each warp's lane 0 fences before counting itself, the last warp fences again after reading it
// (acquire side) before the ticket, and once more so the resets precede the count. The dispatch
// needs none of these fences: each one waited for the warp's outstanding NVLink stores.
template <int kRanks, int kWarps, bool kCombine>
__device__ void finish_send(BlockState<kRanks> &s, unsigned int *counters, unsigned long long *epoch,
                            unsigned long long value) {
    __syncwarp();
    if (lane_id() != 0) return;
    if (kCombine) __threadfence();
    if (atomicAdd(&s.send_done, 1) != kWarps - 1) return;
    if (kCombine) __threadfence();
    if (atomicAdd(counters + kTicketSend, 1u) != gridDim.x - 1) return;
    if (kCombine) __threadfence();
    counters[kTicketSend] = 0;
    if (kCombine) {
        counters[kClaimRecords] = counters[kClaimItems] = 0;
        __threadfence();
    }
    *epoch = value;
}

// End of a receive part: once every block stopped reading this set, the last one stores the new
// receive count and tells every live peer that the set may be written again. With
// `send_epoch` (combine, whose send part reads the top-k records the peers wrote into this set) the
// acknowledgement also waits until this rank's send part of the call has ended: a hook's receive
// launch on another stream may otherwise overtake it.
template <int kRanks>
__device__ void finish_recv(const BlockState<kRanks> &s, const Guard &ctx, unsigned int *ticket,
                            unsigned long long *epoch, unsigned long long value, const unsigned long long *send_epoch,
                            int send_phase, unsigned long long *acks, const int *mask, char *heap, int rank) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    fence_acq_rel_gpu();   // this block's reads of the set before its count (release pattern)
    if (atomicAdd(ticket, 1u) != gridDim.x - 1) return;
    *ticket = 0;       // read by the next launch (a kernel boundary orders them)
    *epoch = value;
    if (send_epoch != nullptr && !ctx.wait(rank, send_phase, [&] { return ld_volatile_u64(send_epoch) >= value; })) return;
    // One fence for all the acknowledgements: acquire for the other blocks' counts (each fenced
    // after its reads) and release before the relaxed stores below. It was a fence, another before
    // the counter resets and a release store per peer: each waits for this thread's outstanding
    // stores, and they sat at the very end of the kernel (~2-3 us from "receive done" to "end").
    fence_acq_rel_sys();
    for (int r = 0; r < kRanks; ++r) {
        if (s.masked[r] || *reinterpret_cast<const volatile int *>(mask + r)) continue;   // masked now or on a timeout
        if (r == rank || s.peer_base[r] != 0)
            st_relaxed_sys(reinterpret_cast<unsigned long long *>(on_peer(heap, s.peer_base, rank, r, acks + rank)), value);
        else
            nvshmemx_signal_op(reinterpret_cast<uint64_t *>(acks + rank), value, NVSHMEM_SIGNAL_SET, r);
    }
}

// The receive part of a launch (Params::phases & kRecv): recv(epoch) with this set's receive count,
// then finish_recv (send_epoch / send_phase as there).
template <int kRanks, class Params, class Recv>
__device__ __forceinline__ void recv_part(const Params &p, const BlockState<kRanks> &s, const Guard &ctx,
                                          const unsigned long long *send_epoch, int send_phase, Recv recv) {
    if (!(p.phases & kRecv)) return;
    const unsigned long long epoch = ld_volatile_u64(p.epochs + 1) + 1;
    trace_stamp(p.trace, kTrRecvStart);
    recv(epoch);
    trace_stamp(p.trace, kTrRecvDone);
    finish_recv(s, ctx, p.tickets + kTicketRecv, p.epochs + 1, epoch, send_epoch, send_phase, p.acks, p.mask, p.heap,
                p.rank);
    trace_stamp(p.trace, kTrEnd);
}

// How warps share (local expert, source) pairs: warp `gw` of `total` takes pairs p0, p0 + step, ...
// and, within a pair, items j0, j0 + stride, ... (several warps per pair when warps outnumber pairs).
struct PairSplit {
    int p0, step, j0, stride;
    __device__ PairSplit(int gw, int total, int pairs) {
        if (total >= pairs) {
            stride = total / pairs;
            p0 = gw < pairs * stride ? gw % pairs : pairs;
            j0 = gw / pairs;
            step = pairs;   // one pair per warp
        } else {
            p0 = gw, step = total, j0 = 0, stride = 1;
        }
    }
};

template <class TopkT, int kExperts>
__device__ __forceinline__ int expert_at(const void *topk_idx, long long i) {
    const long long e = static_cast<long long>(__ldg(static_cast<const TopkT *>(topk_idx) + i));
    return e >= 0 && e < kExperts ? static_cast<int>(e) : -1;
}

}  // namespace ll
}  // namespace epcomm
