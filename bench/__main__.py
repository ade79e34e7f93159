"""`python -m bench` (what `make bench` runs).

With GPUs: one process per local GPU (NCCL), the same-run baselines of targets.md, the layout kernel
and every implemented mode; a table on stdout, JSON and PNG plots (bench/plots.py) in --out
(default bench/results/ in a clone, else the current directory). Without GPUs (or with
EPCOMM_BACKEND=cpu): the CPU reference backend on 2 gloo processes, checked round trips.
Exit status: 0 when every case is ok, skipped or not implemented; 1 when a case failed or a rank died;
2 when torch is missing.
"""
from __future__ import annotations

import argparse
import os
import queue as queue_module
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALIASES = {"lowlat": "low_latency", "low-latency": "low_latency", "ll": "low_latency",
           "baseline": "baselines", "copies": "copy", "p2p": "copy", "inter": "internode"}
CPU_WORLD_SIZE = 2
# Measured in the parent before the ranks start: "copy" in a process of its own (no rank opens a
# context on another GPU), "startup" in fresh processes (bench/startup.py).
PARENT_PROBES = ("copy", "startup")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations and sweep points")
    p.add_argument("--only", default="", metavar="M1,M2",
                   help="modules to run: copy, startup, baselines, layout, intranode, low_latency, host "
                        "(host issue time per call), internode (default: all)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the JSON (<UTC date>_<machine>.json) and its PNG plots, or a .json "
                        "path; default bench/results/ in a clone, else the current directory")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds the whole run may take before its processes are killed")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _select(only: str, available):
    if not only:
        return list(available)
    wanted = [ALIASES.get(m.strip(), m.strip()) for m in only.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in available]
    if unknown:
        raise SystemExit(f"--only: unknown module(s) {unknown}; choose from {', '.join(available)}")
    return [m for m in available if m in wanted]


def _copy_probe(mp_ctx, quick: bool, timeout: float):
    """Copy baselines in a short-lived process of their own: returns merged results."""
    from bench import report
    from bench.baselines import copy_probe_main
    from bench.harness import Record
    queue = mp_ctx.Queue()
    proc = mp_ctx.Process(target=copy_probe_main, args=(queue, quick))
    proc.start()
    outcome, give_up = None, time.monotonic() + timeout
    while outcome is None:
        try:
            outcome = queue.get(timeout=1.0)
        except queue_module.Empty:
            if not proc.is_alive() and queue.empty():
                outcome = f"the copy probe process died (exit code {proc.exitcode})"
            elif time.monotonic() > give_up:
                outcome = f"the copy probe gave no answer within {timeout:.0f} s"
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    if isinstance(outcome, str):
        failed = Record("copy baselines", status=f"error: {outcome.strip().splitlines()[-1]}",
                        extra={"traceback": outcome}, module="copy")
        return report.merge([[failed]])
    return report.merge(outcome)


def _startup_probe(quick: bool, num_gpus: int):
    """Import and first-use JIT times, each from fresh processes (bench/startup.py): merged results."""
    from bench import report
    from bench.startup import startup_probe
    print("bench: start-up costs (fresh processes, empty JIT cache)...", file=sys.stderr)
    return report.merge([startup_probe(quick, num_gpus)])


def _wait(procs, deadline: float) -> int:
    """Join the rank processes; once one fails, give the others a minute, then kill them."""
    failed_at = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        codes = [p.exitcode for p in procs if not p.is_alive()]
        if not alive:
            break
        if failed_at is None and any(c != 0 for c in codes):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now - failed_at > 60):
            for rank, p in enumerate(procs):
                if p.is_alive():
                    print(f"bench: killing rank {rank} (" +
                          ("time limit reached" if now > deadline else "another rank failed") + ")",
                          file=sys.stderr)
                    p.kill()
                    p.join(10)
            break
        time.sleep(0.5)
    worst = 0
    for rank, p in enumerate(procs):
        if p.exitcode not in (0, None):
            print(f"bench: rank {rank} exited with code {p.exitcode}", file=sys.stderr)
            worst = max(worst, 1)
    return worst


def main(argv=None) -> int:
    args = _parse(argv if argv is not None else sys.argv[1:])
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print("bench: torch is not installed. Run `make deps` (installs torch and the CPU toolchain), "
              "then `make bench` again.", file=sys.stderr)
        return 2
    from bench.runner import CPU_MODULES, GPU_MODULES, Options, rank_main
    from bench.report import utc_now

    # NVLink multicast is forbidden on the GPU machines; keep it off in every process we start.
    for key, value in (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(key, value)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

    forced_cpu = os.environ.get("EPCOMM_BACKEND", "").lower() == "cpu"
    num_gpus = 0 if forced_cpu else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    mode = "gpu" if num_gpus else "cpu"
    started = utc_now()
    deadline = time.monotonic() + args.timeout
    mp_ctx = mp.get_context("spawn")
    if mode == "gpu":
        modules = _select(args.only, PARENT_PROBES + GPU_MODULES)
        print(f"bench: {num_gpus} GPU(s); modules: "
              f"{', '.join(modules)}{' (quick)' if args.quick else ''}", file=sys.stderr)
        pre = _copy_probe(mp_ctx, args.quick, 600.0) if "copy" in modules else []
        if "startup" in modules:
            pre += _startup_probe(args.quick, num_gpus)
        modules = [m for m in modules if m not in PARENT_PROBES]
        world_size, reason = num_gpus, ""
    else:
        reason = "EPCOMM_BACKEND=cpu" if forced_cpu else "no GPU found"
        if args.only:
            print(f"bench: --only is ignored without GPUs ({reason})", file=sys.stderr)
        print(f"bench: {reason}: running the CPU reference backend on {CPU_WORLD_SIZE} gloo processes",
              file=sys.stderr)
        modules, pre, world_size = list(CPU_MODULES), _startup_probe(args.quick, 0), CPU_WORLD_SIZE
    opts = Options(mode=mode, modules=modules, quick=args.quick, out=args.out, started=started,
                   collective_timeout_s=min(600.0, args.timeout), root=ROOT, pre_results=pre,
                   cpu_reason=reason)
    port = _free_port()
    procs = [mp_ctx.Process(target=rank_main, args=(rank, world_size, port, opts))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    return _wait(procs, deadline)


if __name__ == "__main__":
    sys.exit(main())
