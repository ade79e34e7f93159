"""bench/scale_model.py: the invariants of the internode scale model (CPU, small samples)."""
from __future__ import annotations

import pytest

from bench import scale_model as sm

SAMPLES = 4096


@pytest.fixture(scope="module")
def uniform():
    return {ep: sm.sample_routing("uniform", ep, samples=SAMPLES) for ep in sm.EP_SIZES}


def test_sampled_routing_matches_the_closed_form(uniform):
    for ep, r in uniform.items():
        nodes = max(1, ep // sm.LOCAL_RANKS)
        assert r.ranks == pytest.approx(ep * sm.uniform_reach_probability(ep), rel=0.03)
        assert r.nodes == pytest.approx(nodes * sm.uniform_reach_probability(nodes), rel=0.03)


def test_routing_counts_are_consistent(uniform):
    previous = None
    for ep, r in sorted(uniform.items()):
        nodes = max(1, ep // sm.LOCAL_RANKS)
        assert 1 <= r.nodes <= min(sm.TOPK, nodes) and r.remote_nodes <= r.nodes
        assert r.nodes <= r.ranks <= sm.TOPK
        assert r.nvl_rows <= r.ranks                       # forwarders keep their own copy
        if nodes == 1:
            assert r.remote_nodes == 0                     # EP8: one node, nothing over RDMA
        if previous is not None:
            assert r.remote_nodes >= previous.remote_nodes  # more nodes: more transfers per token
        previous = r
    limited = sm.sample_routing("node-limited", 256, samples=SAMPLES)
    assert limited.nodes <= sm.MAX_TOPK_GROUPS < uniform[256].nodes


def test_time_terms_and_pipeline_depth(uniform):
    r = uniform[64]
    base = dict(impl="epcomm", gpu="H200", routing=r, routing_name="uniform", op="dispatch_bf16", ep=64,
                per_sm_gbps=25.0)
    p = sm.predict(tokens=4096, **base)
    terms = (p.t_rdma_us, p.t_nvl_us, p.t_sm_us)
    assert p.dominant == ("RDMA", "NVLink", "SMs")[terms.index(max(terms))]
    overlapped = sm.predict(tokens=4096, depth=1e12, **base)
    one_shot = sm.predict(tokens=4096, depth=1.0, **base)
    assert overlapped.us == pytest.approx(max(terms) + sm.FIXED_US)
    assert one_shot.us == pytest.approx(sum(terms) + sm.FIXED_US)
    assert overlapped.us <= p.us <= one_shot.us
    double = sm.predict(tokens=8192, **base)                 # bytes scale with N, the fixed cost does not
    assert double.us - sm.FIXED_US == pytest.approx(2 * (p.us - sm.FIXED_US), rel=0.05)
    faster_rdma = sm.predict(tokens=4096, rdma_gbps=2 * sm.RDMA_GBPS, **base)
    assert faster_rdma.t_rdma_us == pytest.approx(p.t_rdma_us / 2) and faster_rdma.us <= p.us
    assert p.logical_gbps == pytest.approx(4096 * r.ranks * 2 * sm.HIDDEN / p.us / 1e3)


def test_intranode_has_no_rdma_and_fp8_moves_fewer_bytes(uniform):
    common = dict(gpu="H800", routing=uniform[8], routing_name="uniform", ep=8, tokens=4096, per_sm_gbps=20.0)
    bf16 = sm.predict("deepep", op="dispatch_bf16", **common)
    fp8 = sm.predict("deepep", op="dispatch_fp8", **common)
    assert bf16.t_rdma_us == 0 and bf16.deepep_rdma_gbps is None and bf16.nodes == 1
    assert fp8.us < bf16.us


def test_model_bounds_the_published_and_measured_figures():
    """Ideal links make the model an upper bound: every measured figure (DeepEP V1's published H800
    numbers, epcomm's committed 2 x H200 run) is at most the model's, and DeepEP's within 30% of it."""
    doc = sm.build(samples=SAMPLES)
    for check in doc["checks"]:
        assert 0 < check["measured_over_model"] <= 1.0, check
        if check["what"].startswith("DeepEP"):
            assert check["measured_over_model"] > 0.7, check
    speedups = {(c["gpu"], c["op"], c["ep"]): c["speedup"] for c in doc["epcomm_vs_deepep"]
                if c["routing"] == "uniform" and c["tokens"] == 4096}
    assert len(speedups) == len(sm.NVLINK_GBPS) * len(sm.OPS) * len(sm.EP_SIZES)
    assert doc["summary"] and all(isinstance(line, str) for line in doc["summary"])


def test_epcomm_records_come_from_its_plan():
    from epcomm.ops import internode_plan as plan
    rdma, nvl = sm.wire_bytes("epcomm", "combine_bf16", 8)
    assert rdma == plan.combine_partial_bytes(2 * sm.HIDDEN) and nvl == plan.combine_push_bytes(2 * sm.HIDDEN)
    assert sm.pipeline_depth("epcomm", 4096, 24) == 4096 / (plan.num_channels(24) * sm.DEEPEP_RDMA_CHUNK)
