"""`python -m bench` without GPUs: the CPU reference backend on 2 gloo processes must pass its round
trip checks (normal, low-latency and internode mode: every rank its own node), exit 0, say that
it ran the CPU backend, and write a complete JSON report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


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
    # Internode records name the Buffer sizes the calls ran in.
    for name in (n for n in expected if n.startswith("CPU internode")):
        setting = by_name[name]["setting"]
        assert setting["num_rdma_bytes"] > 0 and setting["num_nvl_bytes"] >= 0, setting


def test_pipelined_stats_counts_calls_on_cpu():
    """The pipelined timing loop (the low-latency target's method) on the CPU falls back to the
    host clock per call: the warm-up calls, then one time per timed call."""
    from bench.harness import pipelined_stats
    calls, syncs = [], []
    timing = pipelined_stats(lambda: calls.append(1), warmup=3, iters=7,
                             sync=lambda: syncs.append(1), device="cpu")
    assert len(timing.times_us) == 7 and all(t >= 0 for t in timing.times_us)
    assert len(calls) == 10 and len(syncs) == 7


def test_startup_probe_measures_import_and_first_use_jit_in_fresh_processes():
    """bench/startup.py on the CPU: import time, then the layout mode's first-use kernel compiled
    into an empty cache (cold) and read back by another process that may not compile (warm: run
    with EPCOMM_ASSERT_NO_COMPILE=1, so a miss would fail it), each a target record."""
    from bench.startup import startup_probe
    records = startup_probe(quick=True, num_gpus=0, modes=("layout",))
    by_name = {r.name: r for r in records}
    assert [r.status for r in records] == ["ok"] * 3, [(r.name, r.status, r.extra) for r in records]
    cold = by_name["startup: layout first use, cold JIT (compile + link for sm_90, no GPU)"]
    warm = by_name["startup: layout first use, warm cache (cache read, no GPU)"]
    assert cold.extra["kernels"] == warm.extra["kernels"] == 1 and not cold.extra["loaded"]
    assert cold.us > 0 and warm.us > 0
    assert by_name["startup: import epcomm (fresh process)"].target == ("us", "<=", 0.5e6)


def test_first_use_sources_name_every_mode():
    from bench.startup import MODES, first_use_sources
    import pytest
    for mode in MODES:
        sources = first_use_sources(mode, 2)
        assert sources and all(s.kernels for s in sources), mode
    with pytest.raises(ValueError, match="unknown mode"):
        first_use_sources("nope", 2)


def test_startup_jit_on_a_gpu_loads_every_cubin(monkeypatch, tmp_path):
    """The GPU path of the first-use figure (--load) without a GPU: the device's arch decides the
    build target, and every built cubin goes to cuModuleLoadData in the primary context."""
    import contextlib
    import types
    from bench import startup
    from epcomm.runtime import arch, launch, module
    loaded = []

    class Driver:
        def cuModuleLoadData(self, handle, cubin):
            loaded.append(bytes(cubin))
            return 0
    monkeypatch.setenv("EPCOMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(startup, "_cuda_context", lambda: None)
    monkeypatch.setattr(arch, "device_arch", lambda index: types.SimpleNamespace(cc=90, feature=90))
    monkeypatch.setattr(module, "primary_context", lambda index: 1234)
    monkeypatch.setattr(launch, "pushed_context", lambda context: contextlib.nullcontext())
    monkeypatch.setattr(launch, "driver", lambda: Driver())
    result = startup._time_jit("layout", 2, load=True)
    assert result["loaded"] and result["arch"] == "sm_90" and result["kernels"] == 1
    assert len(loaded) == 1 and loaded[0]


def test_startup_probe_reports_a_failing_measurement_as_an_error_record(monkeypatch):
    """A worker that fails (here: every one) becomes an error record per figure; the probe itself
    returns, so the rest of the bench still runs."""
    from bench import startup

    def fail(args, cache_dir, timeout, warm=False):
        raise RuntimeError(f"python -m bench.startup {' '.join(args)} failed:\nboom")
    monkeypatch.setattr(startup, "_run_worker", fail)
    records = startup.startup_probe(quick=True, num_gpus=0, modes=("layout",))
    assert len(records) == 3
    assert all(r.status.startswith("error: python -m bench.startup") for r in records), \
        [r.status for r in records]
