// Bounded waits on other GPUs. A wait that runs past its deadline records who waited for whom in a
// host-mapped ErrorRecord (first failure wins) and returns false; the kernel then winds down and the
// host raises epcomm.errors.PeerTimeout. Nothing here traps, so the CUDA context survives.
#pragma once
#include "ptx.cuh"
#if defined(EPCOMM_NVSHMEM_INLINE) || defined(EPCOMM_NVSHMEM_LIB)
#include "nvshmem.cuh"   // a failure is told to peers not mapped here with a put
#endif

namespace epcomm {

// Read by epcomm.runtime.status (cuda_decls) as its ctypes ErrorRecord; 32 bytes.
struct ErrorRecord {
    int code;   // ErrorCode below
    int op;     // epcomm.runtime.status.register_op id (a runtime Params field, not a template arg)
    int rank;   // the rank that waited
    int peer;   // the rank it waited for (-1 = unknown / local)
    int phase;  // op-specific phase number (named in Python next to the op); -1: not in a wait
    int reporter;   // kPeerReported*: the rank that failed first and told this one (-1 otherwise);
                    // `peer` is then whom that rank waited for, or whose data broke the rule there
    int reserved[2];
};
static_assert(sizeof(ErrorRecord) == 32, "ErrorRecord layout is mirrored in Python");

// Read by epcomm.runtime.status (cuda_decls); each code is one exception class on the host.
enum ErrorCode : int {
    kOk = 0,
    kPeerTimeout = 1,             // a wait of this rank ran out: PeerTimeout
    kDeviceCheckFailed = 2,       // a size / configuration violation only the GPU can see (more rows
                                  // than num_worst_tokens...): DeviceCheckFailed
    kPeerReportedTimeout = 3,     // `peer` timed out in this call and told this rank: PeerTimeout
    kPeerReportedViolation = 4,   // `peer` found a violation and told this rank: PeerFailed
};

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
    unsigned long long deadline_ns;   // %globaltimer value after which waits on a peer fail
    unsigned long long timeout_ns;    // the bound itself (a wait on this rank's own data gets two)
    int op;
    int rank;

    __device__ __forceinline__ static WaitContext make(ErrorRecord *err, unsigned long long timeout_ns,
                                                       int op, int rank) {
        return WaitContext{err, globaltimer_ns() + timeout_ns, timeout_ns, op, rank};
    }

    // First failure wins: elect by code, then the details.
    __device__ __noinline__ void record(int peer, int phase, int code = kPeerTimeout, int reporter = -1) const {
        if (atomicCAS(&err->code, kOk, code) == kOk) {
            err->op = op;
            err->rank = rank;
            err->peer = peer;
            err->phase = phase;
            err->reporter = reporter;
            __threadfence_system();
        }
    }
};

// WaitContext plus a sticky failure flag in device memory, for kernels whose waits are many and
// hot: the host-mapped ErrorRecord is written once on failure (what the host raises from), and
// waits poll the flag instead. Why not poll the record: it is host memory, read over PCIe, and
// such reads serialise GPU-wide (~1 us each). A failure makes the Buffer unusable
// (StatusRecord.check) until Buffer.recover zeroes the whole buffer, flag included, as a new
// Buffer starts. The flag is per rank: kernels of later calls see it and wind down at once.
//
// The first failure of a rank is also written into every peer's flag, as a report word naming
// this rank and the peer it waited for (or whose data broke a rule): a peer whose own waits were
// all satisfied so far (its dispatch completed, its combine now waits for ranks that wound down)
// stops at its next poll instead of waiting out its own deadline, and records the report. So every
// rank of a failed call raises within one timeout of its start, naming the same culprit. The flag
// sits at the same offset of every rank's buffer: a peer mapped here (peer_bases[r] != 0, NVLink)
// gets a store, any other an NVSHMEM put of that word.
constexpr unsigned int kFlagLocal = 1u;                  // this rank failed; its record says why
constexpr unsigned int kReport = 1u << 31;
constexpr unsigned int kReportViolation = 1u << 30;
constexpr int kReportRankBits = 15;                      // reporter and culprit: ranks < 32767
constexpr unsigned int kReportNoPeer = (1u << kReportRankBits) - 1u;

__device__ __forceinline__ unsigned int report_word(int reporter, int culprit, bool violation) {
    return kReport | (violation ? kReportViolation : 0u) | (static_cast<unsigned int>(reporter) << kReportRankBits) |
           (culprit < 0 ? kReportNoPeer : static_cast<unsigned int>(culprit));
}

// A wait can be late only because the peer it waits for is itself waiting (a reducer that waits
// for room from a receiver that waits for the silent rank). Had it timed out at its own deadline,
// which may come first, every rank would name that peer instead of the rank that stopped
// answering. So a wait that has run half its bound tells every peer, once per kernel (`notes`,
// below), which rank it waits for; a wait for peer P that runs out while P has a note gets one
// more bound, within which P's wait for the rank with no note (the silent one) runs out and its
// report, naming the culprit, reaches this rank. Even a note naming this rank counts: flow
// control makes waits look circular (this rank's receiver waits for P's rows while P waits for
// room this receiver frees only after rows from the silent rank), and the note holds only the
// first long wait of P's kernel. A real cycle among live ranks times out at the second bound.
// A note counts in the kernel that saw it arrive: each kernel starts by clearing this rank's
// notes (a peer's note from an earlier call must not stretch this one).
constexpr unsigned int kNoNote = 0u;   // a note holds 1 + the rank waited for

struct Guard {
    WaitContext ctx;
    unsigned int *flag;             // device memory of this rank, inside the buffer at peer_bases[rank]
    unsigned int *notes;            // [num_ranks] in the same buffer: notes[r], rank r's long wait (kNoNote: none)
    const long long *peer_bases;    // [num_ranks] the ranks' buffers as mapped here (0: not mapped)
    int num_ranks;

    // At the start of a kernel, by every thread (block 0 clears the notes: see above).
    __device__ __forceinline__ static Guard make(unsigned int *flag, unsigned int *notes, ErrorRecord *err,
                                                 unsigned long long timeout_ns, int op, int rank,
                                                 const long long *peer_bases, int num_ranks) {
        if (blockIdx.x == 0)
            for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) notes[r] = kNoNote;
        return Guard{WaitContext::make(err, timeout_ns, op, rank), flag, notes, peer_bases, num_ranks};
    }
    // True once this rank or a peer failed. A peer's report is taken by one thread (it swaps the
    // word for kFlagLocal) and recorded by that thread alone: the record is host memory, and every
    // thread of the next kernel checks the flag. First failure wins, so a rank's own earlier
    // failure stays what it raises. `phase`: the wait this rank was in.
    __device__ __forceinline__ bool failed(int phase = -1) const {
        const unsigned int v = *static_cast<volatile unsigned int *>(flag);
        if ((v & kReport) && atomicCAS(flag, v, kFlagLocal) == v) adopt(v, phase);
        return v != 0u;
    }
    __device__ __noinline__ void adopt(unsigned int v, int phase) const {
        const unsigned int mask = kReportNoPeer, culprit = v & mask;
        ctx.record(culprit == kReportNoPeer ? -1 : static_cast<int>(culprit), phase,
                   (v & kReportViolation) ? kPeerReportedViolation : kPeerReportedTimeout,
                   static_cast<int>((v >> kReportRankBits) & mask));
    }
    // This rank failed (its record is written): stop its kernels and, the first time, its peers'.
    __device__ __noinline__ void raise_flag(int culprit, bool violation) const {
        const unsigned int before = atomicExch(flag, kFlagLocal);
        __threadfence_system();
        if (before == 0u) store_on_peers(flag, report_word(ctx.rank, culprit, violation));
    }
    // `word` into the same place of every peer's buffer as `local` in this rank's.
    __device__ __noinline__ void store_on_peers(unsigned int *local, unsigned int word) const {
        const long long own = peer_bases[ctx.rank];
        const long long offset = reinterpret_cast<long long>(local) - own;
        for (int r = 0; r < num_ranks; ++r) {
            if (r == ctx.rank) continue;
            const long long peer = own != 0 ? peer_bases[r] : 0;
            if (peer != 0) {
                *reinterpret_cast<volatile unsigned int *>(peer + offset) = word;
            } else {
#if defined(EPCOMM_NVSHMEM_INLINE) || defined(EPCOMM_NVSHMEM_LIB)
                nvshmem_uint32_p(local, word, r);   // the symmetric address names it on PE r
#endif
            }
        }
        __threadfence_system();
    }
    // A peer did not answer in time: ErrorRecord code kPeerTimeout (PeerTimeout on the host).
    __device__ __noinline__ void timeout(int peer, int phase) const {
        ctx.record(peer, phase);
        raise_flag(peer, false);
    }
    // A size/config violation only the GPU can see: ErrorRecord code kDeviceCheckFailed.
    __device__ __noinline__ void violation(int peer, int phase) const {
        ctx.record(peer, phase, kDeviceCheckFailed);
        raise_flag(peer, true);
    }
    // Whether a wait for `peer` has run out. A wait for this rank's own data (made by its other
    // blocks, or by its own forwarding) is late only because one of their waits for a peer is:
    // it gets a second bound, so that wait runs out first, names the peer and raises the flag,
    // which ends this one too. Otherwise the rank could name itself, whichever wait ran out first.
    // A wait for a peer that is itself waiting gets a second bound too (notes, above).
    __device__ __forceinline__ bool past_deadline(int peer) const {
        const unsigned long long now = globaltimer_ns();
        if (peer == ctx.rank) return now > ctx.deadline_ns + ctx.timeout_ns;
        if (peer < 0 || peer >= num_ranks) return now > ctx.deadline_ns;
        if (now + ctx.timeout_ns / 2 <= ctx.deadline_ns) return false;
        return past_deadline_of_long_wait(peer, now);
    }
    __device__ __noinline__ bool past_deadline_of_long_wait(int peer, unsigned long long now) const {
        const unsigned int note = static_cast<unsigned int>(peer) + 1u;
        // The kernel's first long wait is this rank's note (later ones would make every check a
        // store on every peer); the note itself is only a hint, so a lost race is harmless.
        if (*reinterpret_cast<volatile unsigned int *>(notes + ctx.rank) == kNoNote &&
            atomicCAS(notes + ctx.rank, kNoNote, note) == kNoNote)
            store_on_peers(notes + ctx.rank, note);
        if (now <= ctx.deadline_ns) return false;
        if (now > ctx.deadline_ns + ctx.timeout_ns) return true;
        return *reinterpret_cast<volatile unsigned int *>(notes + peer) == kNoNote;
    }
    // Spin until ready(); every kPollsPerCheck polls check the flag and the deadline.
    template <class Ready>
    __device__ __forceinline__ bool wait(int peer, int phase, Ready ready) const {
        return spin_until(ready, [&] {
            if (failed(phase)) return true;
            if (!past_deadline(peer)) return false;
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
