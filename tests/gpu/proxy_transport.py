"""The internode round trip over NVSHMEM's UCX proxy transport on TCP loopback, with a verdict:
`python -m tests.gpu.proxy_transport --ucx PATH [--ranks M] [--timeout S] [--log-dir DIR]`.

M ranks share one GPU under CUDA MPS as M nodes of 1 rank (tests.gpu_session), with P2P between the
PEs off, so every transfer of the RDMA stage goes through NVSHMEM's CPU proxy and UCX over TCP, as
on RoCE / EFA clusters that use the proxy transports (IBRC, UCX, libfabric) rather than IBGDA.
Settings (/work/shared/docs/platform.md, "A proxy remote transport without a NIC"):
  NVSHMEM_REMOTE_TRANSPORT=ucx NVSHMEM_DISABLE_P2P=1 UCX_TLS=tcp,cuda_copy,self UCX_NET_DEVICES=lo
  LD_LIBRARY_PATH=<ucx>/lib UCX_MODULE_DIR=<ucx>/lib/ucx NVSHMEM_DEBUG=INFO
--ucx: the libucx-cu13 (or -cu12) wheel file, a folder holding it (`pip download libucx-cu13
--no-deps -d .whl`: /.whl/ is git-ignored, so carry it to the GPU machine), the folder it was
unpacked into, or a UCX prefix with lib/libucp.so.0; default: the installed `libucx` package. The ranks run tests/gpu/test_internode_proxy_gpu.py (it skips without
EPCOMM_TEST_PROXY_TRANSPORT=ucx, which this sets).

Prints one line `VERDICT: PASS | FAIL | NOT RUN: why`; exit status 0, 1, 2 alike.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_FILE = "tests/gpu/test_internode_proxy_gpu.py"
GATE = "EPCOMM_TEST_PROXY_TRANSPORT"


class NotRun(RuntimeError):
    """Nothing was tested (no UCX, no GPU, no MPS): the verdict says why."""


def find_ucx(spec: Optional[str], scratch: str) -> str:
    """The UCX prefix (a folder with lib/libucp.so.0) from --ucx or the installed libucx package; a
    wheel file is unpacked into `scratch`."""
    if spec is None:
        found = importlib.util.find_spec("libucx")
        if found is None or not found.submodule_search_locations:
            raise NotRun("no UCX: pass --ucx with the libucx-cu13 wheel (or its unpacked folder), or "
                         "pip install libucx-cu13")
        spec = list(found.submodule_search_locations)[0]
    wheels = sorted(glob.glob(os.path.join(spec, "libucx*.whl"))) if os.path.isdir(spec) else []
    if wheels:   # a download folder (pip download libucx-cu13 --no-deps -d DIR)
        spec = wheels[-1]
    if os.path.isfile(spec) and spec.endswith(".whl"):
        with zipfile.ZipFile(spec) as wheel:
            for member in wheel.infolist():
                path = wheel.extract(member, scratch)
                mode = member.external_attr >> 16   # zip keeps Unix modes here; extract() drops them
                if mode & 0o777:
                    os.chmod(path, mode & 0o777)
        spec = scratch
    for prefix in (spec, os.path.join(spec, "libucx")):
        if os.path.exists(os.path.join(prefix, "lib", "libucp.so.0")):
            return os.path.abspath(prefix)
    raise NotRun(f"no UCX at {spec}: expected lib/libucp.so.0 there or under libucx/")


def transport_env(ucx: str, environ: Dict[str, str]) -> Dict[str, str]:
    """The variables the ranks get on top of `environ` (a user's UCX_TLS / UCX_NET_DEVICES /
    NVSHMEM_DEBUG win). NVSHMEM_DEBUG=INFO: a rank that dies in NVSHMEM's start-up of the transport
    says where in its log."""
    lib = os.path.join(ucx, "lib")
    paths = [lib] + [p for p in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    return {"NVSHMEM_REMOTE_TRANSPORT": "ucx", "NVSHMEM_DISABLE_P2P": "1",
            "UCX_TLS": environ.get("UCX_TLS") or "tcp,cuda_copy,self",
            "UCX_NET_DEVICES": environ.get("UCX_NET_DEVICES") or "lo",
            "LD_LIBRARY_PATH": os.pathsep.join(paths), "UCX_MODULE_DIR": os.path.join(lib, "ucx"),
            "NVSHMEM_DEBUG": environ.get("NVSHMEM_DEBUG") or "INFO", GATE: "ucx"}


def ucx_devices(ucx: str, env: Dict[str, str]) -> Tuple[bool, str]:
    """(tcp on the configured device listed, what ucx_info -d said in one line)."""
    info = os.path.join(ucx, "bin", "ucx_info")
    if not os.access(info, os.X_OK):
        return True, "ucx_info not shipped; not checked"
    run = subprocess.run([info, "-d"], env=env, capture_output=True, text=True, timeout=60)
    transports = sorted(set(re.findall(r"Transport:\s*(\S+)", run.stdout)))
    devices = sorted(set(re.findall(r"Device:\s*(\S+)", run.stdout)))
    ok = "tcp" in transports and env["UCX_NET_DEVICES"] in devices
    return ok, f"ucx_info -d: transports {transports}, devices {devices}"


# Markers in the ranks' logs, most telling first: (regex, verdict).
FAILURE_MARKERS = [
    (r"AMO \d+ not supported[^\n]*", "an NVSHMEM remote atomic (signal / AMO) in a transfer, which the UCX "
                                     "transport without GDRCopy refuses"),
    (r"GDRCopy[^\n]*", "NVSHMEM needs GDRCopy for this transport"),
    (r"(?:nvshmem|NVSHMEM)[^\n]*(?:transport|ucx)[^\n]*(?:fail|error)[^\n]*", "NVSHMEM's UCX transport did not come up"),
    (r"PeerTimeout[^\n]*", "a wait ran out (data or signal never arrived over the proxy)"),
]


def unfinished_step(log_text: str) -> Optional[str]:
    """The step of test_symmetric_allocation_over_the_proxy begun and never returned (the log's
    `proxy step: NAME: begun|returned` lines), if any."""
    state: Dict[str, str] = {}
    for name, said in re.findall(r"^proxy step: (\S+): (begun|returned)$", log_text, re.M):
        state[name] = said
    return next((name for name, said in state.items() if said == "begun"), None)


def verdict(session_ok: bool, logs: List[str]) -> Tuple[int, str]:
    """(exit status, verdict line) from the session's status (every rank's pytest passed) and the
    ranks' logs (rank order)."""
    from tests.gpu_session import skip_reasons, summarise
    summaries = [summarise(text) for text in logs]
    if session_ok and logs:
        if all(re.search(r"\d+ passed", s) and "skipped" not in s for s in summaries):
            return 0, (f"VERDICT: PASS: internode dispatch / combine over NVSHMEM's UCX proxy transport "
                       f"(TCP loopback, P2P off), {len(logs)} nodes of 1 rank, bit-exact against the "
                       f"oracle ({summaries[0]})")
        reasons = skip_reasons(logs[0])
        return 2, f"VERDICT: NOT RUN: {summaries[0]}; skipped: {'; '.join(reasons) or 'no reason printed'}"
    text = "\n".join(logs)
    unfinished = unfinished_step(text)
    amo = re.search(r"AMO (\d+) not supported[^\n]*", text)
    if unfinished and amo:   # nothing of epcomm ran: this machine cannot run the check
        return 2, (f"VERDICT: NOT RUN: NVSHMEM's own {unfinished} aborted before any epcomm kernel ran: its "
                   f"barrier signals a PE that P2P cannot reach with a remote atomic (AMO {amo.group(1)}), "
                   f"which the UCX transport applies only with GDRCopy: `{amo.group(0).strip()[:200]}`")
    for pattern, meaning in FAILURE_MARKERS:
        found = re.search(pattern, text)
        if found:
            return 1, f"VERDICT: FAIL: {meaning}: `{found.group(0).strip()[:200]}`"
    worst = next((f"rank {r}: {s}" for r, s in enumerate(summaries) if "failed" in s or "no pytest" in s
                  or "error" in s), summaries[0] if summaries else "no rank log")
    return 1, f"VERDICT: FAIL: {worst}"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.proxy_transport", description=__doc__.split("\n")[0])
    parser.add_argument("--ucx", default=None, help="libucx wheel, its unpacked folder, or a UCX prefix")
    parser.add_argument("--ranks", type=int, default=2, help="nodes of 1 rank sharing GPU 0 (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole session")
    parser.add_argument("--log-dir", default=None, help="per-rank logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="epcomm-proxy-")
    log_dir = args.log_dir or os.path.join(scratch, "logs")
    os.makedirs(log_dir, exist_ok=True)
    try:
        if args.ranks < 2:
            raise NotRun(f"--ranks must be at least 2 (nodes of 1 rank), got {args.ranks}")
        ucx = find_ucx(args.ucx, os.path.join(scratch, "ucx"))
        env = dict(os.environ, **transport_env(ucx, os.environ))
        ok, said = ucx_devices(ucx, env)
        print(f"proxy_transport: UCX at {ucx}; {said}", flush=True)
        if not ok:
            raise NotRun(f"UCX has no tcp transport on {env['UCX_NET_DEVICES']} ({said})")
        cmd = [sys.executable, "-m", "tests.gpu_session", "--ranks-per-gpu", str(args.ranks), "--gpus", "1",
               "--timeout", str(args.timeout), "--log-dir", log_dir, "--",
               "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", TEST_FILE]
        run = subprocess.run(cmd, cwd=ROOT, env=env)
        if run.returncode == 2:
            raise NotRun("tests.gpu_session could not start the ranks (no GPU or no MPS; its message above)")
        logs = []
        for rank in range(args.ranks):
            path = os.path.join(log_dir, f"rank{rank}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    logs.append(f.read())
        status, line = verdict(run.returncode == 0, logs)
    except NotRun as e:
        status, line = 2, f"VERDICT: NOT RUN: {e}"
    finally:
        shutil.rmtree(os.path.join(scratch, "ucx"), ignore_errors=True)
    print(line, flush=True)
    print(f"proxy_transport: logs in {log_dir}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
