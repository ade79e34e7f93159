"""A scale model of internode normal mode: predicted dispatch / combine time and GB/s from EP8 to
EP256, checked against DeepEP V1's published H800 figures and epcomm's own measured runs.

    python -m bench.scale_model [--out DIR] [--samples S]

writes scale_model.json (every prediction, the checks, the summary) and scale_model.png into DIR
(default bench/results/ in a clone, else the current directory) and prints the tables.

Model (per rank; routing is symmetric, so what a rank sends equals what it receives):
- Topology: nodes of L = 8 ranks (M = R / 8 nodes; EP8 is one node, NVLink only), H = 7168,
  K = 8, E = 256, N tokens per rank.
- Routing, sampled (seeded, `samples` tokens of a rank on node 0, local index 0):
  "uniform": top-8 of 256 experts, every set of 8 distinct experts equally likely;
  "node-limited": DeepEP's test_internode routing behind its published figures: the experts are
  cut into M groups (one per node), each token keeps the min(4, M) groups with the largest max
  score, then the top-8 experts of those (scores |N(0,1)| + 1: uniform choices within the limit).
  From the samples: distinct nodes a token reaches (own included), remote nodes, distinct ranks,
  and NVLink rows: each reached node's forwarder (the rank of the source's local index) sends the
  token to the other ranks of that node that need it; on the own node the source does.
- Bytes: RDMA = remote nodes x the wire record per (token, node) (one transfer per destination
  node); NVLink = NVLink rows x the record per (token, rank). epcomm's records come from
  epcomm.ops.internode_plan (dispatch: row, scales, top-k, source, local rows; combine: fp32
  partial sums with MAX_TOPK weights); DeepEP's: row + scales + 12 bytes per top-k slot + 8 bytes
  of source meta, combine a BF16 row + top-k weights.
- Time = max(t_rdma, t_nvl, t_sm) + (sum of the other two) / D + FIXED_US, where t_x = bytes /
  bandwidth per GPU and direction (RDMA 50 GB/s; NVLink 160 GB/s on H800, 450 on H100/H200),
  t_sm = logical received bytes / (SMs x per-SM rate) is what the SMs copy (per-SM rates measured
  at 8 SMs, where both libraries are SM-bound: DeepEP V1 in targets.md, epcomm in the committed
  bench JSON), D is the pipeline depth (chunks in flight: DeepEP N / (SMs/2 channels x 16-token
  RDMA chunks; epcomm likewise with internode_plan.num_channels and the same chunk), FIXED_US the notify / launch /
  signalling cost of a call.
- Figures: logical GB/s (targets.md: every received row, own included, BF16 2H bytes, FP8 H + H/32)
  and DeepEP's "RDMA GB/s" (its test's metric: rows to every node reached, own node included,
  times 2H, x (1 + 4/128) / 2 for FP8), so published numbers compare as they were measured.
The model assumes ideal links (no protocol efficiency): it is an upper bound, and the checks give
each measured figure as a fraction of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

HIDDEN, TOPK, EXPERTS, LOCAL_RANKS = 7168, 8, 256, 8
EP_SIZES = (8, 16, 32, 64, 128, 256)
TOKENS = (4096, 8192)
SMS = 24
RDMA_GBPS = 50.0
NVLINK_GBPS = {"H800": 160.0, "H200": 450.0}
FIXED_US = 25.0
MAX_TOPK_GROUPS = 4                 # DeepEP's test: tokens reach at most 4 nodes' groups
DEEPEP_RDMA_CHUNK = 16              # DeepEP's num_max_rdma_chunked_send_tokens in its tuning
# Logical GB/s per SM at 8 SMs (SM-bound): DeepEP V1 on the H200 (targets.md: 93 FP8 / 121 BF16 /
# 117 combine at 8 SMs); epcomm from the committed run (bench JSON, intranode SMs=8).
DEEPEP_PER_SM = {"dispatch_fp8": 93 / 8, "dispatch_bf16": 121 / 8, "combine_bf16": 117 / 8}
# DeepEP V1's published H800 figures (its README; 4096 tokens, H=7168, top-4 groups, top-8
# experts, FP8 dispatch, BF16 combine): internode RDMA GB/s, intranode EP8 NVLink GB/s.
DEEPEP_PUBLISHED = {16: {"dispatch_fp8": 43, "combine_bf16": 43}, 32: {"dispatch_fp8": 58, "combine_bf16": 57},
                    64: {"dispatch_fp8": 51, "combine_bf16": 50}, 8: {"dispatch_fp8": 153, "combine_bf16": 158}}
MEASURED_JSON = "2026-11-30T022939Z_2xH200.json"
OPS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16")


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    nodes: float          # distinct nodes a token reaches, own included
    remote_nodes: float   # of those, other nodes: RDMA transfers per token
    ranks: float          # distinct ranks: logical rows per token
    nvl_rows: float       # NVLink transfers per token (forwarders and own node)


def sample_routing(kind: str, num_ranks: int, local_ranks: int = LOCAL_RANKS, num_experts: int = EXPERTS,
                   num_topk: int = TOPK, samples: int = 1 << 15, seed: int = 0) -> Routing:
    import torch
    local_ranks = min(local_ranks, num_ranks)
    nodes = num_ranks // local_ranks
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(samples, num_experts, generator=gen).abs() + 1
    if kind == "node-limited":
        groups = min(MAX_TOPK_GROUPS, nodes)
        best = scores.view(samples, nodes, -1).amax(-1).topk(groups, dim=-1).indices
        keep = torch.zeros(samples, nodes, dtype=torch.bool).scatter_(1, best, True)
        scores = scores.masked_fill(~keep.repeat_interleave(num_experts // nodes, dim=1), 0)
    elif kind != "uniform":
        raise ValueError(f"routing must be uniform or node-limited, got {kind!r}")
    experts = scores.topk(num_topk, dim=-1).indices
    rank_hit = torch.zeros(samples, num_ranks, dtype=torch.bool)
    rank_hit.scatter_(1, experts // (num_experts // num_ranks), True)
    per_node = rank_hit.view(samples, nodes, local_ranks)
    node_hit = per_node.any(-1)
    # A reached node's forwarder (local index 0, the source's) keeps its own copy and forwards the
    # rest; on the source's node the source sends to the other local ranks itself.
    nvl = per_node.sum(-1) - per_node[..., 0].int()
    return Routing(nodes=node_hit.sum(1).float().mean().item(),
                   remote_nodes=node_hit[:, 1:].sum(1).float().mean().item(),
                   ranks=rank_hit.sum(1).float().mean().item(),
                   nvl_rows=nvl.sum(1).float().mean().item())


def uniform_reach_probability(units: int, num_experts: int = EXPERTS, num_topk: int = TOPK) -> float:
    """P(a uniform top-k token reaches a given one of `units` equal expert blocks)."""
    per_unit = num_experts // units
    return 1 - math.comb(num_experts - per_unit, num_topk) / math.comb(num_experts, num_topk)


# ---------------------------------------------------------------------------------------------
# Bytes and times
# ---------------------------------------------------------------------------------------------
def logical_row_bytes(op: str, hidden: int = HIDDEN) -> float:
    return hidden * (1 + 4 / 128) if op == "dispatch_fp8" else 2 * hidden


def wire_bytes(impl: str, op: str, local_ranks: int, hidden: int = HIDDEN, num_topk: int = TOPK):
    """(bytes per RDMA transfer, bytes per NVLink transfer) of one token."""
    fp8 = op == "dispatch_fp8"
    row, scales = (hidden, hidden // 128) if fp8 else (2 * hidden, 0)
    if impl == "epcomm":
        from epcomm.ops import internode_plan as plan
        if op.startswith("dispatch"):
            record = plan.dispatch_record_bytes(row, scales, num_topk, local_ranks)
            return record, record
        return plan.combine_partial_bytes(2 * hidden), plan.combine_push_bytes(2 * hidden)
    if op.startswith("dispatch"):
        record = row + 4 * scales + 12 * num_topk + 8
        return record, record
    return 2 * hidden + 4 * num_topk, 2 * hidden + 4 * num_topk


def pipeline_depth(impl: str, num_tokens: int, sms: int) -> float:
    if impl == "epcomm":   # streams per channel in RDMA chunks, as DeepEP's
        from epcomm.ops import internode_plan as plan
        return max(1.0, num_tokens / (plan.num_channels(sms) * DEEPEP_RDMA_CHUNK))
    return max(1.0, num_tokens / ((sms // 2) * DEEPEP_RDMA_CHUNK))


@dataclass
class Prediction:
    impl: str
    gpu: str
    routing: str
    op: str
    ep: int
    nodes: int
    tokens: int
    sms: int
    t_rdma_us: float
    t_nvl_us: float
    t_sm_us: float
    depth: float
    us: float
    dominant: str
    logical_gbps: float
    deepep_rdma_gbps: Optional[float]


def predict(impl: str, gpu: str, routing: Routing, routing_name: str, op: str, ep: int, tokens: int,
            per_sm_gbps: float, sms: int = SMS, rdma_gbps: float = RDMA_GBPS,
            nvlink_gbps: Optional[float] = None, local_ranks: int = LOCAL_RANKS,
            fixed_us: float = FIXED_US, depth: Optional[float] = None) -> Prediction:
    local_ranks = min(local_ranks, ep)
    nvlink_gbps = NVLINK_GBPS[gpu] if nvlink_gbps is None else nvlink_gbps
    rdma_wire, nvl_wire = wire_bytes(impl, op, local_ranks)
    row = logical_row_bytes(op)
    terms = {"RDMA": tokens * routing.remote_nodes * rdma_wire / rdma_gbps / 1e3,
             "NVLink": tokens * routing.nvl_rows * nvl_wire / nvlink_gbps / 1e3,
             "SMs": tokens * routing.ranks * row / (sms * per_sm_gbps) / 1e3}
    depth = pipeline_depth(impl, tokens, sms) if depth is None else depth
    dominant = max(terms, key=terms.get)
    us = terms[dominant] + (sum(terms.values()) - terms[dominant]) / depth + fixed_us
    nodes = ep // local_ranks
    rdma_metric = tokens * routing.nodes * row / us / 1e3 if nodes > 1 else None
    return Prediction(impl, gpu, routing_name, op, ep, nodes, tokens, sms, terms["RDMA"], terms["NVLink"],
                      terms["SMs"], depth, us, dominant, tokens * routing.ranks * row / us / 1e3, rdma_metric)


# ---------------------------------------------------------------------------------------------
# The committed measurements
# ---------------------------------------------------------------------------------------------
def _results_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def measured_epcomm(path: Optional[str] = None) -> Dict[str, dict]:
    """epcomm's figures from the committed 2 x H200 run: per-SM rates at 8 SMs, intranode and 2 x 1
    internode logical GB/s at N=4096, 24 SMs, and the P2P copy engine's GB/s."""
    with open(path or os.path.join(_results_dir(), MEASURED_JSON)) as f:
        results = {r["name"]: r for r in json.load(f)["results"] if r["status"] == "ok"}

    def gbps(name):
        return results[name]["logical_gbps"]["avg"]
    shape = "N=4096 H=7168 K=8 E=256"
    names = {"dispatch_bf16": "dispatch BF16", "dispatch_fp8": "dispatch FP8", "combine_bf16": "combine BF16"}
    p2p = next(r for n, r in results.items() if n.startswith("P2P copy"))
    return {"per_sm": {op: gbps(f"intranode {n} {shape} SMs=8") / 8 for op, n in names.items()},
            "intranode": {op: gbps(f"intranode {n} {shape} SMs=24") for op, n in names.items()},
            "internode_2x1": {op: gbps(f"internode {n} {shape} SMs=24") for op, n in names.items()},
            "p2p_gbps": p2p["logical_gbps"]["avg"]}


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------
def build(samples: int = 1 << 15) -> dict:
    measured = measured_epcomm()
    rates = {"epcomm": measured["per_sm"], "deepep": DEEPEP_PER_SM}
    routings = {(kind, ep): sample_routing(kind, ep, samples=samples)
                for kind in ("uniform", "node-limited") for ep in EP_SIZES}
    predictions = [predict(impl, gpu, routings[(kind, ep)], kind, op, ep, n, rates[impl][op])
                   for impl in ("epcomm", "deepep") for gpu in NVLINK_GBPS for kind in ("uniform", "node-limited")
                   for op in OPS for ep in EP_SIZES for n in TOKENS]
    # epcomm without overlap between its stages (one-shot calls, D = 1): what pipelining is worth
    predictions += [dataclasses.replace(predict("epcomm", gpu, routings[("uniform", ep)], "uniform", op, ep, n,
                                                rates["epcomm"][op], depth=1.0), impl="epcomm_one_shot")
                    for gpu in NVLINK_GBPS for op in OPS for ep in EP_SIZES for n in TOKENS]
    checks = []
    for ep, published in sorted(DEEPEP_PUBLISHED.items()):
        for op, value in published.items():
            p = predict("deepep", "H800", routings[("node-limited", ep)], "node-limited", op, ep, 4096,
                        DEEPEP_PER_SM[op])
            # intranode, DeepEP's test reports received bytes (own rows included): the logical figure
            model = p.deepep_rdma_gbps if ep > LOCAL_RANKS else p.logical_gbps
            checks.append({"what": f"DeepEP V1 H800 EP{ep} {op}", "metric": "RDMA GB/s" if ep > 8 else "NVLink GB/s",
                           "measured": value, "model": model, "measured_over_model": value / model,
                           "dominant": p.dominant})
    # epcomm on 2 H200s: intranode (one node of 2) and 2 nodes of 1 whose "RDMA" is NVSHMEM puts
    # over NVLink (the P2P copy engine's figure stands for that link).
    for op in OPS:
        intra = sample_routing("uniform", 2, 2, samples=samples)
        p = predict("epcomm", "H200", intra, "uniform", op, 2, 4096, measured["per_sm"][op], local_ranks=2)
        checks.append({"what": f"epcomm 2 x H200 intranode {op}", "metric": "logical GB/s",
                       "measured": measured["intranode"][op], "model": p.logical_gbps,
                       "measured_over_model": measured["intranode"][op] / p.logical_gbps, "dominant": p.dominant})
        inter = sample_routing("uniform", 2, 1, samples=samples)
        p = predict("epcomm", "H200", inter, "uniform", op, 2, 4096, measured["per_sm"][op], local_ranks=1,
                    rdma_gbps=measured["p2p_gbps"])
        checks.append({"what": f"epcomm 2 x H200 internode 2x1 {op}", "metric": "logical GB/s",
                       "measured": measured["internode_2x1"][op], "model": p.logical_gbps,
                       "measured_over_model": measured["internode_2x1"][op] / p.logical_gbps,
                       "dominant": p.dominant})
    return {"model": __doc__.split("\n\n", 2)[2].strip(), "constants": {
                "hidden": HIDDEN, "topk": TOPK, "experts": EXPERTS, "local_ranks": LOCAL_RANKS, "sms": SMS,
                "rdma_gbps": RDMA_GBPS, "nvlink_gbps": NVLINK_GBPS, "fixed_us": FIXED_US,
                "per_sm_gbps": rates, "samples": samples},
            "routing": {f"{k} EP{ep}": asdict(r) for (k, ep), r in routings.items()},
            "predictions": [asdict(p) for p in predictions], "checks": checks,
            "epcomm_vs_deepep": compare(predictions), "summary": summary(predictions, checks, rates["epcomm"])}


def summary(predictions: List[Prediction], checks: List[dict], epcomm_per_sm: Dict[str, float]) -> List[str]:
    """What the numbers say, in sentences built from them."""
    by = {(p.impl, p.gpu, p.routing, p.op, p.ep, p.tokens): p for p in predictions}
    deepep_checks = [c["measured_over_model"] for c in checks if c["what"].startswith("DeepEP")]
    dominant = {}
    for c in checks:
        if c["what"].startswith("DeepEP"):
            dominant.setdefault(c["what"].split()[3], set()).add(c["dominant"])
    internode = [c["measured_over_model"] for c in checks if "internode 2x1" in c["what"]]
    lines = [f"DeepEP V1's published H800 figures are {min(deepep_checks):.0%}-{max(deepep_checks):.0%} of the "
             f"model (an upper bound with ideal links); the model's dominant term there: "
             + ", ".join(f"{ep} {'/'.join(sorted(terms))}" for ep, terms in dominant.items()) + ".",
             f"epcomm's measured 2 x 1 internode calls reach {min(internode):.0%}-{max(internode):.0%} of the model "
             f"(its intranode ones far more): today its internode kernels, not the links, set the time."]
    for gpu in NVLINK_GBPS:
        for op in OPS:
            cells = []
            for ep in EP_SIZES:
                e, d = by[("epcomm", gpu, "uniform", op, ep, 4096)], by[("deepep", gpu, "uniform", op, ep, 4096)]
                cells.append(f"EP{ep} {d.us / e.us:.2f}x ({e.dominant})")
            lines.append(f"{gpu} {op}, uniform top-8, N=4096, 24 SMs, epcomm over DeepEP (epcomm's dominant "
                         f"term): " + ", ".join(cells))
    one_shot = [by[("epcomm", "H200", "uniform", op, ep, 4096)].us / by[("epcomm_one_shot", "H200", "uniform", op,
                                                                          ep, 4096)].us
                for op in OPS for ep in EP_SIZES if ep > LOCAL_RANKS]
    lines.append(f"Pipelining (D = chunk count) against one-shot stages (D = 1) on H200, EP16-256: the pipelined "
                 f"call takes {min(one_shot):.2f}-{max(one_shot):.2f} of the one-shot time.")
    rate_ratio = [epcomm_per_sm[op] / DEEPEP_PER_SM[op] for op in OPS]
    wins = [f"{c[0]} {c[1]} EP{c[2]} ({c[3]:.2f}x)" for c in _cases(by, lambda r: r > 1.1)]
    losses = [f"{c[0]} {c[1]} EP{c[2]} ({c[3]:.2f}x)" for c in _cases(by, lambda r: r < 0.9)]
    lines.append(f"Where epcomm should win (> 1.1x, N=4096): {', '.join(wins) or 'nowhere'}: where the SMs or "
                 f"NVLink decide, by its measured per-SM copy rate ({min(rate_ratio):.1f}-{max(rate_ratio):.1f}x "
                 f"DeepEP's at 8 SMs). Where RDMA decides both move the same dispatch bytes and tie.")
    lines.append(f"Where it should lose (< 0.9x): {', '.join(losses) or 'nowhere'}: its combine sends fp32 partial "
                 f"sums over RDMA (internode_plan.combine_partial_bytes), twice DeepEP's BF16 bytes.")
    return lines


def compare(predictions: List[Prediction]) -> List[dict]:
    """epcomm's predicted speed over DeepEP's, same GPU, routing, op, EP and N."""
    deepep = {(p.gpu, p.routing, p.op, p.ep, p.tokens): p for p in predictions if p.impl == "deepep"}
    out = []
    for p in predictions:
        if p.impl != "epcomm":
            continue
        d = deepep[(p.gpu, p.routing, p.op, p.ep, p.tokens)]
        out.append({"gpu": p.gpu, "routing": p.routing, "op": p.op, "ep": p.ep, "tokens": p.tokens,
                    "epcomm_us": p.us, "deepep_us": d.us, "speedup": d.us / p.us,
                    "epcomm_dominant": p.dominant, "deepep_dominant": d.dominant})
    return out


def _cases(by: dict, keep) -> List[tuple]:
    """(gpu, op, ep, speed-up) of uniform N=4096 cases whose epcomm-over-DeepEP speed-up passes keep."""
    out = []
    for gpu in NVLINK_GBPS:
        for op in OPS:
            for ep in EP_SIZES:
                r = by[("deepep", gpu, "uniform", op, ep, 4096)].us / by[("epcomm", gpu, "uniform", op, ep, 4096)].us
                if keep(r):
                    out.append((gpu, op, ep, r))
    return out


def format_tables(doc: dict) -> str:
    lines = ["checks (model = upper bound with ideal links):",
             f"  {'case':44s} {'metric':12s} {'measured':>9s} {'model':>8s} {'ratio':>6s}  dominant"]
    for c in doc["checks"]:
        lines.append(f"  {c['what']:44s} {c['metric']:12s} {c['measured']:9.1f} {c['model']:8.1f} "
                     f"{c['measured_over_model']:6.2f}  {c['dominant']}")
    lines += ["", "predicted, uniform top-8 of 256, 24 SMs (us; dominant term; epcomm speed-up over DeepEP):",
              f"  {'gpu':5s} {'op':14s} {'N':>5s} " + " ".join(f"{'EP' + str(ep):>24s}" for ep in EP_SIZES)]
    rows = {(c["gpu"], c["op"], c["tokens"], c["ep"]): c for c in doc["epcomm_vs_deepep"] if c["routing"] == "uniform"}
    for gpu in NVLINK_GBPS:
        for op in OPS:
            for n in TOKENS:
                cells = [rows[(gpu, op, n, ep)] for ep in EP_SIZES]
                lines.append(f"  {gpu:5s} {op:14s} {n:5d} " + " ".join(
                    f"{c['epcomm_us']:7.0f} {c['epcomm_dominant']:6s} {c['speedup']:5.2f}x   " for c in cells))
    return "\n".join(lines)


def plot(doc: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.scale_model: matplotlib is not installed: no plot", file=sys.stderr)
        return None
    preds = doc["predictions"]
    fig, axes = plt.subplots(1, 3, figsize=(19, 6))
    for ax, n in zip(axes[:2], TOKENS):
        for impl, style in (("epcomm", "-"), ("deepep", "--")):
            for op in OPS:
                pts = sorted((p["ep"], p["us"]) for p in preds if p["impl"] == impl and p["gpu"] == "H200"
                             and p["routing"] == "uniform" and p["op"] == op and p["tokens"] == n)
                ax.plot(*zip(*pts), style, marker="o", label=f"{impl} {op}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="EP size (ranks, 8 per node)", ylabel="predicted time per call (us)",
               title=f"H200, uniform top-8 of 256, N={n}, 24 SMs")
        ax.set_xticks(EP_SIZES, [str(e) for e in EP_SIZES])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    for op, marker in (("dispatch_fp8", "o"), ("combine_bf16", "s")):
        pts = sorted((p["ep"], p["deepep_rdma_gbps"]) for p in preds if p["impl"] == "deepep" and p["gpu"] == "H800"
                     and p["routing"] == "node-limited" and p["op"] == op and p["tokens"] == 4096 and p["ep"] > 8)
        ax.plot(*zip(*pts), "--", marker=marker, label=f"model: DeepEP {op}")
        pub = sorted((ep, v[op]) for ep, v in DEEPEP_PUBLISHED.items() if ep > 8)
        ax.scatter(*zip(*pub), marker=marker, color="black", zorder=3, label=f"DeepEP published {op}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="EP size", ylabel="DeepEP's RDMA GB/s (own node counted)",
           title="check: H800, node-limited routing (DeepEP's test), N=4096")
    ax.set_xticks(EP_SIZES[1:], [str(e) for e in EP_SIZES[1:]])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("epcomm internode scale model (bench/scale_model.py): RDMA 50 GB/s per GPU, NVLink 160 (H800) / "
                 f"450 (H200) GB/s, per-SM rates measured at 8 SMs, fixed {FIXED_US:g} us per call", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for scale_model.json / .png (default bench/results/ in a clone, else cwd)")
    p.add_argument("--samples", type=int, default=1 << 15, help="routed tokens sampled per topology")
    args = p.parse_args(argv)
    from bench.report import default_results_dir
    out = args.out or default_results_dir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(out, exist_ok=True)
    doc = build(args.samples)
    with open(os.path.join(out, "scale_model.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(format_tables(doc))
    print("\n" + "\n".join(doc["summary"]))
    png = plot(doc, os.path.join(out, "scale_model.png"))
    print(f"\nJSON: {os.path.join(out, 'scale_model.json')}" + (f"  plot: {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
