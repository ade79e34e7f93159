"""Rank 0's side of the bench: merge the ranks' records, compare them with the same-run baselines and
targets, print the table, describe the machine, write the JSON (atomically, after every case, so a
crashed run still leaves what it measured)."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import asdict
from typing import Dict, List, Optional

from .harness import Record

STATUS_ORDER = ("ok", "skipped", "not implemented", "error")
METRICS = ("us", "logical_gbps", "nvlink_gbps")


def status_kind(status: str) -> str:
    for kind in reversed(STATUS_ORDER):
        if status.startswith(kind):
            return kind
    return "error"


def _spread(values: List[Optional[float]]) -> Optional[Dict[str, float]]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "avg": sum(values) / len(values), "max": max(values)}


def _rank_entry(record: Record, first: Record) -> dict:
    """A rank's own figures; its setting only where it differs from the first rank's (e.g. the
    number of rows it received)."""
    entry = {k: v for k, v in asdict(record).items()
             if k not in ("name", "module", "setting", "baseline", "target")}
    if record.setting != first.setting:
        entry["setting"] = record.setting
    return entry


def merge(per_rank: List[List[Record]]) -> List[dict]:
    """Records of every rank (same case) -> one result per record name, with per-rank figures and
    their min / avg / max. The worst status of any rank is the result's status."""
    names: List[str] = []
    by_name: Dict[str, List[Optional[Record]]] = {}
    for rank, records in enumerate(per_rank):
        for record in records:
            if record.name not in by_name:
                names.append(record.name)
                by_name[record.name] = [None] * len(per_rank)
            by_name[record.name][rank] = record
    results = []
    for name in names:
        records = by_name[name]
        present = [r for r in records if r is not None]
        first = present[0]
        worst = max(present, key=lambda r: STATUS_ORDER.index(status_kind(r.status)))
        result = {
            "name": name, "module": first.module, "status": worst.status,
            "setting": first.setting, "sms": first.sms, "baseline": first.baseline,
            "target": list(first.target) if first.target else None,
            "per_rank": [None if r is None else _rank_entry(r, first) for r in records],
        }
        for metric in METRICS:
            result[metric] = _spread([getattr(r, metric) for r in present])
        results.append(result)
    return results


def _avg(result: Optional[dict], metric: str) -> Optional[float]:
    if result is None or result.get(metric) is None:
        return None
    return result[metric]["avg"]


def ratios(results: List[dict], copy_p2p_name: Optional[str]) -> Dict[str, dict]:
    """Per result: speedup over its named same-run baseline, its NVLink figure as a fraction of the
    same-run P2P copy-engine figure, and whether its target is met."""
    by_name = {r["name"]: r for r in results}
    p2p = _avg(by_name.get(copy_p2p_name), "nvlink_gbps") if copy_p2p_name else None
    out: Dict[str, dict] = {}
    for result in results:
        if status_kind(result["status"]) != "ok":
            continue
        entry: Dict[str, object] = {}
        us = _avg(result, "us")
        base = by_name.get(result["baseline"]) if result["baseline"] else None
        base_us = _avg(base, "us")
        if us and base_us:
            entry["speedup_vs_baseline"] = base_us / us
        nvlink = _avg(result, "nvlink_gbps")
        if nvlink and p2p and result["name"] != copy_p2p_name:
            entry["nvlink_of_p2p_copy"] = nvlink / p2p
        if result["target"]:
            metric, op, bound = result["target"]
            value = entry.get("speedup_vs_baseline") if metric == "speedup" else _avg(result, metric)
            if value is not None:
                entry["target"] = f"{metric} {op} {bound:g}"
                entry["target_met"] = value <= bound if op == "<=" else value >= bound
        if entry:
            out[result["name"]] = entry
    return out


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------
def fmt(value: Optional[float]) -> str:
    """Four significant figures at most, no exponent for the magnitudes the bench sees."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}" if abs(value) >= 1e-3 else f"{value:.2g}"


def _fmt_spread(spread: Optional[dict]) -> str:
    if spread is None:
        return "-"
    if abs(spread["max"] - spread["min"]) <= 0.005 * max(abs(spread["avg"]), 1e-9):
        return fmt(spread["avg"])
    return f"{fmt(spread['avg'])} ({fmt(spread['min'])}-{fmt(spread['max'])})"


def format_table(results: List[dict], ratio_map: Dict[str, dict]) -> str:
    """Columns: case, SMs, time (avg over ranks, min-max), GB/s logical and NVLink, vs baseline,
    target, status."""
    header = ("case", "SMs", "us avg (min-max)", "GB/s logical", "GB/s NVLink", "vs base", "target",
              "status")
    rows = [header]
    for r in results:
        ratio = ratio_map.get(r["name"], {})
        speedup = ratio.get("speedup_vs_baseline")
        target = ratio.get("target", "")
        if target:
            target += " ok" if ratio["target_met"] else " MISSED"
        status = r["status"]
        rows.append((r["name"], str(r["sms"]) if r["sms"] is not None else "-",
                     _fmt_spread(r["us"]), _fmt_spread(r["logical_gbps"]),
                     _fmt_spread(r["nvlink_gbps"]),
                     f"{speedup:.2f}x" if speedup else "-", target,
                     status if len(status) <= 60 else status[:57] + "..."))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Machine, versions, JSON
# ---------------------------------------------------------------------------------------------
def _run(cmd: List[str]) -> Optional[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(gpu: bool) -> dict:
    import torch
    info = {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "gpu_count": 0, "gpus": []}
    if gpu and torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        for i in range(info["gpu_count"]):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": p.name, "sm_count": p.multi_processor_count,
                                 "capability": f"{p.major}.{p.minor}",
                                 "memory_gib": round(p.total_memory / 2**30, 1),
                                 "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1)})
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = smi.splitlines()[0] if smi else None
        info["topology"] = _run(["nvidia-smi", "topo", "-m"])
    return info


def _dist_version(*names: str) -> Optional[str]:
    from importlib import metadata
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    import torch
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "epcomm": None, "nccl": None,
           "cuda_bindings": _dist_version("cuda-bindings", "cuda-python")}
    try:
        import epcomm
        out["epcomm"] = getattr(epcomm, "__version__", None) or _dist_version("epcomm")
    except Exception as exc:  # the report still records why
        out["epcomm"] = f"import failed: {exc}"
    if torch.cuda.is_available():
        try:
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception:
            pass
    # What epcomm's own toolchain lookup finds (the pieces it compiles and links with), else the
    # installed wheels' versions.
    probes = {"nvrtc": "toolchain.nvrtc_version", "nvjitlink": "toolchain.nvjitlink_version",
              "nvshmem": "toolchain.nvshmem_version", "nvshmem_host_library": "nvshmem.library_version"}
    for key, path in probes.items():
        module_name, function = path.split(".")
        try:
            module = __import__(f"epcomm.runtime.{module_name}", fromlist=[function])
            value = getattr(module, function)()
            out[key] = ".".join(map(str, value)) if value else None
        except Exception as exc:
            out[key] = f"unavailable: {type(exc).__name__}: {exc}"[:200]
    if not out["nvshmem"] or str(out["nvshmem"]).startswith("unavailable"):
        out["nvshmem"] = _dist_version("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12") or out["nvshmem"]
    return out


def environment() -> dict:
    keep = re.compile(r"^(EPCOMM_|NVSHMEM_|NCCL_|CUDA_|TORCH_NCCL|TORCH_SYMM)")
    return {k: v for k, v in sorted(os.environ.items()) if keep.match(k)}


def machine_tag(info: dict) -> str:
    if not info["gpus"]:
        return "cpu"
    name = info["gpus"][0]["name"].replace("NVIDIA", "").strip()
    return f"{info['gpu_count']}x" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def default_results_dir(root: str) -> str:
    """bench/results in a clone (a checkout with .git), else the current directory: never inside
    an installed package."""
    if os.path.exists(os.path.join(root, ".git")):
        return os.path.join(root, "bench", "results")
    return os.getcwd()


def out_path(out: Optional[str], root: str, info: dict, started: _dt.datetime) -> str:
    """The JSON's path: `out` itself when it names a .json file, else <stamp>_<machine>.json in the
    folder `out` (default: default_results_dir). The PNGs go next to it."""
    if out is not None and out.endswith(".json"):
        return out
    name = f"{started.strftime('%Y-%m-%dT%H%M%SZ')}_{machine_tag(info)}.json"
    return os.path.join(out if out is not None else default_results_dir(root), name)


def write_json(path: str, document: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)
