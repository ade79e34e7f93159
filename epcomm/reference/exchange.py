"""Collectives of the CPU backend over a gloo group, every wait bounded by EPCOMM_TIMEOUT_S.

Each gather is point-to-point (isend / irecv with every peer): sizes first, then the bytes, so any
dtype (bf16, fp8, bool, int64) goes through gloo and ranks may hold different row counts. Waiting
on each peer's message separately is what lets a timeout name the peer that did not come.

Every collective call of the backend is framed by two small rounds:
  * agree: each rank sends (op, the arguments that must match on every rank, its own rejection of
    its input or None). A rejection or a mismatch raises on every rank before any data moves.
  * settle: after computing, each rank sends its outcome, so an error that depends on other ranks'
    data (found by the receiving rank only) raises on every rank, before any rank changes state.
After a wait runs out (or gloo drops a peer), the Exchange is broken: the pairs gloo closed cannot
be trusted, so every later call raises BufferUnusable.
"""
from __future__ import annotations

import datetime
import math
import pickle
import time
import zlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

CPU = torch.device("cpu")   # named: frameworks set other default devices

from ..errors import BufferUnusable, PeerFailed, PeerTimeout

# gloo matches point-to-point messages by (peer, tag): a tag of its own keeps these apart from any
# send / recv the user makes on the same group.
_TAG = 0x45504


class Exchange:
    def __init__(self, group, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) for r in range(self.num_ranks)]
        self.broken: Optional[Exception] = None
        self.calls_joined = 0   # agree rounds entered; Buffer reads it to know whether to reject()

    # ---- framing rounds -------------------------------------------------------------------------
    def agree(self, op: str, facts: Sequence, error: Optional[BaseException] = None) -> None:
        """Round 1 of a collective call. facts: (name, value) pairs every rank must hold equal."""
        self.require_usable(op)
        self.calls_joined += 1
        mine = (op, tuple(facts), None if error is None else f"{type(error).__name__}: {error}")
        everyone = self.gather_objects(mine, op, "agree on the call")
        if error is not None:
            return   # the caller re-raises its own error
        self._raise_peer_error(op, [e[2] for e in everyone])
        ops = [e[0] for e in everyone]
        if len(set(ops)) != 1:
            raise ValueError(f"{op}: the ranks are in different calls: {ops} (by rank); every rank "
                             f"must make the same collective calls in the same order")
        for i, (name, _) in enumerate(facts):
            values = [e[1][i][1] if i < len(e[1]) else None for e in everyone]
            if any(v != values[0] for v in values):
                raise ValueError(f"{op}: {name} must be equal on every rank, got {values} (by rank)")

    def reject(self, op: str, error: BaseException) -> None:
        """This rank rejected its input before joining the call: tell the peers waiting in agree()."""
        if self.broken is None:
            self.agree(op, (), error)

    def settle(self, op: str, error: Optional[BaseException]) -> None:
        """Round 2: raise on every rank if the call failed on any (this rank's own error first)."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        outcomes = self.gather_objects(mine, op, "settle the outcome")
        if error is not None:
            raise error
        self._raise_peer_error(op, outcomes)

    def _raise_peer_error(self, op: str, messages: List[Optional[str]]) -> None:
        for peer, message in enumerate(messages):
            if message is not None:
                raise PeerFailed(op, self.rank, peer, message)

    # ---- gathers --------------------------------------------------------------------------------
    def gather_objects(self, obj, op: str, phase: str) -> list:
        """Every rank's picklable `obj`, indexed by rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        return [pickle.loads(b.numpy().tobytes()) for b in self.gather_bytes(data, op, phase)]

    def gather_rows(self, tensor: torch.Tensor, op: str, what: str) -> List[torch.Tensor]:
        """Every rank's `tensor` [rows, *trailing] by rank. Ranks may differ in rows; dtype and
        trailing shape must agree (checked through the row size in bytes)."""
        rows, trailing = tensor.shape[0], tuple(tensor.shape[1:])
        row_bytes = math.prod(trailing) * tensor.element_size()
        counts, widths = self._sizes((rows, row_bytes), op, f"gather {what}")
        if any(w != row_bytes for w in widths):
            raise ValueError(f"{op}: ranks disagree on the row size of {what}: {list(widths)} bytes "
                             f"per row (by rank)")
        data = tensor.contiguous().view(torch.uint8).reshape(-1) if row_bytes else \
            torch.empty(0, dtype=torch.uint8, device=CPU)
        received = self._swap(data, [c * row_bytes for c in counts], op, f"gather {what}")
        return [r.view(tensor.dtype).reshape(c, *trailing) if row_bytes else
                torch.empty((c, *trailing), dtype=tensor.dtype, device=CPU) for r, c in zip(received, counts)]

    def gather_optional(self, tensor: Optional[torch.Tensor], op: str, what: str
                        ) -> Optional[List[torch.Tensor]]:
        """gather_rows, or None when the tensor is absent (agree() made it absent on every rank)."""
        return None if tensor is None else self.gather_rows(tensor, op, what)

    def gather_bytes(self, data: torch.Tensor, op: str, phase: str) -> List[torch.Tensor]:
        """Every rank's 1-D uint8 `data` (sizes may differ), by rank."""
        (sizes,) = self._sizes((data.numel(),), op, phase)
        return self._swap(data, list(sizes), op, phase)

    def _sizes(self, values: tuple, op: str, phase: str) -> List[tuple]:
        """Every rank's small int tuple `values`, transposed (one tuple per field, by rank). The
        header carries the phase's checksum: ranks out of step (one skipped a message) raise here
        rather than read each other's bytes as something else."""
        tag = zlib.crc32(phase.encode())   # not the op: agree() names ranks in different calls
        header = torch.tensor([tag, *values], dtype=torch.int64, device=CPU).view(torch.uint8)
        headers = [h.view(torch.int64).tolist() for h in
                   self._swap(header, [header.numel()] * self.num_ranks, op, f"{phase} (sizes)")]
        if any(h[0] != tag for h in headers):
            error = BufferUnusable(f"{op}: the ranks are out of step at {phase!r}: some rank is in a "
                                   f"different call or phase")
            self.broken = error
            raise error
        return list(zip(*(h[1:] for h in headers)))

    def barrier(self, op: str) -> None:
        self._swap(torch.zeros(1, dtype=torch.uint8, device=CPU), [1] * self.num_ranks, op, "barrier")

    # ---- point to point -------------------------------------------------------------------------
    def _swap(self, data: torch.Tensor, recv_sizes: List[int], op: str, phase: str
              ) -> List[torch.Tensor]:
        """Send `data` to every peer and receive recv_sizes[p] bytes from each peer p. Empty
        messages are skipped on both sides (both know the size)."""
        self.require_usable(op)
        deadline = time.monotonic() + self.timeout_s
        group = self.group
        received: List[torch.Tensor] = [torch.empty(0, dtype=torch.uint8, device=CPU)] * self.num_ranks
        received[self.rank] = data.clone()   # results built from it must not alias the caller's input
        recvs, sends = [], []
        for peer in range(self.num_ranks):
            if peer == self.rank:
                continue
            if recv_sizes[peer]:
                received[peer] = torch.empty(recv_sizes[peer], dtype=torch.uint8, device=CPU)
                recvs.append((peer, dist.irecv(received[peer], self._global[peer], group=group, tag=_TAG)))
            if data.numel():
                sends.append((peer, dist.isend(data, self._global[peer], group=group, tag=_TAG)))
        for peer, work in recvs + sends:
            self._wait(work, peer, deadline, op, phase)
        return received

    def _wait(self, work, peer: int, deadline: float, op: str, phase: str) -> None:
        remaining = max(deadline - time.monotonic(), 1e-3)
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=remaining))
        except RuntimeError as e:   # gloo: the wait ran out, or the peer's connection was closed
            self._fail(PeerTimeout(op, self.rank, peer, phase, self.timeout_s), e)
        if done is False:
            self._fail(PeerTimeout(op, self.rank, peer, phase, self.timeout_s), None)

    def _fail(self, error: PeerTimeout, cause: Optional[BaseException]):
        self.broken = error
        raise error from cause

    def require_usable(self, op: str) -> None:
        if self.broken is not None:
            raise BufferUnusable(f"{op}: the Buffer is unusable after an earlier failure: "
                                 f"{self.broken}") from self.broken
