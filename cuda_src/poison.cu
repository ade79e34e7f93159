// Poison the outputs of a failed call. Launched on the call's stream right after its kernels, so it
// runs before anything the caller queues after the call: if the Buffer's ErrorRecord says a wait
// ran out (or a device check failed), every output is overwritten with a pattern no valid call
// produces (NaN for floating point, -1 for counts and indices); otherwise it returns at once.
// Host side: epcomm/ops/poison.py.
//
// One block: the success path is one read of the host-mapped record (reads of host memory
// serialise GPU-wide, so more blocks would each pay one); the fill runs only after a failure.
#include "common/timeout.cuh"

namespace epcomm {

constexpr int kPoisonTargets = 6;

struct PoisonTarget {
    void *data;
    unsigned long long bytes;
    unsigned int pattern;   // 4 bytes as they lie in memory from the tensor's first byte on
    unsigned int reserved;
};

struct PoisonParams {
    const ErrorRecord *err;   // host-mapped (device pointer)
    int num_targets;
    int reserved;
    PoisonTarget targets[kPoisonTargets];
};
static_assert(sizeof(PoisonTarget) == 24 && sizeof(PoisonParams) == 160, "read by epcomm.runtime.cuda_decls");

template <int kThreads>
__global__ void __launch_bounds__(kThreads) poison_kernel(PoisonParams p) {
    __shared__ int code;
    if (threadIdx.x == 0) code = *reinterpret_cast<const volatile int *>(&p.err->code);
    __syncthreads();
    if (code == kOk) return;
    for (int t = 0; t < p.num_targets; ++t) {
        const PoisonTarget target = p.targets[t];
        unsigned char *bytes = static_cast<unsigned char *>(target.data);
        const unsigned long long head = (4u - (reinterpret_cast<unsigned long long>(bytes) & 3u)) & 3u;
        const unsigned long long lead = head < target.bytes ? head : target.bytes;
        // bytes before the first aligned word and after the last one
        for (unsigned long long i = threadIdx.x; i < lead; i += kThreads)
            bytes[i] = static_cast<unsigned char>(target.pattern >> (8u * (i & 3u)));
        const unsigned long long words = (target.bytes - lead) / 4u;
        const unsigned int shift = 8u * static_cast<unsigned int>(head);
        const unsigned int word = shift ? (target.pattern >> shift) | (target.pattern << (32u - shift)) : target.pattern;
        unsigned int *aligned = reinterpret_cast<unsigned int *>(bytes + lead);
        for (unsigned long long i = threadIdx.x; i < words; i += kThreads) aligned[i] = word;
        for (unsigned long long i = lead + 4u * words + threadIdx.x; i < target.bytes; i += kThreads)
            bytes[i] = static_cast<unsigned char>(target.pattern >> (8u * (i & 3u)));
    }
}

}  // namespace epcomm
