// Bounded waits on other GPUs. A wait that runs past its deadline records who waited for whom in a
// host-mapped ErrorRecord (first failure wins) and returns false; the kernel then winds down and the
// host raises epcomm.errors.PeerTimeout. Nothing here traps, so the CUDA context survives.
#pragma once
#include "ptx.cuh"

namespace epcomm {

// Mirrored by epcomm.runtime.status.ErrorRecord (ctypes); keep both 32 bytes.
struct ErrorRecord {
    int code;   // ErrorCode below
    int op;     // epcomm.runtime.status.register_op id (a runtime Params field, not a template arg)
    int rank;   // the rank that waited
    int peer;   // the rank it waited for (-1 = unknown / local)
    int phase;  // op-specific phase number (named in Python next to the op)
    int reserved[3];
};
static_assert(sizeof(ErrorRecord) == 32, "ErrorRecord layout is mirrored in Python");

// kDeviceCheckFailed: a size / configuration violation that only the GPU can see (e.g. more rows
// than num_worst_tokens); epcomm.errors.DeviceCheckFailed on the host.
enum ErrorCode : int { kOk = 0, kPeerTimeout = 1, kDeviceCheckFailed = 2 };

// The one spin loop of every bounded wait: polls ready() until it holds (true) or, checked once
// every kPollsPerCheck polls (reading %globaltimer or a flag costs more than a poll), until
// give_up() says so (false; give_up records why).
constexpr unsigned int kPollsPerCheck = 1024;
template <class Ready, class GiveUp>
__device__ __forceinline__ bool spin_until(Ready ready, GiveUp give_up) {
    for (unsigned int spins = 1;; ++spins) {
        if (ready()) return true;
        if (spins % kPollsPerCheck == 0 && give_up()) return false;
    }
}

struct WaitContext {
    ErrorRecord *err;                 // host-mapped record (device pointer)
    unsigned long long deadline_ns;   // %globaltimer value after which waits fail
    int op;
    int rank;

    __device__ __forceinline__ static WaitContext make(ErrorRecord *err, unsigned long long timeout_ns,
                                                       int op, int rank) {
        return WaitContext{err, globaltimer_ns() + timeout_ns, op, rank};
    }

    // First failure wins: elect by code, then the details.
    __device__ __noinline__ void record(int peer, int phase, int code = kPeerTimeout) const {
        if (atomicCAS(&err->code, kOk, code) == kOk) {
            err->op = op;
            err->rank = rank;
            err->peer = peer;
            err->phase = phase;
            __threadfence_system();
        }
    }
};

// WaitContext plus a sticky failure flag in device memory, for kernels whose waits are many and
// hot: the host-mapped ErrorRecord is written once on failure (what the host raises from), and
// waits poll the flag instead. Why not poll the record: it is host memory, read over PCIe, and
// such reads serialise GPU-wide (~1 us each). A
// failure makes the Buffer unusable (StatusRecord.check) until Buffer.recover zeroes the whole
// buffer, flag included, as a new Buffer starts. The flag is per rank: kernels of later calls
// see it and wind down at once.
struct Guard {
    WaitContext ctx;
    unsigned int *flag;   // device memory of this rank

    __device__ __forceinline__ static Guard make(unsigned int *flag, ErrorRecord *err, unsigned long long timeout_ns,
                                                 int op, int rank) {
        return Guard{WaitContext::make(err, timeout_ns, op, rank), flag};
    }
    __device__ __forceinline__ bool failed() const { return *static_cast<volatile unsigned int *>(flag) != 0; }
    __device__ __forceinline__ void raise_flag() const {
        *static_cast<volatile unsigned int *>(flag) = 1u;
        __threadfence();
    }
    // A peer did not answer in time: ErrorRecord code kPeerTimeout (PeerTimeout on the host).
    __device__ __noinline__ void timeout(int peer, int phase) const {
        ctx.record(peer, phase);
        raise_flag();
    }
    // A size/config violation only the GPU can see: ErrorRecord code kDeviceCheckFailed.
    __device__ __noinline__ void violation(int peer, int phase) const {
        ctx.record(peer, phase, kDeviceCheckFailed);
        raise_flag();
    }
    __device__ __forceinline__ bool past_deadline() const { return globaltimer_ns() > ctx.deadline_ns; }
    // Spin until ready(); every kPollsPerCheck polls check the local flag and the deadline.
    template <class Ready>
    __device__ __forceinline__ bool wait(int peer, int phase, Ready ready) const {
        return spin_until(ready, [&] {
            if (failed()) return true;
            if (!past_deadline()) return false;
            timeout(peer, phase);
            return true;
        });
    }
};

// Bounded waits for a value another GPU release-writes: poll with relaxed loads (an acquire load
// per spin would invalidate the SM's L1 each time), then one acquire load of the same word
// synchronises with the writer (a fence would also wait for this warp's own pending stores).
// T: int or unsigned long long (the ptx.cuh overloads).
template <class T>
__device__ __forceinline__ bool wait_at_least(const Guard &guard, const T *p, T target, int peer, int phase) {
    if (!guard.wait(peer, phase, [&] { return ld_relaxed_sys(p) >= target; })) return false;
    return ld_acquire_sys(p) >= target;
}

}  // namespace epcomm
