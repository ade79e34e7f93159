"""Run one of DeepEP V1's own test scripts, unchanged, against epcomm: `python -m tests.deep_ep_scripts`.

    python -m tests.deep_ep_scripts [--timeout S] [--gpus G] -- SCRIPT.py --num-processes N [ARGS ...]

DeepEP's tests/test_intranode.py and tests/test_low_latency.py start their own ranks
(torch.multiprocessing.spawn, N = their --num-processes) and bootstrap in utils.init_dist: NCCL,
`device_id=cuda:local_rank`, `torch.cuda.set_device(local_rank)`, MASTER_ADDR / MASTER_PORT, and
WORLD_SIZE / RANK read as the node count and node rank. This runs SCRIPT with:

- `import deep_ep` resolved to epcomm (epcomm/deep_ep_alias/shim first on PYTHONPATH: this shadows
  a real DeepEP install, for this run only) and epcomm's checkout importable;
- MASTER_ADDR=127.0.0.1, a free MASTER_PORT, WORLD_SIZE=1 and RANK=0 (one node);
- the multicast-off settings every GPU run here keeps (tests.gpu_session.SAFE_ENV).

With N <= G (the visible GPUs) nothing else changes: one GPU per rank, NCCL. With N > G all N ranks
share one GPU (the first visible one; CUDA_VISIBLE_DEVICES narrows to it):

- CUDA MPS: the control daemon of tests/gpu_session.py in a private pipe directory, stopped however
  the run ends; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 // N, so every rank's grids are resident
  together (a rank's device then reports its share of the SMs);
- EPCOMM_BACKEND=gpu (epcomm would pick its CPU backend for the gloo group);
- EPCOMM_SHARED_GPU_SHIM=1 and tests/shared_gpu_site first on PYTHONPATH: its sitecustomize, run at
  start-up by every process including the spawned ranks, applies tests/shared_gpu_shim.py, which
  changes exactly three calls: init_process_group's 'nccl' becomes 'gloo' (device_id dropped),
  torch.cuda.set_device(i) selects device 0, and all_gather_into_tensor also takes the stacked
  (R, *x.shape) output NCCL accepts and gloo does not. The scripts' other collectives on CUDA
  tensors (all_reduce, all_gather, barrier) run on gloo's own CUDA paths.

Timings printed under MPS are not performance figures. Exit status: the script's, 124 when it ran
past --timeout (every process of the run is then killed), 2 when the run could not start.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from epcomm.deep_ep_alias import shim_dir
from tests.gpu_session import (ROOT, SAFE_ENV, MpsDaemon, SessionError, free_port, run_guarded,
                               visible_gpus)

SITE_DIR = os.path.join(ROOT, "tests", "shared_gpu_site")
SHIM_FLAG = "EPCOMM_SHARED_GPU_SHIM"


@dataclass(frozen=True)
class Plan:
    """How SCRIPT's N ranks map onto G GPUs."""
    script: str
    script_args: List[str]
    num_processes: int
    gpus: int

    @property
    def shared(self) -> bool:
        return self.num_processes > self.gpus

    @property
    def thread_percentage(self) -> int:
        return max(1, 100 // self.num_processes)

    def env(self, master_port: int, base: Dict[str, str]) -> Dict[str, str]:
        """The script's environment on top of `base` (the caller's)."""
        env = dict(base, **SAFE_ENV)
        front = [str(shim_dir()), ROOT]
        if self.shared:
            front.insert(0, SITE_DIR)
            visible = base.get("CUDA_VISIBLE_DEVICES")
            env.update({SHIM_FLAG: "1", "EPCOMM_BACKEND": "gpu",
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(self.thread_percentage),
                        "CUDA_VISIBLE_DEVICES": visible.split(",")[0] if visible else "0"})
        env["PYTHONPATH"] = os.pathsep.join(front + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else []))
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "WORLD_SIZE": "1",
                    "RANK": "0"})
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(name, None)
        return env

    def describe(self) -> str:
        where = (f"{self.num_processes} ranks sharing one GPU under MPS ({self.thread_percentage} % "
                 f"of its SMs each, gloo, shared-GPU shim)" if self.shared else
                 f"{self.num_processes} rank(s), one GPU each (NCCL)")
        return f"{os.path.basename(self.script)}: {where}"


def num_processes_of(script_args: Sequence[str]) -> int:
    """The value of DeepEP's --num-processes in the script's arguments (the scripts default to 8,
    which is rarely what a one-GPU host wants: it must be given)."""
    for i, arg in enumerate(script_args):
        if arg == "--num-processes" and i + 1 < len(script_args):
            value = script_args[i + 1]
        elif arg.startswith("--num-processes="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            n = int(value)
        except ValueError:
            raise SessionError(f"--num-processes must be an integer, got {value!r}") from None
        if n < 1:
            raise SessionError(f"--num-processes must be at least 1, got {n}")
        return n
    raise SessionError("give the script's --num-processes N (DeepEP's scripts spawn N ranks; their "
                       "default of 8 is not assumed)")


def parse_args(argv: Sequence[str]):
    parser = argparse.ArgumentParser(prog="python -m tests.deep_ep_scripts",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds for the whole script; then every process of it is killed")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to count as visible (default: all)")
    argv = list(argv)
    if "--" not in argv:
        raise SessionError("usage: python -m tests.deep_ep_scripts [options] -- SCRIPT.py --num-processes N ...")
    cut = argv.index("--")
    args = parser.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if not rest or not rest[0].endswith(".py"):
        raise SessionError(f"expected a Python script after --, got {rest[:1] or 'nothing'}")
    if not os.path.isfile(rest[0]):
        raise SessionError(f"no such script: {rest[0]}")
    if args.gpus is not None and args.gpus < 1:
        raise SessionError(f"--gpus must be at least 1, got {args.gpus}")
    return args, rest[0], rest[1:]


def run(plan: Plan, timeout: float, extra_env: Dict[str, str]) -> int:
    env = plan.env(free_port(), dict(os.environ, **extra_env))
    # A session of its own: on timeout the whole group (the script and the ranks it spawned) dies.
    proc = subprocess.Popen([sys.executable, plan.script, *plan.script_args], env=env,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"deep_ep_scripts: {plan.describe()} ran past {timeout:.0f} s; killing it", flush=True)
        return 124
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args, script, script_args = parse_args(sys.argv[1:] if argv is None else argv)
        gpus = args.gpus if args.gpus is not None else visible_gpus()
        if gpus < 1:
            raise SessionError("no CUDA GPU found: DeepEP's scripts need one")
        plan = Plan(script, script_args, num_processes_of(script_args), gpus)
    except SessionError as e:
        print(f"deep_ep_scripts: {e}", file=sys.stderr)
        return 2
    print(f"deep_ep_scripts: {plan.describe()}", flush=True)
    workdir = tempfile.mkdtemp(prefix="epcomm-deep-ep-")
    mps = MpsDaemon(workdir)

    def body() -> int:
        try:
            if plan.shared:
                mps.start()
            return run(plan, args.timeout, mps.env if plan.shared else {})
        finally:
            mps.stop()
            shutil.rmtree(workdir, ignore_errors=True)

    return run_guarded("deep_ep_scripts", body)


if __name__ == "__main__":
    sys.exit(main())
