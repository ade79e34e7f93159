"""The shared-GPU launcher of the GPU suite (tests/gpu_session.py) without a GPU: arguments, rank
layout and environment, MPS absent, log summaries; and the topology helpers GPU tests size from."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import gpu_session as gs
from tests import topology

from tests.conftest import ROOT


def test_layout_places_contiguous_ranks_on_each_gpu():
    layout = gs.Layout(gpus=2, ranks_per_gpu=4)
    assert layout.world_size == 8 and layout.shared and layout.thread_percentage == 25
    assert [layout.gpu_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    env = layout.rank_env(5, 12345)
    assert env["RANK"] == env["LOCAL_RANK"] == "5" and env["WORLD_SIZE"] == "8"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and env["EPCOMM_BACKEND"] == "gpu"
    assert env["EPCOMM_TEST_RANKS_PER_GPU"] == "4" and env["MASTER_PORT"] == "12345"


@pytest.mark.parametrize("n, pct", [(1, None), (2, "50"), (3, "33"), (8, "12")])
def test_thread_percentage_only_when_shared(n, pct):
    env = gs.Layout(1, n).rank_env(0, 1)
    assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == pct


def test_concurrent_jobs_share_the_gpu_under_mps_and_split_the_tests():
    layout = gs.Layout(gpus=1, ranks_per_gpu=2, jobs=4)
    assert layout.world_size == 2 and layout.shared and layout.thread_percentage == 12
    env = layout.rank_env(1, 5, job=3)
    assert env["EPCOMM_TEST_SPLIT"] == "3/4" and env["EPCOMM_TEST_SHARED_GPU"] == "1"
    assert env["EPCOMM_TEST_RANKS_PER_GPU"] == "2" and env["EPCOMM_TEST_JOBS"] == "4"   # memory shares: 8 processes
    assert gs.Layout(1, 8).rank_env(0, 1)["EPCOMM_TEST_JOBS"] == "1"
    single = gs.Layout(1, 1, jobs=3)       # one rank per job, still three processes per GPU
    assert single.shared and single.thread_percentage == 33
    assert "EPCOMM_TEST_SPLIT" not in gs.Layout(1, 1).rank_env(0, 1)
    assert "EPCOMM_TEST_SHARED_GPU" not in gs.Layout(1, 1).rank_env(0, 1)


def test_no_sm_partition_leaves_the_percentage_unset(monkeypatch, tmp_path):
    """--no-sm-partition: no CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, not even one the caller had set,
    and the ranks are told (the oversubscription reproduction runs only then)."""
    args, _ = gs.parse_args(["--ranks-per-gpu", "8", "--no-sm-partition"])
    layout = gs.Layout(1, args.ranks_per_gpu, sm_partition=not args.no_sm_partition)
    env = layout.rank_env(3, 1)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env and env["EPCOMM_TEST_MPS_UNPARTITIONED"] == "1"
    assert "EPCOMM_TEST_MPS_UNPARTITIONED" not in gs.Layout(1, 8).rank_env(3, 1)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "12")
    monkeypatch.setattr(gs.subprocess, "Popen", lambda cmd, env, **kw: env)
    envs = [proc for proc, _ in gs.launch(gs.Layout(1, 2, sm_partition=False), ["-q"], str(tmp_path), {})]
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in e for e in envs)
    with pytest.raises(gs.SessionError, match="needs --ranks-per-gpu 2 or more"):
        gs.parse_args(["--no-sm-partition"])


def test_parse_args_defaults_and_pytest_passthrough(monkeypatch):
    monkeypatch.delenv("RANKS_PER_GPU", raising=False)
    args, rest = gs.parse_args([])
    assert args.ranks_per_gpu == 1 and rest == gs.DEFAULT_PYTEST_ARGS
    args, rest = gs.parse_args(["--ranks-per-gpu", "4", "--timeout", "9", "-k", "x", "tests/a.py"])
    assert (args.ranks_per_gpu, args.timeout, rest) == (4, 9.0, ["-k", "x", "tests/a.py"])
    monkeypatch.setenv("RANKS_PER_GPU", "8")
    assert gs.parse_args([])[0].ranks_per_gpu == 8


@pytest.mark.parametrize("argv, message", [(["--ranks-per-gpu", "0"], "between 1 and 100"),
                                           (["--gpus", "0"], "at least 1"),
                                           (["--jobs", "0"], "--jobs must be at least 1"),
                                           (["--jobs", "20", "--ranks-per-gpu", "8"], "at most 100")])
def test_bad_arguments_are_refused(argv, message):
    with pytest.raises(gs.SessionError, match=message):
        gs.parse_args(argv)


def test_without_mps_it_says_so_and_stops(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))   # no nvidia-cuda-mps-control anywhere
    daemon = gs.MpsDaemon(str(tmp_path))
    with pytest.raises(gs.SessionError, match="CUDA MPS is not available"):
        daemon.start()
    daemon.stop()   # nothing started: a no-op


def test_mps_daemon_is_stopped_after_a_failed_start(monkeypatch, tmp_path):
    """A control binary that starts but never opens its pipe: start() fails and still sends quit."""
    fake = tmp_path / gs.MPS_CONTROL
    calls = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\ncat >> {calls}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gs.time, "monotonic", iter(range(0, 1000, 20)).__next__)
    daemon = gs.MpsDaemon(str(tmp_path))
    with pytest.raises(gs.SessionError, match="control pipe did not appear"):
        daemon.start()
    assert "-d" in calls.read_text() and "quit" in calls.read_text() and not daemon.running


def test_the_cli_without_a_gpu_exits_2_with_the_reason():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "tests.gpu_session", "--gpus", "1", "--ranks-per-gpu",
                          "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--ranks-per-gpu must be between 1 and 100" in run.stderr


def test_jobs_run_disjoint_shares_that_cover_the_selection(monkeypatch, tmp_path):
    """Two jobs under a stand-in MPS daemon run a 7-case CPU selection: 4 + 3 cases, each once."""
    fake = tmp_path / "bin" / gs.MPS_CONTROL
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\n[ "$1" = "-d" ] && touch "$CUDA_MPS_PIPE_DIRECTORY/control"\ncat >/dev/null\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    logs = tmp_path / "logs"
    code = gs.main(["--gpus", "1", "--jobs", "2", "--timeout", "300", "--log-dir", str(logs), "-q",
                    "-p", "no:cacheprovider", "-k", "test_sm_counts_fit_the_partition",
                    "tests/cpu/test_gpu_session.py"])
    assert code == 0
    ran = [gs.summarise((logs / f"job{j}" / "rank0.log").read_text()) for j in (0, 1)]
    assert ran[0].startswith("4 passed") and ran[1].startswith("3 passed"), ran


def test_a_bad_split_is_a_usage_error(monkeypatch):
    from tests import conftest
    monkeypatch.setenv("EPCOMM_TEST_SPLIT", "2/2")
    with pytest.raises(pytest.UsageError, match="0 <= j < J"):
        conftest._keep_this_jobs_share(None, [])


LOG = """\
...s..F
SKIPPED [3] tests/gpu/test_internode_gpu.py:74: needs at least 2 nodes of 2 ranks (4+ GPUs); this run has 2
SKIPPED [1] tests/gpu/test_intranode_gpu.py:416: needs 2 or more ranks
SKIPPED [2] tests/gpu/test_internode_gpu.py:74: needs at least 2 nodes of 2 ranks (4+ GPUs); this run has 2
FAILED tests/gpu/test_low_latency_gpu.py::test_x - AssertionError
========== 1 failed, 10 passed, 6 skipped in 12.34s ==========
"""


def test_summary_and_grouped_skip_reasons():
    assert gs.summarise(LOG) == "1 failed, 10 passed, 6 skipped"
    assert gs.skip_reasons(LOG) == {
        "needs at least 2 nodes of 2 ranks (4+ GPUs); this run has 2": 5, "needs 2 or more ranks": 1}
    assert gs.summarise("Traceback ...\nSegmentation fault").startswith("no pytest summary")
    killed = gs.summarise("..s.F...\n.ss [ 40%]\n")
    assert "got through 7 passed, 1 failed, 3 skipped" in killed, killed
    verbose = gs.summarise("tests/a.py::t[1] PASSED  [ 1%]\ntests/a.py::t[2] FAILED  [ 2%]\n")
    assert "1 passed, 1 failed" in verbose, verbose
    assert gs.summarise("3 passed in 1.0s") == "3 passed in 1.0s"


# ---- topology helpers ----------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8, 16])
def test_experts_divide_by_ranks_and_stay_near_the_nominal_count(ranks):
    for nominal in (16, 64, 256, 288):
        e = topology.experts(nominal, ranks)
        assert e % ranks == 0 and e >= ranks and abs(e - nominal) < ranks


@pytest.mark.parametrize("ranks, nodes", [(1, []), (2, [(2, 1)]), (3, [(3, 1)]), (4, [(4, 1), (2, 2)]),
                                          (8, [(8, 1), (4, 2), (2, 4)]), (6, [(6, 1), (3, 2), (2, 3)])])
def test_internode_topologies_of_a_rank_count(ranks, nodes):
    assert topology.internode_splits(ranks) == nodes


@pytest.mark.parametrize("wanted, available, got", [(24, 132, 24), (24, 32, 24), (48, 32, 32), (48, 14, 14),
                                                    (8, 13, 8), (20, 13, 12), (2, 1, None)])
def test_sm_counts_fit_the_partition(wanted, available, got):
    assert topology.fit_sms(wanted, available) == got



def test_a_rank_killed_at_the_deadline_says_where_it_was(tmp_path, capsys):
    """At the deadline every running rank is asked for its stacks (SIGUSR1 -> rank<N>.stacks via
    tests/conftest.py's faulthandler), then killed; the report names the test line it was stuck in."""
    test_file = tmp_path / "test_sleeper.py"
    test_file.write_text("import time\n\n\ndef test_sleeps():\n    time.sleep(120)\n")
    layout = gs.Layout(1, 1)
    logs = tmp_path / "logs"
    jobs = [gs.launch(layout, ["-q", "-p", "tests.conftest", "-p", "no:cacheprovider", str(test_file)], str(logs), {})]
    # long enough for pytest to start and import the conftest, far shorter than the sleep
    codes = gs.wait_all(jobs, str(logs / "rank0.log"), timeout=15)
    assert codes == [[-9]]
    assert gs.report(layout, codes, str(logs)) == 1
    printed = capsys.readouterr().out
    assert f"stuck in {test_file}:5 test_sleeps" in printed, printed


def test_stuck_in_reads_the_main_thread_of_the_last_dump():
    dump = ("Thread 0x01 (most recent call first):\n  File \"/x/test_other.py\", line 9 in helper\n\n"
            "Current thread 0x02 (most recent call first):\n  File \"/x/y.py\", line 3 in wait\n"
            "  File \"/x/test_a.py\", line 7 in test_a\n\n"
            "Current thread 0x02 (most recent call first):\n  File \"/x/epcomm/buffer.py\", line 1 in f\n"
            f"  File \"{gs.ROOT}/tests/gpu/test_b.py\", line 12 in test_b\n"
            "  File \"/x/test_a.py\", line 7 in test_a\n")
    assert gs.stuck_in(dump) == "; stuck in tests/gpu/test_b.py:12 test_b"
    assert gs.stuck_in("no dump here") == ""


def test_native_output_reaches_the_rank_log(tmp_path):
    """Ranks run pytest with --capture=sys: a write to fd 2 followed by an immediate exit (what
    NVSHMEM does on a fatal init error) is in the rank's log."""
    test_file = tmp_path / "test_native_exit.py"
    test_file.write_text("import os\n\n\ndef test_exits():\n    os.write(2, b'native fatal error\\n')\n"
                         "    os._exit(255)\n")
    logs = tmp_path / "logs"
    jobs = [gs.launch(gs.Layout(1, 1), ["-q", "-p", "no:cacheprovider", str(test_file)], str(logs), {})]
    assert gs.wait_all(jobs, str(logs / "rank0.log"), timeout=60) == [[255]]
    assert "native fatal error" in (logs / "rank0.log").read_text()


def test_every_rank_writes_when_each_test_started_and_ended(tmp_path):
    """rank<N>.timeline (tests/conftest.py's hooks): a start line and an outcome line per test, in
    order, with wall-clock times that bracket the test's own; read back as (start, end, outcome)."""
    test_file = tmp_path / "test_three.py"
    test_file.write_text("import time\n\nimport pytest\n\n\ndef test_a():\n    print('a', time.time())\n\n\n"
                         "def test_b():\n    assert False\n\n\ndef test_c():\n    pytest.skip('no')\n")
    logs = tmp_path / "logs"
    before = time.time()
    jobs = [gs.launch(gs.Layout(1, 1), ["-q", "-s", "-p", "tests.conftest", "-p", "no:cacheprovider",
                                        str(test_file)], str(logs), {})]
    assert gs.wait_all(jobs, str(logs / "rank0.log"), timeout=60) == [[1]]
    lines = [line.split() for line in (logs / "rank0.timeline").read_text().splitlines()]
    assert [(what, node.split("::")[-1]) for _, what, node in lines] == [
        ("start", "test_a"), ("passed", "test_a"), ("start", "test_b"), ("failed", "test_b"),
        ("start", "test_c"), ("skipped", "test_c")]
    stamps = [float(t) for t, _, _ in lines]
    ran_at = float(next(line for line in (logs / "rank0.log").read_text().split("\n") if line.startswith("a "))
                   .split()[1])
    assert before <= stamps[0] <= ran_at <= stamps[1] <= stamps[2] <= stamps[5] <= time.time()
    read = gs.read_timeline(str(logs / "rank0.timeline"))
    assert [(outcome, node.split("::")[-1]) for _, _, outcome, node in read] == [
        ("passed", "test_a"), ("failed", "test_b"), ("skipped", "test_c")]
    assert [(s, e) for s, e, _, _ in read] == [(stamps[0], stamps[1]), (stamps[2], stamps[3]), (stamps[4], stamps[5])]


def test_a_failure_lists_the_other_jobs_tests_that_ran_beside_it(tmp_path):
    """Only tests of other jobs that overlap a failed (or killed) test by 1 s or more; a killed
    test (no end line) lasts until the last stamp of any job."""
    (tmp_path / "j0").write_text("100 start a\n130 failed a\n131 start k\n")
    (tmp_path / "j1").write_text("90 start b\n101 passed b\n101 start c\n121 passed c\n140 start d\n150 passed d\n")
    (tmp_path / "j2").write_text("129.5 start e\n135 passed e\n")
    timelines = {j: gs.read_timeline(str(tmp_path / f"j{j}")) for j in range(3)}
    assert timelines[0] == [(100.0, 130.0, "failed", "a"), (131.0, None, "running", "k")]
    assert gs.beside_failures(timelines) == [
        "job 0 a failed (30.0 s); beside it: job 1 b (11.0 s, passed); job 1 c (20.0 s, passed)",
        "job 0 k running (19.0 s); beside it: job 1 d (10.0 s, passed); job 2 e (5.5 s, passed)"]
    assert gs.beside_failures({0: timelines[0][:1]}) == [
        "job 0 a failed (30.0 s); beside it: no test of another job for 1 s or more"]


def test_host_threads_split_the_cores(monkeypatch, tmp_path):
    """Every rank of every job gets OMP_NUM_THREADS = cores // processes (at least 1); a caller's
    own setting wins."""
    assert gs.Layout(1, 8, jobs=2).host_threads(16) == 1
    assert gs.Layout(1, 2).host_threads(16) == 8
    assert gs.Layout(2, 8, jobs=3).host_threads(16) == 1
    monkeypatch.setattr(gs.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(gs.subprocess, "Popen", lambda cmd, env, **kw: env)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    envs = [proc for proc, _ in gs.launch(gs.Layout(1, 4), ["-q"], str(tmp_path), {})]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["4"] * 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    envs = [proc for proc, _ in gs.launch(gs.Layout(1, 4), ["-q"], str(tmp_path), {})]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["3"] * 4
