"""PNG plots of a bench JSON, written next to it (what `make bench` does after its run).

    python -m bench.plots bench/results/<stamp>_<machine>.json [--out DIR]

Per normal mode (intranode, internode): logical GB/s against tokens per rank, hidden size and SM
count, each sweep at the run's usual setting of the other two (the most common value), with the
same-run baselines (torch+NCCL dispatch / combine, NCCL all_to_all_single) as points and the P2P
copy engine as a line. Low-latency mode: time against tokens (and hidden size) for the kernels, the
whole calls and the back-to-back pairs, with the NCCL all_to_all_single of the same bytes. Every
figure says which machine and versions it comes from. matplotlib is optional: without it the bench
says so and writes no plots.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

_PARAM = re.compile(r"\s*\b((N|H|K|E|SMs)=\d+|\d+x\d+)")
_BASELINE_STYLES = (("x", "black"), ("+", "dimgray"), ("D", "saddlebrown"), ("s", "darkred"))
NORMAL_SWEEPS = (("N", "tokens per rank N"), ("H", "hidden size H"), ("sms", "SMs (Config.num_sms)"))
_KEY_NAMES = {"sms": "SMs"}
LL_SWEEPS = (("N", "tokens per rank N"), ("H", "hidden size H"))


def series_label(name: str) -> str:
    """A result's name without its shape parameters: the curve it belongs to."""
    return re.sub(r"\s+", " ", _PARAM.sub("", name)).strip()


def _ok(results: Sequence[dict], module: str, metric: str) -> List[dict]:
    return [r for r in results if r["module"] == module and r["status"] == "ok" and r.get(metric)]


def _usual(rows: Sequence[dict], keys: Sequence[str]) -> Dict[str, int]:
    """The most common value of each setting key among rows (ties: the larger value)."""
    usual = {}
    for key in keys:
        counts = collections.Counter(r["setting"][key] for r in rows if key in r["setting"])
        if counts:
            usual[key] = max(counts, key=lambda v: (counts[v], v))
    return usual


def sweep(rows: Sequence[dict], key: str, fixed: Dict[str, int], metric: str) -> Dict[str, list]:
    """label -> sorted [(x, y)] of rows whose setting matches `fixed` except for `key`."""
    curves: Dict[str, list] = collections.defaultdict(list)
    for r in rows:
        s = r["setting"]
        if key not in s or any(s.get(k, v) != v for k, v in fixed.items() if k != key):
            continue
        curves[series_label(r["name"])].append((s[key], r[metric]["avg"]))
    return {label: sorted(points) for label, points in curves.items()}


def footer(document: dict) -> str:
    machine, v = document.get("machine", {}), document.get("versions", {})
    gpus = machine.get("gpus") or []
    hw = f"{machine.get('gpu_count', 0)} x {gpus[0]['name']} ({gpus[0]['sm_count']} SMs)" if gpus else "CPU"
    parts = [hw, f"driver {machine.get('driver')}" if machine.get("driver") else None,
             f"torch {v.get('torch')}", f"CUDA {v.get('cuda')}" if v.get("cuda") else None,
             f"NVRTC {v.get('nvrtc')}", f"NVSHMEM {v.get('nvshmem')}",
             f"NCCL {v.get('nccl')}" if v.get("nccl") else None, f"epcomm {v.get('epcomm')}",
             str(document.get("date", ""))[:19] + " UTC" + (" (quick)" if document.get("quick") else "")]
    return " | ".join(p for p in parts if p)


def _plot_curves(ax, curves: Dict[str, list], key: str) -> None:
    for label, points in sorted(curves.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=label)
    values = {x for points in curves.values() for x, _ in points}
    if len(values) == 1:
        ax.text(0.02, 0.97, f"this run did not sweep {_KEY_NAMES.get(key, key)}", transform=ax.transAxes,
                va="top", fontsize=8, color="grey")


def _baseline_points(results: Sequence[dict], key: str, fixed: Dict[str, int], metric: str) -> Dict[str, list]:
    """Same-run baselines on a normal-mode sweep: torch+NCCL dispatch / combine (setting N, H) and
    NCCL all_to_all_single (tokens_per_pair stands for N)."""
    rows = []
    for r in _ok(results, "baselines", metric):
        s = dict(r["setting"])
        if "tokens_per_pair" in s:
            s["N"] = s.pop("tokens_per_pair")
        rows.append(dict(r, setting=s))
    return sweep(rows, key, {k: v for k, v in fixed.items() if k in ("N", "H")}, metric)


def normal_mode_figure(plt, document: dict, module: str):
    results = document["results"]
    rows = _ok(results, module, "logical_gbps")
    if not rows:
        return None
    fixed = _usual(rows, ("N", "H", "sms", "K", "E"))
    p2p = next((r for r in _ok(results, "copy", "logical_gbps") if r["name"].startswith("P2P copy")), None)
    fig, axes = plt.subplots(1, len(NORMAL_SWEEPS), figsize=(18, 5.8))
    for ax, (key, xlabel) in zip(axes, NORMAL_SWEEPS):
        _plot_curves(ax, sweep(rows, key, fixed, "logical_gbps"), key)
        if key != "sms":
            baselines = sorted(_baseline_points(results, key, fixed, "logical_gbps").items())
            for (label, points), (marker, color) in zip(baselines, _BASELINE_STYLES):
                xs, ys = zip(*points)
                ax.scatter(xs, ys, marker=marker, color=color, s=60, zorder=3, label=f"baseline: {label}")
        if p2p is not None:
            ax.axhline(p2p["logical_gbps"]["avg"], color="grey", linestyle="--", linewidth=1,
                       label="P2P copy engine (one way)")
        others = ", ".join(f"{_KEY_NAMES.get(k, k)}={v}" for k, v in fixed.items() if k != key)
        ax.set(xlabel=xlabel, ylabel="logical GB/s per rank",
               title=f"{module}: against {_KEY_NAMES.get(key, key)} ({others})")
        if key == "N":
            ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"epcomm {module} normal mode, R={rows[0]['setting'].get('R')}\n{footer(document)}", fontsize=10)
    fig.tight_layout()
    return fig


_LL_CURVES = ("(kernel time)", "(whole call)", "(whole calls back to back, pipelined",
              "(back to back, one CUDA graph replay)")


def low_latency_figure(plt, document: dict):
    results = document["results"]
    rows = [r for r in _ok(results, "low_latency", "us") if any(c in r["name"] for c in _LL_CURVES)
            or r["name"].startswith("NCCL all_to_all_single")]
    if not rows:
        return None
    fixed = _usual(rows, ("N", "H", "K", "E"))
    fig, axes = plt.subplots(1, len(LL_SWEEPS), figsize=(16, 6))
    for ax, (key, xlabel) in zip(axes, LL_SWEEPS):
        for label, points in sorted(sweep(rows, key, fixed, "us").items()):
            xs, ys = zip(*points)
            style = dict(linestyle="--", color="black") if label.startswith("NCCL") else {}
            ax.plot(xs, ys, marker="o", label=("baseline: " if style else "") + label, **style)
        others = ", ".join(f"{k}={v}" for k, v in fixed.items() if k != key)
        ax.set(xlabel=xlabel, ylabel="time per call (us)", title=f"low-latency: against {key} ({others})")
        if key == "N":
            ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    R = next((r["setting"]["R"] for r in rows if "R" in r["setting"]), None)
    fig.suptitle(f"epcomm low-latency mode, R={R}\n{footer(document)}", fontsize=10)
    fig.tight_layout()
    return fig


def write_plots(json_path: str, out_dir: Optional[str] = None) -> List[str]:
    """PNG files for the bench JSON at json_path (next to it, or in out_dir); [] when matplotlib is
    missing (said on stderr) or nothing in the file can be plotted."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed: no plots (pip install matplotlib, then "
              f"python -m bench.plots {json_path})", file=sys.stderr)
        return []
    with open(json_path) as f:
        document = json.load(f)
    out_dir = out_dir or os.path.dirname(os.path.abspath(json_path))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(json_path))[0]
    figures = {"intranode": normal_mode_figure(plt, document, "intranode"),
               "internode": normal_mode_figure(plt, document, "internode"),
               "low_latency": low_latency_figure(plt, document)}
    written = []
    for name, fig in figures.items():
        if fig is None:
            continue
        path = os.path.join(out_dir, f"{stem}_{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a bench results JSON")
    p.add_argument("--out", default=None, metavar="DIR", help="folder for the PNGs (default: the JSON's)")
    args = p.parse_args(argv)
    for path in write_plots(args.json, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
