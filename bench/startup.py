"""Start-up costs a user pays once per process (targets.md): `import epcomm` < 0.5 s; per mode, the
JIT of its first use with an empty cache < 15 s, and with a warm cache < 0.2 s.

Every figure comes from a fresh Python process (`python -m bench.startup ...`), as a user's first
call would pay it:
  * `import epcomm` alone;
  * per mode, the kernels that its first dispatch + combine at the targets.md setting builds
    (`first_use_sources`), compiled and linked into an empty cache directory (cold), then read back
    from that directory by another fresh process (warm: with EPCOMM_ASSERT_NO_COMPILE=1, so a
    cache miss fails the figure). On a GPU both also load each cubin into the device
    (cuModuleLoadData); NVSHMEM's per-module initialisation, which needs the NVSHMEM world of a
    running job, is not in the figures. Without a GPU the builds target sm_90 (compile and link
    only: the JIT is host work either way).
`python -m bench` runs this in the parent process before the ranks start, as it does the copy probe.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("layout", "intranode", "low_latency", "internode")
QUICK_MODES = ("layout",)
TARGET_S = {"import": 0.5, "cold": 15.0, "warm": 0.2}
CPU_ARCH = 90   # the build target without a GPU


def first_use_sources(mode: str, num_ranks: int):
    """The kernel sources a first dispatch + combine of `mode` builds at the targets.md setting
    (H=7168, K=8, int64 top-k indices; E=256, or 288 in low-latency mode; BF16 fresh dispatch in
    normal mode, FP8 dispatch in low-latency mode with T=128; internode: every rank its own node)."""
    import torch
    if mode == "layout":
        from epcomm.ops.layout import layout_source
        return [layout_source(8, 256, num_ranks, num_ranks, torch.int64, 16)]
    if mode == "intranode":
        from epcomm.ops import intranode_plan as plan
        from epcomm.ops.intranode import kernel_source
        return [kernel_source(plan.notify_kernel(num_ranks)),
                kernel_source(plan.dispatch_kernel(num_ranks, 7168 * 2, 0, "long long", True)),
                kernel_source(plan.combine_kernel(num_ranks, 7168 * 2))]
    if mode == "low_latency":
        from epcomm.ops.low_latency import combine_source, dispatch_source
        return [dispatch_source(7168, 8, num_ranks, 288, 128, True, False, False),
                combine_source(7168, 8, num_ranks, 288, 128)]
    if mode == "internode":
        from epcomm.ops import internode_plan as plan
        from epcomm.ops.internode import kernel_source
        return [kernel_source(plan.notify_kernel(num_ranks, 1)),
                kernel_source(plan.dispatch_kernel(num_ranks, 1, 7168 * 2, 0, "long long", True)),
                kernel_source(plan.combine_kernel(num_ranks, 1, 7168 * 2))]
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


# ---- the worker: one measurement in this (fresh) process ----------------------------------------
def _time_import() -> dict:
    t0 = time.perf_counter()
    import epcomm  # noqa: F401
    return {"seconds": time.perf_counter() - t0}


def _time_jit(mode: str, num_ranks: int, load: bool) -> dict:
    """Build (or read from EPCOMM_CACHE_DIR) the mode's first-use sources, loading each cubin into
    device 0 when `load`. The clock starts before epcomm's JIT modules are imported, as a first
    call's does; torch, and with `load` its CUDA context on device 0, exist before it, as they do
    in the caller's process."""
    if load:
        _cuda_context()
    else:
        import torch  # noqa: F401
    t0 = time.perf_counter()
    from epcomm.runtime import cache
    sources = first_use_sources(mode, num_ranks)
    if load:
        from epcomm.runtime.arch import device_arch
        arch = device_arch(0)
        cc, feature = arch.cc, arch.feature
    else:
        from epcomm.runtime.arch import native_feature
        cc, feature = CPU_ARCH, native_feature(CPU_ARCH)
    cubins = [cache.get_cubin(src, cc, feature) for src in sources]
    built_s = time.perf_counter() - t0
    if load:
        _load_all(cubins)
    return {"seconds": time.perf_counter() - t0, "build_or_read_s": built_s, "kernels": len(sources),
            "arch": f"sm_{cc}", "feature": feature, "loaded": load}


def _cuda_context() -> None:
    """torch with its CUDA context on device 0, as a caller's process has them."""
    import torch
    torch.zeros(1, device="cuda:0")


def _load_all(cubins) -> None:
    from ctypes import byref, c_void_p
    from epcomm.runtime.launch import check, driver, pushed_context
    from epcomm.runtime.module import primary_context
    with pushed_context(primary_context(0)):
        for compiled in cubins:
            module = c_void_p()
            check(driver().cuModuleLoadData(byref(module), compiled.cubin), "cuModuleLoadData")


def _worker(argv) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.startup")
    p.add_argument("what", choices=("import", "jit"))
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--load", action="store_true", help="also load each cubin into device 0")
    args = p.parse_args(argv)
    result = _time_import() if args.what == "import" else _time_jit(args.mode, args.ranks, args.load)
    print(json.dumps(result))


# ---- the probe: fresh processes, one Record per figure -----------------------------------------
def _run_worker(args: List[str], cache_dir: str, timeout: float, warm: bool = False) -> dict:
    """One fresh process; `warm`: with EPCOMM_ASSERT_NO_COMPILE=1, so a cache miss fails the figure
    instead of timing a build."""
    env = dict(os.environ, EPCOMM_CACHE_DIR=cache_dir,
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("EPCOMM_ASSERT_NO_COMPILE", None)
    if warm:
        env["EPCOMM_ASSERT_NO_COMPILE"] = "1"
    out = subprocess.run([sys.executable, "-m", "bench.startup", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"python -m bench.startup {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def startup_probe(quick: bool, num_gpus: int, modes=None) -> list:
    """Records (bench.harness.Record) of import and first-use JIT times, each from fresh processes;
    `num_gpus` 0 builds for sm_90 without loading. A failing measurement becomes an error record."""
    from .harness import Record
    modes = modes or (QUICK_MODES if quick else MODES)
    ranks = max(num_gpus, 2)
    records = []

    def measure(name, setting, target_s, run):
        try:
            result = run()
        except Exception as exc:   # one failing figure must not hide the others
            records.append(Record(name, setting, status=f"error: {str(exc).splitlines()[0]}",
                                  extra={"detail": str(exc)}, module="startup"))
            return
        records.append(Record(name, setting, us=result["seconds"] * 1e6, extra=result,
                              target=("us", "<=", target_s * 1e6), module="startup"))

    with tempfile.TemporaryDirectory(prefix="epcomm-startup-") as scratch:
        def best_import() -> dict:
            imports = [_run_worker(["import"], scratch, 120) for _ in range(3)]
            return min(imports, key=lambda r: r["seconds"]) | {"all_s": [r["seconds"] for r in imports]}
        measure("startup: import epcomm (fresh process)", {}, TARGET_S["import"], best_import)
        load = ["--load"] if num_gpus else []
        for mode in modes:
            cache_dir = os.path.join(scratch, mode)   # empty: the cold run fills it, the warm one reads it
            args = ["jit", "--mode", mode, "--ranks", str(ranks), *load]
            setting = {"mode": mode, "R": ranks}
            how = "compile + link + load" if num_gpus else f"compile + link for sm_{CPU_ARCH}, no GPU"
            measure(f"startup: {mode} first use, cold JIT ({how})", setting, TARGET_S["cold"],
                    lambda: _run_worker(args, cache_dir, 900))
            how = "cache read + load" if num_gpus else "cache read, no GPU"
            measure(f"startup: {mode} first use, warm cache ({how})", setting, TARGET_S["warm"],
                    lambda: _run_worker(args, cache_dir, 300, warm=True))
    return records


if __name__ == "__main__":
    _worker(sys.argv[1:])
