"""Host-side geometry of the internode kernels (cuda_src/internode.cu): the Params structs and
constants (read from cuda_src/internode_protocol.cuh), the layout of the RDMA buffer, the chunking
and the size hint. Pure Python: no torch, no GPU.

RDMA buffer of every rank (same offsets everywhere):
  header (internode_protocol.cuh `Header`) | data region
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

from ..runtime import cuda_decls

_DECLS = cuda_decls.header("internode_protocol.cuh")
THREADS = _DECLS.constant("kThreads")
NOTIFY_THREADS = _DECLS.constant("kNotifyThreads")
MAX_CHUNKS = _DECLS.constant("kMaxChunks")                 # signal words per source node
MAX_TOPK = _DECLS.constant("kMaxTopk")                     # combine's rows hold this many weights whatever K is
MAX_LOCAL_EXPERTS = _DECLS.constant("kMaxLocalExperts")    # expert counts per notify row
NOTIFY_HEAD = _DECLS.constant("kNotifyHead")               # header ints of a notify row
# Token chunks per block in dispatch's RDMA stage: each (node, chunk) is one put with a signal, so
# more chunks start the transfers (and the receivers' copies) earlier, at more signals.
CHUNKS_PER_BLOCK = 4
# Partial sums per combine signal, at least (more when the capacity needs more than MAX_CHUNKS).
MIN_CHUNK_RECORDS = 16
# Ranks per node the size hint assumes for more than this many ranks (DeepEP's NVLink domain).
HINT_LOCAL_RANKS = 8
# Tokens per rank the size hint provides for (a call with more raises, naming this hint).
HINT_TOKENS = 4096

# ErrorRecord.phase names: the comments of internode_protocol.cuh's `Phase`.
PHASES = _DECLS.enum_comments("Phase")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# ---- Params (declared in internode_protocol.cuh) ---------------------------------------------
PARAMS = {name: _DECLS.struct(name) for name in ("NotifyParams", "DispatchParams", "CombineParams")}
NotifyParams, DispatchParams, CombineParams = PARAMS.values()


# ---- RDMA buffer layout ----------------------------------------------------------------------
def header_bytes(num_ranks: int, num_nodes: int) -> int:
    """Bytes of internode_protocol.cuh's Header<R, M>."""
    return _DECLS.member("Header", "kBytes", kRanks=num_ranks, kNodes=num_nodes)


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
