"""A bounded meeting of every rank of a group, through the torch.distributed key-value store.

Buffer.recover needs to know that every rank is alive and has quiesced its device before any rank
clears the communication state. A collective on the group cannot do that: a timed-out NCCL or gloo
collective stays queued (or closes the pairs) and would break the group the caller keeps using, and
it cannot name the rank that did not come. The store can: each rank publishes its arrival under its
own key and polls for the others', with a deadline.

Timeouts make the outcome a single atomic decision (`compare_set` on one key): the first rank that
sees every arrival writes "go", the first that runs out of time writes who it waited for; every rank,
a late one included, follows whichever was written first. So either every rank proceeds or none
does, and a rank arriving after the others gave up raises instead of waiting for them. A meeting may
carry a payload from each rank (the arguments every rank must agree on, epcomm/agreement.py): it is
written with the arrival, and every rank that proceeds reads every rank's.
"""
from __future__ import annotations

import time
from typing import List, Optional

from ..errors import PeerTimeout

_GO = b"go"
_POLL_S = 0.002


def default_store():
    """The store torch.distributed was initialised with (every group's keys live under it)."""
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


class Rendezvous:
    """Meetings of one object's ranks for one purpose (e.g. one Buffer's recoveries): `prefix` must
    be equal on every rank and unique to that object and purpose; each meet() names a new round, in
    the same order on every rank."""

    def __init__(self, store, prefix: str, rank: int, num_ranks: int):
        self.store, self.prefix, self.rank, self.num_ranks = store, prefix, rank, num_ranks
        self.rounds = 0

    def meet(self, op: str, phase: str, timeout_s: float, payload: bytes = b"1") -> List[bytes]:
        """Return every rank's payload (by rank) once every rank has called meet() for this round;
        raise PeerTimeout (naming the rank waited for) on every rank when one did not arrive
        within timeout_s of another."""
        base = f"{self.prefix}/{self.rounds}"
        self.rounds += 1
        store, decision = self.store, f"{base}/decision"
        store.set(f"{base}/rank{self.rank}", payload)
        arrived = store.add(f"{base}/arrived", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            if arrived >= self.num_ranks:
                outcome = store.compare_set(decision, "", _GO)
                break
            if store.check([decision]):
                outcome = store.get(decision)
                break
            if time.monotonic() > deadline:
                missing = self._missing(base)
                verdict = f"{self.rank} {missing[0] if missing else -1}".encode()
                outcome = store.compare_set(decision, "", verdict)
                break
            time.sleep(_POLL_S)
            arrived = store.add(f"{base}/arrived", 0)
        if outcome == _GO:
            keys = [f"{base}/rank{r}" for r in range(self.num_ranks)]
            many = getattr(store, "multi_get", None)   # one round trip (torch >= 2.5), not one per rank
            return [bytes(v) for v in many(keys)] if many else [store.get(k) for k in keys]
        decider, peer = (int(v) for v in outcome.decode().split())
        if decider == self.rank:
            raise PeerTimeout(op, self.rank, peer, phase, timeout_s)
        raise PeerTimeout(op, self.rank, peer, f"{phase}: rank {decider} gave up waiting for rank {peer}",
                          timeout_s)

    def _missing(self, base: str) -> List[int]:
        return [r for r in range(self.num_ranks) if not self.store.check([f"{base}/rank{r}"])]


def group_rendezvous(group, token: str, store: Optional[object] = None) -> Rendezvous:
    """A Rendezvous of `group`'s ranks under key prefix epcomm/<token>; token: equal on every rank
    and unique to the meetings' owner and purpose."""
    import torch.distributed as dist
    return Rendezvous(default_store() if store is None else store, f"epcomm/{token}",
                      dist.get_rank(group), dist.get_world_size(group))
