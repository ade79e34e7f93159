// Shared pieces of the intranode kernels (protocol: cuda_src/README.md): constants, phases, the NVL
// buffer header and the Params structs (read by the host through epcomm.runtime.cuda_decls), signal
// helpers, the chunk loop of the sending blocks.
#pragma once
#include "common/arch.cuh"
#include "common/bf16.cuh"
#include "common/epoch.cuh"
#include "common/limits.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"
#include "common/trace.cuh"

namespace epcomm {
namespace intranode {

constexpr int kThreads = kDataThreads;     // data kernels
constexpr int kWarps = kThreads / 32;      // = sender warps per chunk = ready count of a chunk
constexpr int kNotifyThreads = 1024;
constexpr int kMaxChunks = 1024;           // G <= kMaxChunks (signal arrays are sized by it)
constexpr int kParts = 8;                  // a received chunk is claimed in kParts pieces
// 16-byte loads a lane keeps in flight when copying a row (per warp and rank in the reduction).
// Copies are latency-bound per SM, so more bytes in flight help most at small SM counts.
constexpr int kMaxUnroll = 16;

// Phases recorded in ErrorRecord.phase; each comment is the phase's name in the host's errors
// (epcomm.ops.intranode_plan.PHASES reads them).
enum Phase : int {
    kPhasePeerBusy = 0,       // peer still busy with its previous intranode kernel
    kPhaseCounts = 1,         // waiting for the peer's token counts
    kPhaseData = 2,           // waiting for the peer's rows
    kPhaseRingSpace = 3,      // waiting for the peer to free receive-ring space
    kPhaseChunkTooBig = 4,    // a chunk has more rows than the receive ring (num_nvl_bytes too small)
    kPhaseWorstTokens = 5,    // more rows received than num_worst_tokens
    kPhaseConfigMismatch = 6  // ranks use different chunk counts or expert counts (Config.num_sms or
                              // num_experts differ)
};

// Header of every rank's NVL buffer, then (dispatch only) the notify area, then the rings.
template <int kRanks>
struct Header {
    static constexpr long long kEpoch = 0;          // u64, local
    static constexpr long long kFinished = 8;       // u32, local: blocks done with this kernel
    static constexpr long long kClaim = 12;         // u32, local: next receive claim
    static constexpr long long kFailed = 16;        // u32, local: nonzero once a kernel of this rank failed
    static constexpr long long kSendClaim = 20;     // u32, local: next chunk a sending block takes
    static constexpr long long kDone = 64;          // u64[R]
    static constexpr long long kNotifyFlag = kDone + 8LL * kRanks;
    static constexpr long long kReady = (kNotifyFlag + 8LL * kRanks + 127) / 128 * 128;  // u32[R][G]
    static constexpr long long kParts = kReady + 4LL * kRanks * kMaxChunks;  // u32[R][G], local
    static constexpr long long kConsumed = kParts + 4LL * kRanks * kMaxChunks;  // u64[R][G]
    static constexpr long long kWaitNotes = kConsumed + 8LL * kRanks * kMaxChunks;  // u32[R]: Guard::notes
    static constexpr long long kBytes = (kWaitNotes + 4LL * kRanks + 127) / 128 * 128;
};

struct NotifyParams {
    const bool *is_token_in_rank;    // [N, R]
    const int *num_tokens_per_expert;  // [E]
    int *info;                       // [R*R + E_l + 1]: rank_prefix | expert counts | max N of all ranks
    int *channel_prefix;             // [R, G+1]
    int *recv_channel_prefix;        // [R, G+1]
    int *send_head;                  // [N, R]
    const long long *peer_bases;     // [R] NVL buffer of each rank in this process's address space
    ErrorRecord *err;
    unsigned long long timeout_ns;
    long long notify_offset;         // bytes from the buffer base to the notify area
    int num_tokens, num_chunks, tokens_per_chunk, num_local_experts;
    int notify_ints;                 // ints one source writes into each rank's notify area
    int rank, op;
    unsigned long long *trace;       // [blocks, kTraceWarps, kTraceSlots] in EPCOMM_TRACE builds, else null
};

struct DispatchParams {
    const void *x;                   // [N, H] bf16 or e4m3
    const float *x_scales;           // [N, S] any strides, or null
    const void *topk_idx;            // [N, K] IdxT, or null
    const float *topk_weights;       // [N, K]
    const int *rank_prefix;          // [R, R]
    const int *channel_prefix;       // [R, G+1]
    const int *recv_channel_prefix;  // [R, G+1]
    const int *send_head;            // [N, R]
    void *recv_x;                    // [M_out, H]
    float *recv_x_scales;            // [M_out, S]
    void *recv_topk_idx;             // [M_out, K] IdxT
    float *recv_topk_weights;        // [M_out, K]
    int *recv_src_idx;               // [M_out]
    const long long *peer_bases;
    ErrorRecord *err;
    long long scale_stride_token, scale_stride_group;  // elements
    unsigned long long timeout_ns;
    long long staging_offset;
    int ring_rows, record_bytes, num_tokens, num_chunks, tokens_per_chunk, num_topk;
    int num_local_experts, num_out_rows, rank, num_send_blocks, op;
    unsigned long long *trace;
};

struct CombineParams {
    const void *x;                   // [M, H] bf16, this rank's dispatch row order
    const float *topk_weights;       // [M, K] or null
    const void *bias0, *bias1;       // [N, H] bf16 or null
    const int *rank_prefix, *channel_prefix, *recv_channel_prefix, *send_head;
    void *combined_x;                // [N, H] bf16
    float *combined_weights;         // [N, K]
    const long long *peer_bases;
    ErrorRecord *err;
    unsigned long long timeout_ns;
    long long staging_offset;
    int ring_rows, record_bytes, num_tokens, num_chunks, tokens_per_chunk, num_topk;
    int rank, num_send_blocks, op;
    unsigned long long *trace;
};

// ---- trace (profiling builds: common/trace.cuh) -------------------------------------------------
// Rows [block][kTraceWarps][kTraceSlots] of Params::trace; the slot meanings are named by
// TRACE_SLOTS in epcomm/ops/intranode_plan.py.
constexpr int kTraceWarps = 32;
enum TraceSlot : int {
    kTrStart = 0,     // warp start (after begin_epoch)
    kTrIdle = 1,      // peers idle (senders) / notify: counts published
    kTrSent = 2,      // send / push loop done
    kTrFirstData = 3, // first received chunk ready
    kTrReceived = 4,  // receive / reduce loop done
    kTrWaitNs = 5,    // ns spent waiting for peers' data signals
    kTrSignalNs = 6,  // ns spent in the sender's release signals
    kTrClaims = 7,    // receive claims taken
    kTrEnd = 8,       // block reached kernel_end (warp 0); last block: + done published (slot 9)
    kTrPublished = 9,
    kTrChunks = 10,   // chunks this warp's block sent (send_chunks)
    kTraceSlots = 11
};
__device__ __forceinline__ void trace_set(unsigned long long *trace, int slot, unsigned long long v) {
    TraceRow(trace, kTraceWarps, kTraceSlots).set(slot, v);
}
__device__ __forceinline__ void trace_add(unsigned long long *trace, int slot, unsigned long long v) {
    TraceRow(trace, kTraceWarps, kTraceSlots).add(slot, v);
}
__device__ __forceinline__ void trace_first(unsigned long long *trace, int slot, unsigned long long v) {
    TraceRow(trace, kTraceWarps, kTraceSlots).first(slot, v);
}

// ---- small helpers ---------------------------------------------------------------------------
__device__ __forceinline__ void red_add_relaxed_sys(int *p, int v) {
    asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned int atomic_add_acq_rel_cta(unsigned int *shared, unsigned int v) {
    unsigned int old;
    const unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(shared));
    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v) : "memory");
    return old;
}
// Failure handling of the intranode kernels: epcomm::Guard (common/timeout.cuh) with its sticky
// flag in each rank's own NVL header (every peer is mapped: a failure is told with stores).
// Params: any intranode Params (peer_bases, err, timeout_ns, op, rank).
template <int kRanks, class Params>
__device__ __forceinline__ Guard make_guard(const char *local_base, const Params &p) {
    char *base = const_cast<char *>(local_base);
    return Guard::make(reinterpret_cast<unsigned int *>(base + Header<1>::kFailed),
                       reinterpret_cast<unsigned int *>(base + Header<kRanks>::kWaitNotes), p.err, p.timeout_ns, p.op,
                       p.rank, p.peer_bases, kRanks);
}

template <int kRanks> __device__ __forceinline__ int *ready_ptr(char *base, int peer, int chunk) {
    return reinterpret_cast<int *>(base + Header<kRanks>::kReady) + peer * kMaxChunks + chunk;
}
template <int kRanks> __device__ __forceinline__ int *parts_ptr(char *base, int peer, int chunk) {
    return reinterpret_cast<int *>(base + Header<kRanks>::kParts) + peer * kMaxChunks + chunk;
}
template <int kRanks>
__device__ __forceinline__ unsigned long long *consumed_ptr(char *base, int peer, int chunk) {
    return reinterpret_cast<unsigned long long *>(base + Header<kRanks>::kConsumed) + peer * kMaxChunks + chunk;
}
template <int kRanks> __device__ __forceinline__ unsigned long long *done_ptr(char *base, int peer) {
    return reinterpret_cast<unsigned long long *>(base + Header<kRanks>::kDone) + peer;
}
template <int kRanks> __device__ __forceinline__ unsigned long long *notify_flag_ptr(char *base, int peer) {
    return reinterpret_cast<unsigned long long *>(base + Header<kRanks>::kNotifyFlag) + peer;
}
// Ring of pair (src -> dst) inside dst's buffer: peers other than dst, in order after dst.
template <int kRanks> __device__ __forceinline__ int ring_index(int src, int dst) {
    return (src - dst - 1 + kRanks) % kRanks;
}
__device__ __forceinline__ int rows_before(const int *rank_prefix, int num_ranks, int src, int dst) {
    return src == 0 ? 0 : __ldg(rank_prefix + (src - 1) * num_ranks + dst);
}

// The sending warps of a block share every chunk. Each warp arrives on the chunk's block-local
// counter once its stores are issued (release, CTA scope); the warp arriving last makes them all
// visible to the peers with ONE system-scope fence and signals each peer `ready += kWarps`.
// (A release per warp cost each sending warp ~2.5-5 us of stall per chunk, ~40 us per call.)
template <int kRanks>
__device__ __forceinline__ void chunk_done(unsigned int *arrivals, char *const *peers, int rank, int g) {
    __syncwarp();
    unsigned int last = 0;
    if (lane_id() == 0) last = atomic_add_acq_rel_cta(arrivals, 1u) == kWarps - 1;
    if (__shfl_sync(0xffffffffu, last, 0) && lane_id() == 0) {
        fence_acq_rel_sys();
        for (int j = 0; j < kRanks; ++j)
            if (j != rank) red_add_relaxed_sys(ready_ptr<kRanks>(peers[j], rank, g), kWarps);
    }
    __syncwarp();
}

// The last block to finish publishes the epoch locally and as `done` to every peer.
template <int kRanks>
__device__ __forceinline__ void kernel_end(char *const *peers, int rank, unsigned long long epoch,
                                           unsigned long long *trace) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    trace_set(trace, kTrEnd, trace_now());
    char *local = peers[rank];
    auto *finished = reinterpret_cast<unsigned int *>(local + Header<kRanks>::kFinished);
    __threadfence();
    if (atomicAdd(finished, 1u) != gridDim.x - 1) return;
    __threadfence();
    *finished = 0;
    *reinterpret_cast<volatile unsigned int *>(local + Header<kRanks>::kClaim) = 0;
    *reinterpret_cast<volatile unsigned int *>(local + Header<kRanks>::kSendClaim) = 0;
    *reinterpret_cast<volatile unsigned long long *>(local + Header<kRanks>::kEpoch) = epoch;
    fence_acq_rel_sys();
    for (int j = 0; j < kRanks; ++j)
        if (j != rank) st_release_sys(done_ptr<kRanks>(peers[j], rank), epoch);
    trace_set(trace, kTrPublished, trace_now());
}

// Lanes wait (one peer each) until every peer finished its previous kernel. False on failure.
template <int kRanks>
__device__ __forceinline__ bool wait_peers_idle(char *const *peers, int rank, unsigned long long epoch,
                                                const Guard &ctx) {
    bool ok = true;
    for (int j = lane_id(); j < kRanks; j += 32) {
        if (j == rank) continue;
        ok = ok && wait_at_least(ctx, done_ptr<kRanks>(peers[rank], j), epoch - 1, j, kPhasePeerBusy);
    }
    return __all_sync(0xffffffffu, ok);
}

// Before a sender writes chunk g of pair (self -> peer) (stream rows [prefix[g], prefix[g+1])), every
// chunk whose rows it overwrites (stream start < prefix[g+1] - ring_rows) must be consumed. `cursor`
// = chunks already known consumed (they are checked in order). One lane per peer.
template <int kRanks>
__device__ __forceinline__ bool wait_ring_space(const int *prefix, int g, int ring_rows, int *cursor,
                                                const unsigned long long *consumed, int peer,
                                                unsigned long long epoch, const Guard &ctx) {
    const int limit = __ldg(prefix + g + 1) - ring_rows;
    int x = *cursor;
    while (x < g && __ldg(prefix + x) < limit) {
        if (!wait_at_least(ctx, consumed + x, epoch, peer, kPhaseRingSpace)) return false;
        ++x;
    }
    *cursor = x;
    return true;
}

// Shared memory of a dispatch / combine block.
template <int kRanks>
struct BlockShared {
    char *peers[kRanks];
    int cursors[kWarps][kRanks];         // per sending warp and peer: wait_ring_space's cursor
    unsigned int arrivals[kMaxChunks];   // per chunk the block sends (its i-th): warps done with it
    // The block's i-th chunk: 0 not claimed yet, 1 being claimed, else chunk + 2 (a chunk >= G: none
    // left). A block takes at most G chunks and then one past the end, hence G + 1 slots.
    int claimed[kMaxChunks + 1];
    __device__ __forceinline__ void zero() {
        for (int j = threadIdx.x; j < kWarps * kRanks; j += blockDim.x) cursors[j / kRanks][j % kRanks] = 0;
        for (int i = threadIdx.x; i < kMaxChunks; i += blockDim.x) arrivals[i] = 0;
        for (int i = threadIdx.x; i <= kMaxChunks; i += blockDim.x) claimed[i] = 0;
    }
    // The block's i-th chunk, for every warp of the block (warps walk i = 0, 1, ... in step but
    // not in sync). The first warp to get here takes the rank's next chunk from `counter`; the
    // others wait for it here (in shared memory: that warp only does one atomic meanwhile, so the
    // wait needs no bound).
    __device__ __forceinline__ int claim_chunk(int i, unsigned int *counter) {
        int g = 0;
        if (lane_id() == 0) {
            volatile int *slot = &claimed[i];
            if (atomicCAS(&claimed[i], 0, 1) == 0) {
                g = static_cast<int>(atomicAdd(counter, 1u));
                *slot = g + 2;
            } else {
                int v;
                while ((v = *slot) == 1) {
                }
                g = v - 2;
            }
        }
        return __shfl_sync(0xffffffffu, g, 0);
    }
};

// What every dispatch / combine block starts with (Params: DispatchParams or CombineParams).
struct KernelStart {
    unsigned long long epoch;
    Guard ctx;
};
template <int kRanks, class Params>
__device__ __forceinline__ KernelStart data_kernel_begin(BlockShared<kRanks> &sh, const Params &p) {
    sh.zero();   // begin_epoch's __syncthreads orders this before any use
    const unsigned long long epoch = begin_epoch<kRanks>(sh.peers, p.peer_bases, p.rank, Header<kRanks>::kEpoch);
    const KernelStart start{epoch, make_guard<kRanks>(sh.peers[p.rank], p)};
    trace_set(p.trace, kTrStart, trace_now());
    return start;
}

// The chunk loop of a sending block (dispatch senders, combine pushers), per warp. Chunks go to the
// sending blocks one at a time, in increasing order, from a rank-wide counter (claim_chunk), so a
// block that moves rows faster takes more of them and all sending blocks run out within about one
// chunk of each other (a static chunk-to-block map left the slowest block far behind). Rows still
// land where send_head puts them, and
// every chunk is signalled on its own, so the order in which chunks complete does not matter to the
// receivers; increasing claims keep the ring-space waits deadlock-free (a chunk waits only for
// chunks claimed before it). For each chunk g: wait until every peer consumed the rows that g
// overwrites in its ring (prefix + j * (G + 1): the stream prefix of the pair written into peer j's
// ring), let send_chunk(g) store this warp's items, then chunk_done (the last warp of the block
// signals the peers).
template <int kRanks, class Params, class SendChunk>
__device__ __forceinline__ void send_chunks(const Params &p, const int *prefix, BlockShared<kRanks> &sh,
                                            unsigned long long epoch, const Guard &ctx, SendChunk send_chunk) {
    const int lane = lane_id(), warp = warp_id(), rank = p.rank, stride = p.num_chunks + 1;
    char *const *peers = sh.peers;
    int *cursor = sh.cursors[warp];
    if (!wait_peers_idle<kRanks>(peers, rank, epoch, ctx)) return;
    trace_set(p.trace, kTrIdle, trace_now());
    auto *counter = reinterpret_cast<unsigned int *>(peers[rank] + Header<kRanks>::kSendClaim);
    for (int i = 0;; ++i) {
        const int g = sh.claim_chunk(i, counter);
        if (g >= p.num_chunks) break;
        trace_add(p.trace, kTrChunks, 1);
        bool ok = true;
        for (int j = lane; j < kRanks; j += 32) {
            if (j == rank) continue;
            const int *pair_prefix = prefix + j * stride;
            if (warp == 0 && __ldg(pair_prefix + g + 1) - __ldg(pair_prefix + g) > p.ring_rows)
                ctx.violation(j, kPhaseChunkTooBig);
            ok = ok && wait_ring_space<kRanks>(pair_prefix, g, p.ring_rows, cursor + j,
                                               consumed_ptr<kRanks>(peers[rank], j, 0), j, epoch, ctx);
        }
        if (!__all_sync(0xffffffffu, ok)) return;
        send_chunk(g);
        const unsigned long long signal_start = trace_now();
        chunk_done<kRanks>(sh.arrivals + i, peers, rank, g);
        trace_add(p.trace, kTrSignalNs, trace_now() - signal_start);
    }
    trace_set(p.trace, kTrSent, trace_now());
}

// Row copy geometry: a row of kRowInt4 16-byte units is moved in kSegs segments of up to 32*kUnroll
// units, each by one warp with kUnroll loads in flight per lane.
template <int kRowInt4, int kUnrollLimit>
struct RowSplit {
    static constexpr int kPerLane = (kRowInt4 + 31) / 32;
    static constexpr int kSegs = (kPerLane + kUnrollLimit - 1) / kUnrollLimit;
    static constexpr int kUnroll = (kPerLane + kSegs - 1) / kSegs;
    static constexpr int kSegInt4 = 32 * kUnroll;
};

}  // namespace intranode
}  // namespace epcomm
