// Internode combine, device side: per channel, a pushing block moves every received row over
// NVLink into a FIFO of its source's RDMA peer here; a reducing group of warps of that rank sums
// each token's rows of local ranks 0..L-1 in fp32 and streams the partial sums to the source
// through fixed-size rings; a receiving group of the source adds bias and the nodes' partials in
// order. Protocol: cuda_src/README.md.
#pragma once
#include "internode_protocol.cuh"

namespace epcomm {
namespace internode {

template <int kRanks, int kLocal, int kRowInt4>
struct Combine {
    static constexpr int kNodes = kRanks / kLocal;
    static constexpr int kRowBytes = kRowInt4 * 16;            // bf16 row
    static constexpr int kPartialRowBytes = 2 * kRowBytes;     // fp32 row, channels in PartialLayout order
    using Partial = PartialLayout<kRowInt4>;
    using H = Header<kRanks, kNodes>;

    // FIFO entry: bf16 row | weights f32[kMaxTopk] | K i32 | pad | u64 tag; partial sum: fp32 row |
    // weights f32[kMaxTopk] | K i32. K is that of the writer: another K than the reader's (some
    // ranks passed topk_weights, others not) is a kPhaseConfigMismatch.
    static constexpr long long kPushTopk = kRowBytes + 4LL * kMaxTopk;
    static constexpr long long kPushTag = kPushTopk + 8;
    static constexpr long long kPartialTopk = kPartialRowBytes + 4LL * kMaxTopk;
    // The tag of the entry of linear index q in this call: a bijection of (epoch, q), mixed so that
    // bytes other kernels left in the FIFO region never match it by accident (p ~ 2^-64).
    static __device__ __forceinline__ unsigned long long tag_of(unsigned long long epoch, int q) {
        return mix_epoch(epoch ^ (static_cast<unsigned long long>(q) << 40));
    }

    // The reducer of channel ch on rank (node, l) serves the sources (n, l), n = 0..M-1, in one
    // linear order: q = (records of sources (0..n-1, l) in channel ch) + index of the record among
    // (n, l)'s. Both sides of a FIFO compute it from the same recv_rdma_channel_prefix rows.
    static __device__ __forceinline__ int records_of(const CombineParams &p, int s, int ch, int *first) {
        const int stride = p.num_channels + 1;
        *first = __ldg(p.recv_rdma_channel_prefix + s * stride + ch);
        return __ldg(p.recv_rdma_channel_prefix + s * stride + ch + 1) - *first;
    }

    // This rank's rows from source s whose record index lies in [lo, hi): rows of s are
    // contiguous, record index ascending (recv_src_meta[2]), so a binary search finds them.
    static __device__ __forceinline__ int lower_row(const CombineParams &p, int row_lo, int row_hi, int index) {
        while (row_lo < row_hi) {
            const int mid = (row_lo + row_hi) / 2;
            if (__ldg(p.recv_src_meta + 3LL * mid + 2) < index) row_lo = mid + 1;
            else row_hi = mid;
        }
        return row_lo;
    }

    struct PushState {
        int n, row, row_end, q_base, written, published;   // source node, next row, rows end, ...
    };

    // Pusher state for reducer l: position on the first source node with rows left.
    static __device__ void push_seek(const CombineParams &p, int ch, int l, PushState &st) {
        while (st.row >= st.row_end && st.n < kNodes) {
            int first;
            if (st.n >= 0) st.q_base += records_of(p, st.n * kLocal + l, ch, &first);
            if (++st.n >= kNodes) break;
            const int s = st.n * kLocal + l;
            const int cnt = records_of(p, s, ch, &first);
            const int rows_lo = s == 0 ? 0 : __ldg(p.recv_gbl_rank_prefix_sum + s - 1);
            const int rows_hi = __ldg(p.recv_gbl_rank_prefix_sum + s);
            st.row = lower_row(p, rows_lo, rows_hi, first);
            st.row_end = lower_row(p, st.row, rows_hi, first + cnt);
        }
    }
    // Linear index of the pusher's next row (the total once it has none left).
    static __device__ __forceinline__ int push_next_q(const CombineParams &p, int ch, int l, const PushState &st) {
        if (st.n >= kNodes) return st.q_base;
        int first;
        records_of(p, st.n * kLocal + l, ch, &first);
        return st.q_base + __ldg(p.recv_src_meta + 3LL * st.row + 2) - first;
    }

    // Block 2ch: groups of warps, group g owning the reducers l = g, g + kPushGroups, ... of this
    // node (one each for L <= 16). Pusher stream (channel ch, reducer l): this rank's rows from the
    // sources (n, l), in linear order, into the FIFO [ch][this local rank] of rank (node, l), entry
    // w in slot w % push_ring once the reducer consumed entry w - push_ring (kPushHead); after each
    // batch the linear index of the next row goes to the reducer (kPushProgress): every index below
    // it that has no entry was not sent to this rank. The group's leader picks a stream that can
    // move and its batch, every warp of the group copies a slice of each row, the leader announces.
    static constexpr int kPushGroups = kLocal < kWarps ? kLocal : kWarps;
    static constexpr int kPushGroupWarps = kWarps / kPushGroups;
    static constexpr int kMaxPushBatch = 32;
    struct PushShared {
        int stop, all_done, count, l, next;
        int row[kMaxPushBatch], q[kMaxPushBatch], slot[kMaxPushBatch];
    };

    static __device__ __forceinline__ void push_group_sync(int g) {
        if (kPushGroupWarps > 1) group_barrier(1 + g, kPushGroupWarps * 32);
        else __syncwarp();
    }

    // The leader's batch of stream l, written to `sh` (count rows, the next index to announce);
    // false if the stream can neither push nor announce anything.
    static __device__ bool push_batch(const CombineParams &p, const Call &c, int ch, int l, PushState &st, PushShared &sh) {
        const unsigned int head = min_stamped(word_at(c.base, H::kPushHead + 8LL * (ch * kLocal + l)), 1, 1, c.epoch);
        const int batch = min(min(p.push_chunk, kMaxPushBatch), (int)head + p.push_ring - st.written);
        int count = 0;
        for (; count < batch && st.n < kNodes; ++count) {
            if (lane_id() == 0) {
                sh.row[count] = st.row;
                sh.q[count] = push_next_q(p, ch, l, st);
                sh.slot[count] = st.written % p.push_ring;
            }
            ++st.written;
            ++st.row;
            push_seek(p, ch, l, st);
        }
        const int next = push_next_q(p, ch, l, st);
        if (count == 0 && next == st.published) return false;
        if (lane_id() == 0) {
            sh.count = count;
            sh.l = l;
            sh.next = next;
        }
        st.published = next;
        return true;
    }

    static __device__ void push(const CombineParams &p, char *const *peers, const Call &c, int ch, PushShared *shared) {
        constexpr int kOwned = (kLocal + kPushGroups - 1) / kPushGroups;
        const int lane = lane_id(), g = warp_id() / kPushGroupWarps, gw = warp_id() % kPushGroupWarps;
        const int k_top = p.num_topk;
        if (g >= kPushGroups) return;
        PushShared &sh = shared[g];
        PushState st[kOwned];   // the leader's
        if (gw == 0) {
            for (int o = 0; o < kOwned; ++o) {
                st[o] = PushState{-1, 0, 0, 0, 0, -1};
                if (g + o * kPushGroups < kLocal) push_seek(p, ch, g + o * kPushGroups, st[o]);
            }
        }
        Spinner spin;
        while (true) {
            if (gw == 0) {
                bool all_done = true, chosen = false;
                int waiting = -1;
#pragma unroll
                for (int o = 0; o < kOwned; ++o) {
                    const int l = g + o * kPushGroups;
                    if (l >= kLocal || (st[o].n >= kNodes && st[o].published == st[o].q_base)) continue;
                    all_done = false;
                    if (!chosen && push_batch(p, c, ch, l, st[o], sh)) chosen = true;
                    else if (!chosen) waiting = c.node * kLocal + l;
                }
                const bool stop = !all_done && !chosen && !spin.idle(c.guard, waiting, kPhaseRingRoom);
                if (lane == 0) {
                    sh.all_done = all_done;
                    sh.stop = stop;
                    if (!chosen) sh.count = -1;
                }
            }
            push_group_sync(g);
            if (sh.all_done || sh.stop) return;
            const int count = sh.count, l = sh.l;
            if (count > 0) {
                const int reducer = c.node * kLocal + l;
                char *fifo = reinterpret_cast<char *>(__ldg(p.push_bases + reducer)) + p.push_offset +
                             (long long)(ch * kLocal + c.local) * p.push_ring * p.push_bytes;
                for (int b = 0; b < count; ++b) {
                    char *entry = fifo + (long long)sh.slot[b] * p.push_bytes;
                    const int r = sh.row[b];
                    const int4 *row = reinterpret_cast<const int4 *>(static_cast<const char *>(p.x) + (long long)r * kRowBytes);
                    for (int u = gw * 32 + lane; u < kRowInt4; u += kPushGroupWarps * 32)
                        st_cg_v4(reinterpret_cast<int4 *>(entry) + u, ld_nc_v4(row + u));
                    if (gw == kPushGroupWarps - 1) {
                        if (lane < k_top)
                            reinterpret_cast<float *>(entry + kRowBytes)[lane] =
                                p.topk_weights != nullptr ? __ldg(p.topk_weights + (long long)r * k_top + lane) : 0.f;
                        if (lane == 0) {
                            *reinterpret_cast<int *>(entry + kPushTopk) = k_top;
                            *reinterpret_cast<unsigned long long *>(entry + kPushTag) = tag_of(c.epoch, sh.q[b]);
                        }
                    }
                }
            }
            push_group_sync(g);   // the group's entries before the progress that announces them
            if (gw == 0 && count >= 0) {
                const int reducer = c.node * kLocal + l;
                if (lane == 0) put_word(c.base, peers[reducer], H::kPushProgress + 8LL * (ch * kLocal + c.local),
                                        stamped(c.epoch, sh.next), reducer);
                __syncwarp();
                if (count > 0) trace_chunk(p.trace, kTrPushFirst);   // a progress-only announcement moved no rows
            }
        }
    }

    // Block 2ch + 1 is two groups of kGroupWarps warps: the reducer and the receiver of channel
    // ch. In each, warp 0 of the group (the leader) waits and decides, every warp of the group
    // moves a slice of each row's 16-byte units, and the leader announces.
    static constexpr int kGroupWarps = kWarps / 2;
    static constexpr int kMaxBatch = 32;   // records per reducer batch (presence kept in shared memory)
    struct ReduceShared {
        int stop, end;
        unsigned int mask[kMaxBatch];          // local ranks whose entry of the record is present
        int slot[kMaxBatch][kLocal];           // their FIFO slots
    };

    // Reducer: the linear order of channel ch, source node by source node. Per batch (one source,
    // at most `chunk` records): the leader waits until every local rank's progress passed the
    // batch's first index and the source freed room, and finds the entries present (tag of this
    // call and index); the group sums them per record, local ranks 0..L-1 in that order, in fp32,
    // into the source's ring [this node][ch] (in place when mapped, else the staging ring [n][ch]);
    // the leader hands the FIFO slots back and announces the records (put, then the tail).
    static __device__ void reduce(const CombineParams &p, char *const *peers, const Call &c, int ch, ReduceShared &sh) {
        const int lane = lane_id(), gw = warp_id() % kGroupWarps, k_top = p.num_topk;
        const int group_threads = kGroupWarps * 32;
        char *base = c.base;
        const Guard &guard = c.guard;
        const unsigned long long epoch = c.epoch;
        const long long pb = p.partial_bytes;
        const char *fifo = reinterpret_cast<const char *>(__ldg(p.push_bases + c.rank)) + p.push_offset +
                           (long long)ch * kLocal * p.push_ring * p.push_bytes;
        const unsigned long long *progress = word_at(base, H::kPushProgress + 8LL * ch * kLocal);
        int taken = 0;   // leader, lane j < L: entries of local rank j's FIFO consumed
        int q = 0;
        for (int n = 0; n < kNodes; ++n) {
            const int s = n * kLocal + c.local;
            int first;
            const int cnt = records_of(p, s, ch, &first);
            char *holder = peers[s];
            const int window = holder != nullptr ? p.ring : p.stage;
            const unsigned long long *head_word = word_at(base, H::kPartialHead + 8LL * (n * kMaxChannels + ch));
            const long long ring_first = (long long)(c.node * p.num_channels + ch) * p.ring;
            const long long stage_first = (long long)(n * p.num_channels + ch) * p.stage;
            for (int k = 0; k < cnt;) {
                if (gw == 0) {
                    bool ok = true;
                    if (lane < kLocal)
                        ok = wait_at_least(guard, progress + lane, stamped(epoch, q + 1), c.node * kLocal + lane, kPhasePushes);
                    if (lane == 0 && ok && k >= window)   // the source's count of this call must pass k - window
                        ok = wait_at_least(guard, head_word, stamped(epoch, k - window + 1), s, kPhaseRingRoom);
                    ok = __all_sync(0xffffffffu, ok);
                    const int ready = (int)min_stamped(progress, 1, kLocal, epoch) - q;
                    const int room = (int)min_stamped(head_word, 1, 1, epoch) + window - k;
                    const int end = k + min(min(cnt - k, min(p.chunk, kMaxBatch)), min(ready, room));
                    for (int b = 0; ok && b < end - k; ++b) {
                        bool present = false;
                        if (lane < kLocal) {
                            const int slot = taken % p.push_ring;
                            const char *entry = fifo + ((long long)lane * p.push_ring + slot) * p.push_bytes;
                            present = __ldcg(reinterpret_cast<const unsigned long long *>(entry + kPushTag)) == tag_of(epoch, q + b);
                            if (present && ld_cg(reinterpret_cast<const int *>(entry + kPushTopk)) != k_top)
                                note_violation(c, c.node * kLocal + lane, kPhaseConfigMismatch);
                            sh.slot[b][lane] = slot;
                            taken += present;
                        }
                        const unsigned int mask = __ballot_sync(0xffffffffu, present);
                        if (lane == 0) sh.mask[b] = mask;
                    }
                    if (lane == 0) {
                        sh.stop = !ok;
                        sh.end = end;
                    }
                }
                group_barrier(1, group_threads);
                if (sh.stop) return;
                const int end = sh.end;
                for (int b = 0; b < end - k; ++b) {
                    const unsigned int mask = sh.mask[b];
                    const char *entries[kLocal];
#pragma unroll
                    for (int j = 0; j < kLocal; ++j)
                        entries[j] = fifo + ((long long)j * p.push_ring + sh.slot[b][j]) * p.push_bytes;
                    const int r = k + b;
                    char *dst = holder != nullptr ? holder + p.partial_recv_offset + (ring_first + r % p.ring) * pb
                                                  : base + p.partial_stage_offset + (stage_first + r % p.stage) * pb;
                    for (int u = gw * 32 + lane; u < kRowInt4; u += group_threads) {
                        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int j = 0; j < kLocal; ++j)
                            if (mask >> j & 1u) add_bf16x8(acc, ld_cg_v4(entries[j] + 16 * u));
                        *reinterpret_cast<float4 *>(Partial::lo(dst, u)) = make_float4(acc[0], acc[1], acc[2], acc[3]);
                        *reinterpret_cast<float4 *>(Partial::hi(dst, u)) = make_float4(acc[4], acc[5], acc[6], acc[7]);
                    }
                    if (gw == kGroupWarps - 1) {
                        if (lane < k_top) {
                            float w = 0.f;
#pragma unroll
                            for (int j = 0; j < kLocal; ++j)
                                if (mask >> j & 1u) w += ld_cg(reinterpret_cast<const float *>(entries[j] + kRowBytes) + lane);
                            reinterpret_cast<float *>(dst + kPartialRowBytes)[lane] = w;
                        }
                        if (lane == 0) *reinterpret_cast<int *>(dst + kPartialTopk) = k_top;
                    }
                }
                group_barrier(1, group_threads);   // the group's reads of the entries and writes of the sums
                if (gw == 0) {
                    // FIFO slots back to the local ranks
                    if (lane < kLocal)
                        put_word(base, peers[c.node * kLocal + lane], H::kPushHead + 8LL * (ch * kLocal + c.local),
                                 stamped(epoch, taken), c.node * kLocal + lane);
                    publish_stream(base, holder, k, end, pb, p.partial_recv_offset + ring_first * pb, p.ring,
                                   p.partial_stage_offset + stage_first * pb, p.stage,
                                   H::kPartialTail + 8LL * (c.node * kMaxChannels + ch), epoch, s);
                    trace_chunk(p.trace, kTrReduceFirst);
                }
                q += end - k;
                k = end;
            }
        }
    }

    // Receiver, this rank as the source: its tokens of channel ch, one per warp of the group at a
    // time, token t = bias0 + bias1 + the partial sums of the nodes it reached, node ascending, in
    // fp32; weights likewise (from 0). After each round the leader hands the consumed slots back
    // to each node's reducer (kPartialHead). A round takes at most `stage` tokens: with the
    // earlier rounds' slots handed back, the ring of every node then has room for all of them.
    static __device__ void receive(const CombineParams &p, char *const *peers, const Call &c, int ch, int *consumed,
                                   int *published, int *stop) {
        const int lane = lane_id(), gw = warp_id() % kGroupWarps, k_top = p.num_topk, stride = p.num_channels + 1;
        char *base = c.base;
        const Guard &guard = c.guard;
        const unsigned long long epoch = c.epoch;
        const long long pb = p.partial_bytes;
        const int round = min(kGroupWarps, p.stage);
        auto record_of = [&](int t, int m) {   // index of t's partial in the ring of node m, or -1
            const int i = __ldg(p.send_rdma_head + (long long)t * kNodes + m);
            return i < 0 ? -1 : i - __ldg(p.rdma_channel_prefix + m * stride + ch);
        };
        if (gw == 0)
            for (int m = lane; m < kNodes; m += 32) consumed[m] = published[m] = 0;
        const int t_begin = channel_begin(ch, p.tokens_per_channel, p.num_tokens);
        const int t_end = channel_end(ch, p.tokens_per_channel, p.num_tokens);
        for (int t0 = t_begin; t0 < t_end; t0 += round) {
            const int t = t0 + gw;
            bool ok = true;
            if (gw < round && t < t_end) {
                for (int m = lane; m < kNodes && ok; m += 32) {
                    const int k = record_of(t, m);
                    if (k >= 0)
                        ok = wait_at_least(guard, word_at(base, H::kPartialTail + 8LL * (m * kMaxChannels + ch)),
                                           stamped(epoch, k + 1), m * kLocal + c.local, kPhasePartials);
                }
                ok = __all_sync(0xffffffffu, ok);
                if (ok) {
                    for (int u = lane; u < kRowInt4; u += 32) {
                        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                        if (p.bias0 != nullptr) add_bf16x8(acc, __ldg(static_cast<const int4 *>(p.bias0) + (long long)t * kRowInt4 + u));
                        if (p.bias1 != nullptr) add_bf16x8(acc, __ldg(static_cast<const int4 *>(p.bias1) + (long long)t * kRowInt4 + u));
                        for (int m = 0; m < kNodes; ++m) {
                            const int k = record_of(t, m);
                            if (k < 0) continue;
                            const char *partial = base + p.partial_recv_offset + ((long long)(m * p.num_channels + ch) * p.ring + k % p.ring) * pb;
                            const int4 halves[2] = {ld_cg_v4(Partial::lo(partial, u)), ld_cg_v4(Partial::hi(partial, u))};
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                acc[4 * h] += __int_as_float(halves[h].x);
                                acc[4 * h + 1] += __int_as_float(halves[h].y);
                                acc[4 * h + 2] += __int_as_float(halves[h].z);
                                acc[4 * h + 3] += __int_as_float(halves[h].w);
                            }
                        }
                        static_cast<int4 *>(p.combined_x)[(long long)t * kRowInt4 + u] = pack_bf16x8(acc);
                    }
                    float w = 0.f;
                    for (int m = 0; m < kNodes; ++m) {
                        const int k = record_of(t, m);
                        if (k < 0) continue;
                        const char *partial = base + p.partial_recv_offset + ((long long)(m * p.num_channels + ch) * p.ring + k % p.ring) * pb;
                        if (lane == 0 && ld_cg(reinterpret_cast<const int *>(partial + kPartialTopk)) != k_top)
                            note_violation(c, m * kLocal + c.local, kPhaseConfigMismatch);
                        if (lane < k_top) w += ld_cg(reinterpret_cast<const float *>(partial + kPartialRowBytes) + lane);
                    }
                    if (lane < k_top) p.combined_weights[(long long)t * k_top + lane] = w;
                }
            }
            if (!ok && lane == 0) *stop = 1;
            group_barrier(2, kGroupWarps * 32);   // the round's reads of the partials
            if (*stop) return;
            if (gw == 0) {
                for (int m = lane; m < kNodes; m += 32) {
                    for (int tt = min(t0 + round, t_end) - 1; tt >= t0; --tt) {   // the round's last token at m
                        const int k = record_of(tt, m);
                        if (k >= 0) {
                            consumed[m] = k + 1;
                            break;
                        }
                    }
                    if (consumed[m] != published[m]) {
                        const int r = m * kLocal + c.local;
                        put_word(base, peers[r], H::kPartialHead + 8LL * (c.node * kMaxChannels + ch),
                                 stamped(epoch, consumed[m]), r);
                        published[m] = consumed[m];
                    }
                }
                trace_chunk(p.trace, kTrFinishFirst);
            }
        }
    }
};

}  // namespace internode
}  // namespace epcomm
