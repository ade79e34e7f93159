// Normal-mode internode dispatch / combine: the notify kernel and the entry kernels. Protocol (RDMA
// and NVLink stages streamed through fixed-size rings per channel): cuda_src/README.md. Host side: epcomm/ops/internode.py,
// internode_plan.py.
#include "internode_dispatch.cuh"
#include "internode_combine.cuh"

namespace epcomm {
namespace internode {

// ---- notify: exchange counts over NVSHMEM, build the routing tables --------------------------
// Count row one rank puts into every rank r: [G, N, E_l, K, S, row bytes, 0, 0 | tokens to each rank
// [R] | channel prefix toward r's node [G+1] (room for kMaxChannels + 1) | this rank's per-expert counts
// of r's experts [E_l] (room for kMaxLocalExperts)]: notify_ints long, every field at an offset that
// depends on R alone, so a rank using another G, E_l or token format (K top-k, S scales, row bytes:
// the dispatch record) is still read at the right place and caught (kPhaseConfigMismatch).
template <int kRanks, int kLocal>
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const __grid_constant__ NotifyParams p) {
    constexpr int kNodes = kRanks / kLocal;
    using H = Header<kRanks, kNodes>;
    __shared__ char *peers[kRanks];
    __shared__ int sent[kRanks];
    __shared__ int block_ok;
    const int warp = warp_id(), lane = lane_id(), num_warps = kNotifyThreads / 32;
    const Call call = begin_call<kRanks, kLocal>(peers, p);
    char *base = call.base;
    const unsigned long long epoch = call.epoch;
    const Guard &guard = call.guard;
    const int n = p.num_tokens, tpc = p.tokens_per_channel, stride = p.num_channels + 1, num_le = p.num_local_experts;
    const int ints = p.notify_ints;
    constexpr int kSent = kNotifyHead, kPrefix = kSent + kRanks, kExperts = kPrefix + kMaxChannels + 1;
    const int head[kNotifyHead] = {p.num_channels, n, num_le, p.num_topk, p.num_scales, p.row_bytes, 0, 0};

    // One warp per node (send_rdma_head, channel prefix) and per rank (send_nvl_head without its
    // offset, totals), scanning the tokens 32 at a time.
    for (int w = warp; w < kNodes + kRanks; w += num_warps) {
        const bool per_node = w < kNodes;
        const int target = per_node ? w : w - kNodes;
        int running = 0;
        for (int first = 0; first < n; first += 32) {
            const int t = first + lane;
            bool in = false;
            if (t < n) {
                const bool *row = p.is_token_in_rank + (long long)t * kRanks;
                if (per_node) {
                    for (int j = 0; j < kLocal; ++j) in |= row[target * kLocal + j];
                } else {
                    in = row[target];
                }
            }
            const unsigned mask = __ballot_sync(0xffffffffu, in);
            const int index = running + __popc(mask & ((1u << lane) - 1u));
            if (t < n) {
                if (per_node) {
                    p.send_rdma_head[(long long)t * kNodes + target] = in ? index : -1;
                    if (t % tpc == 0) p.rdma_channel_prefix[target * stride + t / tpc] = index;
                } else {
                    p.send_nvl_head[(long long)t * kRanks + target] = in ? index : -1;
                }
            }
            running += __popc(mask);
        }
        if (per_node) {
            for (int g = lane; g <= p.num_channels; g += 32)
                if ((long long)g * tpc >= n) p.rdma_channel_prefix[target * stride + g] = running;
        } else if (lane == 0) {
            sent[target] = running;
            p.gbl_channel_prefix[target] = running;
        }
    }
    if (!wait_all_idle<kRanks, kNodes>(call, &block_ok)) {
        kernel_finish<kRanks, kNodes>(call);
        return;
    }

    // Stage one row per destination in this rank's buffer, put it, then the epoch into signal word
    // [this rank] there (self included). Only the used part travels: up to this rank's expert
    // counts, in whole 16-byte units (ints is a multiple of 4 and has room for kMaxLocalExperts >=
    // E_l: the host checks it).
    const int used = min((kExperts + num_le + 3) / 4 * 4, ints);
    for (int r = warp; r < kRanks; r += num_warps) {
        int *row = reinterpret_cast<int *>(base + p.stage_offset) + r * ints;
        const int r_node = r / kLocal;
        for (int i = lane; i < used; i += 32) {
            int v = 0;
            if (i < kNotifyHead) v = head[i];
            else if (i < kPrefix) v = sent[i - kSent];
            else if (i < kPrefix + stride) v = p.rdma_channel_prefix[r_node * stride + i - kPrefix];
            else if (i >= kExperts && i < kExperts + num_le) v = __ldg(p.num_tokens_per_expert + r * num_le + i - kExperts);
            row[i] = v;
        }
        int *dst = reinterpret_cast<int *>(base + p.area_offset) + p.rank * ints;
        put_bytes(reinterpret_cast<char *>(dst), reinterpret_cast<const char *>(row), 4ull * used, r);
        __syncwarp();
        if (lane == 0) put_word(base, nullptr, H::kNotifySignal + 8LL * p.rank, epoch, r);
        __syncwarp();
    }

    for (int s = threadIdx.x; s < kRanks; s += kNotifyThreads)
        if (!wait_at_least(guard, word_at(base, H::kNotifySignal + 8LL * s), epoch, s, kPhaseCounts)) block_ok = 0;
    __syncthreads();
    if (block_ok) {
        const int *area = reinterpret_cast<const int *>(base + p.area_offset);
        auto count = [&](int s, int j) { return __ldcg(area + s * ints + kSent + j); };   // tokens s sends to j
        // info: max N | rank prefix [i][j] = tokens to j from ranks 0..i | expert counts
        for (int idx = threadIdx.x; idx < kRanks * kRanks; idx += kNotifyThreads) {
            const int i = idx / kRanks, j = idx % kRanks;
            int sum = 0;
            for (int s = 0; s <= i; ++s) sum += count(s, j);
            p.info[1 + idx] = sum;
        }
        for (int e = threadIdx.x; e < num_le; e += kNotifyThreads) {
            int sum = 0;
            for (int s = 0; s < kRanks; ++s) sum += __ldcg(area + s * ints + kExperts + e);
            p.info[1 + kRanks * kRanks + e] = sum;
        }
        for (int idx = threadIdx.x; idx < kRanks * stride; idx += kNotifyThreads)
            p.recv_rdma_channel_prefix[idx] = __ldcg(area + (idx / stride) * ints + kPrefix + idx % stride);
        if (threadIdx.x == 0) {
            int max_tokens = 0, rows = 0;
            for (int s = 0; s < kRanks; ++s) {
                max_tokens = max(max_tokens, __ldcg(area + s * ints + 1));
                bool same = true;
                for (int f = 0; f < kNotifyHead; ++f)
                    if (f != 1) same &= __ldcg(area + s * ints + f) == head[f];
                if (!same) guard.violation(s, kPhaseConfigMismatch);
                p.recv_gbl_channel_prefix[s] = rows;
                rows += count(s, p.rank);
                p.recv_gbl_rank_prefix_sum[s] = rows;
                if (s % kLocal == kLocal - 1) p.recv_rdma_rank_prefix_sum[s / kLocal] = rows;
            }
            p.info[0] = max_tokens;
            p.gbl_channel_prefix[kRanks] = max_tokens;   // handle[2][R]
        }
        // send_nvl_head: add the rows that lower ranks send to each destination before this one.
        for (int j = threadIdx.x; j < kRanks; j += kNotifyThreads) {
            int before = 0;
            for (int s = 0; s < p.rank; ++s) before += count(s, j);
            sent[j] = before;   // the totals were published above; reuse the slots
        }
        __syncthreads();
        for (long long idx = threadIdx.x; idx < (long long)n * kRanks; idx += kNotifyThreads) {
            const int head = p.send_nvl_head[idx];
            if (head >= 0) p.send_nvl_head[idx] = head + sent[idx % kRanks];
        }
    }
    kernel_finish<kRanks, kNodes>(call);
}

// ---- dispatch and combine (their warps: internode_dispatch.cuh, internode_combine.cuh) ---------
// The frame both data kernels share: begin the call, wait until every rank finished its previous
// internode kernel, run `steps(peers, call)`, finish the call. Grid: two blocks per channel.
// Trace builds stamp each warp's start, idle and done around the steps.
template <int kRanks, int kLocal, class P, class Steps>
__device__ __forceinline__ void data_call(const P &p, Steps steps) {
    __shared__ char *peers[kRanks];
    __shared__ int block_ok;
    const Call call = begin_call<kRanks, kLocal>(peers, p);
    trace_stamp(p.trace, kTrStart);
    if (wait_all_idle<kRanks, kRanks / kLocal>(call, &block_ok)) {
        trace_stamp(p.trace, kTrIdle);
        steps(static_cast<char *const *>(peers), call);
    }
    trace_stamp(p.trace, kTrDone);
    kernel_finish<kRanks, kRanks / kLocal>(call);
}

template <int kRanks, int kLocal, int kRowInt4, int kScales, typename IdxT, bool kFresh>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
    using D = Dispatch<kRanks, kLocal, kRowInt4, kScales, IdxT, kFresh>;
    __shared__ typename D::Shared streams;
    data_call<kRanks, kLocal>(p, [&](char *const *peers, const Call &call) {
        D::run(p, peers, call, streams);
        D::pad(p);
    });
}

// Block 2ch pushes channel ch; in block 2ch + 1 one group of warps reduces it, the other receives it.
template <int kRanks, int kLocal, int kRowInt4>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
    using C = Combine<kRanks, kLocal, kRowInt4>;
    __shared__ typename C::PushShared pushing[C::kPushGroups];
    __shared__ typename C::ReduceShared reducing;
    __shared__ int consumed[kRanks / kLocal], published[kRanks / kLocal], receive_stop;
    data_call<kRanks, kLocal>(p, [&](char *const *peers, const Call &call) {
        const int ch = blockIdx.x / 2;
        if (threadIdx.x == 0) receive_stop = 0;
        __syncthreads();
        if (blockIdx.x % 2 == 0) C::push(p, peers, call, ch, pushing);
        else if (warp_id() < C::kGroupWarps) C::reduce(p, peers, call, ch, reducing);
        else C::receive(p, peers, call, ch, consumed, published, &receive_stop);
    });
}

}  // namespace internode
}  // namespace epcomm
