"""One bench rank: join the process group, run the selected case modules' cases in order, gather every
case's records to all ranks, and (rank 0) show progress, print the table and write the JSON."""
from __future__ import annotations

import atexit
import datetime as _dt
import importlib
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from . import report
from .harness import BenchContext, Case, CheckFailed, Record, Skip

# Case modules by --only name. "copy" (P2P / device copies) runs in the parent before the ranks
# start (bench/baselines.py, copy_probe), so no rank process opens a context on another GPU.
# internode runs last: its path is the newest, so a failure there cannot touch the other figures.
GPU_MODULES = ("baselines", "layout", "intranode", "low_latency", "host", "internode")
CPU_MODULES = ("reference",)
MODULE_PATHS = {"baselines": "bench.baselines", "layout": "bench.layout",
                "intranode": "bench.intranode", "low_latency": "bench.low_latency",
                "internode": "bench.internode", "host": "bench.host_profile",
                "reference": "bench.cpu_reference"}


@dataclass
class Options:
    mode: str                      # "gpu" or "cpu"
    modules: List[str]
    quick: bool
    out: Optional[str]
    started: _dt.datetime
    collective_timeout_s: float
    root: str                      # where bench/ lives (a clone's results folder is under it)
    cpu_reason: str = ""           # why the CPU backend runs ("no GPU found", "EPCOMM_BACKEND=cpu")
    pre_results: List[dict] = field(default_factory=list)   # merged copy-probe results


class Progress:
    """tqdm on a terminal when installed; else (no tqdm, or output to a log) a text bar, one line per
    finished case (stderr)."""

    def __init__(self, total: int):
        self.total, self.done, self.bar = total, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc="bench", unit="case", file=sys.stderr,
                                dynamic_ncols=True)
            except ImportError:
                pass

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(message[:60])

    def step(self, result_lines: List[str]) -> None:
        """One case finished, with these results."""
        self.done += 1
        if self.bar is not None:
            for line in result_lines:
                self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
            return
        width = 20
        filled = width * self.done // max(self.total, 1)
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
        for i, line in enumerate(result_lines):
            print(f"{bar if i == 0 else ' ' * len(bar)} {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
def _module_cases(name: str, ctx: BenchContext) -> List[Case]:
    """The module's cases; a missing or failing module becomes one case that reports why."""
    def report_only(status: str) -> List[Case]:
        def run(_ctx):
            return Record(name, status=status)
        return [Case(name, run)]

    try:
        module = importlib.import_module(MODULE_PATHS[name])
    except ModuleNotFoundError as exc:
        if exc.name == MODULE_PATHS[name]:
            return report_only(f"not implemented: {MODULE_PATHS[name].replace('.', '/')}.py is missing")
        return report_only(f"error: import {MODULE_PATHS[name]}: {exc}")
    except Exception as exc:
        return report_only(f"error: import {MODULE_PATHS[name]}: {type(exc).__name__}: {exc}")
    try:
        return list(module.cases(ctx))
    except NotImplementedError as exc:
        return report_only(f"not implemented: {exc}")
    except Exception as exc:
        return report_only(f"error: {name}.cases(): {type(exc).__name__}: {exc}")


def _plain(value):
    """Records cross processes and land in JSON: turn tensors and other objects into plain data."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def run_case(ctx: BenchContext, module: str, case: Case) -> List[Record]:
    """Run one case on this rank; NotImplementedError, Skip and any other exception become a
    record with that status instead of stopping the bench."""
    ctx.progress(case.name)
    try:
        out = case.run(ctx)
        records = [out] if isinstance(out, Record) else list(out)
        if not records:
            raise RuntimeError("the case returned no record")
        if ctx.is_gpu:
            torch.cuda.synchronize(ctx.device)
    except NotImplementedError as exc:
        records = [Record(case.name, case.setting, status=f"not implemented: {exc}")]
    except Skip as exc:
        records = [Record(case.name, case.setting, status=f"skipped: {exc}")]
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        kind = "check failed" if isinstance(exc, CheckFailed) else type(exc).__name__
        records = [Record(case.name, case.setting, status=f"error: {kind}: {message}",
                          extra={"traceback": traceback.format_exc()})]
        ctx.release_buffer(destroy=False)   # it may be unusable now; the next case makes a new one
    for record in records:
        record.module = module
        record.setting = _plain(record.setting)
        record.extra = _plain(record.extra)
    return records


def _result_line(result: dict) -> str:
    figure = f"{report.fmt(result['us']['avg'])} us" if result["us"] else ""
    if result["logical_gbps"]:
        figure += f", {report.fmt(result['logical_gbps']['avg'])} GB/s"
    status = "" if result["status"] == "ok" else f" [{result['status'][:80]}]"
    return f"{result['name']}: {figure}{status}"


# ---------------------------------------------------------------------------------------------
# Rank entry point
# ---------------------------------------------------------------------------------------------
def _init(rank: int, world_size: int, port: int, opts: Options) -> Tuple[torch.device, object, object]:
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    timeout = _dt.timedelta(seconds=opts.collective_timeout_s)
    init = f"tcp://127.0.0.1:{port}"
    if opts.mode == "gpu":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device)
        # Records and checks travel over gloo so a wedged GPU cannot block the report.
        return device, dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout)
    os.environ["EPCOMM_BACKEND"] = "cpu"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size,
                            timeout=timeout)
    return torch.device("cpu"), dist.group.WORLD, dist.group.WORLD


def rank_main(rank: int, world_size: int, port: int, opts: Options) -> None:
    import torch.distributed as dist
    device, group, object_group = _init(rank, world_size, port, opts)
    progress: Optional[Progress] = None
    ctx = BenchContext(rank, world_size, rank, device, group, object_group, opts.quick)
    plan: List[Tuple[str, Case]] = [(m, c) for m in opts.modules for c in _module_cases(m, ctx)]
    if rank == 0:
        progress = Progress(len(plan))
        ctx.on_progress = progress.note
        info = report.machine_info(opts.mode == "gpu")
        out = report.out_path(opts.out, opts.root, info, opts.started)
        document = {"schema": 1, "complete": False, "date": opts.started.isoformat(),
                    "mode": opts.mode, "quick": opts.quick, "modules": opts.modules,
                    "world_size": world_size, "machine": info, "versions": report.versions(),
                    "env": report.environment(), "results": list(opts.pre_results)}
    for result in opts.pre_results:
        ctx.results[result["name"]] = result
    for module, case in plan:
        records = run_case(ctx, module, case)
        gathered: List[Optional[List[Record]]] = [None] * world_size
        dist.all_gather_object(gathered, records, group=object_group)
        merged = report.merge(gathered)
        for result in merged:
            ctx.results[result["name"]] = result
        if rank == 0:
            document["results"].extend(merged)
            report.write_json(out, document)
            progress.step([_result_line(r) for r in merged])
    try:
        ctx.release_buffer()
    except Exception as exc:
        print(f"rank {rank}: Buffer.destroy failed: {exc}", file=sys.stderr)
    exit_code = 0
    if rank == 0:
        progress.close()
        exit_code = _finish(document, out, opts)
    dist.barrier(group=object_group)
    dist.destroy_process_group()
    # Leave without interpreter teardown: gloo's C++ worker threads can still be joinable while
    # torch's globals are destroyed, which aborts the process ("terminate called without an
    # active exception") after all work has finished; that once failed a CI run. Everything this
    # rank had to say is written and flushed by now. The atexit handlers still run (NVSHMEM
    # finalisation among them).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _finish(document: dict, out: str, opts: Options) -> int:
    """Final JSON and the printed summary; exit code 1 if any case errored or a check failed."""
    results = document["results"]
    p2p = next((r["name"] for r in results if r["name"].startswith("P2P copy")), None)
    document["ratios"] = report.ratios(results, p2p)
    document["versions"] = report.versions()   # again: epcomm loaded its toolchain meanwhile
    kinds = [report.status_kind(r["status"]) for r in results]
    document["summary"] = {k: kinds.count(k) for k in report.STATUS_ORDER}
    document["complete"] = True
    report.write_json(out, document)
    print()
    if opts.mode == "cpu":
        print(f"{opts.cpu_reason}: {CPU_BANNER}")
    print(report.format_table(results, document["ratios"]))
    problems = [r for r in results if report.status_kind(r["status"]) == "error"]
    if problems:
        print("\nerrors (tracebacks in the JSON, per rank):")
        for r in problems:
            print(f"  {r['name']}: {r['status']}")
    print()
    counts = ", ".join(f"{n} {k}" for k, n in document["summary"].items() if n)
    print(f"{len(results)} results: {counts}. JSON: {out}")
    from .plots import write_plots
    try:
        for path in write_plots(out):
            print(f"plot: {path}")
    except Exception as exc:   # a plotting bug must not turn a finished run into a failed one
        print(f"bench: plotting failed ({type(exc).__name__}: {exc}); the JSON is complete; "
              f"retry with python -m bench.plots {out}", file=sys.stderr)
    return 1 if document["summary"]["error"] else 0


CPU_BANNER = ("ran the CPU reference backend (EPCOMM_BACKEND=cpu, gloo, 2 processes); "
              "times below are of the CPU path, not of any GPU kernel")
