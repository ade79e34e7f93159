"""bench/plots.py and where the bench writes its results (CPU; no GPU needed)."""
from __future__ import annotations

import datetime as dt
import json
import os
import sys

import pytest

from tests.conftest import ROOT
COMMITTED = os.path.join(ROOT, "bench", "results", "2026-11-30T022939Z_2xH200.json")


def _result(name, module, setting, gbps=None, us=1.0, status="ok"):
    spread = lambda v: None if v is None else {"min": v, "avg": v, "max": v}
    return {"name": name, "module": module, "status": status, "setting": setting,
            "logical_gbps": spread(gbps), "us": spread(us)}


def test_sweep_keeps_the_other_settings_fixed():
    from bench.plots import series_label, sweep
    rows = [_result(f"intranode dispatch BF16 N={n} H={h} K=8 E=256 SMs={m}", "intranode",
                    {"N": n, "H": h, "sms": m}, gbps=float(n + h + m))
            for n, h, m in [(128, 7168, 24), (4096, 7168, 24), (4096, 2048, 24), (4096, 7168, 8)]]
    assert series_label(rows[0]["name"]) == "intranode dispatch BF16"
    fixed = {"N": 4096, "H": 7168, "sms": 24}
    assert sweep(rows, "N", fixed, "logical_gbps") == {"intranode dispatch BF16": [(128, 7320.0), (4096, 11288.0)]}
    assert [x for x, _ in sweep(rows, "H", fixed, "logical_gbps")["intranode dispatch BF16"]] == [2048, 7168]
    assert [x for x, _ in sweep(rows, "sms", fixed, "logical_gbps")["intranode dispatch BF16"]] == [8, 24]


def test_plots_of_the_committed_run(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plots import write_plots
    paths = write_plots(COMMITTED, str(tmp_path))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == [f"2026-11-30T022939Z_2xH200_{m}.png" for m in ("internode", "intranode", "low_latency")]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_matplotlib_means_no_plots_and_a_message(tmp_path, monkeypatch, capsys):
    from bench.plots import write_plots
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib now raises
    assert write_plots(COMMITTED, str(tmp_path)) == []
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_nothing_to_plot_writes_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plots import write_plots
    doc = tmp_path / "cpu.json"
    doc.write_text(json.dumps({"results": [_result("CPU dispatch bf16", "reference", {"N": 64})]}))
    assert write_plots(str(doc)) == []


def test_results_go_where_the_user_says(tmp_path, monkeypatch):
    from bench.report import default_results_dir, out_path
    info, started = {"gpus": []}, dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
    assert out_path(str(tmp_path / "x.json"), ROOT, info, started) == str(tmp_path / "x.json")
    assert out_path(str(tmp_path), ROOT, info, started) == str(tmp_path / "2026-12-01T120000Z_cpu.json")
    assert default_results_dir(ROOT) == os.path.join(ROOT, "bench", "results")   # this clone
    installed = tmp_path / "site-packages"                                       # no .git: not a clone
    installed.mkdir()
    monkeypatch.chdir(tmp_path)
    assert out_path(None, str(installed), info, started) == str(tmp_path / "2026-12-01T120000Z_cpu.json")
