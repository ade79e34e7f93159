"""epcomm's JIT from the command line (no GPU needed).

    python -m epcomm.jit --precompile --arch sm_80,sm_90 [--jobs N]

compiles and links every registered kernel family's representative sources (epcomm.ops.registry)
for every listed arch, with each feature set that arch can run (sm_90: SM90 and SM80 paths), into
the cache (EPCOMM_CACHE_DIR). One line per build with its times; exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import re
import sys
import time
import traceback
from typing import List, Tuple


def _parse_archs(text: str) -> List[int]:
    archs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(?:sm_?)?(\d+)", part.lower())
        if not m or int(m.group(1)) < 80:
            raise argparse.ArgumentTypeError(f"bad arch {part!r} (expected sm_80 or newer, "
                                             f"e.g. sm_80,sm_90)")
        archs.append(int(m.group(1)))
    return archs


def _build(task) -> Tuple[bool, str]:
    """Worker: one (source, arch, feature) through the cache -> (ok, detail)."""
    from .runtime import cache
    src, arch_sm, feature = task
    t0 = time.perf_counter()
    try:
        compiled = cache.get_cubin(src, arch_sm, feature)
    except Exception:
        return False, traceback.format_exc()
    if compiled.from_cache:
        return True, f"cached {time.perf_counter() - t0:.2f} s"
    return True, (f"built  nvrtc {compiled.nvrtc_s:.2f} s  nvJitLink {compiled.link_s:.2f} s  "
                  f"cubin {len(compiled.cubin) // 1024} KiB")


def precompile(archs: List[int], jobs: int) -> int:
    from .runtime import toolchain
    from .runtime.arch import native_feature
    from .ops.registry import representative_sources
    print(f"epcomm.jit: {toolchain.describe()}", flush=True)
    tasks = []
    for arch_sm in archs:
        native = native_feature(arch_sm)
        for module, src in representative_sources():
            tasks += [(module, (src, arch_sm, f)) for f in sorted({native, 80}, reverse=True)]
    jobs = max(1, min(jobs, len(tasks)))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if jobs == 1:
            results = map(_build, [task for _, task in tasks])
        else:
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                jobs, mp_context=multiprocessing.get_context("spawn")))
            results = pool.map(_build, [task for _, task in tasks])
        failures = _report(tasks, results)
    print(f"epcomm.jit: {len(tasks) - failures}/{len(tasks)} builds ok in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failures else 0


def _report(tasks, results) -> int:
    """Prints one line per kernel as results arrive; returns the number of failed builds."""
    failures = 0
    for (module, (src, arch_sm, feature)), (ok, detail) in zip(tasks, results):
        label = f"sm_{arch_sm}/f{feature}"
        for kernel in src.kernels:
            status = "ok  " if ok else "FAIL"
            print(f"{status} {label:10s} {src.source:16s} {kernel}  " + (detail if ok else ""),
                  flush=True)
        if not ok:
            failures += 1
            print(f"{module}: {src.source} for sm_{arch_sm}/f{feature} failed:\n{detail}",
                  file=sys.stderr, flush=True)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epcomm.jit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--precompile", action="store_true",
                        help="build every registered kernel family into the cache")
    parser.add_argument("--arch", type=_parse_archs, default=[80, 90],
                        help="comma-separated compile targets (default sm_80,sm_90)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel builds (processes); default: one per CPU")
    args = parser.parse_args(argv)
    if not args.precompile:
        parser.print_help()
        return 2
    return precompile(args.arch, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
