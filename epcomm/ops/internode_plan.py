"""Host-side geometry of the internode kernels (cuda_src/internode.cu): Params mirrors, the layout of
the RDMA buffer, the chunking and the size hint. Pure Python: no torch, no GPU.

RDMA buffer of every rank (same offsets everywhere):
  header (internode_common.cuh `Header`) | data region
The data region is laid out per kernel (a kernel only writes it once every rank finished the
previous internode kernel, so the layouts may overlap):
  notify:   received count rows [R][notify_ints] i32 | outgoing count rows [R][notify_ints] i32
            (every field at an offset that depends on R alone, so ranks that disagree on G, E_l or
            the record format still read each other's header fields and are caught)
  dispatch: received records [M][capacity] | staged records [M][capacity]
            record = row bytes | scales f32[S] | expert ids i32[K] | weights f32[K] | source i32 |
                     row on each local rank i32[L], rounded up to 16 bytes
  combine:  pushed rows [L][M][capacity] (bf16 row | weights f32[MAX_TOPK] | u64 tag) |
            partial sums staged [M][capacity] | partial sums received [M][capacity]
            (partial = fp32 row | weights f32[MAX_TOPK] | u64 tag); sized for MAX_TOPK whatever K
            is, so ranks that differ in K (topk_weights given or not) read the tags at the same
            place, and the tags carry K (a mismatch is a DeviceCheckFailed)
`capacity` = tokens one source node can send to one RDMA peer in a call: a call is one-shot, so
every rank's N must be <= the capacity that num_rdma_bytes leaves. Every data kernel checks the
largest N of all ranks (notify's, kept in handle[2][R]) against its capacity and, when it does not
fit, records a DeviceCheckFailed and skips its work on every rank alike; the host raises a
ValueError first wherever every rank knows that N (exact-mode dispatch and its handles).
"""
from __future__ import annotations

import ctypes

THREADS = 512                 # kThreads
NOTIFY_THREADS = 1024         # kNotifyThreads
MAX_CHUNKS = 1024             # kMaxChunks: signal words per source node
MAX_TOPK = 32                 # kMaxTopk: combine's rows hold this many weights whatever K is
MAX_LOCAL_EXPERTS = 1024      # kMaxLocalExperts: expert counts per notify row
NOTIFY_HEAD = 8               # kNotifyHead: header ints of a notify row
# Token chunks per block in dispatch's RDMA stage: each (node, chunk) is one put with a signal, so
# more chunks start the transfers (and the receivers' copies) earlier, at more signals.
CHUNKS_PER_BLOCK = 4
# Partial sums per combine signal, at least (more when the capacity needs more than MAX_CHUNKS).
MIN_CHUNK_RECORDS = 16
# Ranks per node the size hint assumes for more than this many ranks (DeepEP's NVLink domain).
HINT_LOCAL_RANKS = 8
# Tokens per rank the size hint provides for (a call with more raises, naming this hint).
HINT_TOKENS = 4096

# ErrorRecord.phase names, in the order of internode_common.cuh's `Phase`.
PHASES = [
    "a rank has not finished its previous internode kernel",
    "waiting for a rank's token counts",
    "waiting for a chunk of a source rank's token records",
    "waiting for a local rank's pushed rows",
    "waiting for a node's partial sums",
    "more rows received than num_worst_tokens",
    "ranks use different chunk counts, expert counts or token formats (Config.num_sms, num_experts, "
    "hidden, FP8 or top-k differ, or topk_weights given to combine on some ranks only)",
    "the largest N of all ranks does not fit the RDMA buffer (internode calls are one-shot: raise "
    "num_rdma_bytes; Config.get_rdma_buffer_size_hint)",
]


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# ---- Params mirrors (static_assert'ed in internode_common.cuh and by tests/test_internode_plan.py)
_P, _I, _LL, _ULL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong


class NotifyParams(ctypes.Structure):
    _fields_ = [("is_token_in_rank", _P), ("num_tokens_per_expert", _P), ("info", _P),
                ("rdma_channel_prefix", _P), ("gbl_channel_prefix", _P),
                ("recv_rdma_channel_prefix", _P), ("recv_rdma_rank_prefix_sum", _P),
                ("recv_gbl_channel_prefix", _P), ("recv_gbl_rank_prefix_sum", _P),
                ("send_rdma_head", _P), ("send_nvl_head", _P), ("peer_bases", _P), ("err", _P),
                ("timeout_ns", _ULL), ("area_offset", _LL), ("stage_offset", _LL),
                ("num_tokens", _I), ("num_chunks", _I), ("tokens_per_chunk", _I),
                ("num_local_experts", _I), ("notify_ints", _I), ("num_topk", _I), ("num_scales", _I),
                ("row_bytes", _I), ("rank", _I), ("op", _I)]


class DispatchParams(ctypes.Structure):
    _fields_ = [("x", _P), ("x_scales", _P), ("topk_idx", _P), ("topk_weights", _P),
                ("rdma_channel_prefix", _P), ("recv_rdma_channel_prefix", _P),
                ("recv_gbl_rank_prefix_sum", _P), ("send_rdma_head", _P), ("send_nvl_head", _P),
                ("recv_x", _P), ("recv_x_scales", _P), ("recv_topk_idx", _P),
                ("recv_topk_weights", _P), ("recv_src_meta", _P), ("max_tokens", _P), ("peer_bases", _P),
                ("err", _P), ("scale_stride_token", _LL), ("scale_stride_group", _LL), ("timeout_ns", _ULL),
                ("recv_offset", _LL), ("stage_offset", _LL),
                ("capacity", _I), ("record_bytes", _I), ("num_tokens", _I), ("num_chunks", _I),
                ("tokens_per_chunk", _I), ("num_topk", _I), ("num_local_experts", _I),
                ("num_out_rows", _I), ("rank", _I), ("op", _I)]


class CombineParams(ctypes.Structure):
    _fields_ = [("x", _P), ("topk_weights", _P), ("bias0", _P), ("bias1", _P),
                ("recv_src_meta", _P), ("recv_gbl_rank_prefix_sum", _P),
                ("recv_rdma_channel_prefix", _P), ("send_rdma_head", _P), ("combined_x", _P),
                ("combined_weights", _P), ("max_tokens", _P), ("peer_bases", _P), ("err", _P),
                ("timeout_ns", _ULL),
                ("push_offset", _LL), ("partial_stage_offset", _LL), ("partial_recv_offset", _LL),
                ("capacity", _I), ("push_bytes", _I), ("partial_bytes", _I), ("chunk_records", _I),
                ("num_tokens", _I), ("num_chunks", _I), ("num_topk", _I), ("rank", _I), ("op", _I),
                ("pad_", _I)]


PARAMS = {"NotifyParams": NotifyParams, "DispatchParams": DispatchParams,
          "CombineParams": CombineParams}


# ---- RDMA buffer layout ----------------------------------------------------------------------
def header_bytes(num_ranks: int, num_nodes: int) -> int:
    """Bytes of internode_common.cuh's Header<R, M> (mirrored; checked by a static_assert test)."""
    record_signals = _align(64 + 8 * num_ranks * 3, 128)
    return _align(record_signals + 2 * 8 * num_nodes * MAX_CHUNKS, 256)


def notify_ints(num_ranks: int) -> int:
    """Ints of one count row (notify_kernel): sized for MAX_CHUNKS chunks and MAX_LOCAL_EXPERTS
    experts, so its fields sit where every rank looks for them whatever G and E_l it uses."""
    return _align(NOTIFY_HEAD + num_ranks + MAX_CHUNKS + 1 + MAX_LOCAL_EXPERTS, 4)


def notify_offsets(num_ranks: int, num_nodes: int):
    """(area offset, stage offset, end) of notify's count rows."""
    area = header_bytes(num_ranks, num_nodes)
    rows = num_ranks * notify_ints(num_ranks) * 4
    return area, area + rows, area + 2 * rows


def dispatch_record_bytes(row_bytes: int, num_scales: int, num_topk: int, num_local_ranks: int) -> int:
    return _align(row_bytes + 4 * num_scales + 8 * num_topk + 4 + 4 * num_local_ranks, 16)


def combine_push_bytes(row_bytes: int) -> int:
    """bf16 row | weights f32[MAX_TOPK] | u64 tag (row_bytes is a multiple of 16)."""
    return _align(row_bytes + 4 * MAX_TOPK + 8, 16)


def combine_partial_bytes(row_bytes: int) -> int:
    """fp32 row | weights f32[MAX_TOPK] | u64 tag."""
    return _align(2 * row_bytes + 4 * MAX_TOPK + 8, 16)


class DispatchLayout:
    """Offsets of dispatch's records for one (buffer size, record size, topology)."""

    def __init__(self, rdma_bytes: int, num_ranks: int, num_local_ranks: int, record_bytes: int):
        num_nodes = num_ranks // num_local_ranks
        self.record_bytes = record_bytes
        self.recv_offset = header_bytes(num_ranks, num_nodes)
        self.capacity = max(0, (rdma_bytes - self.recv_offset) // (2 * num_nodes * record_bytes))
        self.stage_offset = self.recv_offset + num_nodes * self.capacity * record_bytes


class CombineLayout:
    """Offsets of combine's pushed rows and partial sums for one (buffer size, row, topology)."""

    def __init__(self, rdma_bytes: int, num_ranks: int, num_local_ranks: int, row_bytes: int):
        num_nodes = num_ranks // num_local_ranks
        self.push_bytes = combine_push_bytes(row_bytes)
        self.partial_bytes = combine_partial_bytes(row_bytes)
        self.push_offset = header_bytes(num_ranks, num_nodes)
        per_token = num_nodes * (num_local_ranks * self.push_bytes + 2 * self.partial_bytes)
        self.capacity = max(0, (rdma_bytes - self.push_offset) // per_token)
        self.partial_stage_offset = self.push_offset + num_local_ranks * num_nodes * self.capacity * self.push_bytes
        self.partial_recv_offset = self.partial_stage_offset + num_nodes * self.capacity * self.partial_bytes
        self.chunk_records = max(MIN_CHUNK_RECORDS, -(-self.capacity // MAX_CHUNKS))


def check_capacity(what: str, num_tokens: int, capacity: int, rdma_bytes: int, detail: str) -> None:
    """ValueError when `num_tokens` tokens of one rank do not fit one call."""
    if num_tokens > capacity:
        raise ValueError(f"{what}: {num_tokens} tokens per rank do not fit the RDMA buffer: "
                         f"num_rdma_bytes={rdma_bytes} holds {capacity} ({detail}); internode calls are "
                         f"one-shot, so raise num_rdma_bytes (Config.get_rdma_buffer_size_hint sizes it "
                         f"for {HINT_TOKENS} tokens per rank)")


# ---- chunking --------------------------------------------------------------------------------
def num_chunks(num_sms: int) -> int:
    """G, the token chunks of every rank (a function of the config alone: equal on every rank that
    uses the same Config; the notify kernel checks it)."""
    return max(1, min(MAX_CHUNKS, CHUNKS_PER_BLOCK * num_sms))


def tokens_per_chunk(num_tokens: int, chunks: int) -> int:
    return max(1, -(-num_tokens // chunks))


# ---- kernel names ----------------------------------------------------------------------------
def notify_kernel(num_ranks: int, num_local_ranks: int) -> str:
    return f"epcomm::internode::notify_kernel<{num_ranks}, {num_local_ranks}>"


def dispatch_kernel(num_ranks: int, num_local_ranks: int, row_bytes: int, num_scales: int,
                    index_type: str, fresh: bool) -> str:
    return (f"epcomm::internode::dispatch_kernel<{num_ranks}, {num_local_ranks}, {row_bytes // 16}, "
            f"{num_scales}, {index_type}, {'true' if fresh else 'false'}>")


def combine_kernel(num_ranks: int, num_local_ranks: int, row_bytes: int) -> str:
    return f"epcomm::internode::combine_kernel<{num_ranks}, {num_local_ranks}, {row_bytes // 16}>"


# ---- size hint -------------------------------------------------------------------------------
def hint_local_ranks(num_ranks: int) -> int:
    """Ranks per node the hint assumes: DeepEP's 8 per NVLink domain when they divide the ranks."""
    return HINT_LOCAL_RANKS if num_ranks % HINT_LOCAL_RANKS == 0 else 1


def rdma_bytes_needed(num_tokens: int, row_bytes: int, num_scales: int, num_topk: int,
                      num_ranks: int, num_local_ranks: int) -> int:
    """Smallest num_rdma_bytes whose dispatch and combine capacities are >= num_tokens (BF16 or FP8
    rows of `row_bytes` bytes for dispatch; combine rows are BF16, `2 * hidden` bytes = row_bytes
    for BF16, with MAX_TOPK weights whatever num_topk is). Also covers notify's count rows."""
    num_nodes = num_ranks // num_local_ranks
    header = header_bytes(num_ranks, num_nodes)
    record = dispatch_record_bytes(row_bytes, num_scales, num_topk, num_local_ranks)
    dispatch = 2 * num_nodes * num_tokens * record
    combine = num_nodes * num_tokens * (num_local_ranks * combine_push_bytes(row_bytes) +
                                        2 * combine_partial_bytes(row_bytes))
    notify = notify_offsets(num_ranks, num_nodes)[2] - header
    return _align(header + max(dispatch, combine, notify), 128)


def rdma_size_hint(config, hidden_bytes: int, num_ranks: int) -> int:
    """Bytes of num_rdma_bytes for HINT_TOKENS tokens per rank with rows of `hidden_bytes` (= hidden
    * max(element size, 2), as DeepEP passes it), FP8 scales and 32 top-k entries, on nodes of
    hint_local_ranks(num_ranks) ranks. `config` does not change the layout (one-shot calls)."""
    scales = -(-hidden_bytes // 256)   # FP8 rows: hidden_bytes = 2 * H, one scale per 128 channels
    return rdma_bytes_needed(HINT_TOKENS, hidden_bytes, scales, MAX_TOPK, num_ranks,
                             hint_local_ranks(num_ranks))
