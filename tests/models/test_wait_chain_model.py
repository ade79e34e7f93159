"""A model of the Guard's bounded waits with wait notes (cuda_src/common/timeout.cuh): ranks whose
waits lead to one silent rank, kernels starting at different times. It checks the claims the
README makes: when the ranks' kernels start within half the bound of each other, every rank names
the silent rank, however the waits are tangled; every rank raises within two bounds of its start,
whatever the skew; and without the notes, or with a rule that lets a note naming the reader end
its wait at once, a rank can name a live rank.

Per rank, as the kernel does it: at its start it clears its copies of the peers' notes; its waits
(several at once: one warp per peer or ring) run from its start; after half the bound its first
long wait's peer is its note, sent to every peer; at its deadline (start + bound) each wait reads
its copy of the note of the peer it waits for: under the rule the kernel uses ("any"), any note
gives that wait one more bound; under the rule it replaced ("third"), only a note naming neither
the reader nor the peer itself does. A rank fails at its first wait that runs out, naming that
wait's peer, and reports to every peer; a report that reaches a rank before its own failure is
what that rank raises (its culprit)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import pytest

BOUND = 1.0


@dataclass
class Outcome:
    culprit: int      # the rank this rank's error names
    at: float         # when it raised
    reported: bool    # adopted from a peer's report


def run(waits: List[Sequence[int]], starts: List[float], rule: Optional[str] = "any",
        first: Optional[List[Optional[int]]] = None) -> Dict[int, Outcome]:
    """Outcome of every live rank. waits[r]: the peers live rank r waits for (empty: r is the
    silent rank, never in the call); starts[r]: when r's kernel starts; rule: "any", "third" or
    None (no notes); first[r]: the peer of r's note (default: waits[r][0])."""
    live = [r for r, w in enumerate(waits) if w]
    note_of = {r: (first[r] if first and first[r] is not None else waits[r][0]) for r in live}
    note_at = {r: starts[r] + BOUND / 2 for r in live}

    def note_seen(reader: int, writer: int, at: float) -> Optional[int]:
        """Writer's note as reader's copy holds it at `at` (cleared at reader's start)."""
        if writer not in note_at or not starts[reader] <= note_at[writer] <= at:
            return None
        return note_of[writer]

    def extended(reader: int, peer: int, deadline: float) -> bool:
        theirs = note_seen(reader, peer, deadline) if rule else None
        if theirs is None:
            return False
        return rule == "any" or theirs not in (reader, peer)

    own = {}   # when each rank's first wait runs out, and whom it names
    for r in live:
        deadline = starts[r] + BOUND
        own[r] = min((deadline + (BOUND if extended(r, p, deadline) else 0.0), p) for p in waits[r])
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


def tangle(num_ranks: int, rng: random.Random) -> List[Sequence[int]]:
    """Waits of every rank but a silent one: a random forest rooted at the silent rank (so every
    wait leads to it), plus up to two more waits per rank on any other ranks (cycles included:
    flow control makes them, a receiver waiting for rows whose sender waits for its room)."""
    order = list(range(num_ranks))
    rng.shuffle(order)
    silent, waits = order[0], [[] for _ in range(num_ranks)]
    for i, r in enumerate(order[1:], start=1):
        waits[r].append(order[rng.randrange(i)])
        others = [q for q in range(num_ranks) if q not in (r, waits[r][0])]
        waits[r] += rng.sample(others, min(len(others), rng.randrange(3)))
        rng.shuffle(waits[r])   # which of them is the first long wait (the note) is a race
    assert not waits[silent]
    return waits


@pytest.mark.parametrize("num_ranks", [3, 4, 8, 16, 64])
def test_every_rank_names_the_silent_rank_within_half_a_bound_of_skew(num_ranks):
    rng = random.Random(num_ranks)
    for _ in range(300):
        waits = tangle(num_ranks, rng)
        silent = waits.index([])
        starts = [rng.uniform(0.0, BOUND / 2) for _ in range(num_ranks)]
        for r, got in run(waits, starts).items():
            assert got.culprit == silent, (waits, starts, r, got)
            assert got.at <= starts[r] + 2 * BOUND, (r, got)


@pytest.mark.parametrize("num_ranks", [3, 8, 64])
def test_any_skew_keeps_every_wait_within_two_bounds(num_ranks):
    """Beyond half a bound of skew a rank may name a live rank, but never waits longer."""
    rng = random.Random(100 + num_ranks)
    for _ in range(300):
        waits = tangle(num_ranks, rng)
        starts = [rng.uniform(0.0, 3 * BOUND) for _ in range(num_ranks)]
        for r, got in run(waits, starts).items():
            assert got.at <= starts[r] + 2 * BOUND, (waits, starts, r, got)


def test_a_chain_named_its_first_link_without_the_notes():
    """Rank 2 waits for 1, which waits for the silent 0; rank 2 started first: without notes its
    deadline comes first and every rank names rank 1."""
    waits, starts = [[], [0], [1]], [0.0, 0.3, 0.0]
    assert {r: o.culprit for r, o in run(waits, starts, rule=None).items()} == {1: 1, 2: 1}
    assert {r: o.culprit for r, o in run(waits, starts).items()} == {1: 0, 2: 0}


def test_a_wait_that_looks_circular_is_given_its_second_bound():
    """Rank 2's receiver waits for rank 1's rows; rank 1 waits for the silent 0 and for room in
    rank 2's ring, and its note names rank 2. Had a note naming the reader ended the wait at once
    (the "third" rule), rank 2, starting first, would name rank 1 on every rank."""
    waits, starts = [[], [2, 0], [1]], [0.0, 0.1, 0.0]
    assert {r: o.culprit for r, o in run(waits, starts, rule="third").items()} == {1: 1, 2: 1}
    assert {r: o.culprit for r, o in run(waits, starts).items()} == {1: 0, 2: 0}


def test_a_cycle_of_live_ranks_is_still_bounded():
    """No silent rank: 0 and 1 wait for each other, 2 for 0: nobody waits past two bounds, and
    whoever is named is in the cycle."""
    waits, starts = [[1], [0], [0]], [0.0, 0.1, 0.2]
    for r, got in run(waits, starts).items():
        assert got.at <= starts[r] + 2 * BOUND and got.culprit in (0, 1), (r, got)
