"""Shared test machinery.

CPU tests run the reference backend on several gloo processes with `run_ranks(fn, world_size, ...)`.
GPU tests (marker `gpu`) run under torchrun (`make test-gpu`): every rank runs the same pytest session
and each test is collective; the `dist` fixture gives the NCCL group. Without torchrun or GPUs they
skip with the reason printed (`-rs`).
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import time
import traceback

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tests.gpu_session import STACKS_ENV, STACKS_SIGNAL, TIMELINE_ENV  # noqa: E402 (needs ROOT on sys.path)

# tests.gpu_session asks a rank it is about to kill for every thread's stack, written to the file
# it names (pytest replaces sys.stderr). The file object must outlive the registration.
_STACKS_FILE = None
if os.environ.get(STACKS_ENV):
    _STACKS_FILE = open(os.environ[STACKS_ENV], "a")
    faulthandler.register(STACKS_SIGNAL, file=_STACKS_FILE, all_threads=True)

# tests.gpu_session's timeline: "<unix time> start <test id>" when a test starts and "<unix time>
# passed|failed|skipped <test id>" when it ends (failed: any of its phases), flushed at once (a rank
# killed at the deadline keeps what it wrote).
_TIMELINE_FILE = open(os.environ[TIMELINE_ENV], "a", buffering=1) if os.environ.get(TIMELINE_ENV) else None
_OUTCOMES = {}


def pytest_runtest_logstart(nodeid, location):
    if _TIMELINE_FILE is not None:
        _TIMELINE_FILE.write(f"{time.time():.3f} start {nodeid}\n")


def pytest_runtest_logfinish(nodeid, location):
    if _TIMELINE_FILE is not None:
        _TIMELINE_FILE.write(f"{time.time():.3f} {_OUTCOMES.pop(nodeid, 'passed')} {nodeid}\n")


# ---------------------------------------------------------------------------------------------
# CPU: N gloo processes
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, result_dir):
    import torch
    import torch.distributed as dist
    os.environ.setdefault("EPCOMM_BACKEND", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        fn(rank, world_size, dist.group.WORLD, *args)
        status = "ok"
    except BaseException:  # report everything to the parent, which raises
        status = traceback.format_exc()
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(status)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0):
    """Run fn(rank, world_size, group, *args) on world_size gloo processes; raise on any failure.
    fn must be a module-level function (it is pickled into spawned processes)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as result_dir:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, result_dir))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        failures = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                failures.append(f"rank {r}: did not finish in {timeout} s")
                continue
            path = os.path.join(result_dir, f"rank{r}")
            status = open(path).read() if os.path.exists(path) else f"exit code {p.exitcode}"
            if status != "ok":
                failures.append(f"rank {r}:\n{status}")
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)


# ---------------------------------------------------------------------------------------------
# GPU: torchrun
# ---------------------------------------------------------------------------------------------
def _gpu_skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU tests run on the GPU machine: make test-gpu)"
    if "WORLD_SIZE" not in os.environ:
        return "GPU tests are collective: run them under torchrun with `make test-gpu`"
    return None


def pytest_runtest_logreport(report):
    """Under tests.gpu_session, print each failure as it happens: a run killed at its time limit
    still shows what failed before (pytest's own report comes only at the end). Also keeps each
    test's outcome for the timeline."""
    if report.failed or (report.skipped and report.nodeid not in _OUTCOMES):
        _OUTCOMES[report.nodeid] = "failed" if report.failed else "skipped"
    if report.failed and os.environ.get("EPCOMM_TEST_REPORT_AT_ONCE") == "1":
        sys.stdout.write(f"\nFAILED at once: {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext[-6000:]}\n")
        sys.stdout.flush()


@pytest.hookimpl(trylast=True)   # after -k / -m deselection: split what is really selected
def pytest_collection_modifyitems(config, items):
    _keep_this_jobs_share(config, items)
    reason = _gpu_skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(marker)


def _keep_this_jobs_share(config, items) -> None:
    """EPCOMM_TEST_SPLIT=j/J (tests.gpu_session --jobs J): run every J-th collected test from the
    j-th on. Collection order is the same on every rank, so a job's ranks run the same tests."""
    split = os.environ.get("EPCOMM_TEST_SPLIT")
    if not split:
        return
    job, jobs = (int(v) for v in split.split("/"))
    if not 0 <= job < jobs:
        raise pytest.UsageError(f"EPCOMM_TEST_SPLIT={split}: expected j/J with 0 <= j < J")
    kept = [item for i, item in enumerate(items) if i % jobs == job]
    dropped = [item for i, item in enumerate(items) if i % jobs != job]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


class DistEnv:
    """The collective test environment. With one rank per GPU (torchrun) the group is NCCL; with
    several ranks per GPU (`python -m tests.gpu_session --ranks-per-gpu N`, CUDA MPS) it is gloo,
    since NCCL refuses two ranks on one device, and rank r uses GPU r // N."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.ranks_per_gpu = int(os.environ.get("EPCOMM_TEST_RANKS_PER_GPU", "1"))
        # Processes of every concurrent job (tests.gpu_session --jobs) on each GPU: memory shares.
        self.processes_per_gpu = self.ranks_per_gpu * int(os.environ.get("EPCOMM_TEST_JOBS", "1"))
        self.device_index = self.local_rank // self.ranks_per_gpu
        # Shared with other ranks of this group, or with other jobs' processes (tests.gpu_session).
        self.shared_gpu = self.ranks_per_gpu > 1 or os.environ.get("EPCOMM_TEST_SHARED_GPU") == "1"
        torch.cuda.set_device(self.device_index)
        self.device = torch.device("cuda", self.device_index)
        if not dist.is_initialized():
            if self.shared_gpu:
                dist.init_process_group("gloo")
            else:
                dist.init_process_group("nccl", device_id=self.device)
        self.group = dist.group.WORLD
        # The SMs this rank may use: under an MPS partition the device reports only its share.
        self.num_sms = torch.cuda.get_device_properties(self.device_index).multi_processor_count
        # The default Config (Buffer.num_sms SMs) must fit the share too, or every call that takes
        # the default would (rightly) be refused before launch.
        import epcomm
        from tests.topology import fit_sms
        default = fit_sms(epcomm.Buffer.num_sms, self.num_sms)
        if default is not None and default < epcomm.Buffer.num_sms:
            epcomm.Buffer.set_num_sms(default)

    def all_ok(self, ok: bool) -> bool:
        """True only if ok is true on every rank, so all ranks fail (or pass) a check together."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([0 if ok else 1], device="cpu" if self.shared_gpu else self.device)
        dist.all_reduce(t)
        return int(t.item()) == 0

    def barrier(self):
        import torch.distributed as dist
        if self.shared_gpu:
            dist.barrier()
        else:
            dist.barrier(device_ids=[self.device_index])

    def sms(self, wanted: int) -> int:
        """A normal-mode test's SM count fitted to this rank's share of the device (every block of a
        call must be resident at once); skips when not even 2 SMs fit."""
        from tests.topology import fit_sms
        fitted = fit_sms(wanted, self.num_sms)
        if fitted is None:
            pytest.skip(f"needs 2 SMs per rank; this rank's device has {self.num_sms}")
        return fitted

    def require_sms(self, count: int, what: str) -> None:
        """Skip (on every rank alike: the partition is the same everywhere) when this rank's SM
        share cannot hold `count` SMs."""
        if count > self.num_sms:
            pytest.skip(f"{what} needs {count} SMs; this rank's device has {self.num_sms}"
                        f"{' (MPS partition)' if self.shared_gpu else ''}")


def on_all_ranks(dist_env, check):
    """Run check() here; fail on every rank if it failed on any (never leave a rank hanging)."""
    try:
        check()
        ok, message = True, ""
    except Exception:
        ok, message = False, traceback.format_exc()
    assert dist_env.all_ok(ok), message or "failed on another rank"


_DIST = None


@pytest.fixture(scope="session")
def dist_env():
    global _DIST
    if _DIST is None:
        _DIST = DistEnv()
    return _DIST
