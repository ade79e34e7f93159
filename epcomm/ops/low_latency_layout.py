"""Where the low-latency kernels (cuda_src/low_latency.cu) keep their state in the symmetric RDMA
buffer, and the shapes the kernel templates derive; no GPU needed (Buffer.get_low_latency_rdma_size_hint
calls rdma_size_hint on the CPU).

    [control][signals set 0][signals set 1][data set 0: send | recv][data set 1: send | recv]

control   (depends on R only; offset 0)
          per set: acks [R] u64 (written by the peers), epochs [2] u64 (calls sent / received on the
          set), tickets [8] u32 (epcomm::ll::Counter: blocks done with the current launch's send /
          receive part, then the combine send part's work claims: records, items);
          then failed u32 (16 B: the kernels' sticky failure flag, set with the PeerTimeout record),
          then mask [R] i32 (enable_shrink), then wait notes [R] u32 (Guard::notes: which rank
          each rank has waited for over half the bound).
signals   per set, depends on (T, E): token_tags [R][T] u64 (dispatch messages: a token goes once
          to each rank), record_tags [R][T] u64 (combine: top-k records, by source rank),
          partial_tags [R][T] u64 (combine: partial sums, by expert rank), list_tags [E_l][R] u64,
          lists [E_l][R][16 + 4T] (count + token indices of each (local expert, source)), records [R][T][512 B] (combine: received top-k ids + weights,
          by source rank, as stamped words that carry their call: no tag, no fence; here, not in
          the data region, so that clean_low_latency_buffer zeroes them and no other phase's
          bytes ever sit where a stamp is read).
data      per set, depends on (T, H, E): send = the zero-copy combine buffer [E_l][R*T][H] bf16,
          which also holds the put stages of dispatch (messages [T][msg] then lists [E][16 + 4T]);
          recv = dispatch messages [R][T][msg], or for combine: partials [R][T][H] f32 (received,
          by expert rank), partial_stage [R][T][H] f32 and record_stage [T][512 B] (sources of
          puts). A set carries one call at a time; the acks make sure its previous call was
          consumed before it is rewritten.

Only control and signals must start zeroed (the kernels count calls in them); data is always
written before its tag. Changing T or E moves the signals, hence clean_low_latency_buffer; H
only moves data.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime import cuda_decls

_DECLS = cuda_decls.header("low_latency_dispatch.cuh")   # and the protocol and common headers it includes
THREADS = _DECLS.constant("kDataThreads")             # threads per block of both kernels (template argument)
SCALE_CHANNELS = _DECLS.constant("kScaleChannels")    # channels per FP8 scale
LIST_HEADER_BYTES = _DECLS.constant("kListHeaderBytes")   # count + padding before a list's token indices
SMEM_BUDGET = _DECLS.member("DispatchShape", "kSmemBudget")
ALIGN = 256                  # every region starts on this boundary
MAX_TOPK = _DECLS.constant("kMaxTopk")                # the kernels give one lane per top-k slot
RECORD_BYTES = _DECLS.constant("kRecordBytes")        # combine top-k record: two stamped u64 words per slot
TICKET_BYTES = 4 * _DECLS.constant("kCounters")       # per set: the u32 counters of enum Counter


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def message_bytes(hidden: int, fp8: bool) -> int:
    """One dispatch message (Message<H, fp8>): FP8 payload + f32 scales (padded to 16 bytes), or BF16 row."""
    return _DECLS.member("Message", "kBytes", kHidden=hidden, kFP8=int(fp8))


def list_bytes(num_max_tokens: int) -> int:
    return LIST_HEADER_BYTES + 4 * num_max_tokens


def tokens_per_round(hidden: int, num_topk: int, fp8: bool, threads: int = THREADS) -> int:
    """DispatchShape::kTokensPerRound: tokens one block casts at once."""
    warps = threads // 32
    by_warps = warps // num_topk if num_topk < warps else 1
    by_smem = SMEM_BUDGET // message_bytes(hidden, fp8)
    return by_warps if by_warps < by_smem else max(by_smem, 1)


def dispatch_smem_bytes(hidden: int, num_topk: int, fp8: bool, threads: int = THREADS) -> int:
    """DispatchShape::kSmemBytes: the dispatch kernel's dynamic shared memory."""
    return tokens_per_round(hidden, num_topk, fp8, threads) * message_bytes(hidden, fp8)


@dataclass(frozen=True)
class Layout:
    """Byte offsets (from the buffer's base) of every region for (T, H, R, E)."""
    num_max_tokens: int
    hidden: int
    num_ranks: int
    num_experts: int

    # ---- control ---------------------------------------------------------------------------
    @property
    def _set_control_bytes(self) -> int:
        return _align(8 * self.num_ranks, 16) + 16 + TICKET_BYTES

    def acks(self, s: int) -> int:
        return s * self._set_control_bytes

    def epochs(self, s: int) -> int:
        return self.acks(s) + _align(8 * self.num_ranks, 16)

    def tickets(self, s: int) -> int:
        return self.epochs(s) + 16

    @property
    def failed(self) -> int:
        return 2 * self._set_control_bytes

    @property
    def mask(self) -> int:
        return self.failed + 16

    @property
    def wait_notes(self) -> int:
        return _align(self.mask + 4 * self.num_ranks, 16)

    @property
    def control_bytes(self) -> int:
        return _align(self.wait_notes + 4 * self.num_ranks)

    # ---- signals ----------------------------------------------------------------------------
    @property
    def _tag_array_bytes(self) -> int:
        """[R][T] u64: one tag per (rank, token)."""
        return _align(8 * self.num_ranks * self.num_max_tokens)

    @property
    def _signal_set_bytes(self) -> int:
        return (3 * self._tag_array_bytes + _align(8 * self.num_experts)
                + _align(self.num_experts * list_bytes(self.num_max_tokens)) + self._records_bytes)

    @property
    def _records_bytes(self) -> int:
        return _align(self.num_ranks * self.num_max_tokens * RECORD_BYTES)

    def token_tags(self, s: int) -> int:
        return self.control_bytes + s * self._signal_set_bytes

    def record_tags(self, s: int) -> int:
        return self.token_tags(s) + self._tag_array_bytes

    def partial_tags(self, s: int) -> int:
        return self.record_tags(s) + self._tag_array_bytes

    def list_tags(self, s: int) -> int:
        return self.partial_tags(s) + self._tag_array_bytes

    def lists(self, s: int) -> int:
        return self.list_tags(s) + _align(8 * self.num_experts)

    def records(self, s: int) -> int:
        return self.lists(s) + _align(self.num_experts * list_bytes(self.num_max_tokens))

    @property
    def signals_end(self) -> int:
        """End of what clean_low_latency_buffer zeroes (control and both sets' signals)."""
        return self.token_tags(2)

    # ---- data ------------------------------------------------------------------------------
    @property
    def _send_bytes(self) -> int:
        """The zero-copy combine buffer [E_l][R*T][H] bf16, or dispatch's put stages."""
        stages = self._message_stage_bytes + _align(self.num_experts * list_bytes(self.num_max_tokens))
        return max(_align(self.num_experts * self.num_max_tokens * 2 * self.hidden), stages)

    @property
    def _message_stage_bytes(self) -> int:
        return _align(self.num_max_tokens * 2 * self.hidden)

    @property
    def _partials_bytes(self) -> int:
        """[R][T][H] f32: one partial sum per (rank, token)."""
        return _align(self.num_ranks * self.num_max_tokens * 4 * self.hidden)

    @property
    def _recv_bytes(self) -> int:
        messages = _align(self.num_ranks * self.num_max_tokens * 2 * self.hidden)   # >= [R][T][msg]
        combine = 2 * self._partials_bytes + _align(self.num_max_tokens * RECORD_BYTES)
        return max(messages, combine)

    @property
    def _data_set_bytes(self) -> int:
        return self._send_bytes + self._recv_bytes

    def send(self, s: int) -> int:
        """The zero-copy combine buffer of set s; the dispatch message stage starts here too."""
        return self.signals_end + s * self._data_set_bytes

    def list_stage(self, s: int) -> int:
        return self.send(s) + self._message_stage_bytes

    def recv(self, s: int) -> int:
        """Dispatch messages of set s; combine partials start here too."""
        return self.send(s) + self._send_bytes

    def partial_stage(self, s: int) -> int:
        return self.recv(s) + self._partials_bytes

    def record_stage(self, s: int) -> int:
        return self.partial_stage(s) + self._partials_bytes

    @property
    def total_bytes(self) -> int:
        return self.send(2)


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                   num_experts: int) -> int:
    """Bytes of symmetric buffer low-latency mode needs for (T, H, R, E) (both buffer sets)."""
    for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"get_low_latency_rdma_size_hint: {name} must be a positive int, got {value!r}")
    if num_experts % num_ranks:
        raise ValueError(f"get_low_latency_rdma_size_hint: num_experts ({num_experts}) must be divisible "
                         f"by num_ranks ({num_ranks})")
    return Layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).total_bytes
