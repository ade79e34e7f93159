"""A model of the Guard's bounded waits with wait notes (cuda_src/common/timeout.cuh): ranks whose
waits form chains towards one silent rank, kernels starting at different times. It checks the
claim the README makes: when the ranks' kernels start within half the bound of each other, every
rank names the silent rank, whatever the chains; every rank raises within two bounds of its start,
whatever the skew; and without the notes (the old rule) a rank can name a live link of a chain.

Per rank, as the kernel does it: at its start it clears its copies of the peers' notes; after half
the bound of waiting it sends its note (whom it waits for) to every peer; at its deadline (start +
bound) it reads its copy of the note of the peer it waits for: one naming a third rank gives it one
more bound, otherwise it times out naming that peer and reports to every peer; a report that
reaches a rank before its own timeout is what that rank raises (its culprit)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

BOUND = 1.0


@dataclass
class Outcome:
    culprit: int      # the rank this rank's error names
    at: float         # when it raised
    reported: bool    # adopted from a peer's report


def run(waits_for: List[Optional[int]], starts: List[float], notes: bool = True) -> Dict[int, Outcome]:
    """Outcome of every live rank. waits_for[r]: the peer live rank r waits for (None: r is the
    silent rank, never in the call); starts[r]: when r's kernel starts."""
    live = [r for r, w in enumerate(waits_for) if w is not None]
    note_at = {r: starts[r] + BOUND / 2 for r in live}   # a blocked wait reaches half its bound

    def note_seen(reader: int, writer: int, at: float) -> Optional[int]:
        """Writer's note as reader's copy holds it at `at` (cleared at reader's start)."""
        if writer not in note_at or not starts[reader] <= note_at[writer] <= at:
            return None
        return waits_for[writer]

    own = {}   # when each rank's own wait runs out, and whom it names
    for r in live:
        peer, deadline = waits_for[r], starts[r] + BOUND
        theirs = note_seen(r, peer, deadline) if notes else None
        if theirs is not None and theirs not in (r, peer):
            deadline += BOUND
        own[r] = (deadline, peer)
    # Reports travel at once; the first failure of a rank wins.
    outcome: Dict[int, Outcome] = {}
    for t, r in sorted((own[r][0], r) for r in live):
        if r in outcome:
            continue
        outcome[r] = Outcome(own[r][1], t, False)
        for q in live:
            if q not in outcome and own[q][0] > t:
                outcome[q] = Outcome(own[r][1], t, True)
    return outcome


def chains(num_ranks: int, rng: random.Random) -> List[Optional[int]]:
    """Waits of every rank but a silent one: a random forest rooted at the silent rank."""
    order = list(range(num_ranks))
    rng.shuffle(order)
    silent, waits = order[0], [None] * num_ranks
    for i, r in enumerate(order[1:], start=1):
        waits[r] = order[rng.randrange(i)]   # an earlier rank: no cycles, all lead to the silent one
    assert waits[silent] is None
    return waits


@pytest.mark.parametrize("num_ranks", [3, 4, 8, 16, 64])
def test_every_rank_names_the_silent_rank_within_half_a_bound_of_skew(num_ranks):
    rng = random.Random(num_ranks)
    for _ in range(300):
        waits = chains(num_ranks, rng)
        silent = waits.index(None)
        starts = [rng.uniform(0.0, BOUND / 2) for _ in range(num_ranks)]
        for r, got in run(waits, starts).items():
            assert got.culprit == silent, (waits, starts, r, got)
            assert got.at <= starts[r] + 2 * BOUND, (r, got)


@pytest.mark.parametrize("num_ranks", [3, 8, 64])
def test_any_skew_keeps_every_wait_within_two_bounds(num_ranks):
    """Beyond half a bound of skew a rank may name a live link of the chain (the old rule's
    answer), but never waits longer."""
    rng = random.Random(100 + num_ranks)
    for _ in range(300):
        waits = chains(num_ranks, rng)
        starts = [rng.uniform(0.0, 3 * BOUND) for _ in range(num_ranks)]
        for r, got in run(waits, starts).items():
            assert got.at <= starts[r] + 2 * BOUND, (waits, starts, r, got)


def test_a_chain_named_its_first_link_without_the_notes():
    """Rank 2 waits for 1, which waits for the silent 0; rank 2 started first: with the old rule
    its deadline comes first and every rank names rank 1."""
    waits, starts = [None, 0, 1], [0.0, 0.3, 0.0]
    assert {r: o.culprit for r, o in run(waits, starts, notes=False).items()} == {1: 1, 2: 1}
    assert {r: o.culprit for r, o in run(waits, starts).items()} == {1: 0, 2: 0}


def test_a_cycle_of_live_ranks_is_still_bounded():
    """No silent rank: 0 and 1 wait for each other, 2 for 0. Each note names a rank the reader
    is, or waits for, or the cycle is closed by: nobody waits past two bounds."""
    waits, starts = [1, 0, 0], [0.0, 0.1, 0.2]
    for r, got in run(waits, starts).items():
        assert got.at <= starts[r] + 2 * BOUND and got.culprit in (0, 1), (r, got)
