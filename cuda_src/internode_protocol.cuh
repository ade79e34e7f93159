// Shared pieces of the internode kernels (protocol: cuda_src/README.md): constants, phases, the RDMA
// buffer header and the Params structs (read by the host through epcomm.runtime.cuda_decls), the
// start / end bookkeeping of every kernel, the stamped words of the rings and the record layout.
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
namespace internode {

constexpr int kThreads = kDataThreads;      // data kernels: two blocks per channel
constexpr int kWarps = kThreads / 32;
constexpr int kNotifyThreads = 1024;
constexpr int kMaxChannels = 128;           // channels (Config.num_sms / 2) the header has words for
constexpr int kMaxLocalExperts = 1024;      // expert counts a notify row holds
constexpr int kNotifyHead = 8;              // header ints of a notify row

// Phases recorded in ErrorRecord.phase; each comment is the phase's name in the host's errors
// (epcomm.ops.internode_plan.PHASES reads them).
enum Phase : int {
    kPhasePeerBusy = 0,        // a rank has not finished its previous internode kernel
    kPhaseCounts = 1,          // waiting for a rank's token counts
    kPhaseRecords = 2,         // waiting for a source rank's token records
    kPhasePushes = 3,          // waiting for a local rank's pushed rows
    kPhasePartials = 4,        // waiting for a node's partial sums
    kPhaseWorstTokens = 5,     // more rows received than num_worst_tokens
    kPhaseConfigMismatch = 6,  // ranks use different channel counts, expert counts or token formats
                               // (Config.num_sms, num_experts, hidden, FP8 or top-k differ, or
                               // topk_weights given to combine on some ranks only)
    kPhaseRingRoom = 7         // waiting for a receiver to free ring slots
};

// Header of every rank's RDMA buffer (same offsets everywhere), then the data region that notify,
// dispatch and combine each lay out from Params offsets (the rings). Every word a rank polls lives
// here, never in the data region: each holds the epoch of the call that last wrote it (kDone,
// kNotifySignal) or a count stamped with it (common/epoch.cuh `stamped`), and is never reset.
// M = kNodes, L = kRanks / kNodes, C = kMaxChannels.
template <int kRanks, int kNodes>
struct Header {
    static constexpr int kLocal = kRanks / kNodes;
    static constexpr long long kEpoch = 0;          // u64, local: internode kernels this rank finished
    static constexpr long long kTicket = 8;         // u32, local: blocks done with this kernel
    static constexpr long long kFailed = 16;        // u32, local: Guard's sticky failure flag
    static constexpr long long kViolated = 20;      // u32, local: a data kernel noted a violation
    static constexpr long long kDone = 64;          // u64[R]: epoch each rank last finished
    // u32[R]: Guard::notes, in 8R bytes (the u64 words after it stay 8-byte aligned for any R)
    static constexpr long long kWaitNotes = kDone + 8LL * kRanks;
    static constexpr long long kNotifySignal = kWaitNotes + 8LL * kRanks;       // u64[R]: counts from rank s
    // dispatch: records of (source node, channel) written into this rank's ring (the sender's)
    static constexpr long long kRecordTail = kNotifySignal + 8LL * kRanks;      // u64[M][C]
    // dispatch: records of (channel, destination rank m * L + l) rank m * L + l consumed
    static constexpr long long kRecordHead = kRecordTail + 8LL * kNodes * kMaxChannels;   // u64[C][R]
    // combine: linear index of the next row local rank l pushes to this rank in channel c
    static constexpr long long kPushProgress = kRecordHead + 8LL * kMaxChannels * kRanks;  // u64[C][L]
    // combine: entries of this rank's FIFO toward local rank l that l consumed, channel c
    static constexpr long long kPushHead = kPushProgress + 8LL * kMaxChannels * kLocal;    // u64[C][L]
    // combine: partial sums of (reducing node, channel) written into this rank's ring
    static constexpr long long kPartialTail = kPushHead + 8LL * kMaxChannels * kLocal;     // u64[M][C]
    // combine: partial sums of (source node, channel) the source consumed
    static constexpr long long kPartialHead = kPartialTail + 8LL * kNodes * kMaxChannels;  // u64[M][C]
    static constexpr long long kBytes = (kPartialHead + 8LL * kNodes * kMaxChannels + 255) / 256 * 256;
};

struct NotifyParams {
    const bool *is_token_in_rank;        // [N, R]
    const int *num_tokens_per_expert;    // [E]
    int *info;                           // [1 + R*R + E_l]: max N of all ranks | rank prefix | expert counts
    int *rdma_channel_prefix;            // [M, G+1]
    int *gbl_channel_prefix;             // [R + 1]: tokens to each rank | max N of all ranks
    int *recv_rdma_channel_prefix;       // [R, G+1]
    int *recv_rdma_rank_prefix_sum;      // [M]
    int *recv_gbl_channel_prefix;        // [R]
    int *recv_gbl_rank_prefix_sum;       // [R]
    int *send_rdma_head;                 // [N, M]
    int *send_nvl_head;                  // [N, R]
    const long long *peer_bases;         // [R] RDMA buffer of each rank in this process (0 = not mapped)
    ErrorRecord *err;
    unsigned long long timeout_ns;
    long long area_offset;               // received count rows [R][notify_ints]
    long long stage_offset;              // outgoing count rows [R][notify_ints] (source of the puts)
    int num_tokens, num_channels, tokens_per_channel, num_local_experts, notify_ints;
    int num_topk, num_scales, row_bytes;  // the data kernel's token format (checked equal on all ranks)
    int rank, op;
};

struct DispatchParams {
    const void *x;                       // [N, H] bf16 or e4m3
    const float *x_scales;               // [N, S] any strides, or null
    const void *topk_idx;                // [N, K] IdxT, or null
    const float *topk_weights;           // [N, K] or null
    const int *rdma_channel_prefix;      // [M, G+1]
    const int *recv_rdma_channel_prefix; // [R, G+1]
    const int *recv_gbl_rank_prefix_sum; // [R]
    const int *send_rdma_head;           // [N, M]
    const int *send_nvl_head;            // [N, R]
    void *recv_x;                        // [M_out, H]
    float *recv_x_scales;                // [M_out, S]
    void *recv_topk_idx;                 // [M_out, K] IdxT
    float *recv_topk_weights;            // [M_out, K]
    int *recv_src_meta;                  // [M_out, 3]
    const long long *peer_bases;
    ErrorRecord *err;
    long long scale_stride_token, scale_stride_group;   // elements
    unsigned long long timeout_ns;
    long long recv_offset;               // record rings [source node][G][ring]
    long long stage_offset;              // record rings [destination node][G][stage] (put sources)
    int ring, stage, chunk;              // records per receive ring, per staging ring, per put
    int record_bytes, num_tokens, num_channels, tokens_per_channel, num_topk;
    int num_local_experts, num_out_rows, rank, op;
    unsigned long long *trace;           // [blocks, kTraceWarps, kTraceSlots] in EPCOMM_TRACE builds, else null
};

struct CombineParams {
    const void *x;                       // [M_rows, H] bf16, this rank's dispatch row order
    const float *topk_weights;           // [M_rows, K] or null
    const void *bias0, *bias1;           // [N, H] bf16 or null
    const int *recv_src_meta;            // [M_rows, 3]
    const int *recv_gbl_rank_prefix_sum; // [R]
    const int *recv_rdma_channel_prefix; // [R, G+1]
    const int *rdma_channel_prefix;      // [M, G+1]
    const int *send_rdma_head;           // [N, M]
    void *combined_x;                    // [N, H] bf16
    float *combined_weights;             // [N, K] or null
    const long long *peer_bases;         // [R] RDMA buffers
    const long long *push_bases;         // [R] buffers holding the push FIFOs (this node's ranks)
    ErrorRecord *err;
    unsigned long long timeout_ns;
    long long push_offset;               // push FIFOs [G][L pushers][push_ring] (in push_bases buffers)
    long long partial_recv_offset;       // partial rings [reducing node][G][ring]
    long long partial_stage_offset;      // partial rings [source node][G][stage] (put sources)
    int push_ring, push_chunk, push_bytes;
    int ring, stage, chunk, partial_bytes;
    int num_tokens, num_channels, tokens_per_channel, num_topk, rank, op;
    unsigned long long *trace;           // [blocks, kTraceWarps, kTraceSlots] in EPCOMM_TRACE builds, else null
};

// ---- trace (profiling builds: common/trace.cuh) -------------------------------------------------
// Rows [block][kTraceWarps][kTraceSlots] of Params::trace, lane 0 of each warp; the names are
// TRACE_SLOTS in epcomm/ops/internode_plan.py. Every warp stamps start / idle / done; a role's
// leader (warp 0 of its group) stamps, per chunk it completes, the role's three slots: the first
// and the last completion (%globaltimer ns) and the count. A chunk is one announcement: dispatch's
// RDMA sender, a batch of records put and its tail published; dispatch's receiver (the NVLink
// stage: it reads the RDMA peer's ring and copies the rows out), a batch copied and its consumed
// count written back; combine's pusher, a batch of rows in a reducer's FIFO and its progress
// published; the reducer, a batch of partial sums put and its tail published; the finishing
// receiver, a round of tokens summed and its slots handed back. Overlap then reads off the rows:
// a receiver's first chunk before the senders' last means the NVLink stage ran while the RDMA
// stage still had chunks to send.
constexpr int kTraceWarps = kWarps;
enum TraceSlot : int {
    kTrStart = 0,           // the warp began (its epoch read)
    kTrIdle = 1,            // every rank finished its previous internode kernel (wait_all_idle)
    kTrRdmaSendFirst = 2,   // dispatch sender: first chunk's tail published
    kTrRdmaSendLast = 3,    // dispatch sender: last chunk's tail published
    kTrRdmaSendChunks = 4,  // dispatch sender: chunks published
    kTrNvlRecvFirst = 5,    // dispatch receiver: first chunk copied out, consumed count written
    kTrNvlRecvLast = 6,     // dispatch receiver: last chunk copied out
    kTrNvlRecvChunks = 7,   // dispatch receiver: chunks copied out
    kTrPushFirst = 8,       // combine pusher: first batch of rows in a FIFO, progress published
    kTrPushLast = 9,        // combine pusher: last batch pushed
    kTrPushChunks = 10,     // combine pusher: batches pushed
    kTrReduceFirst = 11,    // combine reducer: first batch of partial sums put, tail published
    kTrReduceLast = 12,     // combine reducer: last batch of partial sums published
    kTrReduceChunks = 13,   // combine reducer: batches published
    kTrFinishFirst = 14,    // combine receiver: first round of tokens summed, slots handed back
    kTrFinishLast = 15,     // combine receiver: last round done
    kTrFinishRounds = 16,   // combine receiver: rounds done
    kTrDone = 17,           // the warp's part of the call done (before kernel_finish)
    kTraceSlots = 18
};
__device__ __forceinline__ void trace_stamp(unsigned long long *trace, int slot) {
    if constexpr (kTrace) TraceRow(trace, kTraceWarps, kTraceSlots).set(slot, globaltimer_ns());
}
// One chunk of a role done: `first` is the role's first-completion slot, followed by its
// last-completion slot and its count.
__device__ __forceinline__ void trace_chunk(unsigned long long *trace, int first) {
    if constexpr (kTrace) {
        const TraceRow row(trace, kTraceWarps, kTraceSlots);
        const unsigned long long now = globaltimer_ns();
        row.first(first, now);
        row.set(first + 1, now);
        row.add(first + 2, 1);
    }
}

__device__ __forceinline__ unsigned long long *word_at(char *base, long long offset) {
    return reinterpret_cast<unsigned long long *>(base + offset);
}

// ---- start and end of every internode kernel --------------------------------------------------
// What every block of a kernel knows about its call: this rank's buffer, the call's epoch, the
// failure guard and this rank's place (node, local index).
// Rank s = node * L + local; the RDMA peer of s on node m is m * L + local.
struct Call {
    char *base;
    unsigned long long epoch;
    Guard guard;
    int rank, node, local;
};

// Peer table into shared memory (`peers`), epoch, guard.
template <int kRanks, int kLocal, class Params>
__device__ __forceinline__ Call begin_call(char **peers, const Params &p) {
    static_assert(kRanks % kLocal == 0, "ranks per node must divide the ranks");
    static_assert(kLocal <= 32, "a lane per local rank (presence bits, waits) assumes <= 32 ranks per node");
    using H = Header<kRanks, kRanks / kLocal>;
    const unsigned long long epoch = begin_epoch<kRanks>(peers, p.peer_bases, p.rank, H::kEpoch);
    char *base = peers[p.rank];
    auto *failed = reinterpret_cast<unsigned int *>(base + H::kFailed);
    auto *notes = reinterpret_cast<unsigned int *>(base + H::kWaitNotes);
    const Guard guard = Guard::make(failed, notes, p.err, p.timeout_ns, p.op, p.rank, p.peer_bases, kRanks);
    return Call{base, epoch, guard, p.rank, p.rank / kLocal, p.rank % kLocal};
}

// Before a kernel writes anything another rank reads (its own buffer included: local peers read it
// over NVLink), every rank must have finished the previous internode kernel, whose data it may
// still be reading. Warp 0 of each block waits (lanes over ranks); the result is block-wide. False
// also after any recorded failure (the routing tables may then be garbage, e.g. after a notify
// that timed out): the kernel touches nothing and only keeps the epoch bookkeeping.
template <int kRanks, int kNodes>
__device__ __forceinline__ bool wait_all_idle(const Call &c, int *block_ok) {
    using H = Header<kRanks, kNodes>;
    if (warp_id() == 0) {
        bool ok = !c.guard.failed();
        for (int r = lane_id(); r < kRanks && ok; r += 32)
            if (r != c.rank) ok = wait_at_least(c.guard, word_at(c.base, H::kDone + 8LL * r), c.epoch - 1, r, kPhasePeerBusy);
        ok = __all_sync(0xffffffffu, ok);
        if (lane_id() == 0) *block_ok = ok;
    }
    __syncthreads();
    return *block_ok != 0;
}

// One lane writes a word another rank polls, after this warp's data it announces (ordered by a
// __syncwarp before the call). `peer`: that rank's buffer when mapped here (a release store);
// null: a put of the word after nvshmem_fence, which orders it behind this PE's earlier puts to
// `pe` (the data, and older values of the same word). No NVSHMEM atomic or signal operation: the
// proxy transports (IBRC, UCX, libfabric) would apply those as remote atomics, which need GDRCopy.
__device__ __forceinline__ void put_word(char *base, char *peer, long long offset, unsigned long long value, int pe) {
    if (peer != nullptr) {
        fence_acq_rel_sys();
        st_release_sys(word_at(peer, offset), value);
        return;
    }
    nvshmem_fence();
    nvshmem_uint64_p(reinterpret_cast<uint64_t *>(base + offset), value, pe);
}

// A warp moves `bytes` from this rank's buffer to the same-offset-relative place of `pe` (its part
// of a put; the data was written by this warp before a __syncwarp).
__device__ __forceinline__ void put_bytes(char *remote_dst, const char *local_src, size_t bytes, int pe) {
    __threadfence_system();   // the data before the transport reads it (proxy: the NIC)
    __syncwarp();
    if (bytes > 0) nvshmemx_putmem_nbi_warp(remote_dst, local_src, bytes, pe);
}

// A warp announces records [k, end) of a stream (each `rec` bytes) to `pe`, whose ring starts at
// offset `ring_at` (`ring` slots). Written in place (`holder`: pe's buffer, mapped here): only the
// stamped tail. Otherwise they sit in this rank's staging ring at `stage_at` (`stage` slots): put
// them, in runs contiguous in both rings, then the tail behind them (put_word's fence).
__device__ __forceinline__ void publish_stream(char *base, char *holder, int k, int end, long long rec,
                                               long long ring_at, int ring, long long stage_at, int stage,
                                               long long tail, unsigned long long epoch, int pe) {
    __syncwarp();
    if (holder == nullptr) {
        for (int r = k; r < end;) {
            const int run = min(end - r, min(stage - r % stage, ring - r % ring));
            put_bytes(base + ring_at + (r % ring) * rec, base + stage_at + (r % stage) * rec, (size_t)run * rec, pe);
            r += run;
        }
        __syncwarp();
    }
    if (lane_id() == 0) put_word(base, holder, tail, stamped(epoch, end), pe);
    __syncwarp();
}

// Every block completes its puts (their sources are reused by the next kernel); the last block to
// finish stores the epoch and tells every rank.
template <int kRanks, int kNodes>
__device__ __forceinline__ void kernel_finish(const Call &c) {
    using H = Header<kRanks, kNodes>;
    char *base = c.base;
    const int rank = c.rank;
    const unsigned long long epoch = c.epoch;
    __syncthreads();
    if (threadIdx.x != 0) return;
    nvshmem_quiet();
    auto *ticket = reinterpret_cast<unsigned int *>(base + H::kTicket);
    fence_acq_rel_sys();
    if (atomicAdd(ticket, 1u) != gridDim.x - 1) return;
    fence_acq_rel_sys();
    *ticket = 0;
    if (*reinterpret_cast<volatile unsigned int *>(base + H::kViolated) != 0u) c.guard.raise_flag(-1, true);   // the record names the peer
    *reinterpret_cast<volatile unsigned long long *>(base + H::kEpoch) = epoch;
    for (int r = 0; r < kRanks; ++r)
        if (r != rank) put_word(base, nullptr, H::kDone + 8LL * rank, epoch, r);
    nvshmem_quiet();
}

// A size / format violation a data kernel finds: recorded at once (first failure wins), but the
// call goes on moving data, so every rank completes its transfers and finds the violation itself
// (instead of timing out on a rank that stopped); kernel_finish then raises the flag that stops
// later calls.
__device__ __forceinline__ void note_violation(const Call &c, int peer, int phase) {
    c.guard.ctx.record(peer, phase, kDeviceCheckFailed);
    *reinterpret_cast<volatile unsigned int *>(c.base + Header<1, 1>::kViolated) = 1u;
}

// Round-robin progress over the streams one warp owns: a stream that cannot move must not hold up
// the others (ring slots free up only as other streams move). Warp-uniform; `idle` after a round
// in which no stream moved: false once the kernel must wind down (a failure recorded elsewhere, or
// the call's deadline passed: recorded here against `peer` / `phase`).
struct Spinner {
    unsigned int rounds = 0;
    __device__ __forceinline__ bool idle(const Guard &guard, int peer, int phase) {
        if (++rounds % kPollsPerCheck != 0) return true;
        int stop = 0;
        if (lane_id() == 0) {
            stop = guard.failed(phase);
            if (!stop && guard.past_deadline(peer)) {
                guard.timeout(peer, phase);
                stop = 1;
            }
        }
        return __shfl_sync(0xffffffffu, stop, 0) == 0;
    }
};

// The smallest stamped count of `n` words (lanes over words), warp-uniform; acquire loads, so
// what the writers did before their stamps is visible after.
__device__ __forceinline__ unsigned int min_stamped(const unsigned long long *words, long long stride, int n,
                                                    unsigned long long epoch) {
    unsigned int m = 0xffffffffu;
    for (int j = lane_id(); j < n; j += 32) m = min(m, stamped_count(ld_acquire_sys(words + j * stride), epoch));
    for (int o = 16; o > 0; o >>= 1) m = min(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// A dispatch record: row bytes | scales f32[S] | global expert ids i32[K] | weights f32[K] |
// source token i32 | row on each local rank of the destination node i32[L] (-1: not sent there).
struct RecordFields {
    int scales, topk, weights, src, pos;
    __device__ __forceinline__ RecordFields(int row_bytes, int num_scales, int num_topk) {
        scales = row_bytes;
        topk = scales + 4 * num_scales;
        weights = topk + 4 * num_topk;
        src = weights + 4 * num_topk;
        pos = src + 4;
    }
};

// Channel c of a rank with N tokens: tokens [c * tpc, min(N, (c + 1) * tpc)).
__device__ __forceinline__ int channel_begin(int c, int tpc, int n) { return min(c * tpc, n); }
__device__ __forceinline__ int channel_end(int c, int tpc, int n) { return min((c + 1) * tpc, n); }

}  // namespace internode
}  // namespace epcomm
