// Shared pieces of the internode kernels (protocol: cuda_src/README.md): constants, phases, the RDMA
// buffer header and the Params structs (read by the host through epcomm.runtime.cuda_decls), the
// start / end bookkeeping of every kernel and the record layout.
#pragma once
#include "common/nvshmem.cuh"
#include "common/arch.cuh"
#include "common/bf16.cuh"
#include "common/epoch.cuh"
#include "common/limits.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"

namespace epcomm {
namespace internode {

constexpr int kThreads = kDataThreads;      // data kernels
constexpr int kWarps = kThreads / 32;
constexpr int kNotifyThreads = 1024;
constexpr int kMaxChunks = 1024;            // signal words per source node (dispatch and combine)
constexpr int kMaxLocalExperts = 1024;      // expert counts a notify row holds
constexpr int kNotifyHead = 8;              // header ints of a notify row

// Phases recorded in ErrorRecord.phase; each comment is the phase's name in the host's errors
// (epcomm.ops.internode_plan.PHASES reads them).
enum Phase : int {
    kPhasePeerBusy = 0,        // a rank has not finished its previous internode kernel
    kPhaseCounts = 1,          // waiting for a rank's token counts
    kPhaseRecords = 2,         // waiting for a chunk of a source rank's token records
    kPhasePushes = 3,          // waiting for a local rank's pushed rows
    kPhasePartials = 4,        // waiting for a node's partial sums
    kPhaseWorstTokens = 5,     // more rows received than num_worst_tokens
    kPhaseConfigMismatch = 6,  // ranks use different chunk counts, expert counts or token formats
                               // (Config.num_sms, num_experts, hidden, FP8 or top-k differ, or
                               // topk_weights given to combine on some ranks only)
    kPhaseCapacity = 7         // the largest N of all ranks does not fit the RDMA buffer (internode
                               // calls are one-shot: raise num_rdma_bytes; Config.get_rdma_buffer_size_hint)
};

// Header of every rank's RDMA buffer (same offsets everywhere), then the data region that notify,
// dispatch and combine each lay out from Params offsets. Signal words are never reset: they hold
// the epoch of the call that last wrote them.
template <int kRanks, int kNodes>
struct Header {
    static constexpr long long kEpoch = 0;          // u64, local: internode kernels this rank finished
    static constexpr long long kTicket = 8;         // u32, local: blocks done with this kernel
    static constexpr long long kPushTicket = 12;    // u32, local: combine blocks done pushing
    static constexpr long long kFailed = 16;        // u32, local: Guard's sticky failure flag
    static constexpr long long kDone = 64;          // u64[R]: epoch each rank last finished
    static constexpr long long kNotifySignal = kDone + 8LL * kRanks;        // u64[R]: counts from rank s
    static constexpr long long kPushDone = kNotifySignal + 8LL * kRanks;    // u64[L]: local rank j pushed
    static constexpr long long kRecordSignal = (kPushDone + 8LL * kRanks + 127) / 128 * 128;  // u64[M][G]
    static constexpr long long kPartialSignal = kRecordSignal + 8LL * kNodes * kMaxChunks;    // u64[M][chunks]
    static constexpr long long kBytes = (kPartialSignal + 8LL * kNodes * kMaxChunks + 255) / 256 * 256;
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
    int num_tokens, num_chunks, tokens_per_chunk, num_local_experts, notify_ints;
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
    const int *max_tokens;               // max N of all ranks (notify's; handle[2][R])
    const long long *peer_bases;
    ErrorRecord *err;
    long long scale_stride_token, scale_stride_group;   // elements
    unsigned long long timeout_ns;
    long long recv_offset;               // records [M][capacity] (slot [source node][index])
    long long stage_offset;              // records [M][capacity] (slot [destination node][index])
    int capacity, record_bytes, num_tokens, num_chunks, tokens_per_chunk, num_topk;
    int num_local_experts, num_out_rows, rank, op;
};

struct CombineParams {
    const void *x;                       // [M_rows, H] bf16, this rank's dispatch row order
    const float *topk_weights;           // [M_rows, K] or null
    const void *bias0, *bias1;           // [N, H] bf16 or null
    const int *recv_src_meta;            // [M_rows, 3]
    const int *recv_gbl_rank_prefix_sum; // [R]
    const int *recv_rdma_channel_prefix; // [R, G+1]
    const int *send_rdma_head;           // [N, M]
    void *combined_x;                    // [N, H] bf16
    float *combined_weights;             // [N, K] or null
    const int *max_tokens;               // max N of all ranks (notify's; handle[2][R])
    const long long *peer_bases;
    ErrorRecord *err;
    unsigned long long timeout_ns;
    long long push_offset;               // pushed rows [L][M][capacity] (rows hold kMaxTopk weights)
    long long partial_stage_offset;      // partial sums [M][capacity] (source of the puts)
    long long partial_recv_offset;       // partial sums [M][capacity] (slot [reducing node][index])
    int capacity, push_bytes, partial_bytes, chunk_records, num_tokens, num_chunks, num_topk, rank, op;
};

__device__ __forceinline__ unsigned long long *signal_word(char *base, long long region, int index) {
    return reinterpret_cast<unsigned long long *>(base + region) + index;
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
    return Call{base, epoch, Guard::make(failed, p.err, p.timeout_ns, p.op, p.rank), p.rank, p.rank / kLocal,
                p.rank % kLocal};
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
            if (r != c.rank) ok = wait_at_least(c.guard, signal_word(c.base, H::kDone, r), c.epoch - 1, r, kPhasePeerBusy);
        ok = __all_sync(0xffffffffu, ok);
        if (lane_id() == 0) *block_ok = ok;
    }
    __syncthreads();
    return *block_ok != 0;
}

// One-shot calls: the largest N of all ranks (written by notify, earlier on this stream) must fit the
// kernel's capacity, or slots past the data region would be written. Every rank reads the same N
// and, with equal configs (notify checks them), has the same capacity: when it does not fit, every
// rank records a DeviceCheckFailed and skips its work alike, so no rank waits for data that is
// never sent; kernel_finish still runs (the epoch bookkeeping). Block-uniform.
__device__ __forceinline__ bool fits_capacity(const Call &c, const int *max_tokens, int capacity) {
    if (__ldg(max_tokens) <= capacity) return true;
    if (threadIdx.x == 0) c.guard.violation(-1, kPhaseCapacity);
    return false;
}

// Every block completes its puts (their sources are reused by the next kernel); the last block to
// finish stores the epoch and tells every rank (NVSHMEM signal: remote nodes included).
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
    *reinterpret_cast<volatile unsigned long long *>(base + H::kEpoch) = epoch;
    unsigned long long *done = signal_word(base, H::kDone, rank);
    for (int r = 0; r < kRanks; ++r)
        if (r != rank) nvshmemx_signal_op(reinterpret_cast<uint64_t *>(done), epoch, NVSHMEM_SIGNAL_SET, r);
    nvshmem_quiet();
}

// A warp hands a contiguous run of records (written by any warp of its block before a
// __syncthreads) to the RDMA peer: one put with a signal SET to `epoch` once the bytes landed.
// `direct`: the records were written in place (this rank's own node, or a peer whose buffer is
// mapped: allow_mnnvl), and `signal` is addressable from here: a release of it suffices.
__device__ __forceinline__ void publish_run(char *remote_dst, const char *local_src, size_t bytes,
                                            unsigned long long *signal, unsigned long long epoch, int pe,
                                            bool direct) {
    if (direct) {
        if (lane_id() == 0) {
            fence_acq_rel_sys();
            st_release_sys(signal, epoch);
        }
        __syncwarp();
        return;
    }
    __threadfence_system();   // the block's records before the transport reads them (proxy: the NIC)
    __syncwarp();
    if (bytes == 0) {
        if (lane_id() == 0) nvshmemx_signal_op(reinterpret_cast<uint64_t *>(signal), epoch, NVSHMEM_SIGNAL_SET, pe);
        __syncwarp();
        return;
    }
    nvshmemx_putmem_signal_nbi_warp(remote_dst, local_src, bytes, reinterpret_cast<uint64_t *>(signal), epoch,
                                    NVSHMEM_SIGNAL_SET, pe);
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

}  // namespace internode
}  // namespace epcomm
