"""What the GPU tests derive on the host (tests/topology.py), checked without a GPU: the token
profiles of every rank count, the memory each internode case needs and the skip reason, when the
SM-holding tests can run, and the exact round-trip expectation (helpers round_trip_want) against
oracle.combine fed with every rank's received rows."""
from __future__ import annotations

import pytest
import torch

from epcomm.reference import oracle
from tests import topology
from tests.helpers.gpu import make_inputs, round_trip_want, row_diff

GIB = 1 << 30


@pytest.mark.parametrize("ranks", [2, 3, 4, 8, 16])
def test_token_profiles_cover_every_rank(ranks):
    by_profile = {p: topology.tokens_by_rank(p, ranks) for p in topology.TOKEN_PROFILES}
    assert all(len(ns) == ranks for ns in by_profile.values())
    assert by_profile["zero_on_one"].count(0) == 1 and max(by_profile["zero_on_one"]) > 0
    assert set(by_profile["one"]) == {1}
    assert set(by_profile["n4096"]) == {4096} and set(by_profile["n16384"]) == {16384}
    differing = by_profile["differing"]
    assert len(set(differing)) == min(ranks, 4) and differing[0] == 1 and differing[1] == 4096
    assert (16384 in differing) == (ranks >= 3)


def test_unknown_token_profile_raises():
    with pytest.raises(ValueError, match="unknown token profile 'n8192'"):
        topology.tokens_by_rank("n8192", 4)


def test_round_trip_bytes_count_every_received_row():
    hidden = 7168
    fp8_row = hidden + 4 * (hidden // 128)
    # BF16: own rows in, every rank's rows received, own rows combined back.
    assert topology.round_trip_device_bytes((10, 20), hidden, False) == 20 * 2 * hidden + 30 * 2 * hidden + 20 * 2 * hidden
    assert topology.round_trip_device_bytes((10, 20), hidden, True) == \
        20 * (2 * hidden + fp8_row) + 30 * (2 * hidden + fp8_row) + 20 * 2 * hidden
    assert topology.round_trip_host_bytes((10, 20), hidden, False) == 4 * 20 * hidden + 2 * 30 * 2 * hidden
    big = topology.tokens_by_rank("n16384", 8)
    assert topology.round_trip_device_bytes(big, hidden, True) > topology.round_trip_device_bytes(big, hidden, False)


def test_memory_skip_reason_names_the_share():
    assert topology.memory_skip_reason("N=16384", 10 * GIB, 139 * GIB, 8, "GPU") is None
    reason = topology.memory_skip_reason("N=16384", 10 * GIB, 80 * GIB, 8, "GPU")
    assert reason == ("N=16384 needs 10.0 GiB of GPU memory per rank; 8 rank(s) share 80 GiB here "
                      "(9.0 GiB each)"), reason
    # One rank per GPU gets the whole device (less the 10 % kept back).
    assert topology.memory_skip_reason("x", 70 * GIB, 80 * GIB, 1, "GPU") is None
    assert topology.memory_skip_reason("x", 73 * GIB, 80 * GIB, 1, "GPU") is not None


def test_16384_tokens_fit_8_ranks_on_one_h200():
    """The largest case of the GPU suite, 8 ranks of N = 16384 (FP8 and BF16 rows) under MPS on one
    139 GiB H200, with DeepEP's 3 GB of Buffers and 2 GiB of context each: it runs, not skips."""
    need = topology.round_trip_device_bytes(topology.tokens_by_rank("n16384", 8), 7168, True) + int(3e9) + 2 * GIB
    assert topology.memory_skip_reason("N=16384", need, 139 * GIB, 8, "GPU") is None


@pytest.mark.parametrize("local", [1, 2, 4])
@pytest.mark.parametrize("ns", [(5, 0, 33, 17), (1, 1, 1, 1), (64, 40, 0, 9)])
def test_round_trip_want_is_what_the_oracle_combines(local, ns):
    """oracle.combine of every rank's received rows fed back (nodes of `local` ranks, the kernels'
    fp32 order) is bit for bit round_trip_want of each rank's own inputs, weights included."""
    world, experts, hidden, topk = 4, 16, 256, 4
    inputs = [make_inputs(seed=5, rank=r, num_tokens=ns[r], hidden=hidden, num_experts=experts,
                          num_topk=topk, num_ranks=world, route="nowhere" if r == 3 else "random")
              for r in range(world)]
    routes = [i.layout[3] for i in inputs]
    received = [oracle.dispatch([i.x for i in inputs], None, [i.topk_idx for i in inputs],
                                [i.topk_weights for i in inputs], routes, experts, r) for r in range(world)]
    for rank in range(world):
        got_x, got_w = oracle.combine([w["recv_x"] for w in received], routes, rank,
                                      [w["recv_topk_weights"] for w in received], num_local_ranks=local)
        want_x, want_w = round_trip_want(inputs[rank])
        assert row_diff("combined_x", got_x, want_x) == ""
        assert row_diff("combined_topk_weights", got_w, want_w) == ""


def test_round_trip_want_sums_each_copy_exactly():
    """A token on all 8 ranks comes back as 8 x its row, rounded once (not 8 bf16 additions)."""
    x = torch.tensor([[1.0 + 2 ** -7, 3.0, -0.0078125, 255.0]], dtype=torch.bfloat16)
    inp = make_inputs(seed=1, rank=0, num_tokens=1, hidden=4, num_experts=8, num_topk=1, num_ranks=8)
    inp.x, inp.layout = x, inp.layout[:3] + (torch.ones(1, 8, dtype=torch.bool),)
    want_x, _ = round_trip_want(inp)
    assert torch.equal(want_x, (x.double() * 8).to(torch.bfloat16))


@pytest.mark.parametrize("shared, partitioned, processes, ranks, runs, says", [
    (False, True, 1, 1, True, None),              # make test-gpu, one rank per GPU
    (True, True, 8, 8, True, None),               # 8 ranks on one GPU, one job
    (True, False, 8, 8, False, "without an MPS partition"),
    (True, True, 16, 8, False, "2 jobs share this GPU"),
    (False, True, 3, 1, False, "3 jobs share this GPU"),   # jobs of one rank each, no MPS
])
def test_sm_holding_tests_run_only_with_their_share_to_themselves(shared, partitioned, processes, ranks,
                                                                  runs, says):
    reason = topology.sm_holding_skip_reason(shared, partitioned, processes, ranks)
    assert (reason is None) == runs and (says is None or says in reason), reason
