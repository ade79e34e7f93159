// Memory-ordering helpers named by their semantics. "sys" scope is needed whenever the other side
// is another GPU (peer writes over NVLink) or the host (mapped pinned memory).
#pragma once
#include <cuda/std/cstdint>

namespace epcomm {

// Each ordered load in a 32-bit (int) and a 64-bit (unsigned long long) flavour; `sem` is the PTX
// ordering.
#define EPCOMM_ORDERED_LOAD(name, sem)                                                         \
    __device__ __forceinline__ int name(const int *p) {                                        \
        int v;                                                                                 \
        asm volatile("ld." sem ".sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");     \
        return v;                                                                              \
    }                                                                                          \
    __device__ __forceinline__ unsigned long long name(const unsigned long long *p) {          \
        unsigned long long v;                                                                  \
        asm volatile("ld." sem ".sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");     \
        return v;                                                                              \
    }
EPCOMM_ORDERED_LOAD(ld_acquire_sys, "acquire")
EPCOMM_ORDERED_LOAD(ld_relaxed_sys, "relaxed")
#undef EPCOMM_ORDERED_LOAD

__device__ __forceinline__ void st_release_sys(int *p, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Release at GPU scope: for flags only this GPU's threads read (cheaper than .sys, which also waits
// for this thread's earlier NVLink stores).
__device__ __forceinline__ void st_release_gpu(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int *p, int v) {
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Returns the old value. Release: every write this thread made before is visible to whoever
// acquires the new value.
__device__ __forceinline__ int atomic_add_release_sys(int *p, int v) {
    int old;
    asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ unsigned long long atomic_add_release_sys(unsigned long long *p,
                                                                     unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.add.release.sys.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// 16-byte non-temporal-ish accesses for bulk row copies: the source is read once (L1 no-allocate),
// the destination is written once (cache-global).
__device__ __forceinline__ int4 ld_nc_v4(const int4 *p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Memory that peers write while the kernel runs: L2 only, never a stale L1 line.
__device__ __forceinline__ int4 ld_cg_v4(const void *p) {
    int4 v;
    asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ int ld_cg(const int *p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float ld_cg(const float *p) { return __int_as_float(ld_cg(reinterpret_cast<const int *>(p))); }

// A word that the previous kernel (or this one's other blocks) wrote; no ordering implied.
__device__ __forceinline__ unsigned long long ld_volatile_u64(const void *p) {
    return *static_cast<const volatile unsigned long long *>(p);
}

__device__ __forceinline__ void st_cg_v4(int4 *p, int4 v) {
    asm volatile("st.global.cg.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w) : "memory");
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

}  // namespace epcomm
