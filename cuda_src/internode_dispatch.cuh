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

    // Per-stream progress of the block's warps (lane 0 keeps it).
    struct Shared {
        int sent[kNodes];     // sender: records of (channel, node m) written and announced
        int cursor[kNodes];   // sender: next token of the channel to look at for node m
        int taken[kRanks];    // receiver: records of (channel, source s) consumed
    };

    // One warp writes token t's record for node m (row read from x; the metadata by lanes).
    static __device__ __forceinline__ void write_record(const DispatchParams &p, char *record, int t, int m,
                                                        const RecordFields &f) {
        const int lane = lane_id(), k_top = p.num_topk;
        const int4 *row = reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + (long long)t * kRowBytes);
        warp_copy<4>(reinterpret_cast<int4 *>(record), kRowInt4, lane, [&](int u) { return ld_nc_v4(row + u); });
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

    // Sender, one stream = (channel ch, destination node m): this rank's tokens of the channel
    // that reach m, in token order, record k in slot k % ring of the ring [this node][ch] of the
    // RDMA peer there. Mapped peer (this node; other nodes with allow_mnnvl): written in place,
    // then a release of the tail. Otherwise written to the staging ring [m][ch] (slot k % stage),
    // put, then the tail put behind an nvshmem_fence. Room: every local rank of m must have
    // consumed record k - ring (k - stage when staged: an announced staging slot is free once its
    // record was consumed, hence landed). Moves up to `chunk` records; false if it could not move.
    static __device__ bool send_step(const DispatchParams &p, char *const *peers, const Call &c, Shared &sh,
                                     int ch, int m) {
        char *base = c.base;
        const int lane = lane_id(), n = p.num_tokens, stride = p.num_channels + 1;
        const int first = __ldg(p.rdma_channel_prefix + m * stride + ch);
        const int total = __ldg(p.rdma_channel_prefix + m * stride + ch + 1) - first;
        const int k = sh.sent[m];
        if (k >= total) return false;
        char *holder = peers[m * kLocal + c.local];
        const bool direct = holder != nullptr;
        const unsigned int head = min_stamped(word_at(base, H::kRecordHead + 8LL * (ch * kRanks + m * kLocal)), 1,
                                              kLocal, c.epoch);
        const int end = min(total, min(k + p.chunk, (int)head + (direct ? p.ring : p.stage)));
        if (end <= k) return false;
        const RecordFields f(kRowBytes, kScales, p.num_topk);
        const long long rec = p.record_bytes;
        const long long ring_first = (long long)(c.node * p.num_channels + ch) * p.ring;
        const long long stage_first = (long long)(m * p.num_channels + ch) * p.stage;
        int t = sh.cursor[m], r = k;
        const int t_end = channel_end(ch, p.tokens_per_channel, n);
        while (r < end && t < t_end) {
            const bool in = t + lane < t_end && __ldg(p.send_rdma_head + (long long)(t + lane) * kNodes + m) >= 0;
            unsigned int mask = __ballot_sync(0xffffffffu, in);
            int next = t + 32;
            while (mask != 0 && r < end) {
                const int tok = t + __ffs(mask) - 1;
                mask &= mask - 1;
                char *record = direct ? holder + p.recv_offset + (ring_first + r % p.ring) * rec
                                      : base + p.stage_offset + (stage_first + r % p.stage) * rec;
                write_record(p, record, tok, m, f);
                ++r;
                next = tok + 1;
            }
            t = next;
        }
        publish_stream(base, holder, k, end, rec, p.recv_offset + ring_first * rec, p.ring,
                       p.stage_offset + stage_first * rec, p.stage, H::kRecordTail + 8LL * (c.node * kMaxChannels + ch),
                       c.epoch, m * kLocal + c.local);
        if (lane == 0) {
            sh.sent[m] = end;
            sh.cursor[m] = t;
        }
        __syncwarp();
        return true;
    }

    // Receiver, one stream = (channel ch, source s): s's records for this node sit in the ring
    // [s's node][ch] of s's RDMA peer here (local rank s % L). Each record with a row for this rank
    // is copied to that row (its place in the contract's order); then this rank's consumed count
    // goes to s (kRecordHead). False if no record had arrived.
    static __device__ bool receive_step(const DispatchParams &p, char *const *peers, const Call &c, Shared &sh,
                                        int ch, int s) {
        const int lane = lane_id(), stride = p.num_channels + 1, k_top = p.num_topk, src_node = s / kLocal;
        const int first = __ldg(p.recv_rdma_channel_prefix + s * stride + ch);
        const int total = __ldg(p.recv_rdma_channel_prefix + s * stride + ch + 1) - first;
        const int k = sh.taken[s];
        if (k >= total) return false;
        char *holder = peers[c.node * kLocal + s % kLocal];
        const unsigned long long *tail_word = word_at(holder, H::kRecordTail + 8LL * (src_node * kMaxChannels + ch));
        int tail = 0;
        if (lane == 0) {
            tail = (int)stamped_count(ld_relaxed_sys(tail_word), c.epoch);
            if (tail > k) tail = (int)stamped_count(ld_acquire_sys(tail_word), c.epoch);
        }
        tail = min(__shfl_sync(0xffffffffu, tail, 0), total);
        if (tail <= k) return false;
        const RecordFields f(kRowBytes, kScales, k_top);
        const long long rec = p.record_bytes;
        const long long ring_first = (long long)(src_node * p.num_channels + ch) * p.ring;
        const int first_le = p.rank * p.num_local_experts;
        for (int r0 = k; r0 < tail; r0 += 32) {
            // lanes read 32 records' rows for this rank, then the warp copies the ones it has
            int my_row = -1;
            if (r0 + lane < tail)
                my_row = ld_cg(reinterpret_cast<const int *>(holder + p.recv_offset + (ring_first + (r0 + lane) % p.ring) * rec +
                                                             f.pos) + c.local);
            unsigned int mask = __ballot_sync(0xffffffffu, my_row >= 0);
            while (mask != 0) {
                const int j = __ffs(mask) - 1;
                mask &= mask - 1;
                const int row = __shfl_sync(0xffffffffu, my_row, j), r = r0 + j;
                if (row >= p.num_out_rows) {   // only num_worst_tokens can make this happen
                    if (lane == 0) note_violation(c, s, kPhaseWorstTokens);
                    continue;
                }
                const char *record = holder + p.recv_offset + (ring_first + r % p.ring) * rec;
                warp_copy(static_cast<int4 *>(p.recv_x) + (long long)row * kRowInt4, kRowInt4, lane,
                          [&](int u) { return ld_cg_v4(record + 16 * u); });
                for (int q = lane; q < kScales; q += 32)
                    p.recv_x_scales[(long long)row * kScales + q] = ld_cg(reinterpret_cast<const float *>(record + f.scales) + q);
                if (!kFresh) continue;
                if (lane < k_top) {
                    const int e = ld_cg(reinterpret_cast<const int *>(record + f.topk) + lane);
                    const bool mine = e >= first_le && e < first_le + p.num_local_experts;
                    static_cast<IdxT *>(p.recv_topk_idx)[(long long)row * k_top + lane] = static_cast<IdxT>(mine ? e - first_le : -1);
                    p.recv_topk_weights[(long long)row * k_top + lane] =
                        mine ? ld_cg(reinterpret_cast<const float *>(record + f.weights) + lane) : 0.f;
                }
                if (lane < 3) {
                    const int meta[3] = {s, lane == 1 ? ld_cg(reinterpret_cast<const int *>(record + f.src)) : 0, first + r};
                    p.recv_src_meta[(long long)row * 3 + lane] = meta[lane];
                }
            }
        }
        __syncwarp();
        if (lane == 0) {
            put_word(c.base, peers[s], H::kRecordHead + 8LL * (ch * kRanks + c.rank), stamped(c.epoch, tail), s);
            sh.taken[s] = tail;
        }
        __syncwarp();
        return true;
    }

    // Block 2ch sends channel ch, block 2ch + 1 receives it; each warp owns the streams w, w + W,
    // ... (nodes, resp. source ranks) and moves them round-robin until all are done.
    static __device__ void run(const DispatchParams &p, char *const *peers, const Call &c, Shared &sh) {
        const int ch = blockIdx.x / 2, warp = warp_id();
        const bool sender = blockIdx.x % 2 == 0;
        const int streams = sender ? kNodes : kRanks;
        for (int i = threadIdx.x; i < kNodes; i += kThreads) {
            sh.sent[i] = 0;
            sh.cursor[i] = channel_begin(ch, p.tokens_per_channel, p.num_tokens);
        }
        for (int i = threadIdx.x; i < kRanks; i += kThreads) sh.taken[i] = 0;
        __syncthreads();
        Spinner spin;
        int waiting = warp;   // a stream this warp last could not move (named if the wait times out)
        while (true) {
            bool all_done = true, moved = false;
            for (int i = warp; i < streams; i += kWarps) {
                if (sender) {
                    const int stride = p.num_channels + 1;
                    const int total = __ldg(p.rdma_channel_prefix + i * stride + ch + 1) - __ldg(p.rdma_channel_prefix + i * stride + ch);
                    if (sh.sent[i] >= total) continue;
                    all_done = false;
                    if (send_step(p, peers, c, sh, ch, i)) moved = true;
                    else waiting = i * kLocal + c.local;
                } else {
                    const int stride = p.num_channels + 1;
                    const int total = __ldg(p.recv_rdma_channel_prefix + i * stride + ch + 1) - __ldg(p.recv_rdma_channel_prefix + i * stride + ch);
                    if (sh.taken[i] >= total) continue;
                    all_done = false;
                    if (receive_step(p, peers, c, sh, ch, i)) moved = true;
                    else waiting = i;
                }
            }
            if (all_done) return;
            if (!moved && !spin.idle(c.guard, waiting, sender ? kPhaseRingRoom : kPhaseRecords)) return;
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
