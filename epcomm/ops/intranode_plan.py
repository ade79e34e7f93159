"""Host-side geometry of the intranode kernels (cuda_src/intranode.cu): Params mirrors, the layout of
the NVL buffer, the chunking, the SM split and the size hint. Pure Python: no torch, no GPU.

NVL buffer of every rank (same offsets everywhere):
  header (signals, see intranode.cu `Header`) | dispatch only: notify area | receive rings
A ring per peer holds `ring_rows` records; a record is one row plus its metadata:
  dispatch: row bytes | scales f32[S] | local top-k i32[K] | weights f32[K] | source index i32
  combine:  row bytes (bf16) | weights f32[K]
each rounded up to 16 bytes.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

THREADS = 512                 # data kernels (kThreads)
NOTIFY_THREADS = 1024         # kNotifyThreads
MAX_CHUNKS = 1024             # kMaxChunks: G never exceeds it
PARTS_PER_CHUNK = 8           # kParts

# Chunks per sending block: more chunks = finer pipelining between the NVLink writes and the
# receivers' copies (and a shorter tail), fewer = less signalling. See bench/NOTES.md "intranode".
CHUNKS_PER_SEND_BLOCK = 8
# Share of the SMs that send (dispatch) / push (combine); every block also receives once its
# sends are done, so the rest only sets how early receiving starts.
DISPATCH_SEND_SHARE = 2 / 3
COMBINE_PUSH_SHARE = 1 / 2
# Ring capacity (rows per peer) the size hint provides: a dispatch of up to this many rows per
# peer is one-shot (no sender ever waits for ring space).
HINT_RING_ROWS = 4096
MAX_TOPK = 32

# ErrorRecord.phase names, in the order of intranode.cu's `Phase`.
PHASES = [
    "peer still busy with its previous intranode kernel",
    "waiting for the peer's token counts",
    "waiting for the peer's rows",
    "waiting for the peer to free receive-ring space",
    "a chunk has more rows than the receive ring (num_nvl_bytes too small)",
    "more rows received than num_worst_tokens",
    "ranks use different chunk counts or expert counts (Config.num_sms or num_experts differ)",
]


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# Profiling builds (EPCOMM_INTRANODE_TRACE=1): per (block, warp) slots of intranode_common.cuh's
# TraceSlot, u64 each; stamps are %globaltimer ns, the *_ns / claims slots are sums.
TRACE_WARPS = 32
TRACE_SLOTS = ["start", "idle", "sent", "first_data", "received", "wait_ns", "signal_ns", "claims",
               "end", "published", "chunks"]

# ---- Params mirrors (static_assert'ed in intranode.cu and by tests/test_intranode_plan.py) ----
_P, _I, _LL, _ULL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong


class NotifyParams(ctypes.Structure):
    _fields_ = [("is_token_in_rank", _P), ("num_tokens_per_expert", _P), ("info", _P),
                ("channel_prefix", _P), ("recv_channel_prefix", _P), ("send_head", _P),
                ("peer_bases", _P), ("err", _P), ("timeout_ns", _ULL), ("notify_offset", _LL),
                ("num_tokens", _I), ("num_chunks", _I), ("tokens_per_chunk", _I),
                ("num_local_experts", _I), ("rank", _I), ("op", _I), ("trace", _P)]


class DispatchParams(ctypes.Structure):
    _fields_ = [("x", _P), ("x_scales", _P), ("topk_idx", _P), ("topk_weights", _P),
                ("rank_prefix", _P), ("channel_prefix", _P), ("recv_channel_prefix", _P),
                ("send_head", _P), ("recv_x", _P), ("recv_x_scales", _P), ("recv_topk_idx", _P),
                ("recv_topk_weights", _P), ("recv_src_idx", _P), ("peer_bases", _P), ("err", _P),
                ("scale_stride_token", _LL), ("scale_stride_group", _LL), ("timeout_ns", _ULL),
                ("staging_offset", _LL), ("ring_rows", _I), ("record_bytes", _I),
                ("num_tokens", _I), ("num_chunks", _I), ("tokens_per_chunk", _I), ("num_topk", _I),
                ("num_local_experts", _I), ("num_out_rows", _I), ("rank", _I),
                ("num_send_blocks", _I), ("op", _I), ("pad_", _I), ("trace", _P)]


class CombineParams(ctypes.Structure):
    _fields_ = [("x", _P), ("topk_weights", _P), ("bias0", _P), ("bias1", _P),
                ("rank_prefix", _P), ("channel_prefix", _P), ("recv_channel_prefix", _P),
                ("send_head", _P), ("combined_x", _P), ("combined_weights", _P),
                ("peer_bases", _P), ("err", _P), ("timeout_ns", _ULL), ("staging_offset", _LL),
                ("ring_rows", _I), ("record_bytes", _I), ("num_tokens", _I), ("num_chunks", _I),
                ("tokens_per_chunk", _I), ("num_topk", _I), ("rank", _I), ("num_send_blocks", _I),
                ("op", _I), ("pad_", _I), ("trace", _P)]


PARAMS = {"NotifyParams": NotifyParams, "DispatchParams": DispatchParams,
          "CombineParams": CombineParams}


# ---- NVL buffer layout -----------------------------------------------------------------------
def header_bytes(num_ranks: int) -> int:
    """Bytes of intranode.cu's Header<R> (mirrored; checked by a static_assert test)."""
    ready = _align(64 + 16 * num_ranks, 128)
    return ready + (4 + 4 + 8) * num_ranks * MAX_CHUNKS


def notify_ints(num_ranks: int, num_local_experts: int) -> int:
    """Ints one source writes into each rank's notify area (the same formula as notify_kernel's
    notify_ints; sized for MAX_CHUNKS so that a rank using another G is read at the right place)."""
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

