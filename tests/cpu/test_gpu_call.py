""".ci/gpu-call (the developer driver of one GPU-machine command) without a GPU: lanes run their
tasks in order, each bounded; a task that finished is marked done and skipped by the next call, one
cut at its bound is marked cut (REDO runs it again); a bound written `N!` starts only with N
seconds left; every log comes back in logs.tgz with one summary line per task."""
from __future__ import annotations

import os
import subprocess
import tarfile

from tests.conftest import ROOT

PLAN = """# lane name bound command
a    first   30     echo one > $LOGS/first/first.txt
a    long    500!   echo never
b    slow    2      sleep 4
"""


def _call(cwd, **env):
    out = os.path.join(cwd, "out")
    os.makedirs(out, exist_ok=True)
    run = subprocess.run(["bash", os.path.join(ROOT, ".ci", "gpu-call"), "plan"], cwd=cwd, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OUT=out, BUDGET="60", **env))
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_tasks_bounds_marks_and_logs(tmp_path):
    (tmp_path / "plan").write_text(PLAN)
    said = _call(str(tmp_path))
    assert "first: rc=0" in said and "long: not run" in said and "of the 500s it needs" in said, said
    assert "slow: rc=0" in said, said
    done = sorted(os.listdir(tmp_path / ".jit" / "done"))
    assert done == ["first", "slow.cut"], done          # slow took its whole bound: cut
    with tarfile.open(tmp_path / "out" / "logs.tgz") as packed:
        names = packed.getnames()
        assert "logs/summary.txt" in names and "logs/first.log" in names, names
        assert packed.extractfile("logs/first/first.txt").read() == b"one\n"

    again = _call(str(tmp_path))
    assert "first: done in an earlier call" in again and "slow: cut at its bound" in again, again
    redo = _call(str(tmp_path), REDO="slow", SKIP="long")
    assert "slow: rc=0" in redo and "long: done in an earlier call" in redo, redo


def _plans():
    ci = os.path.join(ROOT, ".ci")
    return sorted(os.path.join(ci, f) for f in os.listdir(ci) if f.startswith("gpu-plan"))


def test_the_committed_plans_are_well_formed():
    """Every .ci/gpu-plan* line is LANE NAME BOUND COMMAND with a unique name, a bound of seconds
    (`N` or `N!`) a call can hold, and a command bash parses."""
    plans = _plans()
    assert len(plans) >= 2, plans
    for plan in plans:
        names = []
        with open(plan) as f:
            lines = [line.rstrip("\n") for line in f if line.strip() and not line.lstrip().startswith("#")]
        for line in lines:
            lane, name, bound, command = line.split(None, 3)
            assert bound.rstrip("!").isdigit() and 0 < int(bound.rstrip("!")) <= 560, (plan, line)
            parsed = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
            assert parsed.returncode == 0, (plan, name, parsed.stderr)
            names.append(name)
        assert len(names) == len(set(names)), (plan, names)


def test_the_deepep_build_script_parses():
    script = os.path.join(ROOT, ".ci", "gpu-deepep-build")
    assert os.access(script, os.X_OK)
    parsed = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
