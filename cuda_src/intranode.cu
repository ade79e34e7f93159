// Normal-mode intranode dispatch / combine: the notify kernel and the entry kernels. Every rank
// stores straight into its peers' NVL buffers; protocol (routing, rings, signals, claims):
// cuda_src/README.md. Host side: epcomm/ops/intranode.py, intranode_plan.py.
#pragma once
#include "intranode_protocol.cuh"
#include "intranode_dispatch.cuh"
#include "intranode_combine.cuh"

namespace epcomm {
namespace intranode {

// ---- notify: exchange counts, build the routing tables --------------------------------------
template <int kRanks>
__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const __grid_constant__ NotifyParams p) {
    __shared__ char *peers[kRanks];
    __shared__ int failed;
    const int warp = warp_id(), lane = lane_id(), num_warps = kNotifyThreads / 32;
    if (threadIdx.x == 0) failed = 0;
    const unsigned long long epoch = begin_epoch<kRanks>(peers, p.peer_bases, p.rank, Header<kRanks>::kEpoch);
    const Guard ctx = make_guard<kRanks>(peers[p.rank], p);
    trace_set(p.trace, kTrStart, trace_now());
    const int n = p.num_tokens, num_chunks = p.num_chunks, tpc = p.tokens_per_chunk, stride = num_chunks + 1;
    const int num_le = p.num_local_experts;
    // The stride does not depend on G, so a rank with another G is still read correctly (and caught).
    const int notify_ints = p.notify_ints;

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

    // Publish to every rank (self included): [G, N, E_l, 0, counts to each rank, this rank's
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
            else if (i == 2) v = num_le;
            else if (i >= 4 && i < 4 + kRanks) v = p.channel_prefix[(i - 4) * stride + num_chunks];
            else if (i >= 4 + kRanks && i < 4 + kRanks + num_le) v = p.num_tokens_per_expert[j * num_le + i - 4 - kRanks];
            else if (i >= 4 + kRanks + num_le && i < 4 + kRanks + num_le + stride) v = p.channel_prefix[j * stride + i - 4 - kRanks - num_le];
            dst[i] = v;
        }
        __syncwarp();
        if (lane == 0) st_release_sys(notify_flag_ptr<kRanks>(peers[j], p.rank), epoch);
    }
    trace_set(p.trace, kTrIdle, trace_now());

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

    trace_set(p.trace, kTrSent, trace_now());
    for (int s = threadIdx.x; s < kRanks; s += kNotifyThreads) {
        if (!wait_at_least(ctx, notify_flag_ptr<kRanks>(peers[p.rank], s), epoch, s, kPhaseCounts)) failed = 1;
    }
    __syncthreads();
    trace_set(p.trace, kTrFirstData, trace_now());
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
            int max_tokens = 0;
            for (int s = 0; s < kRanks; ++s) {
                max_tokens = max(max_tokens, __ldcg(area + s * notify_ints + 1));
                if (__ldcg(area + s * notify_ints) != num_chunks || __ldcg(area + s * notify_ints + 2) != num_le)
                    ctx.violation(s, kPhaseConfigMismatch);
            }
            p.info[kRanks * kRanks + num_le] = max_tokens;
        }
    }
    kernel_end<kRanks>(peers, p.rank, epoch, p.trace);
}

// ---- kernels of dispatch and combine (their warps: intranode_dispatch.cuh, intranode_combine.cuh)
template <int kRanks, int kRowInt4, int kScales, typename IdxT, bool kFresh>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
    using D = Dispatch<kRanks, kRowInt4, kScales, IdxT, kFresh>;
    __shared__ BlockShared<kRanks> sh;
    const KernelStart k = data_kernel_begin<kRanks>(sh, p);
    // After any recorded failure the routing tables may be garbage (e.g. a notify that timed out):
    // touch nothing, only keep the epoch bookkeeping.
    if (!k.ctx.failed()) {
        if ((int)blockIdx.x < p.num_send_blocks) D::send(p, sh, k.epoch, k.ctx);
        if (kRanks > 1) D::receive(p, sh.peers, k.epoch, k.ctx);
        D::pad(p);
    }
    kernel_end<kRanks>(sh.peers, p.rank, k.epoch, p.trace);
}

template <int kRanks, int kRowInt4>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
    using C = Combine<kRanks, kRowInt4>;
    __shared__ BlockShared<kRanks> sh;
    const KernelStart k = data_kernel_begin<kRanks>(sh, p);
    if (!k.ctx.failed()) {
        if ((int)blockIdx.x < p.num_send_blocks) C::push(p, sh, k.epoch, k.ctx);
        C::reduce(p, sh.peers, k.epoch, k.ctx);
    }
    kernel_end<kRanks>(sh.peers, p.rank, k.epoch, p.trace);
}

}  // namespace intranode
}  // namespace epcomm
