"""The README's CPU quick start runs as written (2 gloo processes, normal and low-latency modes)."""
import os
import re
import subprocess
import sys

from tests.conftest import ROOT, _free_port

MARKER = "<!-- test: cpu-quickstart"


def _quickstart() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    after = text[text.index(MARKER):]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match, "no python block after the quick-start marker"
    return match.group(1)


def test_cpu_quickstart_runs_as_written(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart())
    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_PORT=str(_free_port()))
    env.pop("EPCOMM_BACKEND", None)   # the gloo group alone must pick the CPU backend
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"rank {rank}: normal and low-latency round trips ok" in out.stdout
