// Feature-set switch and warp-level helpers. The JIT (epcomm.runtime.options) defines exactly one
// of EPCOMM_FEATURE_SM90 / EPCOMM_FEATURE_SM80; EPCOMM_ARCH=sm80 in the environment selects the
// SM80 paths on a Hopper GPU, so both are testable on one machine. What differs today: the FP8
// e4m3 conversion (hardware cvt on SM90, an exact software one on SM80; low_latency_protocol.cuh).
#pragma once
#include <cuda/std/cstdint>
#include "ptx.cuh"

#if defined(EPCOMM_FEATURE_SM90) == defined(EPCOMM_FEATURE_SM80)
#error "define exactly one of EPCOMM_FEATURE_SM90 / EPCOMM_FEATURE_SM80 (epcomm.runtime.options does)"
#endif

namespace epcomm {

#if defined(EPCOMM_FEATURE_SM90)
constexpr int kFeature = 90;
#else
constexpr int kFeature = 80;
#endif
constexpr int kWarpSize = 32;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

// Warp copy of n16 16-byte units: each lane first loads kBatch units (predicated, so no serial
// tail), then stores them, keeping kBatch loads in flight. `load(i)` reads unit i of the source
// (ld_nc_v4 for read-only input, ld_cg_v4 for memory peers write during the kernel).
template <int kBatch = 8, class Load>
__device__ __forceinline__ void warp_copy(int4 *dst, int n16, int lane, Load load) {
    for (int base = 0; base < n16; base += kBatch * kWarpSize) {
        int4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = base + u * kWarpSize + lane;
            if (i < n16) v[u] = load(i);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
            const int i = base + u * kWarpSize + lane;
            if (i < n16) st_cg_v4(dst + i, v[u]);
        }
    }
}

// Barrier of `threads` threads (a group of whole warps) on hardware barrier `id` (1..15; 0 is
// __syncthreads's).
__device__ __forceinline__ void group_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A warp's claim of the next unit of work: lane 0's atomicAdd on the counter, broadcast to every
// lane. Work taken in atomicAdd order goes to whichever warps are running, so no warp waits for
// work that only a block not (yet) resident would do.
__device__ __forceinline__ unsigned int warp_claim(unsigned int *counter) {
    unsigned int v = 0;
    if (lane_id() == 0) v = atomicAdd(counter, 1u);
    return __shfl_sync(0xffffffffu, v, 0);
}

}  // namespace epcomm
