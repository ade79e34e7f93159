"""Run the GPU test suite with one or several ranks per GPU: `python -m tests.gpu_session`.

    python -m tests.gpu_session [--ranks-per-gpu N] [--gpus G] [--jobs J] [--no-sm-partition]
                                [--timeout S] [--log-dir DIR] [pytest arguments ...]

With N = 1 this is torchrun with one rank per GPU over NCCL (what `make test-gpu` always ran). With
N > 1 the G x N ranks share the G GPUs under CUDA MPS: the control daemon is started in a private
pipe directory (and stopped however the run ends), every rank gets
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 // N so all ranks' grids are resident together (a rank's
device then reports only its share of the SMs), the ranks bootstrap over gloo (NCCL refuses two ranks
on one GPU) and EPCOMM_BACKEND=gpu forces the GPU backend, which would otherwise pick the CPU backend
for a gloo group. Timings under MPS are not performance figures: correctness only.
--no-sm-partition leaves CUDA_MPS_ACTIVE_THREAD_PERCENTAGE unset (every rank sees all SMs, so the
ranks' grids cannot all be resident: the failure reproduction of
tests/gpu/test_failure_gpu.py -k oversubscribed, which runs only then, EPCOMM_TEST_MPS_UNPARTITIONED=1).

--jobs J runs J independent groups of G x N ranks at once, each on every J-th collected test (the
same order on every rank), all under one MPS daemon with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE =
100 // (N x J): a cold JIT cache (each new shape compiles for seconds, one build at a time per
group) then spreads over the host's cores. Logs go to DIR/job<j>/ then.

Each rank's output goes to DIR/rank<r>.log (rank 0's also to the terminal); the end prints one line
per rank and rank 0's skip reasons grouped. Exit status: 0 when every rank's pytest passed.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPS_CONTROL = "nvidia-cuda-mps-control"
# Multicast can take the shared GPU machines down; kept off wherever the suite runs.
SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1"}
DEFAULT_PYTEST_ARGS = ["-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", "tests"]


class SessionError(RuntimeError):
    """The session could not run (no GPU, no MPS, bad arguments): nothing was tested."""


@dataclass(frozen=True)
class Layout:
    """Where each rank runs: ranks r*N .. r*N+N-1 share GPU r (contiguous, so a host's ranks stay
    contiguous in the group, as epcomm's NVLink / RDMA split requires)."""
    gpus: int
    ranks_per_gpu: int
    jobs: int = 1
    sm_partition: bool = True

    @property
    def world_size(self) -> int:
        """Ranks of one job's group."""
        return self.gpus * self.ranks_per_gpu

    @property
    def shared(self) -> bool:
        """Several processes on each GPU (ranks of one group, or of concurrent jobs): MPS."""
        return self.ranks_per_gpu * self.jobs > 1

    @property
    def thread_percentage(self) -> int:
        return 100 // (self.ranks_per_gpu * self.jobs)

    def host_threads(self, cpus: int) -> int:
        """torch's CPU threads per rank (OMP_NUM_THREADS): the host's cores split among every
        process of every job, as torchrun's default of 1 does for a GPU each: every rank builds
        the oracle's inputs on the CPU, and R x J ranks each starting one OpenMP thread per core
        would oversubscribe the host R x J times."""
        return max(1, cpus // (self.world_size * self.jobs))

    def gpu_of(self, rank: int) -> int:
        return rank // self.ranks_per_gpu

    def rank_env(self, rank: int, master_port: int, job: int = 0) -> Dict[str, str]:
        """Environment of one rank, on top of the caller's (torchrun's names, so conftest reads
        them the same way in both modes)."""
        env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master_port), "EPCOMM_TEST_RANKS_PER_GPU": str(self.ranks_per_gpu),
               "EPCOMM_BACKEND": "gpu", "EPCOMM_TEST_REPORT_AT_ONCE": "1", "EPCOMM_TEST_JOBS": str(self.jobs)}
        if self.shared:
            env["EPCOMM_TEST_SHARED_GPU"] = "1"
            if self.sm_partition:
                env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.thread_percentage)
            else:
                env["EPCOMM_TEST_MPS_UNPARTITIONED"] = "1"
        if self.jobs > 1:
            env["EPCOMM_TEST_SPLIT"] = f"{job}/{self.jobs}"
        return env


def parse_args(argv: Sequence[str]):
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_session", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-gpu", type=int, default=int(os.environ.get("RANKS_PER_GPU", "1") or 1))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("GPU_TEST_JOBS", "1") or 1),
                        help="independent groups of ranks run at once, each on every J-th test")
    parser.add_argument("--no-sm-partition", action="store_true",
                        help="with --ranks-per-gpu > 1: leave CUDA_MPS_ACTIVE_THREAD_PERCENTAGE unset")
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("GPU_TEST_TIMEOUT", "3000")),
                        help="seconds for the whole run; then every rank is killed")
    parser.add_argument("--log-dir", default=None, help="per-rank logs (default: a temporary directory)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.ranks_per_gpu < 1 or args.ranks_per_gpu > 100:
        raise SessionError(f"--ranks-per-gpu must be between 1 and 100, got {args.ranks_per_gpu}")
    if args.jobs < 1 or args.ranks_per_gpu * args.jobs > 100:
        raise SessionError(f"--jobs must be at least 1 and ranks-per-gpu x jobs at most 100, got "
                           f"{args.jobs} x {args.ranks_per_gpu}")
    if args.gpus is not None and args.gpus < 1:
        raise SessionError(f"--gpus must be at least 1, got {args.gpus}")
    if args.no_sm_partition and args.ranks_per_gpu < 2:
        raise SessionError("--no-sm-partition needs --ranks-per-gpu 2 or more (it is about ranks sharing a GPU)")
    if pytest_args and pytest_args[0] == "--":
        pytest_args = pytest_args[1:]
    return args, pytest_args or list(DEFAULT_PYTEST_ARGS)


def visible_gpus() -> int:
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip().splitlines()[-1])
    except Exception:
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- MPS ----------------------------------------------------------------------------------------
class MpsDaemon:
    """The MPS control daemon in a private pipe / log directory; `stop()` is safe to call twice."""

    def __init__(self, workdir: str):
        self.pipe_dir = os.path.join(workdir, "mps-pipe")
        self.log_dir = os.path.join(workdir, "mps-log")
        self.running = False

    @property
    def env(self) -> Dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def start(self) -> None:
        if shutil.which(MPS_CONTROL) is None:
            raise SessionError(f"CUDA MPS is not available: {MPS_CONTROL} is not on PATH (it ships with "
                               f"the NVIDIA driver); several ranks per GPU need it")
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        env = dict(os.environ, **self.env)
        run = subprocess.run([MPS_CONTROL, "-d"], env=env, capture_output=True, text=True, timeout=30)
        if run.returncode != 0:
            raise SessionError(f"CUDA MPS did not start ({MPS_CONTROL} -d exited {run.returncode}): "
                               f"{(run.stderr or run.stdout).strip()} {self._log_tail()}")
        self.running = True
        # The control pipe appears once the daemon listens; clients started before it would run
        # without MPS (time-sliced), so wait for it.
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(self.pipe_dir, "control")):
            if time.monotonic() > deadline:
                self.stop()
                raise SessionError(f"CUDA MPS started but its control pipe did not appear in "
                                   f"{self.pipe_dir} within 10 s {self._log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        env = dict(os.environ, **self.env)
        try:
            subprocess.run([MPS_CONTROL], input="quit\n", env=env, capture_output=True, text=True,
                           timeout=30)
        except subprocess.TimeoutExpired:
            print("gpu_session: MPS control daemon did not quit within 30 s", file=sys.stderr)

    def _log_tail(self) -> str:
        path = os.path.join(self.log_dir, "control.log")
        try:
            with open(path) as f:
                return "(control.log: " + " | ".join(f.read().strip().splitlines()[-3:]) + ")"
        except OSError:
            return ""


# ---- the ranks ----------------------------------------------------------------------------------
def job_log_dir(layout: Layout, log_dir: str, job: int) -> str:
    return log_dir if layout.jobs == 1 else os.path.join(log_dir, f"job{job}")


def launch(layout: Layout, pytest_args: List[str], log_dir: str, extra_env: Dict[str, str],
           job: int = 0):
    """One job's group: its ranks' processes, logging to `log_dir` (that job's folder)."""
    port = free_port()
    procs = []
    os.makedirs(log_dir, exist_ok=True)
    for rank in range(layout.world_size):
        env = dict(os.environ, **SAFE_ENV, **extra_env, **layout.rank_env(rank, port, job))
        env.setdefault("OMP_NUM_THREADS", str(layout.host_threads(os.cpu_count() or 1)))
        if not layout.sm_partition:
            env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)   # nor one inherited from the caller
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else ROOT
        env[STACKS_ENV] = os.path.join(log_dir, f"rank{rank}.stacks")
        env[TIMELINE_ENV] = os.path.join(log_dir, f"rank{rank}.timeline")
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        # --capture=sys: what native libraries write to the process's stderr (NVSHMEM's fatal init
        # errors, which exit(-1) at once, CUDA's aborts) lands in the rank log instead of in a
        # capture file that such an exit never prints; a caller's -s still overrides it.
        cmd = [sys.executable, "-m", "pytest", "--capture=sys", *pytest_args]
        # Rank 0 also writes to the terminal through tee-like forwarding in wait_all.
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    return procs


# A rank still running when it is to be killed first writes every thread's Python stack into
# rank<N>.stacks beside its log (faulthandler, registered by tests/conftest.py on SIGUSR1 for the
# file STACKS_ENV names; pytest replaces sys.stderr), so a killed run says where each rank
# was: report() names the test file line it was stuck in.
STACKS_SIGNAL = signal.SIGUSR1
STACKS_ENV = "EPCOMM_TEST_STACKS_FILE"
# Every rank also writes rank<N>.timeline: the wall-clock time each test started and ended, and its
# outcome, so the logs of jobs sharing a GPU line up (which test of another job ran while this one stalled).
TIMELINE_ENV = "EPCOMM_TEST_TIMELINE_FILE"
STACKS_WAIT_S = 2.0


def dump_stacks(*jobs) -> None:
    """Ask every running rank of these jobs (process lists) for its stacks, then give them
    STACKS_WAIT_S to write them (once, whatever the number of ranks asked)."""
    asked = False
    for procs in jobs:
        for proc, _ in procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, STACKS_SIGNAL)
                    asked = True
                except ProcessLookupError:
                    pass
    if asked:
        time.sleep(STACKS_WAIT_S)


def kill_all(procs) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc, _ in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def wait_all(jobs, echo_log: str, timeout: float) -> List[List[Optional[int]]]:
    """Wait for every rank of every job (a list of process lists), echoing `echo_log`; a job with a
    rank that failed while its others still run is given a grace period (its peers' collective
    waits are bounded), then that job's ranks are killed; at the deadline everything is."""
    deadline = time.monotonic() + timeout
    echo = open(echo_log)
    failed_at: Dict[int, float] = {}
    try:
        while True:
            chunk = echo.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            running = False
            for j, procs in enumerate(jobs):
                codes = [p.poll() for p, _ in procs]
                if any(c is None for c in codes):
                    running = True
                    if j not in failed_at and any(c not in (None, 0) for c in codes):
                        failed_at[j] = time.monotonic()
                    if j in failed_at and time.monotonic() - failed_at[j] > 120:
                        print(f"\ngpu_session: a rank of job {j} exited with failure 120 s ago and "
                              f"others still run; killing them", flush=True)
                        dump_stacks(procs)
                        kill_all(procs)
            if not running:
                break
            if time.monotonic() > deadline:
                print(f"\ngpu_session: timed out after {timeout:.0f} s; killing every rank", flush=True)
                dump_stacks(*jobs)
                break
            time.sleep(0.2)
        sys.stdout.write(echo.read())
    finally:
        echo.close()
        for procs in jobs:
            kill_all(procs)
            for _, log in procs:
                log.close()
    return [[p.returncode for p, _ in procs] for procs in jobs]


_SUMMARY = re.compile(r"=+ (.*(?:passed|failed|skipped|error|deselected|no tests ran).*?) (?:in [0-9.]+s.*)?=+\s*$")
_SKIP = re.compile(r"^SKIPPED \[(\d+)\] [^:]+(?::\d+)?: (.*)$")


def summarise(log_text: str) -> str:
    """The final pytest summary line of a log ('3 passed, 1 skipped'), or what ended it."""
    lines = [l for l in log_text.splitlines() if l.strip()]
    for line in reversed(lines):
        m = _SUMMARY.search(line)
        if m:
            return m.group(1).strip()
        if re.match(r"^\d+ (passed|failed|skipped)", line.strip()):
            return line.strip()
    return "no pytest summary (crashed or killed); " + progress(lines)


_FRAME = re.compile(r'File "([^"]+\.py)", line (\d+) in (\w+)')


def stuck_in(stacks_text: str) -> str:
    """'; stuck in FILE:LINE FUNCTION': the innermost test-file frame of the main thread in the
    last stack dump of a rank (dump_stacks), or '' without one."""
    lines = stacks_text.splitlines()
    starts = [i for i, l in enumerate(lines) if l.startswith("Current thread 0x")]
    if not starts:
        return ""
    for line in lines[starts[-1] + 1:]:
        if not line.startswith("  File"):
            break
        m = _FRAME.search(line)
        if m and os.path.basename(m.group(1)).startswith("test_"):
            path = m.group(1)
            path = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path
            return f"; stuck in {path}:{m.group(2)} {m.group(3)}"
    return ""


_PROGRESS = re.compile(r"^([.sFExX]+)\s*(\[\s*\d+%\])?$")


def progress(lines: List[str]) -> str:
    """What a log without a summary got through: its progress characters counted (-q), or its
    per-test PASSED / FAILED / SKIPPED lines (-v)."""
    counts = collections.Counter()
    for line in lines:
        m = _PROGRESS.match(line.strip())
        if m:
            counts.update({"passed": m.group(1).count("."), "failed": m.group(1).count("F"),
                           "skipped": m.group(1).count("s"), "errors": m.group(1).count("E")})
        else:
            for word in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
                if re.search(rf"::\S+ {word}\b", line):
                    counts[{"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped",
                            "ERROR": "errors"}[word]] += 1
    done = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    return f"got through {done or 'nothing'}; last line: {lines[-1][:160] if lines else 'none'}"


def skip_reasons(log_text: str) -> Dict[str, int]:
    counts: Dict[str, int] = collections.Counter()
    for line in log_text.splitlines():
        m = _SKIP.match(line.strip())
        if m:
            counts[m.group(2).strip()] += int(m.group(1))
    return dict(counts)


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")


def report(layout: Layout, codes: List[List[Optional[int]]], log_dir: str) -> int:
    jobs = f", {layout.jobs} jobs at once" if layout.jobs > 1 else ""
    print(f"\n===== gpu_session: {layout.world_size} ranks on {layout.gpus} GPU(s), "
          f"{layout.ranks_per_gpu} per GPU{jobs}{' under MPS' if layout.shared else ''}"
          f"{'' if layout.sm_partition or not layout.shared else ' without an SM partition'}; logs in {log_dir}")
    reasons: Dict[str, int] = collections.Counter()
    totals: Dict[str, int] = collections.Counter()
    for job, job_codes in enumerate(codes):
        folder = job_log_dir(layout, log_dir, job)
        for rank, code in enumerate(job_codes):
            with open(os.path.join(folder, f"rank{rank}.log"), errors="replace") as f:
                text = f.read()
            summary = summarise(text)
            stacks = os.path.join(folder, f"rank{rank}.stacks")
            if code != 0 and os.path.isfile(stacks):
                with open(stacks, errors="replace") as f:
                    summary += stuck_in(f.read())
            where = f"job {job} " if layout.jobs > 1 else ""
            print(f"{where}rank {rank} (GPU {layout.gpu_of(rank)}): exit {code}: {summary}")
            if rank == 0:
                reasons.update(skip_reasons(text))
                for n, what in _COUNT.findall(summary):
                    totals[what.rstrip("s") if what.startswith("error") else what] += int(n)
    if layout.jobs > 1:
        print("rank 0 of all jobs: " + (", ".join(f"{n} {w}" for w, n in totals.items()) or "nothing"))
        timelines = {}
        for job in range(layout.jobs):
            path = os.path.join(job_log_dir(layout, log_dir, job), "rank0.timeline")
            if os.path.isfile(path):
                timelines[job] = read_timeline(path)
        lines = beside_failures(timelines)
        if lines:
            print("tests of other jobs beside each failure or killed test (rank 0 timelines; the jobs share the GPUs):")
            for line in lines:
                print("  " + line)
    if reasons:
        print("skips on rank 0, by reason:")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d}  {reason}")
    return 0 if all(c == 0 for job_codes in codes for c in job_codes) else 1


# ---- timelines: which tests of other jobs ran beside a failure ------------------------------------
TimedTest = Tuple[float, Optional[float], str, str]   # start, end (None: still running), outcome, test id


def read_timeline(path: str) -> List[TimedTest]:
    """(start, end, outcome, test id) of every test a rank<N>.timeline names, in order; a test still
    running when the rank was killed has end None and outcome "running"."""
    started: Dict[str, float] = {}
    tests: List[TimedTest] = []
    with open(path, errors="replace") as f:
        for line in f:
            parts = line.split(None, 2)
            if len(parts) != 3:
                continue
            stamp, what, node = float(parts[0]), parts[1], parts[2].strip()
            if what == "start":
                started[node] = stamp
            elif node in started:
                tests.append((started.pop(node), stamp, what, node))
    tests.extend((stamp, None, "running", node) for node, stamp in started.items())
    return sorted(tests)


def beside_failures(timelines: Dict[int, List[TimedTest]], min_overlap_s: float = 1.0) -> List[str]:
    """One line per failed (or killed) test of a job: the tests of the other jobs that ran at least
    min_overlap_s beside it, with their own durations. Jobs share the GPU: a test that stalls
    there can be the cause or a victim of another job's."""
    last = max((e if e is not None else s for tests in timelines.values() for s, e, _, _ in tests), default=0.0)
    spans = {job: [(s, last if e is None else e, o, n) for s, e, o, n in tests] for job, tests in timelines.items()}
    lines = []
    for job, tests in sorted(spans.items()):
        for start, stop, outcome, node in tests:
            if outcome not in ("failed", "running"):
                continue
            beside = [f"job {other} {n} ({e - s:.1f} s, {o})"
                      for other, others in sorted(spans.items()) if other != job
                      for s, e, o, n in others if min(stop, e) - max(start, s) >= min_overlap_s]
            lines.append(f"job {job} {node} {outcome} ({stop - start:.1f} s); beside it: "
                         + ("; ".join(beside) or f"no test of another job for {min_overlap_s:g} s or more"))
    return lines


def run_guarded(prog: str, body: Callable[[], int], on_interrupt: str = "") -> int:
    """body()'s exit status; 2 when it raised SessionError, 130 when interrupted. SIGTERM and SIGINT
    raise KeyboardInterrupt meanwhile, so body's `finally` stops ranks and MPS however the run ends."""
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return body()
    except SessionError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"{prog}: interrupted ({e}){on_interrupt}", file=sys.stderr)
        return 130
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(argv: Sequence[str]) -> int:
    try:
        args, pytest_args = parse_args(argv)
        gpus = args.gpus if args.gpus is not None else visible_gpus()
        if gpus < 1:
            raise SessionError("no CUDA GPU found: the GPU suite needs one (CPU tests: make test)")
        layout = Layout(gpus, args.ranks_per_gpu, args.jobs, not args.no_sm_partition)
    except SessionError as e:
        print(f"gpu_session: {e}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="epcomm-gpu-session-")
    log_dir = args.log_dir or workdir
    os.makedirs(log_dir, exist_ok=True)
    mps = MpsDaemon(workdir)
    jobs = []

    def body() -> int:
        try:
            extra_env = {}
            if layout.shared:
                mps.start()
                extra_env.update(mps.env)
            jobs.extend(launch(layout, pytest_args, job_log_dir(layout, log_dir, j), extra_env, j)
                        for j in range(layout.jobs))
            codes = wait_all(jobs, os.path.join(job_log_dir(layout, log_dir, 0), "rank0.log"), args.timeout)
            return report(layout, codes, log_dir)
        finally:
            for procs in jobs:
                kill_all(procs)
            mps.stop()

    return run_guarded("gpu_session", body, "; stopping the ranks and MPS")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
