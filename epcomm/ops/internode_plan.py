"""Host-side geometry of the internode kernels (cuda_src/internode.cu): the Params structs and
constants (read from cuda_src/internode_protocol.cuh), the rings of the RDMA and NVL buffers, the
channels and the size hints. Pure Python: no torch, no GPU.

A call streams through rings of fixed size: G = Config.num_sms / 2 channels (two blocks each), and
per channel one ring per node pair and one FIFO per local rank pair, sized by the Config's chunk
fields; no size depends on the number of tokens N.

RDMA buffer of every rank (same offsets everywhere):
  header (internode_protocol.cuh `Header`: every polled word) | data region
The data region is laid out per kernel (a kernel only writes it once every rank finished the
previous internode kernel, so the layouts overlap):
  notify:   received count rows [R][notify_ints] i32 | outgoing count rows [R][notify_ints] i32
            (every field at an offset that depends on R alone, so ranks that disagree on G, E_l or
            the record format still read each other's header fields and are caught)
  dispatch: record rings [source node][G][ring] | staging rings [destination node][G][stage]
            record = row bytes | scales f32[S] | expert ids i32[K] | weights f32[K] | source i32 |
                     row on each local rank i32[L], rounded up to 16 bytes
            ring = num_max_rdma_chunked_recv_tokens, stage = min(ring, 2 * send chunk)
  combine:  partial rings [reducing node][G][ring] | staging rings [source node][G][stage]
            (partial = fp32 row | weights f32[MAX_TOPK] | K i32; ring = half the dispatch ring,
            as a partial is twice a BF16 row) | push FIFOs when the NVL buffer cannot hold them
NVL buffer (combine): push FIFOs [G][L pushers][push_ring], push_ring =
num_max_nvl_chunked_recv_tokens, entry = bf16 row | weights f32[MAX_TOPK] | K i32 | pad | u64 tag.
"""
from __future__ import annotations

from ..runtime import cuda_decls

_DECLS = cuda_decls.header("internode_protocol.cuh")
THREADS = _DECLS.constant("kThreads")
NOTIFY_THREADS = _DECLS.constant("kNotifyThreads")
MAX_CHANNELS = _DECLS.constant("kMaxChannels")             # channels the header has words for
MAX_TOPK = _DECLS.constant("kMaxTopk")                     # combine's rows hold this many weights whatever K is
MAX_LOCAL_EXPERTS = _DECLS.constant("kMaxLocalExperts")    # expert counts per notify row
NOTIFY_HEAD = _DECLS.constant("kNotifyHead")               # header ints of a notify row
BLOCKS_PER_CHANNEL = 2                                     # data kernels: a sending and a receiving block
# Ranks per node the size hints assume for more than this many ranks (DeepEP's NVLink domain).
HINT_LOCAL_RANKS = 8

# ErrorRecord.phase names: the comments of internode_protocol.cuh's `Phase`.
PHASES = _DECLS.enum_comments("Phase")

# Profiling builds (EPCOMM_INTERNODE_TRACE=1): per (block, warp) slots of internode_protocol.cuh's
# TraceSlot, u64 each: %globaltimer ns, except the *_chunks / *_rounds slots (counts). Per role,
# its first and last chunk completed (the enum's comments say what completes a chunk).
TRACE_WARPS = _DECLS.constant("kTraceWarps")
TRACE_SLOTS = _DECLS.enum_names("TraceSlot", "kTr")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# ---- Params (declared in internode_protocol.cuh) ---------------------------------------------
PARAMS = {name: _DECLS.struct(name) for name in ("NotifyParams", "DispatchParams", "CombineParams")}
NotifyParams, DispatchParams, CombineParams = PARAMS.values()


# ---- channels and rings ----------------------------------------------------------------------
def num_channels(num_sms: int) -> int:
    """G, the channels of every call (a function of the config alone: equal on every rank that uses
    the same Config; the notify kernel checks it)."""
    return max(1, num_sms // BLOCKS_PER_CHANNEL)


def check_channels(what: str, num_sms: int) -> None:
    if num_channels(num_sms) > MAX_CHANNELS:
        raise ValueError(f"{what}: Config.num_sms={num_sms} gives {num_channels(num_sms)} channels; internode "
                         f"mode supports up to {MAX_CHANNELS} ({BLOCKS_PER_CHANNEL * MAX_CHANNELS} SMs)")


def tokens_per_channel(num_tokens: int, channels: int) -> int:
    return max(1, -(-num_tokens // channels))


class Rings:
    """Tokens per ring, per staging ring and per transfer of one kernel, from the Config."""
    __slots__ = ("ring", "stage", "chunk")

    def __init__(self, ring: int, chunk: int):
        self.ring, self.chunk = ring, min(chunk, ring)
        # A staged record's slot is free once the receiver consumed it (it has landed): two
        # transfers in flight per stream keep the link busy; more would only cost memory.
        self.stage = min(ring, 2 * self.chunk)

    def __repr__(self):
        return f"Rings(ring={self.ring}, stage={self.stage}, chunk={self.chunk})"


def dispatch_rings(rdma_recv: int, rdma_send: int) -> Rings:
    """From Config.num_max_rdma_chunked_recv_tokens / _send_tokens."""
    return Rings(rdma_recv, rdma_send)


def combine_rings(rdma_recv: int, rdma_send: int) -> Rings:
    """Partial sums are fp32, twice a BF16 record: half the tokens per ring, the same bytes."""
    return Rings(max(rdma_send, rdma_recv // 2), rdma_send)


def push_rings(nvl_recv: int, nvl_send: int) -> Rings:
    """From Config.num_max_nvl_chunked_recv_tokens / _send_tokens."""
    return Rings(nvl_recv, nvl_send)


def _config_rings(config):
    rdma = (config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
    return (dispatch_rings(*rdma), combine_rings(*rdma),
            push_rings(config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens))


# ---- RDMA / NVL buffer layouts ---------------------------------------------------------------
def header_bytes(num_ranks: int, num_nodes: int) -> int:
    """Bytes of internode_protocol.cuh's Header<R, M>."""
    return _DECLS.member("Header", "kBytes", kRanks=num_ranks, kNodes=num_nodes)


def notify_ints(num_ranks: int) -> int:
    """Ints of one count row (notify_kernel): sized for MAX_CHANNELS channels and MAX_LOCAL_EXPERTS
    experts, so its fields sit where every rank looks for them whatever G and E_l it uses."""
    return _align(NOTIFY_HEAD + num_ranks + MAX_CHANNELS + 1 + MAX_LOCAL_EXPERTS, 4)


def notify_offsets(num_ranks: int, num_nodes: int):
    """(area offset, stage offset, end) of notify's count rows."""
    area = header_bytes(num_ranks, num_nodes)
    rows = num_ranks * notify_ints(num_ranks) * 4
    return area, area + rows, area + 2 * rows


def dispatch_record_bytes(row_bytes: int, num_scales: int, num_topk: int, num_local_ranks: int) -> int:
    return _align(row_bytes + 4 * num_scales + 8 * num_topk + 4 + 4 * num_local_ranks, 16)


def combine_push_bytes(row_bytes: int) -> int:
    """bf16 row | weights f32[MAX_TOPK] | K i32 | pad | u64 tag (row_bytes is a multiple of 16)."""
    return _align(row_bytes + 4 * MAX_TOPK + 16, 16)


def combine_partial_bytes(row_bytes: int) -> int:
    """fp32 row | weights f32[MAX_TOPK] | K i32."""
    return _align(2 * row_bytes + 4 * MAX_TOPK + 4, 16)


class DispatchLayout:
    """Offsets of dispatch's rings for one (topology, record size, channels, rings)."""

    def __init__(self, num_ranks: int, num_local_ranks: int, record_bytes: int, channels: int, rings: Rings):
        num_nodes = num_ranks // num_local_ranks
        self.record_bytes, self.channels, self.rings = record_bytes, channels, rings
        self.recv_offset = header_bytes(num_ranks, num_nodes)
        self.stage_offset = self.recv_offset + num_nodes * channels * rings.ring * record_bytes
        self.end = self.stage_offset + num_nodes * channels * rings.stage * record_bytes


class CombineLayout:
    """Offsets of combine's rings and push FIFOs. The FIFOs go to the NVL buffer when it holds them
    (`push_in_nvl`), else after the rings in the RDMA buffer."""

    def __init__(self, num_ranks: int, num_local_ranks: int, row_bytes: int, channels: int, rings: Rings,
                 pushes: Rings, nvl_bytes: int):
        num_nodes = num_ranks // num_local_ranks
        self.channels, self.rings, self.pushes = channels, rings, pushes
        self.push_bytes = combine_push_bytes(row_bytes)
        self.partial_bytes = combine_partial_bytes(row_bytes)
        self.partial_recv_offset = header_bytes(num_ranks, num_nodes)
        self.partial_stage_offset = self.partial_recv_offset + num_nodes * channels * rings.ring * self.partial_bytes
        rings_end = self.partial_stage_offset + num_nodes * channels * rings.stage * self.partial_bytes
        self.fifo_bytes = channels * num_local_ranks * pushes.ring * self.push_bytes
        self.push_in_nvl = self.fifo_bytes <= nvl_bytes
        self.push_offset = 0 if self.push_in_nvl else _align(rings_end, 256)
        self.end = rings_end if self.push_in_nvl else self.push_offset + self.fifo_bytes


def check_fits(what: str, end: int, rdma_bytes: int, detail: str) -> None:
    """ValueError when a layout does not fit num_rdma_bytes (a function of the Config, the token
    format and the Buffer alone: every rank with the same arguments raises alike)."""
    if end > rdma_bytes:
        raise ValueError(f"{what}: num_rdma_bytes={rdma_bytes} is smaller than the {end} bytes {detail} need "
                         f"(Config.get_rdma_buffer_size_hint; or fewer SMs / smaller num_max_*_chunked_* "
                         f"tokens in the Config)")


# ---- kernel names ----------------------------------------------------------------------------
def notify_kernel(num_ranks: int, num_local_ranks: int) -> str:
    return f"epcomm::internode::notify_kernel<{num_ranks}, {num_local_ranks}>"


def dispatch_kernel(num_ranks: int, num_local_ranks: int, row_bytes: int, num_scales: int,
                    index_type: str, fresh: bool) -> str:
    return (f"epcomm::internode::dispatch_kernel<{num_ranks}, {num_local_ranks}, {row_bytes // 16}, "
            f"{num_scales}, {index_type}, {'true' if fresh else 'false'}>")


def combine_kernel(num_ranks: int, num_local_ranks: int, row_bytes: int) -> str:
    return f"epcomm::internode::combine_kernel<{num_ranks}, {num_local_ranks}, {row_bytes // 16}>"


# ---- size hints ------------------------------------------------------------------------------
def hint_local_ranks(num_ranks: int) -> int:
    """Ranks per node the hints assume: DeepEP's 8 per NVLink domain when they divide the ranks."""
    return HINT_LOCAL_RANKS if num_ranks % HINT_LOCAL_RANKS == 0 else 1


def rdma_bytes_needed(config, row_bytes: int, num_scales: int, num_topk: int, num_ranks: int,
                      num_local_ranks: int) -> int:
    """Smallest num_rdma_bytes for dispatch rows of `row_bytes` bytes (BF16 or FP8 with
    `num_scales` scales) and combine rows of `row_bytes` BF16 bytes, with the push FIFOs in the NVL
    buffer; also covers notify's count rows. Independent of the number of tokens."""
    channels, num_nodes = num_channels(config.num_sms), num_ranks // num_local_ranks
    record = dispatch_record_bytes(row_bytes, num_scales, num_topk, num_local_ranks)
    dispatch_rings_, combine_rings_, push_rings_ = _config_rings(config)
    dispatch = DispatchLayout(num_ranks, num_local_ranks, record, channels, dispatch_rings_).end
    combine = CombineLayout(num_ranks, num_local_ranks, row_bytes, channels, combine_rings_, push_rings_,
                            1 << 62).end
    notify = notify_offsets(num_ranks, num_nodes)[2]
    return _align(max(dispatch, combine, notify), 128)


def rdma_bytes_for(configs, row_bytes: int, num_scales: int, num_topk: int, num_ranks: int,
                   num_local_ranks: int, nvl_bytes: int) -> int:
    """num_rdma_bytes that calls with each Config of `configs` need next to an NVL buffer of
    `nvl_bytes` (combine's push FIFOs move into the RDMA buffer when the NVL buffer cannot hold
    them)."""
    need = 0
    for config in configs:
        rdma = (config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
        pushes = push_rings(config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens)
        combine = CombineLayout(num_ranks, num_local_ranks, row_bytes, num_channels(config.num_sms),
                                combine_rings(*rdma), pushes, nvl_bytes).end
        need = max(need, combine, rdma_bytes_needed(config, row_bytes, num_scales, num_topk, num_ranks,
                                                    num_local_ranks))
    return _align(need, 128)


def rdma_size_hint(config, hidden_bytes: int, num_ranks: int) -> int:
    """num_rdma_bytes for rows of `hidden_bytes` (= hidden * max(element size, 2), as DeepEP passes
    it), FP8 scales and MAX_TOPK top-k entries, on nodes of hint_local_ranks(num_ranks) ranks."""
    scales = -(-hidden_bytes // 256)   # FP8 rows: hidden_bytes = 2 * H, one scale per 128 channels
    return rdma_bytes_needed(config, hidden_bytes, scales, MAX_TOPK, num_ranks, hint_local_ranks(num_ranks))


def nvl_size_hint(config, hidden_bytes: int, num_ranks: int) -> int:
    """num_nvl_bytes internode combine uses: the push FIFOs of nodes of hint_local_ranks ranks."""
    local = hint_local_ranks(num_ranks)
    _, combine_rings_, push_rings_ = _config_rings(config)
    layout = CombineLayout(num_ranks, local, hidden_bytes, num_channels(config.num_sms), combine_rings_,
                           push_rings_, 1 << 62)
    return _align(layout.fifo_bytes, 128)
