// Internode dispatch, device side: per channel, a sending block streams this rank's records to the
// RDMA peer of each destination node through fixed-size rings, and a receiving block copies the
// records of every source out of the rings of its node's ranks over NVLink; then padding. Protocol:
// cuda_src/README.md.
#pragma once
#include "internode_protocol.cuh"

namespace epcomm {
namespace internode {

template <int kRanks, int kLocal, int kRowInt4, int kScales, typename IdxT, bool kFresh>
struct Dispatch {
    static constexpr int kNodes = kRanks / kLocal;
    static constexpr int kRowBytes = kRowInt4 * 16;
    using H = Header<kRanks, kNodes>;

    // Block 2ch sends channel ch, block 2ch + 1 receives it, each as groups of warps: group g owns
    // the streams g, g + groups, ... (destination nodes, resp. source ranks). The group's leader
    // (its warp 0) moves the streams round-robin, picking one that can move and its batch; every
    // warp of the group copies a slice of each record's row, the last one the metadata; the leader
    // announces. A stream that cannot move must not hold up the others (ring slots free up only as
    // other streams move).
    static constexpr int kSendGroups = kNodes < kWarps ? kNodes : kWarps;
    static constexpr int kRecvGroups = kRanks < kWarps ? kRanks : kWarps;
    static constexpr int kMaxBatch = 32;   // records per step (kept in shared memory)
    struct Batch {
        int stop, all_done, count, stream, k, end;
        int token[kMaxBatch];   // sender: the records' tokens; receiver: the records' rows here
        int index[kMaxBatch];   // receiver: the records' indices in the stream
    };
    struct Shared {
        int sent[kNodes];     // sender: records of (channel, node m) written and announced
        int cursor[kNodes];   // sender: next token of the channel to look at for node m
        int taken[kRanks];    // receiver: records of (channel, source s) consumed
        Batch batch[kWarps];  // one per group
    };

    // The group's part of token t's record for node m: row units gw, gw + gs, ... (of 32 lanes);
    // the metadata by the last warp (gw == gs - 1).
    static __device__ __forceinline__ void write_record(const DispatchParams &p, char *record, int t, int m,
                                                        const RecordFields &f, int gw, int gs) {
        const int lane = lane_id(), k_top = p.num_topk;
        const int4 *row = reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + (long long)t * kRowBytes);
        for (int u = gw * 32 + lane; u < kRowInt4; u += gs * 32) st_cg_v4(reinterpret_cast<int4 *>(record) + u, ld_nc_v4(row + u));
        if (gw != gs - 1) return;
        for (int s = lane; s < kScales; s += 32)
            reinterpret_cast<float *>(record + f.scales)[s] =
                __ldg(p.x_scales + t * p.scale_stride_token + s * p.scale_stride_group);
        if (kFresh && lane < k_top) {
            reinterpret_cast<int *>(record + f.topk)[lane] =
                static_cast<int>(__ldg(static_cast<const IdxT *>(p.topk_idx) + (long long)t * k_top + lane));
            reinterpret_cast<float *>(record + f.weights)[lane] =
                p.topk_weights != nullptr ? __ldg(p.topk_weights + (long long)t * k_top + lane) : 0.f;
        }
        if (lane == 0) reinterpret_cast<int *>(record + f.src)[0] = t;
        for (int j = lane; j < kLocal; j += 32)
            reinterpret_cast<int *>(record + f.pos)[j] = __ldg(p.send_nvl_head + (long long)t * kRanks + m * kLocal + j);
    }

    static __device__ __forceinline__ int stream_total(const int *prefix, int stride, int i, int ch) {
        return __ldg(prefix + i * stride + ch + 1) - __ldg(prefix + i * stride + ch);
    }

    // Sender stream (channel ch, destination node m): this rank's tokens of the channel that reach
    // m, in token order, record k in slot k % ring of the ring [this node][ch] of the RDMA peer
    // there. Mapped peer (this node; other nodes with allow_mnnvl): written in place, then a
    // release of the tail. Otherwise written to the staging ring [m][ch] (slot k % stage), put,
    // then the tail put behind an nvshmem_fence. Room: every local rank of m must have consumed
    // record k - ring (k - stage when staged: an announced staging slot is free once its record
    // was consumed, hence landed). The leader's batch: up to `chunk` records; false if none.
    static __device__ bool send_batch(const DispatchParams &p, char *const *peers, const Call &c, Shared &sh,
                                      Batch &b, int ch, int m) {
        const int lane = lane_id(), n = p.num_tokens, stride = p.num_channels + 1;
        const int total = stream_total(p.rdma_channel_prefix, stride, m, ch);
        const int k = sh.sent[m];
        const bool direct = peers[m * kLocal + c.local] != nullptr;
        const unsigned int head = min_stamped(word_at(c.base, H::kRecordHead + 8LL * (ch * kRanks + m * kLocal)), 1,
                                              kLocal, c.epoch);
        const int end = min(min(total, k + min(p.chunk, kMaxBatch)), (int)head + (direct ? p.ring : p.stage));
        if (end <= k) return false;
        int t = sh.cursor[m], r = k;
        const int t_end = channel_end(ch, p.tokens_per_channel, n);
        while (r < end && t < t_end) {
            const bool in = t + lane < t_end && __ldg(p.send_rdma_head + (long long)(t + lane) * kNodes + m) >= 0;
            unsigned int mask = __ballot_sync(0xffffffffu, in);
            int next = t + 32;
            while (mask != 0 && r < end) {
                const int tok = t + __ffs(mask) - 1;
                mask &= mask - 1;
                if (lane == 0) b.token[r - k] = tok;
                ++r;
                next = tok + 1;
            }
            t = next;
        }
        if (lane == 0) {
            b.stream = m;
            b.k = k;
            b.end = r;   // == end unless the tables disagree with send_rdma_head
            sh.sent[m] = r;
            sh.cursor[m] = t;
        }
        return true;
    }

    // Receiver stream (channel ch, source s): s's records for this node sit in the ring [s's
    // node][ch] of s's RDMA peer here (local rank s % L). The leader's batch: the records that
    // arrived (up to kMaxBatch) and, of those with a row for this rank, the rows (their places in
    // the contract's order). False if none arrived.
    static __device__ bool receive_batch(const DispatchParams &p, char *const *peers, const Call &c, Shared &sh,
                                         Batch &b, int ch, int s) {
        const int lane = lane_id(), stride = p.num_channels + 1, src_node = s / kLocal;
        const int total = stream_total(p.recv_rdma_channel_prefix, stride, s, ch);
        const int k = sh.taken[s];
        char *holder = peers[c.node * kLocal + s % kLocal];
        const unsigned long long *tail_word = word_at(holder, H::kRecordTail + 8LL * (src_node * kMaxChannels + ch));
        int tail = 0;
        if (lane == 0) {
            tail = (int)stamped_count(ld_relaxed_sys(tail_word), c.epoch);
            if (tail > k) tail = (int)stamped_count(ld_acquire_sys(tail_word), c.epoch);
        }
        tail = min(min(__shfl_sync(0xffffffffu, tail, 0), total), k + kMaxBatch);
        if (tail <= k) return false;
        const RecordFields f(kRowBytes, kScales, p.num_topk);
        const long long ring_first = (long long)(src_node * p.num_channels + ch) * p.ring;
        int row = -1;
        if (k + lane < tail)
            row = ld_cg(reinterpret_cast<const int *>(holder + p.recv_offset + (ring_first + (k + lane) % p.ring) * p.record_bytes +
                                                      f.pos) + c.local);
        if (row >= p.num_out_rows) {   // only num_worst_tokens can make this happen
            note_violation(c, s, kPhaseWorstTokens);
            row = -1;
        }
        const unsigned int mask = __ballot_sync(0xffffffffu, row >= 0);
        if (row >= 0) {
            const int at = __popc(mask & ((1u << lane) - 1u));
            b.token[at] = row;
            b.index[at] = k + lane;
        }
        if (lane == 0) {
            b.stream = s;
            b.k = k;
            b.end = tail;
            b.count = __popc(mask);
            sh.taken[s] = tail;
        }
        return true;
    }

    // The group's copy of the batch's records to their rows: row units in slices, the scales,
    // top-k and meta by the last warp.
    static __device__ void receive_copy(const DispatchParams &p, char *const *peers, const Call &c, const Batch &b,
                                        int ch, int gw, int gs) {
        const int lane = lane_id(), k_top = p.num_topk, s = b.stream, src_node = s / kLocal;
        const char *holder = peers[c.node * kLocal + s % kLocal];
        const RecordFields f(kRowBytes, kScales, k_top);
        const long long ring_first = (long long)(src_node * p.num_channels + ch) * p.ring;
        const int stride = p.num_channels + 1, first = __ldg(p.recv_rdma_channel_prefix + s * stride + ch);
        const int first_le = p.rank * p.num_local_experts;
        for (int i = 0; i < b.count; ++i) {
            const long long row = b.token[i];
            const int r = b.index[i];
            const char *record = holder + p.recv_offset + (ring_first + r % p.ring) * p.record_bytes;
            int4 *dst = static_cast<int4 *>(p.recv_x) + row * kRowInt4;
            for (int u = gw * 32 + lane; u < kRowInt4; u += gs * 32) dst[u] = ld_cg_v4(record + 16 * u);
            if (gw != gs - 1) continue;
            for (int q = lane; q < kScales; q += 32)
                p.recv_x_scales[row * kScales + q] = ld_cg(reinterpret_cast<const float *>(record + f.scales) + q);
            if (!kFresh) continue;
            if (lane < k_top) {
                const int e = ld_cg(reinterpret_cast<const int *>(record + f.topk) + lane);
                const bool mine = e >= first_le && e < first_le + p.num_local_experts;
                static_cast<IdxT *>(p.recv_topk_idx)[row * k_top + lane] = static_cast<IdxT>(mine ? e - first_le : -1);
                p.recv_topk_weights[row * k_top + lane] = mine ? ld_cg(reinterpret_cast<const float *>(record + f.weights) + lane) : 0.f;
            }
            if (lane < 3) {
                const int meta[3] = {s, lane == 1 ? ld_cg(reinterpret_cast<const int *>(record + f.src)) : 0, first + r};
                p.recv_src_meta[row * 3 + lane] = meta[lane];
            }
        }
    }

    static __device__ __forceinline__ void group_sync(int g, int gs) {
        if (gs > 1) group_barrier(1 + g, gs * 32);
        else __syncwarp();
    }

    static __device__ void run(const DispatchParams &p, char *const *peers, const Call &c, Shared &sh) {
        const int ch = blockIdx.x / 2, lane = lane_id();
        const bool sender = blockIdx.x % 2 == 0;
        const int streams = sender ? kNodes : kRanks, groups = sender ? kSendGroups : kRecvGroups;
        const int gs = kWarps / groups, g = warp_id() / gs, gw = warp_id() % gs;
        const int stride = p.num_channels + 1;
        char *base = c.base;
        for (int i = threadIdx.x; i < kNodes; i += kThreads) {
            sh.sent[i] = 0;
            sh.cursor[i] = channel_begin(ch, p.tokens_per_channel, p.num_tokens);
        }
        for (int i = threadIdx.x; i < kRanks; i += kThreads) sh.taken[i] = 0;
        __syncthreads();
        if (g >= groups) return;
        Batch &b = sh.batch[g];
        const RecordFields f(kRowBytes, kScales, p.num_topk);
        const long long rec = p.record_bytes;
        Spinner spin;
        int next = g;   // the leader's round-robin position among the group's streams
        while (true) {
            if (gw == 0) {
                bool all_done = true, chosen = false;
                int waiting = -1;
                for (int tried = 0, i = next; tried < (streams - g + groups - 1) / groups; ++tried) {
                    const bool done = sender ? sh.sent[i] >= stream_total(p.rdma_channel_prefix, stride, i, ch)
                                             : sh.taken[i] >= stream_total(p.recv_rdma_channel_prefix, stride, i, ch);
                    if (!done) {
                        all_done = false;
                        if (sender ? send_batch(p, peers, c, sh, b, ch, i) : receive_batch(p, peers, c, sh, b, ch, i)) {
                            chosen = true;
                            next = i + groups < streams ? i + groups : g;
                            break;
                        }
                        waiting = sender ? i * kLocal + c.local : i;
                    }
                    i = i + groups < streams ? i + groups : g;
                }
                const bool stop = !all_done && !chosen && !spin.idle(c.guard, waiting, sender ? kPhaseRingRoom : kPhaseRecords);
                if (lane == 0) {
                    b.all_done = all_done;
                    b.stop = stop;
                    if (!chosen) b.end = -1;
                }
            }
            group_sync(g, gs);
            if (b.all_done || b.stop) return;
            const int end = b.end;
            if (end >= 0) {
                if (sender) {
                    const int m = b.stream;
                    char *holder = peers[m * kLocal + c.local];
                    const long long ring_first = (long long)(c.node * p.num_channels + ch) * p.ring;
                    const long long stage_first = (long long)(m * p.num_channels + ch) * p.stage;
                    for (int r = b.k; r < end; ++r)
                        write_record(p, holder != nullptr ? holder + p.recv_offset + (ring_first + r % p.ring) * rec
                                                          : base + p.stage_offset + (stage_first + r % p.stage) * rec,
                                     b.token[r - b.k], m, f, gw, gs);
                } else {
                    receive_copy(p, peers, c, b, ch, gw, gs);
                }
            }
            group_sync(g, gs);   // the group's records (resp. its reads of them) before the leader announces
            if (gw == 0 && end >= 0) {
                if (sender) {
                    const int m = b.stream;
                    publish_stream(base, peers[m * kLocal + c.local], b.k, end, rec,
                                   p.recv_offset + (long long)(c.node * p.num_channels + ch) * p.ring * rec, p.ring,
                                   p.stage_offset + (long long)(m * p.num_channels + ch) * p.stage * rec, p.stage,
                                   H::kRecordTail + 8LL * (c.node * kMaxChannels + ch), c.epoch,
                                   m * kLocal + c.local);
                    trace_chunk(p.trace, kTrRdmaSendFirst);
                } else {
                    const int s = b.stream;
                    if (lane == 0) put_word(base, peers[s], H::kRecordHead + 8LL * (ch * kRanks + c.rank), stamped(c.epoch, end), s);
                    __syncwarp();
                    trace_chunk(p.trace, kTrNvlRecvFirst);
                }
            }
        }
    }

    // Rows past the received ones (num_worst_tokens): zero data and scales, top-k -1 / 0, meta -1.
    static __device__ void pad(const DispatchParams &p) {
        const int lane = lane_id(), k_top = p.num_topk;
        const int received = __ldg(p.recv_gbl_rank_prefix_sum + kRanks - 1);
        const int num_warps = gridDim.x * kWarps;
        for (int row = received + blockIdx.x * kWarps + warp_id(); row < p.num_out_rows; row += num_warps) {
            int4 *dst = static_cast<int4 *>(p.recv_x) + (long long)row * kRowInt4;
            for (int u = lane; u < kRowInt4; u += 32) dst[u] = make_int4(0, 0, 0, 0);
            for (int q = lane; q < kScales; q += 32) p.recv_x_scales[(long long)row * kScales + q] = 0.f;
            if (!kFresh) continue;
            if (lane < k_top) {
                static_cast<IdxT *>(p.recv_topk_idx)[(long long)row * k_top + lane] = static_cast<IdxT>(-1);
                p.recv_topk_weights[(long long)row * k_top + lane] = 0.f;
            }
            if (lane < 3) p.recv_src_meta[(long long)row * 3 + lane] = -1;
        }
    }
};

}  // namespace internode
}  // namespace epcomm
