// Low-latency dispatch / combine over the NVSHMEM symmetric heap: the entry kernels. Protocol
// (transfers, tags, buffer-set reuse, dispatch, combine, masking): cuda_src/README.md. Host side:
// epcomm/ops/low_latency.py; the buffer layout: epcomm/ops/low_latency_layout.py.
#include "low_latency_dispatch.cuh"
#include "low_latency_combine.cuh"

namespace epcomm {
namespace ll {

// Dynamic shared memory: DispatchShape::kSmemBytes.
template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, bool kFP8, bool kRoundScale,
          bool kUE8M0, class TopkT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ DispatchParams p) {
    static_assert(kExperts % kRanks == 0 && kThreads % 32 == 0 && kRanks <= kThreads, "shape");
    static_assert(!kFP8 || kHidden % kScaleChannels == 0, "FP8 needs hidden % 128 == 0");
    static_assert(kHidden % 8 == 0 && (!kUE8M0 || (kFP8 && kRoundScale && kHidden % 512 == 0)), "hidden / UE8M0");
    static_assert(kTopK >= 1 && kTopK <= kMaxTopk, "one lane per top-k slot");
    extern __shared__ __align__(16) char smem[];
    __shared__ BlockState<kRanks> s;
    const Guard ctx = Guard::make(p.failed, p.wait_notes, p.err, p.timeout_ns, p.op, p.rank, p.peer_bases, kRanks);
    trace_stamp(p.trace, kTrStart);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile_u64(p.epochs) + 1;   // in flight with the block state loads
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
        dispatch_send<kHidden, kTopK, kRanks, kExperts, kMaxTokens, kFP8, kRoundScale, TopkT, kThreads>(p, s, ctx, epoch, smem);
        finish_send<kRanks, kThreads / 32, false>(s, p.tickets, p.epochs, epoch);   // per warp: see dispatch_send's end
        trace_stamp(p.trace, kTrSendDone);
    } else {
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    }
    recv_part(p, s, ctx, nullptr, 0, [&](unsigned long long epoch) {
        dispatch_recv<kHidden, kRanks, kExperts, kMaxTokens, kFP8, kUE8M0, kThreads>(p, s, ctx, epoch);
    });
}

template <int kHidden, int kTopK, int kRanks, int kExperts, int kMaxTokens, class TopkT, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ CombineParams p) {
    static_assert(kExperts % kRanks == 0 && kThreads % 32 == 0 && kRanks <= kThreads, "shape");
    static_assert(kHidden % 8 == 0 && kTopK >= 1 && kTopK <= kMaxTopk && 16 * kTopK <= kRecordBytes,
                  "hidden % 8 == 0, 1 <= top-k <= 32");
    __shared__ BlockState<kRanks> s;
    __shared__ CombineItem<kTopK> items[kItemGroups];
    __shared__ int ranks[kThreads / 32][32];
    const Guard ctx = Guard::make(p.failed, p.wait_notes, p.err, p.timeout_ns, p.op, p.rank, p.peer_bases, kRanks);
    trace_stamp(p.trace, kTrStart);
    if (p.phases & kSend) {
        const unsigned long long epoch = ld_volatile_u64(p.epochs) + 1;   // in flight with the block state loads
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
        // The first record, claimed and loaded during the release wait, by as many warps per block
        // as give every block's share of T one record each (one warp at T=128 on 132 SMs), not by
        // all of them: 32 claims per block put ~4200 atomics on one counter right at the start,
        // which the release wait then waits for. Fewer resident blocks still send every record:
        // each claiming warp goes on claiming until the counter passes T.
        const int claimers = min(kThreads / 32, static_cast<int>((kMaxTokens + gridDim.x - 1) / gridDim.x));
        int t = warp_id() < claimers ? warp_claim(p.tickets + kClaimRecords) : kMaxTokens, e;
        float w;
        load_record<kTopK, kExperts, TopkT>(p, t, e, w);
        wait_released(s, ctx, p.acks, epoch, p.mask, p.enable_shrink != 0);
        trace_stamp(p.trace, kTrReleased);
        if (!s.abort) {   // block-uniform: the item groups below sync on barriers
            combine_send_records<kTopK, kRanks, kExperts, kMaxTokens, TopkT>(p, s, epoch, t, e, w);
            trace_stamp(p.trace, kTrSendA);
            combine_send_partials<kHidden, kTopK, kRanks, kExperts, kMaxTokens, TopkT, kThreads>(p, s, ctx, epoch, items);
            trace_stamp(p.trace, kTrSendC);
        }
        finish_send<kRanks, kThreads / 32, true>(s, p.tickets, p.epochs, epoch);
        trace_stamp(p.trace, kTrSendDone);
    } else {
        load_block_state(s, p.peer_bases, p.mask, p.use_nvlink);
    }
    recv_part(p, s, ctx, p.epochs, kPhaseSendEnd, [&](unsigned long long epoch) {
        combine_recv<kHidden, kTopK, kRanks, kExperts, kMaxTokens, TopkT, kThreads>(p, s, ctx, epoch, ranks);
    });
}

}  // namespace ll
}  // namespace epcomm
