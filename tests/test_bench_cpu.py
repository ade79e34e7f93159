"""`python -m bench` without GPUs: the CPU reference backend on 2 gloo processes must pass its round
trip checks (normal, low-latency and internode mode: every rank its own node), exit 0, say that
it ran the CPU backend, and write a complete JSON report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_cpu_round_trip(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, EPCOMM_BACKEND="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    log = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, log
    assert "ran the CPU reference backend" in proc.stdout, log

    report = json.loads(out.read_text())
    assert report["complete"] and report["mode"] == "cpu" and report["world_size"] == 2
    assert report["versions"]["torch"] and report["machine"]["hostname"]
    by_name = {r["name"]: r for r in report["results"]}
    expected = {"CPU layout", "CPU dispatch bf16", "CPU dispatch bf16 (cached handle)",
                "CPU combine bf16", "CPU low-latency dispatch bf16", "CPU low-latency dispatch fp8",
                "CPU low-latency combine bf16", "CPU internode layout", "CPU internode dispatch bf16",
                "CPU internode dispatch bf16 (cached handle)", "CPU internode combine bf16"}
    assert expected <= set(by_name), sorted(by_name)
    for name in expected:
        result = by_name[name]
        assert result["status"] == "ok", (name, result["status"])
        assert len(result["per_rank"]) == 2 and all(r["us"] > 0 for r in result["per_rank"]), result
        assert result["us"]["min"] <= result["us"]["avg"] <= result["us"]["max"]


def test_pipelined_stats_counts_calls_on_cpu():
    """The pipelined timing loop (the low-latency target's method) on the CPU falls back to the
    host clock per call: the warm-up calls, then one time per timed call."""
    from bench.harness import pipelined_stats
    calls, syncs = [], []
    timing = pipelined_stats(lambda: calls.append(1), warmup=3, iters=7,
                             sync=lambda: syncs.append(1), device="cpu")
    assert len(timing.times_us) == 7 and all(t >= 0 for t in timing.times_us)
    assert len(calls) == 10 and len(syncs) == 7
