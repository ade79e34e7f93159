"""`Config`: the tuning knobs of one normal-mode (high-throughput) call, the recommended tables for
`Buffer.get_dispatch_config` / `Buffer.get_combine_config`, and the buffer size hints.

This module imports no torch: `Config` is plain data, hashable, so ops modules can key kernel
specialisations on it. The size numbers come from the planning module that owns the buffer layout
(`epcomm.ops.intranode_plan.nvl_size_hint`, `epcomm.ops.internode_plan.rdma_size_hint` and
`nvl_size_hint`: pure formulas, no GPU launch code).
"""
from __future__ import annotations

import functools
import operator
from typing import Dict, Tuple

from .ops import internode_plan, intranode_plan

# DeepEP's convention: a hint for more ranks than this assumes ranks spread over several NVLink
# domains (internode mode); up to this many, the RDMA buffer is not used by normal-mode calls.
NVLINK_DOMAIN_RANKS = 8
BUFFER_ALIGNMENT_BYTES = 128   # Buffer sizes are multiples of this

# Chunk sizes per rank count: (nvl send, nvl recv, rdma send, rdma recv) in tokens: DeepEP V1's
# recommended values, returned and validated so DeepEP code runs unchanged. epcomm's intranode
# kernels do not read them: they cut work from Config.num_sms (epcomm/ops/intranode_plan.py), and
# the bench sweeps that; the internode kernels size their rings by them (internode_plan.Rings). A rank count absent from a table takes the entry of the next larger count
# listed (the largest entry beyond the table), so every R >= 1 has a config.
DISPATCH_CHUNKS: Dict[int, Tuple[int, int, int, int]] = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    128: (20, 560, 12, 128),
    160: (28, 720, 12, 128),
}
COMBINE_CHUNKS: Dict[int, Tuple[int, int, int, int]] = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    128: (1, 560, 8, 128),
    160: (2, 720, 8, 128),
}


def align_buffer_bytes(nbytes: int) -> int:
    """Round a hint up to a valid Buffer size (a multiple of 128 bytes, as DeepEP's hints are)."""
    return -(-nbytes // BUFFER_ALIGNMENT_BYTES) * BUFFER_ALIGNMENT_BYTES


def _positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value <= 0:
        raise ValueError(f"{owner}: {name} must be > 0, got {value}")
    return value


class Config:
    """Tuning of one normal-mode dispatch / combine.

    Arguments:
        num_sms: SMs the call may occupy; even (DeepEP's channels pair a sending and a receiving SM).
        num_max_nvl_chunked_send_tokens: tokens a sender moves per NVLink chunk; < the recv count.
        num_max_nvl_chunked_recv_tokens: tokens of the NVLink receive queue of one channel.
        num_max_rdma_chunked_send_tokens: tokens per RDMA chunk (internode); at most half the queue.
        num_max_rdma_chunked_recv_tokens: tokens of the RDMA receive queue of one channel, rounded up
            to a multiple of the send chunk (as DeepEP does).
    The kernels may interpret the chunk fields their own way, but every value is validated here.
    """

    __slots__ = ("_fields",)

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        num_sms = _positive_int("Config", "num_sms", num_sms)
        if num_sms % 2:
            raise ValueError(f"Config: num_sms must be even, got {num_sms}")
        nvl_send = _positive_int("Config", "num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens)
        nvl_recv = _positive_int("Config", "num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens)
        if nvl_send >= nvl_recv:
            raise ValueError(f"Config: num_max_nvl_chunked_send_tokens ({nvl_send}) must be < "
                             f"num_max_nvl_chunked_recv_tokens ({nvl_recv})")
        rdma_send = _positive_int("Config", "num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens)
        rdma_recv = _positive_int("Config", "num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        # The sender must always find room for a whole chunk while the receiver holds the other half.
        if rdma_send > rdma_recv // 2:
            raise ValueError(f"Config: num_max_rdma_chunked_send_tokens ({rdma_send}) must be <= half of "
                             f"num_max_rdma_chunked_recv_tokens ({rdma_recv}, rounded up to a multiple "
                             f"of the send chunk)")
        self._fields = (num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)

    num_sms = property(lambda self: self._fields[0])
    num_max_nvl_chunked_send_tokens = property(lambda self: self._fields[1])
    num_max_nvl_chunked_recv_tokens = property(lambda self: self._fields[2])
    num_max_rdma_chunked_send_tokens = property(lambda self: self._fields[3])
    num_max_rdma_chunked_recv_tokens = property(lambda self: self._fields[4])

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of `num_nvl_bytes` that normal-mode calls with this config need for tokens of
        `hidden_bytes` bytes (hidden * element size, scales not included) over `num_ranks` ranks:
        the intranode rings up to NVLINK_DOMAIN_RANKS ranks, internode combine's push FIFOs beyond."""
        hidden_bytes = _positive_int("Config.get_nvl_buffer_size_hint", "hidden_bytes", hidden_bytes)
        num_ranks = _positive_int("Config.get_nvl_buffer_size_hint", "num_ranks", num_ranks)
        if num_ranks > NVLINK_DOMAIN_RANKS:
            return align_buffer_bytes(int(internode_plan.nvl_size_hint(self, hidden_bytes, num_ranks)))
        return align_buffer_bytes(int(intranode_plan.nvl_size_hint(self, hidden_bytes, num_ranks)))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of `num_rdma_bytes` that internode normal-mode calls need; 0 for at most
        NVLINK_DOMAIN_RANKS ranks (one NVLink domain: the RDMA buffer is unused), as in DeepEP."""
        hidden_bytes = _positive_int("Config.get_rdma_buffer_size_hint", "hidden_bytes", hidden_bytes)
        num_ranks = _positive_int("Config.get_rdma_buffer_size_hint", "num_ranks", num_ranks)
        if num_ranks <= NVLINK_DOMAIN_RANKS:
            return 0
        return align_buffer_bytes(int(internode_plan.rdma_size_hint(self, hidden_bytes, num_ranks)))

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and self._fields == other._fields

    def __hash__(self) -> int:
        return hash(self._fields)

    def __repr__(self) -> str:
        return ("Config(num_sms={}, num_max_nvl_chunked_send_tokens={}, num_max_nvl_chunked_recv_tokens={}, "
                "num_max_rdma_chunked_send_tokens={}, num_max_rdma_chunked_recv_tokens={})".format(*self._fields))


_TABLES = {"dispatch": DISPATCH_CHUNKS, "combine": COMBINE_CHUNKS}


def recommended(kind: str, num_ranks: int, num_sms: int) -> Config:
    """The Config of table `kind` ("dispatch" or "combine") for `num_ranks` ranks using `num_sms` SMs."""
    num_ranks = _positive_int("Buffer.get_dispatch_config/get_combine_config", "num_ranks", num_ranks)
    return _table_config(kind, num_ranks, num_sms)


@functools.lru_cache(maxsize=None)
def _table_config(kind: str, num_ranks: int, num_sms: int) -> Config:
    # Memoised: every dispatch / combine without a config looks its default up, building and
    # validating a Config cost ~5 us of host time per call, and a Config is immutable.
    table = _TABLES[kind]
    listed = sorted(table)
    key = next((r for r in listed if r >= num_ranks), listed[-1])
    return Config(num_sms, *table[key])
