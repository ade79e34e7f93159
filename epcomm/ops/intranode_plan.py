"""Host-side geometry of the intranode kernels (cuda_src/intranode.cu): the Params structs and
constants (read from cuda_src/intranode_protocol.cuh), the layout of the NVL buffer, the chunking,
the SM split and the size hint. Pure Python: no torch, no GPU.

NVL buffer of every rank (same offsets everywhere):
  header (signals, intranode_protocol.cuh `Header`) | dispatch only: notify area | receive rings
A ring per peer holds `ring_rows` records; a record is one row plus its metadata:
  dispatch: row bytes | scales f32[S] | local top-k i32[K] | weights f32[K] | source index i32
  combine:  row bytes (bf16) | weights f32[K]
each rounded up to 16 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime import cuda_decls

_DECLS = cuda_decls.header("intranode_protocol.cuh")
THREADS = _DECLS.constant("kThreads")                # data kernels
NOTIFY_THREADS = _DECLS.constant("kNotifyThreads")
MAX_CHUNKS = _DECLS.constant("kMaxChunks")           # G never exceeds it
PARTS_PER_CHUNK = _DECLS.constant("kParts")
MAX_TOPK = _DECLS.constant("kMaxTopk")

# Chunks per sending block: more chunks = finer pipelining between the NVLink writes and the
# receivers' copies (and a shorter tail), fewer = less signalling (chosen by the SM sweep).
CHUNKS_PER_SEND_BLOCK = 8
# Share of the SMs that send (dispatch) / push (combine); every block also receives once its
# sends are done, so the rest only sets how early receiving starts.
DISPATCH_SEND_SHARE = 2 / 3
COMBINE_PUSH_SHARE = 1 / 2
# Ring capacity (rows per peer) the size hint provides: a dispatch of up to this many rows per
# peer is one-shot (no sender ever waits for ring space).
HINT_RING_ROWS = 4096
# ErrorRecord.phase names: the comments of intranode_protocol.cuh's `Phase`.
PHASES = _DECLS.enum_comments("Phase")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# Profiling builds (EPCOMM_INTRANODE_TRACE=1): per (block, warp) slots of intranode_protocol.cuh's
# TraceSlot, u64 each; stamps are %globaltimer ns, the *_ns / claims slots are sums.
TRACE_WARPS = _DECLS.constant("kTraceWarps")
TRACE_SLOTS = _DECLS.enum_names("TraceSlot", "kTr")

# ---- Params (declared in intranode_protocol.cuh) ---------------------------------------------
PARAMS = {name: _DECLS.struct(name) for name in ("NotifyParams", "DispatchParams", "CombineParams")}
NotifyParams, DispatchParams, CombineParams = PARAMS.values()


# ---- NVL buffer layout -----------------------------------------------------------------------
def header_bytes(num_ranks: int) -> int:
    """Bytes of intranode_protocol.cuh's Header<R>."""
    return _DECLS.member("Header", "kBytes", kRanks=num_ranks)


def notify_ints(num_ranks: int, num_local_experts: int) -> int:
    """Ints one source writes into each rank's notify area (NotifyParams.notify_ints; sized for
    MAX_CHUNKS so that a rank using another G is read at the right place)."""
    return _align(4 + num_ranks + num_local_experts + MAX_CHUNKS + 1, 4)


def dispatch_record_bytes(row_bytes: int, num_scales: int, num_topk: int) -> int:
    return _align(row_bytes + 4 * num_scales + 8 * num_topk + 4, 16)


def combine_record_bytes(row_bytes: int, num_topk: int) -> int:
    return _align(row_bytes + 4 * num_topk, 16)


def dispatch_staging_offset(num_ranks: int, num_local_experts: int) -> int:
    notify = num_ranks * notify_ints(num_ranks, num_local_experts) * 4
    return _align(header_bytes(num_ranks) + notify, 256)


def combine_staging_offset(num_ranks: int) -> int:
    return _align(header_bytes(num_ranks), 256)


def ring_rows(nvl_bytes: int, staging_offset: int, record_bytes: int, num_ranks: int,
              what: str) -> int:
    """Records per peer ring; ValueError when not even one fits."""
    if num_ranks == 1:
        return 1
    rows = (nvl_bytes - staging_offset) // ((num_ranks - 1) * record_bytes)
    if rows < 1:
        need = staging_offset + (num_ranks - 1) * record_bytes
        raise ValueError(f"{what}: num_nvl_bytes={nvl_bytes} is too small: {num_ranks} ranks need at "
                         f"least {need} bytes ({staging_offset} of header and one {record_bytes}-byte "
                         f"record per peer); Config.get_nvl_buffer_size_hint gives a good size")
    return min(rows, 1 << 30)


# ---- chunking and SM split -------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    blocks: int        # grid size (= Config.num_sms)
    send_blocks: int   # blocks that send / push first (then receive)


def dispatch_split(num_sms: int, num_ranks: int) -> Split:
    if num_ranks == 1:
        return Split(num_sms, num_sms)
    return Split(num_sms, min(num_sms, max(1, round(num_sms * DISPATCH_SEND_SHARE))))


def combine_split(num_sms: int, num_ranks: int) -> Split:
    if num_ranks == 1:
        return Split(num_sms, 0)
    return Split(num_sms, min(num_sms, max(1, round(num_sms * COMBINE_PUSH_SHARE))))


def num_chunks(num_sms: int, num_ranks: int) -> int:
    """G, the chunks every rank cuts its tokens into; a function of the config alone, so equal on
    every rank that uses the same Config (the notify kernel checks it)."""
    return max(1, min(MAX_CHUNKS, CHUNKS_PER_SEND_BLOCK * dispatch_split(num_sms, num_ranks).send_blocks))


def tokens_per_chunk(num_tokens: int, chunks: int) -> int:
    return -(-num_tokens // chunks)


# ---- kernel names ----------------------------------------------------------------------------
def notify_kernel(num_ranks: int) -> str:
    return f"epcomm::intranode::notify_kernel<{num_ranks}>"


def dispatch_kernel(num_ranks: int, row_bytes: int, num_scales: int, index_type: str, fresh: bool) -> str:
    return (f"epcomm::intranode::dispatch_kernel<{num_ranks}, {row_bytes // 16}, {num_scales}, "
            f"{index_type}, {'true' if fresh else 'false'}>")


def combine_kernel(num_ranks: int, row_bytes: int) -> str:
    return f"epcomm::intranode::combine_kernel<{num_ranks}, {row_bytes // 16}>"


# ---- size hint -------------------------------------------------------------------------------
def nvl_size_hint(config, hidden_bytes: int, num_ranks: int) -> int:
    """Bytes of NVL buffer for good performance with `config`: the header, the notify area (up to
    1024 local experts) and a ring of HINT_RING_ROWS records per peer, records sized for the worst
    case of `hidden_bytes` (= hidden * max(element size, 2), as DeepEP passes it): FP8 scales and
    32 top-k entries. Fewer bytes still work (the rings are reused), down to one chunk per ring."""
    if num_ranks == 1:
        return combine_staging_offset(1)
    scales = -(-hidden_bytes // 256)   # FP8 rows: hidden_bytes = 2 * H, one scale per 128 channels
    record = max(dispatch_record_bytes(hidden_bytes, scales, MAX_TOPK),
                 combine_record_bytes(hidden_bytes, MAX_TOPK))
    offset = dispatch_staging_offset(num_ranks, 1024)
    return _align(offset + (num_ranks - 1) * HINT_RING_ROWS * record, 128)

