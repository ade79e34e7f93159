"""Cross-rank agreement on a call's collective arguments, once per argument set.

GPU low-latency kernels lay out their buffers from (T, H, E, K, the FP8 flags): ranks that differ
would read each other's rows at the wrong places and return wrong results without any wait running
out. The Buffer therefore checks a new argument set across the group once and remembers it; later
calls with the same set cost one set lookup. The CPU backend agrees on every call already
(reference/exchange.py).

The check is a bounded meeting through the torch.distributed store (runtime/rendezvous.py), not a
collective on the group: a rank that does not come (it skips the call, or is stuck) is named on
every rank, and the group the caller keeps using is left as it was. A timed-out collective would
stay queued in the group, so the caller's next collective there would wait behind it for ever.
"""
from __future__ import annotations

from typing import Sequence, Tuple

from .runtime.rendezvous import Rendezvous

PHASE = "agree on the arguments"


def agree(rendezvous: Rendezvous, op: str, names: Sequence[str], values: Tuple[int, ...],
          timeout_s: float) -> None:
    """Raise ValueError on every rank if any rank holds other `values` (ints / bools) for `names`;
    PeerTimeout naming the rank waited for when one does not join within timeout_s."""
    mine = ",".join(str(int(v)) for v in values).encode()
    table = [[int(v) for v in row.decode().split(",")]
             for row in rendezvous.meet(op, PHASE, timeout_s, payload=mine)]
    for i, name in enumerate(names):
        column = [row[i] if i < len(row) else None for row in table]
        if any(v != column[0] for v in column):
            raise ValueError(f"{op}: {name} must be equal on every rank, got {column} (by rank)")
