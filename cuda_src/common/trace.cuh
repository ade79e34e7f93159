// Profiling stamps (builds with -DEPCOMM_TRACE only, the ops' trace=True kernels; compiled out
// otherwise, and a null table writes nothing). Lane 0 of every warp owns one row of u64 slots in a
// table [blocks][row_warps][slots]; each family names its slots (and the Python side reads them).
#pragma once
#include "arch.cuh"
#include "ptx.cuh"

namespace epcomm {

#ifdef EPCOMM_TRACE
constexpr bool kTrace = true;
#else
constexpr bool kTrace = false;
#endif

struct TraceRow {
    unsigned long long *slots;   // null: nothing to write (not a trace build, no table, not lane 0)

    __device__ __forceinline__ TraceRow(unsigned long long *table, int row_warps, int num_slots)
        : slots(kTrace && table != nullptr && lane_id() == 0
                    ? table + (static_cast<long long>(blockIdx.x) * row_warps + warp_id()) * num_slots
                    : nullptr) {}
    __device__ __forceinline__ void set(int slot, unsigned long long v) const {
        if (kTrace && slots != nullptr) slots[slot] = v;
    }
    __device__ __forceinline__ void add(int slot, unsigned long long v) const {
        if (kTrace && slots != nullptr) slots[slot] += v;
    }
    // For a slot the warp reaches more than once: keeps the first value.
    __device__ __forceinline__ void first(int slot, unsigned long long v) const {
        if (kTrace && slots != nullptr && slots[slot] == 0) slots[slot] = v;
    }
};

__device__ __forceinline__ unsigned long long trace_now() { return kTrace ? globaltimer_ns() : 0ull; }

}  // namespace epcomm
