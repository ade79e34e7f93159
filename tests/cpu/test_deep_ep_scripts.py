"""The launcher of DeepEP's own test scripts (tests/deep_ep_scripts.py) without a GPU: arguments,
the rank layout and environment, the shared-GPU shim (tests/shared_gpu_shim.py) and the
sitecustomize that carries it into spawned ranks, and a DeepEP-style script run end to end on gloo."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest

from epcomm.deep_ep_alias import shim_dir
from tests import deep_ep_scripts as des
from tests import shared_gpu_shim as shim
from tests.conftest import ROOT, run_ranks
from tests.gpu_session import SessionError


@pytest.mark.parametrize("args, n", [(["--num-processes", "4"], 4), (["--x", "1", "--num-processes=2"], 2)])
def test_num_processes_read_from_the_script_arguments(args, n):
    assert des.num_processes_of(args) == n


@pytest.mark.parametrize("args, match", [([], "give the script's --num-processes"),
                                         (["--num-processes", "two"], "must be an integer"),
                                         (["--num-processes", "0"], "at least 1")])
def test_num_processes_missing_or_bad_is_a_clear_error(args, match):
    with pytest.raises(SessionError, match=match):
        des.num_processes_of(args)


def test_parse_args_splits_launcher_and_script_arguments(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    args, path, rest = des.parse_args(["--timeout", "9", "--", str(script), "--num-processes", "2"])
    assert (args.timeout, path, rest) == (9.0, str(script), ["--num-processes", "2"])
    with pytest.raises(SessionError, match="usage"):
        des.parse_args([str(script)])
    with pytest.raises(SessionError, match="no such script"):
        des.parse_args(["--", str(tmp_path / "missing.py")])


def test_one_gpu_per_rank_changes_only_the_alias_and_the_rendezvous():
    plan = des.Plan("s.py", [], num_processes=2, gpus=2)
    env = plan.env(4321, {"PYTHONPATH": "/mine", "LOCAL_RANK": "3", "WORLD_SIZE": "8"})
    assert not plan.shared
    assert env["PYTHONPATH"].split(os.pathsep) == [str(shim_dir()), ROOT, "/mine"]
    assert (env["MASTER_PORT"], env["WORLD_SIZE"], env["RANK"]) == ("4321", "1", "0")
    assert "LOCAL_RANK" not in env and env["NVSHMEM_DISABLE_NVLS"] == "1"
    for name in (des.SHIM_FLAG, "EPCOMM_BACKEND", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_VISIBLE_DEVICES"):
        assert name not in env


@pytest.mark.parametrize("n, pct", [(2, "50"), (4, "25"), (8, "12")])
def test_shared_gpu_env(n, pct):
    env = des.Plan("s.py", [], num_processes=n, gpus=1).env(1, {"CUDA_VISIBLE_DEVICES": "3,5"})
    assert env["PYTHONPATH"].split(os.pathsep) == [des.SITE_DIR, str(shim_dir()), ROOT]
    assert env[des.SHIM_FLAG] == "1" and env["EPCOMM_BACKEND"] == "gpu"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == pct and env["CUDA_VISIBLE_DEVICES"] == "3"


@pytest.mark.parametrize("given, want", [("nccl", "gloo"), ("NCCL", "gloo"), ("gloo", "gloo"),
                                         ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"), (None, None)])
def test_backend_rewrite(given, want):
    assert shim.gloo_backend(given) == want


def _fake_torch():
    calls = []

    def init_process_group(backend=None, init_method=None, world_size=-1, rank=-1, device_id=None):
        calls.append(("init", backend, init_method, world_size, rank, device_id))

    def set_device(device):
        calls.append(("set_device", device))

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        calls.append(("all_gather_into_tensor", tuple(output_tensor.shape), group))

    torch = types.SimpleNamespace(distributed=types.SimpleNamespace(init_process_group=init_process_group,
                                                                    all_gather_into_tensor=all_gather_into_tensor),
                                  cuda=types.SimpleNamespace(set_device=set_device))
    return torch, calls


def test_shim_rewrites_exactly_the_three_calls_and_installs_once():
    torch, calls = _fake_torch()
    assert shim.install(torch) and not shim.install(torch)
    # DeepEP's init_dist decides from the signature whether to pass device_id: it must still see it.
    assert "device_id" in inspect.signature(torch.distributed.init_process_group).parameters
    torch.distributed.init_process_group(backend="nccl", init_method="tcp://h:1", world_size=4, rank=3,
                                         device_id="cuda:3")
    torch.distributed.init_process_group("cpu:gloo,cuda:nccl", "env://")
    for index in (3, "cuda:2", -1):
        torch.cuda.set_device(index)
    import torch as real_torch
    x = real_torch.zeros(5, 2)
    torch.distributed.all_gather_into_tensor(real_torch.zeros(4, 5, 2), x, group="g")
    torch.distributed.all_gather_into_tensor(real_torch.zeros(20, 2), x)
    assert calls == [("init", "gloo", "tcp://h:1", 4, 3, None), ("init", "cpu:gloo,cuda:gloo", "env://", -1, -1, None),
                     ("set_device", 0), ("set_device", 0), ("set_device", -1),
                     ("all_gather_into_tensor", (20, 2), "g"), ("all_gather_into_tensor", (20, 2), None)]


def _stacked_gather(rank, world, group):
    import torch
    import torch.distributed as dist
    x = torch.full((3, 2), rank, dtype=torch.int64)
    out = torch.empty((world, 3, 2), dtype=torch.int64)
    with pytest.raises(RuntimeError, match="invalid tensor size"):
        dist.all_gather_into_tensor(out, x, group=group)
    shim.wrap_all_gather_into_tensor(dist.all_gather_into_tensor)(out, x, group=group)
    assert torch.equal(out, torch.arange(world).view(-1, 1, 1).expand(world, 3, 2))


def test_stacked_all_gather_into_tensor_fails_on_gloo_and_works_through_the_shim():
    run_ranks(_stacked_gather, 3)


def _run(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_sitecustomize_applies_the_shim_only_when_asked_and_keeps_the_hidden_one(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = ("import os, torch, torch.distributed as d\n"
            f"print(getattr(d.init_process_group, {shim.MARK!r}, False), os.environ.get('OTHER_SITECUSTOMIZE_RAN'))")
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([des.SITE_DIR, str(other)]))
    base.pop(des.SHIM_FLAG, None)
    on = _run(code, dict(base, **{des.SHIM_FLAG: "1"}))
    off = _run(code, base)
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert on.stdout.split() == ["True", "1"] and off.stdout.split() == ["False", "1"]


# A script started the way DeepEP's are (spawn, NCCL with device_id, WORLD_SIZE read as the node
# count), minus CUDA: on a CPU-only torch it can only run if the shim turned NCCL into gloo.
_SCRIPT = textwrap.dedent("""
    import inspect, os, sys
    import torch
    import torch.distributed as dist
    import deep_ep

    def loop(local_rank, num_local_ranks, out):
        params = dict(backend="nccl", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                      world_size=int(os.environ["WORLD_SIZE"]) * num_local_ranks,
                      rank=int(os.environ["RANK"]) * num_local_ranks + local_rank)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            params["device_id"] = torch.device(f"cuda:{local_rank}")
        dist.init_process_group(**params)
        total = torch.tensor([local_rank + 1])
        dist.all_reduce(total)
        gathered = torch.empty((num_local_ranks, 1), dtype=torch.int64)
        dist.all_gather_into_tensor(gathered, torch.tensor([local_rank * 10]))  # stacked, as DeepEP's
        import epcomm
        with open(os.path.join(out, f"rank{local_rank}"), "w") as f:
            f.write(f"{dist.get_backend()} {total.item()} {gathered.view(-1).tolist()} {deep_ep.Buffer is epcomm.Buffer}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        n = int(sys.argv[sys.argv.index("--num-processes") + 1])
        torch.multiprocessing.spawn(loop, args=(n, sys.argv[-1]), nprocs=n)
""")


def test_deep_ep_style_script_runs_on_gloo_with_the_alias(tmp_path):
    script = tmp_path / "test_fake.py"
    script.write_text(_SCRIPT)
    plan = des.Plan(str(script), ["--num-processes", "2", str(tmp_path)], num_processes=2, gpus=1)
    assert des.run(plan, timeout=240, extra_env={}) == 0
    got = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert got == ["gloo 3 [0, 10] True"] * 2


def test_timeout_kills_the_script_and_what_it_spawned(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(sys.argv[1], "w").write(str(child.pid))
        time.sleep(600)
    """))
    pid_file = tmp_path / "child"
    plan = des.Plan(str(script), [str(pid_file)], num_processes=1, gpus=1)
    assert des.run(plan, timeout=5, extra_env={}) == 124
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid):
    """Running, not a zombie waiting for its (re)parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_shared_run_without_mps_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert des.main(["--gpus", "1", "--", str(script), "--num-processes", "2"]) == 2
    assert "CUDA MPS is not available" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()


def test_launchers_turn_a_signal_into_130_after_their_cleanup(capsys):
    import signal
    from tests.gpu_session import run_guarded
    cleaned = []

    def body():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            return 0
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    assert run_guarded("x", body, "; stopping") == 130 and cleaned == [True]
    assert "x: interrupted (signal 15); stopping" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    assert run_guarded("x", lambda: (_ for _ in ()).throw(SessionError("no MPS"))) == 2
