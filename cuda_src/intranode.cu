// Normal-mode intranode dispatch / combine: every rank stores straight into its peers' NVL buffers
// (NVLink loads/stores through the peer mappings of the symmetric heap; no NVSHMEM device code).
//
// Routing unit: each source rank cuts its N tokens into G chunks of T = ceil(N / G) consecutive
// tokens (G is the same on every rank; empty chunks are allowed). Pair (s -> j) carries the rows
// of s's tokens that go to j, in token order: the pair's "stream"; a row's stream index k is
// send_head[t][j]. channel_prefix[j][g] (sender side) == recv_channel_prefix[s][g] (receiver side) =
// stream index of chunk g's first row. Row k of s lands at position rank_prefix[s-1][j] + k of j's
// output, so rows come grouped by source and in token order.
//
// Receive rings: j's NVL buffer holds, per peer s, a ring of `ring_rows` records; stream row k of
// pair (s -> j) goes to ring slot k % ring_rows. One-shot when the whole stream fits; otherwise
// the sender waits, before writing chunk g, until the receiver consumed every chunk whose rows
// the write overwrites (consumed flags, one per chunk). Combine uses the same rings backwards
// (j pushes stream k of pair (s -> j) into s's ring of peer j).
//
// Signals (all in the signalled rank's own header, never reset by the writer):
//   ready[s][g]    u32: +1 per sender warp done with chunk g (kWarps per chunk); the receiver that
//                  consumes the chunk sets it back to 0 before it publishes consumed.
//   consumed[j][g] u64: epoch at which j consumed chunk g of this rank (ring space is free).
//   done[j]        u64: epoch of the last kernel rank j finished: nobody writes into j's buffer
//                  before j finished the previous kernel (so no reset ever races a write).
//   notify_flag[s] u64: epoch at which s's counts arrived.
// `epoch` counts this rank's intranode kernels (device-resident; bumped by the last block to
// finish), so CUDA-graph replays and repeated calls need nothing from the host.
// Every wait on a peer is bounded (WaitContext); other failures are recorded with kErrorCapacity.
#pragma once
#include "common/arch.cuh"
#include "common/ptx.cuh"
#include "common/timeout.cuh"

namespace epcomm {
namespace intranode {

constexpr int kThreads = 512;              // data kernels
constexpr int kWarps = kThreads / 32;      // = sender warps per chunk = ready count of a chunk
constexpr int kNotifyThreads = 1024;
constexpr int kMaxChunks = 1024;           // G <= kMaxChunks (signal arrays are sized by it)
constexpr int kParts = 8;                  // a received chunk is claimed in kParts pieces
constexpr int kErrorCapacity = 2;          // ErrorRecord.code for a size/config violation

// Phases recorded in ErrorRecord.phase (named in epcomm/ops/intranode.py, same order).
enum Phase : int {
    kPhasePeerBusy = 0,      // waiting for a peer to finish its previous intranode kernel
    kPhaseCounts = 1,        // notify: waiting for a peer's counts
    kPhaseData = 2,          // waiting for a peer's rows of a chunk
    kPhaseRingSpace = 3,     // waiting for a peer to consume rows that a new chunk overwrites
    kPhaseChunkTooBig = 4,   // a chunk has more rows than the receive ring
    kPhaseWorstTokens = 5,   // more rows received than num_worst_tokens
    kPhaseConfigMismatch = 6 // ranks use different chunk counts (different Config.num_sms)
};

// Header of every rank's NVL buffer, then (dispatch only) the notify area, then the rings.
template <int kRanks>
struct Header {
    static constexpr long long kEpoch = 0;          // u64, local
    static constexpr long long kFinished = 8;       // u32, local: blocks done with this kernel
    static constexpr long long kClaim = 12;         // u32, local: next receive claim
    static constexpr long long kDone = 64;          // u64[R]
    static constexpr long long kNotifyFlag = kDone + 8LL * kRanks;
    static constexpr long long kReady = (kNotifyFlag + 8LL * kRanks + 127) / 128 * 128;  // u32[R][G]
    static constexpr long long kParts = kReady + 4LL * kRanks * kMaxChunks;  // u32[R][G], local
    static constexpr long long kConsumed = kParts + 4LL * kRanks * kMaxChunks;  // u64[R][G]
    static constexpr long long kBytes = kConsumed + 8LL * kRanks * kMaxChunks;
};

struct NotifyParams {
    const bool *is_token_in_rank;    // [N, R]
    const int *num_tokens_per_expert;  // [E]
    int *info;                       // [R*R + E_l + 2]: rank_prefix | expert counts | N max | mismatches
    int *channel_prefix;             // [R, G+1]
    int *recv_channel_prefix;        // [R, G+1]
    int *send_head;                  // [N, R]
    const long long *peer_bases;     // [R] NVL buffer of each rank in this process's address space
    ErrorRecord *err;
    unsigned long long timeout_ns;
    long long notify_offset;         // bytes from the buffer base to the notify area
    int num_tokens, num_chunks, tokens_per_chunk, num_local_experts;
    int rank, op;
};
static_assert(sizeof(NotifyParams) == 104, "NotifyParams is mirrored in epcomm/ops/intranode.py");

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
    int num_local_experts, num_out_rows, rank, num_send_blocks, op, pad_;
};
static_assert(sizeof(DispatchParams) == 200, "DispatchParams is mirrored in epcomm/ops/intranode.py");

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
    int rank, num_send_blocks, op, pad_;
};
static_assert(sizeof(CombineParams) == 152, "CombineParams is mirrored in epcomm/ops/intranode.py");

// ---- small helpers ---------------------------------------------------------------------------
__device__ __forceinline__ void red_add_release_sys(int *p, int v) {
    asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Rows that peers write while the kernel runs: L2 only, never a stale L1 line.
__device__ __forceinline__ int4 ld_cg_v4(const int4 *p) {
    int4 v;
    asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned long long ld_volatile_u64(const void *p) {
    return *static_cast<const volatile unsigned long long *>(p);
}
__device__ __forceinline__ unsigned long long ld_relaxed_sys_u64(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Bounded waits for a value written by another GPU: poll with relaxed loads (an acquire load per
// spin would invalidate the SM's L1 each time), then one acquire fence orders what follows.
__device__ __forceinline__ bool wait_at_least(const WaitContext &ctx, const int *p, int target, int peer,
                                              int phase) {
    if (!ctx.wait(peer, phase, [&] { return ld_relaxed_sys(p) >= target; })) return false;
    fence_acq_rel_sys();
    return true;
}
__device__ __forceinline__ bool wait_at_least(const WaitContext &ctx, const unsigned long long *p,
                                              unsigned long long target, int peer, int phase) {
    if (!ctx.wait(peer, phase, [&] { return ld_relaxed_sys_u64(p) >= target; })) return false;
    fence_acq_rel_sys();
    return true;
}

__device__ __noinline__ void record_failure(ErrorRecord *err, int op, int rank, int peer, int phase) {
    if (atomicCAS(&err->code, kOk, kErrorCapacity) == kOk) {
        err->op = op;
        err->rank = rank;
        err->peer = peer;
        err->phase = phase;
        __threadfence_system();
    }
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

// Every block loads the peer table into shared memory; returns this kernel's epoch.
template <int kRanks>
__device__ __forceinline__ unsigned long long kernel_begin(char **peers, const long long *peer_bases, int rank) {
    for (int j = threadIdx.x; j < kRanks; j += blockDim.x) peers[j] = reinterpret_cast<char *>(peer_bases[j]);
    __syncthreads();
    return ld_volatile_u64(peers[rank] + Header<kRanks>::kEpoch) + 1;
}

// The last block to finish publishes the epoch locally and as `done` to every peer.
template <int kRanks>
__device__ __forceinline__ void kernel_end(char *const *peers, int rank, unsigned long long epoch) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    char *local = peers[rank];
    auto *finished = reinterpret_cast<unsigned int *>(local + Header<kRanks>::kFinished);
    __threadfence();
    if (atomicAdd(finished, 1u) != gridDim.x - 1) return;
    __threadfence();
    *finished = 0;
    *reinterpret_cast<volatile unsigned int *>(local + Header<kRanks>::kClaim) = 0;
    *reinterpret_cast<volatile unsigned long long *>(local + Header<kRanks>::kEpoch) = epoch;
    fence_acq_rel_sys();
    for (int j = 0; j < kRanks; ++j)
        if (j != rank) st_release_sys(done_ptr<kRanks>(peers[j], rank), epoch);
}

// Lanes wait (one peer each) until every peer finished its previous kernel. False on failure.
template <int kRanks>
__device__ __forceinline__ bool wait_peers_idle(char *const *peers, int rank, unsigned long long epoch,
                                                const WaitContext &ctx) {
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
                                                unsigned long long epoch, const WaitContext &ctx) {
    const int limit = __ldg(prefix + g + 1) - ring_rows;
    int x = *cursor;
    while (x < g && __ldg(prefix + x) < limit) {
        if (!wait_at_least(ctx, consumed + x, epoch, peer, kPhaseRingSpace)) return false;
        ++x;
    }
    *cursor = x;
    return true;
}

// Row copy geometry: a row of kRowInt4 16-byte units is moved in kSegs segments of up to 32*kUnroll
// units, each by one warp with kUnroll loads in flight per lane.
template <int kRowInt4, int kMaxUnroll>
struct RowSplit {
    static constexpr int kPerLane = (kRowInt4 + 31) / 32;
    static constexpr int kSegs = (kPerLane + kMaxUnroll - 1) / kMaxUnroll;
    static constexpr int kUnroll = (kPerLane + kSegs - 1) / kSegs;
    static constexpr int kSegInt4 = 32 * kUnroll;
};

// ---- notify: exchange counts, build the routing tables --------------------------------------
template <int kRanks>
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const __grid_constant__ NotifyParams p) {
    __shared__ char *peers[kRanks];
    __shared__ int failed;
    const int warp = warp_id(), lane = lane_id(), num_warps = kNotifyThreads / 32;
    if (threadIdx.x == 0) failed = 0;
    const unsigned long long epoch = kernel_begin<kRanks>(peers, p.peer_bases, p.rank);
    const WaitContext ctx = WaitContext::make(p.err, p.timeout_ns, p.op, p.rank);
    const int n = p.num_tokens, num_chunks = p.num_chunks, tpc = p.tokens_per_chunk, stride = num_chunks + 1;
    const int num_le = p.num_local_experts;
    const int notify_ints = ((4 + kRanks + num_le + stride) + 3) / 4 * 4;

    // Chunk counts per destination, then an inclusive scan per destination.
    for (int g = warp; g < num_chunks; g += num_warps) {
        const int t0 = min(g * tpc, n), t1 = min(t0 + tpc, n);
        for (int j = 0; j < kRanks; ++j) {
            int count = 0;
            for (int base = t0; base < t1; base += 32) {
                const int t = base + lane;
                count += __popc(__ballot_sync(0xffffffffu, t < t1 && p.is_token_in_rank[(long long)t * kRanks + j]));
            }
            if (lane == 0) p.channel_prefix[j * stride + g + 1] = count;
        }
    }
    __syncthreads();
    for (int j = warp; j < kRanks; j += num_warps) {
        int running = 0;
        if (lane == 0) p.channel_prefix[j * stride] = 0;
        for (int base = 1; base <= num_chunks; base += 32) {
            const int g = base + lane;
            int v = g <= num_chunks ? p.channel_prefix[j * stride + g] : 0;
            for (int d = 1; d < 32; d <<= 1) {
                const int other = __shfl_up_sync(0xffffffffu, v, d);
                if (lane >= d) v += other;
            }
            if (g <= num_chunks) p.channel_prefix[j * stride + g] = running + v;
            running += __shfl_sync(0xffffffffu, v, 31);
        }
    }
    __syncthreads();

    // Publish to every rank (self included): [G, N, 0, 0, counts to each rank, this rank's
    // per-expert counts for j's experts, channel_prefix[j][0..G]].
    for (int j = warp; j < kRanks; j += num_warps) {
        bool ok = true;
        if (lane == 0 && j != p.rank)
            ok = wait_at_least(ctx, done_ptr<kRanks>(peers[p.rank], j), epoch - 1, j, kPhasePeerBusy);
        if (!__shfl_sync(0xffffffffu, ok, 0)) {
            failed = 1;
            continue;
        }
        int *dst = reinterpret_cast<int *>(peers[j] + p.notify_offset) + p.rank * notify_ints;
        for (int i = lane; i < notify_ints; i += 32) {
            int v = 0;
            if (i == 0) v = num_chunks;
            else if (i == 1) v = n;
            else if (i >= 4 && i < 4 + kRanks) v = p.channel_prefix[(i - 4) * stride + num_chunks];
            else if (i >= 4 + kRanks && i < 4 + kRanks + num_le) v = p.num_tokens_per_expert[j * num_le + i - 4 - kRanks];
            else if (i >= 4 + kRanks + num_le && i < 4 + kRanks + num_le + stride) v = p.channel_prefix[j * stride + i - 4 - kRanks - num_le];
            dst[i] = v;
        }
        __syncwarp();
        if (lane == 0) st_release_sys(notify_flag_ptr<kRanks>(peers[j], p.rank), epoch);
    }

    // While the counts travel: send_head[t][j] = stream index of token t in pair (self -> j), or -1.
    for (int g = warp; g < num_chunks; g += num_warps) {
        const int t0 = min(g * tpc, n), t1 = min(t0 + tpc, n);
        for (int j = 0; j < kRanks; ++j) {
            int running = p.channel_prefix[j * stride + g];
            for (int base = t0; base < t1; base += 32) {
                const int t = base + lane;
                const bool in = t < t1 && p.is_token_in_rank[(long long)t * kRanks + j];
                const unsigned mask = __ballot_sync(0xffffffffu, in);
                if (t < t1) p.send_head[(long long)t * kRanks + j] = in ? running + __popc(mask & ((1u << lane) - 1)) : -1;
                running += __popc(mask);
            }
        }
    }

    for (int s = threadIdx.x; s < kRanks; s += kNotifyThreads) {
        if (!wait_at_least(ctx, notify_flag_ptr<kRanks>(peers[p.rank], s), epoch, s, kPhaseCounts)) failed = 1;
    }
    __syncthreads();
    if (!failed) {
        const int *area = reinterpret_cast<const int *>(peers[p.rank] + p.notify_offset);
        for (int idx = threadIdx.x; idx < kRanks * kRanks; idx += kNotifyThreads) {
            const int i = idx / kRanks, j = idx % kRanks;
            int sum = 0;
            for (int s = 0; s <= i; ++s) sum += __ldcg(area + s * notify_ints + 4 + j);
            p.info[idx] = sum;
        }
        for (int idx = threadIdx.x; idx < kRanks * stride; idx += kNotifyThreads) {
            const int s = idx / stride, g = idx % stride;
            p.recv_channel_prefix[idx] = __ldcg(area + s * notify_ints + 4 + kRanks + num_le + g);
        }
        for (int e = threadIdx.x; e < num_le; e += kNotifyThreads) {
            int sum = 0;
            for (int s = 0; s < kRanks; ++s) sum += __ldcg(area + s * notify_ints + 4 + kRanks + e);
            p.info[kRanks * kRanks + e] = sum;
        }
        if (threadIdx.x == 0) {
            int max_tokens = 0, mismatches = 0;
            for (int s = 0; s < kRanks; ++s) {
                max_tokens = max(max_tokens, __ldcg(area + s * notify_ints + 1));
                if (__ldcg(area + s * notify_ints) != num_chunks) {
                    ++mismatches;
                    record_failure(p.err, p.op, p.rank, s, kPhaseConfigMismatch);
                }
            }
            p.info[kRanks * kRanks + num_le] = max_tokens;
            p.info[kRanks * kRanks + num_le + 1] = mismatches;
        }
    }
    kernel_end<kRanks>(peers, p.rank, epoch);
}

// ---- dispatch ---------------------------------------------------------------------------------
// A row's metadata as it sits in a ring record after the row bytes.
struct RecordMeta {
    float *scales;
    int *topk;
    float *weights;
    int *src;
    __device__ __forceinline__ RecordMeta(char *record, int row_bytes, int num_scales, int num_topk) {
        scales = reinterpret_cast<float *>(record + row_bytes);
        topk = reinterpret_cast<int *>(scales + num_scales);
        weights = reinterpret_cast<float *>(topk + num_topk);
        src = reinterpret_cast<int *>(weights + num_topk);
    }
};

// One token's metadata in registers, spread over the lanes: lane k < K holds top-k entry k, lane l
// holds scales l, l + 32, ...; src is the token's index (lane 0 stores it).
template <int kScales>
struct TokenMeta {
    static constexpr int kScalesPerLane = kScales > 0 ? (kScales + 31) / 32 : 1;
    long long expert = -1;   // global expert id (sender) / local id (receiver)
    float weight = 0.f;
    float scale[kScalesPerLane];
    int src = -1;
};

template <int kRanks, int kRowInt4, int kScales, typename IdxT, bool kFresh>
struct Dispatch {
    using Split = RowSplit<kRowInt4, 8>;
    using Meta = TokenMeta<kScales>;
    static constexpr int kRowBytes = kRowInt4 * 16;

    static __device__ __forceinline__ bool in_row(int seg, int u, int lane) {
        return seg * Split::kSegInt4 + u * 32 + lane < kRowInt4;
    }

    static __device__ __forceinline__ char *record_at(const DispatchParams &p, char *base, int ring, int k,
                                                      long long ring_bytes) {
        return base + p.staging_offset + ring * ring_bytes + (long long)(k % p.ring_rows) * p.record_bytes;
    }

    // Warp-level sender: chunks blockIdx.x, blockIdx.x + S, ...; each warp takes every kWarps-th
    // (token, segment) of a chunk, reads it once and stores it to every destination; then signals
    // each peer that this warp is done with the chunk.
    static __device__ void send(const DispatchParams &p, char *const *peers, int *cursor,
                                unsigned long long epoch, const WaitContext &ctx) {
        const int lane = lane_id(), warp = warp_id(), rank = p.rank;
        const int n = p.num_tokens, tpc = p.tokens_per_chunk, stride = p.num_chunks + 1;
        for (int j = lane; j < kRanks; j += 32) cursor[j] = 0;
        if (!wait_peers_idle<kRanks>(peers, rank, epoch, ctx)) return;
        const int self_base = rows_before(p.rank_prefix, kRanks, rank, rank);
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;

        for (int g = blockIdx.x; g < p.num_chunks; g += p.num_send_blocks) {
            bool ok = true;
            for (int j = lane; j < kRanks; j += 32) {
                if (j == rank) continue;
                const int *prefix = p.channel_prefix + j * stride;
                if (warp == 0 && __ldg(prefix + g + 1) - __ldg(prefix + g) > p.ring_rows)
                    record_failure(p.err, p.op, rank, j, kPhaseChunkTooBig);
                ok = ok && wait_ring_space<kRanks>(prefix, g, p.ring_rows, cursor + j,
                                                   consumed_ptr<kRanks>(peers[rank], j, 0), j, epoch, ctx);
            }
            if (!__all_sync(0xffffffffu, ok)) return;

            const int t0 = min(g * tpc, n), t1 = min(t0 + tpc, n);
            for (int item = warp; item < (t1 - t0) * Split::kSegs; item += kWarps) {
                const int t = t0 + item / Split::kSegs, seg = item % Split::kSegs;
                int head[kRanks];
#pragma unroll
                for (int j = 0; j < kRanks; ++j) head[j] = __ldg(p.send_head + (long long)t * kRanks + j);
                const int4 *src = static_cast<const int4 *>(p.x) + (long long)t * kRowInt4 + seg * Split::kSegInt4;
                int4 v[Split::kUnroll];
#pragma unroll
                for (int u = 0; u < Split::kUnroll; ++u)
                    if (in_row(seg, u, lane)) v[u] = ld_nc_v4(src + u * 32 + lane);
                Meta meta;
                if (seg == 0) load_meta(p, t, meta);
#pragma unroll
                for (int j = 0; j < kRanks; ++j) {
                    if (head[j] < 0) continue;
                    char *record = nullptr;
                    int4 *dst;
                    int pos = -1;
                    if (j == rank) {
                        pos = self_base + head[j];
                        if (pos >= p.num_out_rows) {   // num_worst_tokens too small
                            if (seg == 0 && lane == 0) record_failure(p.err, p.op, rank, rank, kPhaseWorstTokens);
                            continue;
                        }
                        dst = static_cast<int4 *>(p.recv_x) + (long long)pos * kRowInt4;
                    } else {
                        record = record_at(p, peers[j], ring_index<kRanks>(rank, j), head[j], ring_bytes);
                        dst = reinterpret_cast<int4 *>(record);
                    }
                    dst += seg * Split::kSegInt4;
#pragma unroll
                    for (int u = 0; u < Split::kUnroll; ++u)
                        if (in_row(seg, u, lane)) dst[u * 32 + lane] = v[u];
                    if (seg == 0) store_meta(p, meta, j, pos, record);
                }
            }
            __syncwarp();
            for (int j = lane; j < kRanks; j += 32)
                if (j != rank) red_add_release_sys(ready_ptr<kRanks>(peers[j], rank, g), 1);
        }
    }

    static __device__ __forceinline__ void load_meta(const DispatchParams &p, int t, Meta &meta) {
        const int lane = lane_id();
        meta.src = t;
        if (kFresh && lane < p.num_topk) {
            meta.expert = static_cast<long long>(static_cast<const IdxT *>(p.topk_idx)[(long long)t * p.num_topk + lane]);
            meta.weight = p.topk_weights[(long long)t * p.num_topk + lane];
        }
#pragma unroll
        for (int i = 0; i < Meta::kScalesPerLane; ++i)
            if (i * 32 + lane < kScales)
                meta.scale[i] = p.x_scales[(long long)t * p.scale_stride_token + (long long)(i * 32 + lane) * p.scale_stride_group];
    }

    // Destination j's view of the token: its top-k ids made local to j (-1, weight 0 elsewhere).
    // Local rows (record == nullptr) go to the outputs at `pos`, others into the ring record.
    static __device__ __forceinline__ void store_meta(const DispatchParams &p, const Meta &meta, int j, int pos,
                                                      char *record) {
        const int lane = lane_id(), k_top = p.num_topk;
        const long long first = (long long)j * p.num_local_experts;
        const int local = meta.expert >= first && meta.expert < first + p.num_local_experts ? int(meta.expert - first) : -1;
        const float weight = local >= 0 ? meta.weight : 0.f;
        if (record == nullptr) {
#pragma unroll
            for (int i = 0; i < Meta::kScalesPerLane; ++i)
                if (i * 32 + lane < kScales) p.recv_x_scales[(long long)pos * kScales + i * 32 + lane] = meta.scale[i];
            if (kFresh) {
                if (lane < k_top) {
                    static_cast<IdxT *>(p.recv_topk_idx)[(long long)pos * k_top + lane] = static_cast<IdxT>(local);
                    p.recv_topk_weights[(long long)pos * k_top + lane] = weight;
                }
                if (lane == 0) p.recv_src_idx[pos] = meta.src;
            }
        } else {
            RecordMeta out(record, kRowBytes, kScales, k_top);
#pragma unroll
            for (int i = 0; i < Meta::kScalesPerLane; ++i)
                if (i * 32 + lane < kScales) out.scales[i * 32 + lane] = meta.scale[i];
            if (kFresh) {
                if (lane < k_top) {
                    out.topk[lane] = local;
                    out.weights[lane] = weight;
                }
                if (lane == 0) *out.src = meta.src;
            }
        }
    }

    // Warp-level receiver: claims (chunk, source, part) in chunk order from a rank-wide counter,
    // waits for the source's kWarps signals, copies its part of the chunk's rows out of the ring;
    // the last part to finish frees the chunk (reset ready, publish consumed).
    static __device__ void receive(const DispatchParams &p, char *const *peers, unsigned long long epoch,
                                   const WaitContext &ctx) {
        const int lane = lane_id(), rank = p.rank, stride = p.num_chunks + 1, k_top = p.num_topk;
        char *local = peers[rank];
        auto *claim = reinterpret_cast<unsigned int *>(local + Header<kRanks>::kClaim);
        const int per_chunk = (kRanks - 1) * kParts;
        const unsigned int total = (unsigned int)p.num_chunks * per_chunk;
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;
        while (true) {
            unsigned int c = 0;
            if (lane == 0) c = atomicAdd(claim, 1u);
            c = __shfl_sync(0xffffffffu, c, 0);
            if (c >= total) return;
            const int g = c / per_chunk, r = c % per_chunk, part = r % kParts;
            const int s = (rank + 1 + r / kParts) % kRanks;
            bool ok = true;
            if (lane == 0) ok = wait_at_least(ctx, ready_ptr<kRanks>(local, s, g), kWarps, s, kPhaseData);
            __syncwarp();
            if (!__shfl_sync(0xffffffffu, ok, 0)) return;

            const int begin = __ldg(p.recv_channel_prefix + s * stride + g);
            const int end = __ldg(p.recv_channel_prefix + s * stride + g + 1);
            if (part == 0 && lane == 0 && end - begin > p.ring_rows)
                record_failure(p.err, p.op, rank, s, kPhaseChunkTooBig);
            const int base = rows_before(p.rank_prefix, kRanks, s, rank);
            for (int item = part; item < (end - begin) * Split::kSegs; item += kParts) {
                const int k = begin + item / Split::kSegs, seg = item % Split::kSegs;
                const int pos = base + k;
                if (pos >= p.num_out_rows) {
                    if (lane == 0) record_failure(p.err, p.op, rank, s, kPhaseWorstTokens);
                    continue;
                }
                char *record = record_at(p, local, ring_index<kRanks>(s, rank), k, ring_bytes);
                const int4 *src = reinterpret_cast<const int4 *>(record) + seg * Split::kSegInt4;
                int4 v[Split::kUnroll];
#pragma unroll
                for (int u = 0; u < Split::kUnroll; ++u)
                    if (in_row(seg, u, lane)) v[u] = ld_cg_v4(src + u * 32 + lane);
                Meta meta;
                const RecordMeta in(record, kRowBytes, kScales, k_top);
                if (seg == 0) {
#pragma unroll
                    for (int i = 0; i < Meta::kScalesPerLane; ++i)
                        if (i * 32 + lane < kScales) meta.scale[i] = __ldcg(in.scales + i * 32 + lane);
                    if (kFresh && lane < k_top) {
                        meta.expert = __ldcg(in.topk + lane);
                        meta.weight = __ldcg(in.weights + lane);
                    }
                    if (kFresh && lane == 0) meta.src = __ldcg(in.src);
                }
                int4 *dst = static_cast<int4 *>(p.recv_x) + (long long)pos * kRowInt4 + seg * Split::kSegInt4;
#pragma unroll
                for (int u = 0; u < Split::kUnroll; ++u)
                    if (in_row(seg, u, lane)) dst[u * 32 + lane] = v[u];
                if (seg == 0) {
#pragma unroll
                    for (int i = 0; i < Meta::kScalesPerLane; ++i)
                        if (i * 32 + lane < kScales) p.recv_x_scales[(long long)pos * kScales + i * 32 + lane] = meta.scale[i];
                    if (kFresh) {
                        if (lane < k_top) {
                            static_cast<IdxT *>(p.recv_topk_idx)[(long long)pos * k_top + lane] = static_cast<IdxT>(meta.expert);
                            p.recv_topk_weights[(long long)pos * k_top + lane] = meta.weight;
                        }
                        if (lane == 0) p.recv_src_idx[pos] = meta.src;
                    }
                }
            }
            __syncwarp();
            if (lane == 0) {
                __threadfence();
                int *parts = parts_ptr<kRanks>(local, s, g);
                if (atomicAdd(parts, 1) == kParts - 1) {
                    __threadfence();
                    *reinterpret_cast<volatile int *>(parts) = 0;
                    *reinterpret_cast<volatile int *>(ready_ptr<kRanks>(local, s, g)) = 0;
                    st_release_sys(consumed_ptr<kRanks>(peers[s], rank, g), epoch);
                }
            }
        }
    }

    // num_worst_tokens / cached worst-size outputs: rows past the received ones are zero, top-k -1.
    static __device__ void pad(const DispatchParams &p) {
        const int lane = lane_id(), k_top = p.num_topk;
        const int received = __ldg(p.rank_prefix + (kRanks - 1) * kRanks + p.rank);
        const int first_warp = blockIdx.x * kWarps + warp_id(), num_warps = gridDim.x * kWarps;
        for (int row = received + first_warp; row < p.num_out_rows; row += num_warps) {
            int4 *dst = static_cast<int4 *>(p.recv_x) + (long long)row * kRowInt4;
            for (int i = lane; i < kRowInt4; i += 32) dst[i] = make_int4(0, 0, 0, 0);
            for (int i = lane; i < kScales; i += 32) p.recv_x_scales[(long long)row * kScales + i] = 0.f;
            if (kFresh) {
                if (lane < k_top) {
                    static_cast<IdxT *>(p.recv_topk_idx)[(long long)row * k_top + lane] = static_cast<IdxT>(-1);
                    p.recv_topk_weights[(long long)row * k_top + lane] = 0.f;
                }
                if (lane == 0) p.recv_src_idx[row] = -1;
            }
        }
    }
};

template <int kRanks, int kRowInt4, int kScales, typename IdxT, bool kFresh>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
    using D = Dispatch<kRanks, kRowInt4, kScales, IdxT, kFresh>;
    __shared__ char *peers[kRanks];
    __shared__ int cursors[kWarps][kRanks];
    const unsigned long long epoch = kernel_begin<kRanks>(peers, p.peer_bases, p.rank);
    const WaitContext ctx = WaitContext::make(p.err, p.timeout_ns, p.op, p.rank);
    // After any recorded failure the routing tables may be garbage (e.g. a notify that timed out):
    // touch nothing, only keep the epoch bookkeeping.
    if (!ctx.failed()) {
        if ((int)blockIdx.x < p.num_send_blocks) D::send(p, peers, cursors[warp_id()], epoch, ctx);
        if (kRanks > 1) D::receive(p, peers, epoch, ctx);
        D::pad(p);
    }
    kernel_end<kRanks>(peers, p.rank, epoch);
}

// ---- combine ----------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned int f32_to_bf16_rne(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;   // NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ void accumulate(float *acc, const int4 &v) {
    const unsigned int w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += bf16_lo(w[i]);
        acc[2 * i + 1] += bf16_hi(w[i]);
    }
}

template <int kRanks, int kRowInt4>
struct Combine {
    using PushSplit = RowSplit<kRowInt4, 8>;
    // The reduction keeps one segment of every contributing rank in flight: <= 8 int4 per lane.
    using ReduceSplit = RowSplit<kRowInt4, (8 / kRanks > 0 ? 8 / kRanks : 1)>;

    // Warp-level pusher: for chunk g of every source s, the rows this rank received from s's
    // chunk g go back into s's ring of this rank, with their top-k weights.
    static __device__ void push(const CombineParams &p, char *const *peers, int *cursor,
                                unsigned long long epoch, const WaitContext &ctx) {
        const int lane = lane_id(), warp = warp_id(), rank = p.rank, stride = p.num_chunks + 1, k_top = p.num_topk;
        for (int j = lane; j < kRanks; j += 32) cursor[j] = 0;
        if (!wait_peers_idle<kRanks>(peers, rank, epoch, ctx)) return;
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;
        const int row_bytes = kRowInt4 * 16;
        for (int g = blockIdx.x; g < p.num_chunks; g += p.num_send_blocks) {
            bool ok = true;
            for (int s = lane; s < kRanks; s += 32) {
                if (s == rank) continue;
                const int *prefix = p.recv_channel_prefix + s * stride;
                if (warp == 0 && __ldg(prefix + g + 1) - __ldg(prefix + g) > p.ring_rows)
                    record_failure(p.err, p.op, rank, s, kPhaseChunkTooBig);
                ok = ok && wait_ring_space<kRanks>(prefix, g, p.ring_rows, cursor + s,
                                                   consumed_ptr<kRanks>(peers[rank], s, 0), s, epoch, ctx);
            }
            if (!__all_sync(0xffffffffu, ok)) return;
            for (int i = 1; i < kRanks; ++i) {
                const int s = (rank + i) % kRanks;
                const int begin = __ldg(p.recv_channel_prefix + s * stride + g);
                const int end = __ldg(p.recv_channel_prefix + s * stride + g + 1);
                const int base = rows_before(p.rank_prefix, kRanks, s, rank);
                char *ring = peers[s] + p.staging_offset + ring_index<kRanks>(rank, s) * ring_bytes;
                for (int item = warp; item < (end - begin) * PushSplit::kSegs; item += kWarps) {
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
            }
            __syncwarp();
            for (int s = lane; s < kRanks; s += 32)
                if (s != rank) red_add_release_sys(ready_ptr<kRanks>(peers[s], rank, g), 1);
        }
    }

    // Warp-level reducer: claims (chunk, part) of this rank's own tokens; once every peer signalled
    // the chunk, sums bias0 + bias1 + the rows of ranks 0..R-1 (ascending, fp32) per token.
    static __device__ void reduce(const CombineParams &p, char *const *peers, unsigned long long epoch,
                                  const WaitContext &ctx) {
        using S = ReduceSplit;
        const int lane = lane_id(), rank = p.rank, stride = p.num_chunks + 1, k_top = p.num_topk;
        const int n = p.num_tokens, tpc = p.tokens_per_chunk;
        char *local = peers[rank];
        auto *claim = reinterpret_cast<unsigned int *>(local + Header<kRanks>::kClaim);
        const unsigned int total = (unsigned int)p.num_chunks * kParts;
        const long long ring_bytes = (long long)p.ring_rows * p.record_bytes;
        const int self_base = rows_before(p.rank_prefix, kRanks, rank, rank);
        const int row_bytes = kRowInt4 * 16;
        while (true) {
            unsigned int c = 0;
            if (lane == 0) c = atomicAdd(claim, 1u);
            c = __shfl_sync(0xffffffffu, c, 0);
            if (c >= total) return;
            const int g = c / kParts, part = c % kParts;
            bool ok = true;
            for (int j = lane; j < kRanks; j += 32) {
                if (j == rank) continue;
                ok = ok && wait_at_least(ctx, ready_ptr<kRanks>(local, j, g), kWarps, j, kPhaseData);
                if (part == 0 && __ldg(p.channel_prefix + j * stride + g + 1) - __ldg(p.channel_prefix + j * stride + g) > p.ring_rows)
                    record_failure(p.err, p.op, rank, j, kPhaseChunkTooBig);
            }
            if (!__all_sync(0xffffffffu, ok)) return;
            __syncwarp();

            const int t0 = min(g * tpc, n), t1 = min(t0 + tpc, n);
            for (int item = part; item < (t1 - t0) * S::kSegs; item += kParts) {
                const int t = t0 + item / S::kSegs, seg = item % S::kSegs;
                int head[kRanks];
#pragma unroll
                for (int j = 0; j < kRanks; ++j) head[j] = __ldg(p.send_head + (long long)t * kRanks + j);
                int4 v[kRanks][S::kUnroll];
#pragma unroll
                for (int j = 0; j < kRanks; ++j) {
                    if (head[j] < 0) continue;
                    const int4 *src = j == rank
                        ? static_cast<const int4 *>(p.x) + (long long)(self_base + head[j]) * kRowInt4
                        : reinterpret_cast<const int4 *>(local + p.staging_offset + ring_index<kRanks>(j, rank) * ring_bytes +
                                                         (long long)(head[j] % p.ring_rows) * p.record_bytes);
                    src += seg * S::kSegInt4;
#pragma unroll
                    for (int u = 0; u < S::kUnroll; ++u)
                        if (seg * S::kSegInt4 + u * 32 + lane < kRowInt4)
                            v[j][u] = j == rank ? ld_nc_v4(src + u * 32 + lane) : ld_cg_v4(src + u * 32 + lane);
                }
#pragma unroll
                for (int u = 0; u < S::kUnroll; ++u) {
                    const int idx = seg * S::kSegInt4 + u * 32 + lane;
                    if (idx >= kRowInt4) continue;
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    if (p.bias0) accumulate(acc, ld_nc_v4(static_cast<const int4 *>(p.bias0) + (long long)t * kRowInt4 + idx));
                    if (p.bias1) accumulate(acc, ld_nc_v4(static_cast<const int4 *>(p.bias1) + (long long)t * kRowInt4 + idx));
#pragma unroll
                    for (int j = 0; j < kRanks; ++j)
                        if (head[j] >= 0) accumulate(acc, v[j][u]);
                    int4 out;
                    out.x = (int)(f32_to_bf16_rne(acc[0]) | (f32_to_bf16_rne(acc[1]) << 16));
                    out.y = (int)(f32_to_bf16_rne(acc[2]) | (f32_to_bf16_rne(acc[3]) << 16));
                    out.z = (int)(f32_to_bf16_rne(acc[4]) | (f32_to_bf16_rne(acc[5]) << 16));
                    out.w = (int)(f32_to_bf16_rne(acc[6]) | (f32_to_bf16_rne(acc[7]) << 16));
                    static_cast<int4 *>(p.combined_x)[(long long)t * kRowInt4 + idx] = out;
                }
                if (seg == 0 && lane < k_top) {
                    float w = 0.f;
#pragma unroll
                    for (int j = 0; j < kRanks; ++j) {
                        if (head[j] < 0) continue;
                        w += j == rank ? p.topk_weights[(long long)(self_base + head[j]) * k_top + lane]
                                       : __ldcg(reinterpret_cast<const float *>(
                                             local + p.staging_offset + ring_index<kRanks>(j, rank) * ring_bytes +
                                             (long long)(head[j] % p.ring_rows) * p.record_bytes + row_bytes) + lane);
                    }
                    p.combined_weights[(long long)t * k_top + lane] = w;
                }
            }
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
};

template <int kRanks, int kRowInt4>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
    using C = Combine<kRanks, kRowInt4>;
    __shared__ char *peers[kRanks];
    __shared__ int cursors[kWarps][kRanks];
    const unsigned long long epoch = kernel_begin<kRanks>(peers, p.peer_bases, p.rank);
    const WaitContext ctx = WaitContext::make(p.err, p.timeout_ns, p.op, p.rank);
    if (!ctx.failed()) {
        if ((int)blockIdx.x < p.num_send_blocks) C::push(p, peers, cursors[warp_id()], epoch, ctx);
        C::reduce(p, peers, epoch, ctx);
    }
    kernel_end<kRanks>(peers, p.rank, epoch);
}

}  // namespace intranode
}  // namespace epcomm
