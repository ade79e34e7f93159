"""The examples, run as users run them (torchrun, 2 gloo ranks on the CPU backend), bounded in time.

moe_train.py: every step's loss (the mean over ranks, printed by rank 0) is finite, the last is below
the first, and the script's own check that the replicated parameters stayed equal on every rank
passed. moe_decode.py: its eager decode steps run and it says that the graph part needs GPUs.
"""
import math
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

TIMEOUT_S = 300


def _torchrun(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", EPCOMM_BACKEND="auto", CUDA_VISIBLE_DEVICES="")
    env.pop("EPCOMM_NUM_LOCAL_RANKS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", script), *args]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def test_train_example_loss_goes_down():
    steps = 6
    out = _torchrun("moe_train.py", "--steps", str(steps))
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]
    assert len(losses) == steps, out
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert "replicated parameters equal on every rank" in out, out


def test_decode_example_runs_eager_on_cpu():
    out = _torchrun("moe_decode.py", "--steps", "3")
    assert "eager: 3 decode steps of 16 tokens per rank on 2 ranks" in out, out
    assert "CUDA graph replay needs GPUs: skipped on the CPU backend" in out, out
