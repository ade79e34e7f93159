// Feature-set switches and the row-copy helpers whose best form differs between the two code paths.
// The JIT (epcomm.runtime.options) defines exactly one of EPCOMM_FEATURE_SM90 / EPCOMM_FEATURE_SM80,
// and EPCOMM_ARCH = the compile target (90 for sm_90). EPCOMM_ARCH=sm80 in the environment selects
// the SM80 paths on a Hopper GPU, so both paths are testable on one machine.
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
// SM90: TMA bulk copies (cp.async.bulk), mbarrier transaction counts, clusters, fp8 types.
constexpr bool kHasBulkCopy = kFeature >= 90;
constexpr int kWarpSize = 32;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

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

// A warp's claim of the next unit of work: lane 0's atomicAdd on the counter, broadcast to every
// lane. Work taken in atomicAdd order goes to whichever warps are running, so no warp waits for
// work that only a block not (yet) resident would do.
__device__ __forceinline__ unsigned int warp_claim(unsigned int *counter) {
    unsigned int v = 0;
    if (lane_id() == 0) v = atomicAdd(counter, 1u);
    return __shfl_sync(0xffffffffu, v, 0);
}

// ---- SM80: cp.async (global -> shared, 16 bytes per lane) -----------------------------------------
__device__ __forceinline__ void cp_async_16B(void *smem_dst, const void *gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem_dst)), "l"(gmem_src)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- SM90: mbarrier + TMA bulk copies ------------------------------------------------------------
#if defined(EPCOMM_FEATURE_SM90)
__device__ __forceinline__ void mbarrier_init(uint64_t *bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// Makes mbarrier.init visible to the async proxy (the TMA unit) before a bulk copy signals it.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders this thread's generic-proxy shared-memory writes before later bulk copies read them.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t *bar, uint32_t phase) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done) : "r"(smem_u32(bar)), "r"(phase) : "memory");
    return done != 0;
}
// global -> shared; completion counted on `bar`. bytes % 16 == 0, 16-byte-aligned addresses.
__device__ __forceinline__ void bulk_load(void *smem_dst, const void *gmem_src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// shared -> global (local or an NVLink peer's mapping); tracked by this thread's bulk groups.
__device__ __forceinline__ void bulk_store(void *gmem_dst, const void *smem_src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(gmem_dst), "r"(smem_u32(smem_src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most N groups are pending: _read = their shared-memory source may be reused;
// without = their global writes are done.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// Moves rows global -> shared -> global through one warp's staging buffer. SM90: lane 0 drives the
// TMA bulk engine, so the warp's registers and issue slots stay free; SM80: every lane moves 16
// bytes at a time (cp.async in, vector stores out). Rows are 16-byte multiples at 16-byte-aligned
// addresses. Protocol: init once; then per row load -> wait_load -> (optionally edit the shared
// copy) -> store -> wait_store. After wait_store the destination holds the row (callers still
// fence/release before signalling another GPU) and the stage may be reused.
struct WarpRowStage {
    int4 *smem;       // staging buffer, >= the largest row
    uint64_t *bar;    // SM90: this warp's mbarrier (8 bytes of shared memory); unused on SM80
    uint32_t phase;

    __device__ __forceinline__ void init(int4 *stage, uint64_t *barrier, int lane) {
        smem = stage;
        bar = barrier;
        phase = 0;
#if defined(EPCOMM_FEATURE_SM90)
        if (lane == 0) {
            mbarrier_init(bar, 1);
            fence_mbarrier_init();
        }
#endif
        __syncwarp();
    }

    __device__ __forceinline__ void load(const void *src, uint32_t bytes, int lane) {
#if defined(EPCOMM_FEATURE_SM90)
        if (lane == 0) {
            mbarrier_arrive_expect_tx(bar, bytes);
            bulk_load(smem, src, bytes, bar);
        }
#else
        for (uint32_t i = lane; i < bytes / 16; i += kWarpSize)
            cp_async_16B(smem + i, static_cast<const int4 *>(src) + i);
        cp_async_commit();
#endif
    }

    __device__ __forceinline__ void wait_load() {
#if defined(EPCOMM_FEATURE_SM90)
        while (!mbarrier_try_wait(bar, phase)) {
        }
        phase ^= 1;
#else
        cp_async_wait_all();
#endif
        __syncwarp();
    }

    __device__ __forceinline__ void store(void *dst, uint32_t bytes, int lane) {
#if defined(EPCOMM_FEATURE_SM90)
        fence_proxy_async_shared();   // edits made to the shared copy by any lane
        __syncwarp();
        if (lane == 0) {
            bulk_store(dst, smem, bytes);
            bulk_commit();
        }
#else
        for (uint32_t i = lane; i < bytes / 16; i += kWarpSize) st_cg_v4(static_cast<int4 *>(dst) + i, smem[i]);
#endif
    }

    __device__ __forceinline__ void wait_store(int lane) {
#if defined(EPCOMM_FEATURE_SM90)
        if (lane == 0) bulk_wait<0>();
#endif
        __syncwarp();
    }
};

}  // namespace epcomm
