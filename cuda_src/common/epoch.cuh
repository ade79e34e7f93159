// Call epochs: every rank counts the kernels of a family it finished in a u64 of its own buffer
// (bumped by the last block), so repeated calls and CUDA-graph replays need nothing from the host.
#pragma once
#include "ptx.cuh"

namespace epcomm {

// Every block copies the peer table (each rank's buffer in this process's address space) into
// shared memory and returns this kernel's epoch: the count at `epoch_offset` of this rank's buffer,
// plus one.
template <int kRanks>
__device__ __forceinline__ unsigned long long begin_epoch(char **peers, const long long *peer_bases, int rank,
                                                          long long epoch_offset) {
    for (int j = threadIdx.x; j < kRanks; j += blockDim.x) peers[j] = reinterpret_cast<char *>(peer_bases[j]);
    __syncthreads();
    return ld_volatile_u64(peers[rank] + epoch_offset) + 1;
}

// A 64-bit mix of a call's epoch (splitmix64's finaliser). Words that carry their call hold it
// instead of the epoch itself, so bytes that some other phase left in the same memory (small
// integers, FP8 payload with many zero bytes) match a call's stamp with probability ~2^-32 per
// 32-bit stamp, not whenever they happen to equal a small count.
__device__ __forceinline__ unsigned long long mix_epoch(unsigned long long epoch) {
    unsigned long long z = epoch + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Stamped counters: a word that carries a call's count of something (records written, records
// consumed) as epoch << 32 | count. Never reset: every later call stamps a larger epoch, so a word
// left by an earlier call reads as count 0 of this one. Counts stay below 2^32.
__device__ __forceinline__ unsigned long long stamped(unsigned long long epoch, unsigned int count) {
    return epoch << 32 | count;
}
__device__ __forceinline__ unsigned int stamped_count(unsigned long long word, unsigned long long epoch) {
    return word >= (epoch << 32) ? static_cast<unsigned int>(word - (epoch << 32)) : 0u;
}

}  // namespace epcomm
