"""epcomm's JIT from the command line (no GPU needed).

    python -m epcomm.jit --precompile --arch sm_80,sm_90 [--jobs N]
    python -m epcomm.jit --precompile --arch sm_90 --shapes model.json
    python -m epcomm.jit --rebuild OLD_CACHE_DIR [--jobs N]
    python -m epcomm.jit --list-recipes CACHE_DIR > recipes.json; python -m epcomm.jit --rebuild recipes.json
    python -m epcomm.jit --precompile --arch sm_90 --hidden 7168 --num-topk 8 --num-experts 256 \
        --num-ranks 16 --num-local-ranks 8 --num-max-dispatch-tokens-per-rank 128 --dtypes bf16,fp8

Without shapes it builds every registered kernel family's representative sources
(epcomm.ops.registry) with each feature set an arch can run (sm_90: SM90 and SM80 paths). With a
model's shapes (a JSON or TOML file of epcomm.ops.model_kernels.ModelShapes fields, or the options
below) it builds exactly the kernels that model's Buffer calls will compile, for the feature set
they will use (EPCOMM_ARCH applies), so a cache (EPCOMM_CACHE_DIR) warmed in a container build
serves the first calls without compiling. --rebuild builds again every specialisation recorded in
the entries of a cache directory (any sources or toolchain built them) into EPCOMM_CACHE_DIR with
the current sources and toolchain: a warm cache survives an upgrade; --list-recipes writes those
records as a small JSON list, which --rebuild takes in place of the directory (a cache's set of
kernels kept without its cubins). One line per build with its times; exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
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


def registry_tasks(archs: List[int]) -> list:
    """(label, (source, arch, feature)) for every registered source, every feature set per arch."""
    from .runtime.arch import native_feature
    from .ops.registry import representative_sources
    tasks = []
    for arch_sm in archs:
        native = native_feature(arch_sm)
        for module, src in representative_sources():
            tasks += [(module, (src, arch_sm, f)) for f in sorted({native, 80}, reverse=True)]
    return tasks


def model_tasks(archs: List[int], models) -> list:
    """(label, (source, arch, feature)) for the kernels the models' calls build, each once, with
    the feature set a device of that arch runs them with (EPCOMM_ARCH applied, as at run time)."""
    from . import env
    from .ops.model_kernels import kernel_sources
    from .runtime.arch import Arch
    sources = list(dict.fromkeys(src for model in models for src in kernel_sources(model)))
    tasks = []
    for arch_sm in archs:
        feature = Arch.for_target(arch_sm, env.arch_override()).feature
        tasks += [("model", (src, arch_sm, feature)) for src in sources]
    return tasks


def rebuild_tasks(where: str) -> list:
    """(label, (source, arch, feature)) for every recipe recorded in a cache directory or listed
    in a recipes file."""
    from .runtime import cache
    return [("rebuild", task) for task in cache.recipes(where)]


def precompile(archs: List[int], jobs: int, models=None, rebuild_from=None) -> int:
    from .runtime import toolchain
    print(f"epcomm.jit: {toolchain.describe()}", flush=True)
    if rebuild_from is not None:
        tasks = rebuild_tasks(rebuild_from)
    else:
        tasks = registry_tasks(archs) if models is None else model_tasks(archs, models)
    if not tasks:
        print("epcomm.jit: nothing to build", flush=True)
        return 0
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
                        help="build kernels into the cache: the model's (shape options) or "
                             "every registered family's")
    parser.add_argument("--rebuild", metavar="DIR|FILE",
                        help="build every specialisation recorded in DIR's cache entries (or listed "
                             "in a --list-recipes FILE) again")
    parser.add_argument("--list-recipes", metavar="DIR",
                        help="print the recipes recorded in DIR's cache entries as a JSON list")
    parser.add_argument("--arch", type=_parse_archs, default=[80, 90],
                        help="comma-separated compile targets (default sm_80,sm_90)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel builds (processes); default: one per CPU")
    shapes = parser.add_argument_group(
        "model shapes", "build only what these calls need (a --shapes file may list several models)")
    shapes.add_argument("--shapes", metavar="FILE", help="JSON or TOML file of model shapes")
    for name, metavar, help_text in _SHAPE_OPTIONS:
        shapes.add_argument(f"--{name.replace('_', '-')}", dest=name, metavar=metavar, help=help_text)
    args = parser.parse_args(argv)
    if args.list_recipes is not None:
        from .runtime import cache
        print(json.dumps(cache.recorded_recipes(args.list_recipes), indent=1))
        return 0
    if args.rebuild is not None:
        if args.precompile:
            parser.error("--rebuild and --precompile are separate jobs: give one")
        return precompile(args.arch, args.jobs, rebuild_from=args.rebuild)
    if not args.precompile:
        parser.print_help()
        return 2
    try:
        models = _models(args)
    except (ValueError, TypeError, OSError) as e:
        parser.error(str(e))
    return precompile(args.arch, args.jobs, models)


_SHAPE_OPTIONS = (    # (ModelShapes field, metavar, help)
    ("hidden", "H", "hidden size"), ("num_topk", "K", "top-k"), ("num_experts", "E", "experts"),
    ("num_ranks", "R", "ranks (EP size)"), ("num_local_ranks", "L", "ranks per node (default: R, one node)"),
    ("num_max_dispatch_tokens_per_rank", "T", "low-latency max tokens per rank"),
    ("dtypes", "LIST", "dispatch payloads: bf16,fp8 (default bf16)"),
    ("modes", "LIST", "normal,low_latency (default both)"),
    ("index_dtype", "DTYPE", "topk_idx dtype: int64 (default) or int32"),
    ("ll_scales", "LIST", "FP8 low-latency scales: float,pow2,ue8m0 (default float)"))
_LIST_OPTIONS = ("dtypes", "modes", "ll_scales")


def _models(args):
    """The models named by --shapes and / or the shape options; None when neither is given."""
    from .ops.model_kernels import ModelShapes, load_shapes
    models = load_shapes(args.shapes) if args.shapes else []
    given = {name: getattr(args, name) for name, _, _ in _SHAPE_OPTIONS if getattr(args, name) is not None}
    if given:
        entry = {}
        for name, text in given.items():
            if name in _LIST_OPTIONS:
                entry[name] = tuple(v.strip() for v in text.split(",") if v.strip())
            elif name == "index_dtype":
                entry[name] = text
            else:
                try:
                    entry[name] = int(text)
                except ValueError:
                    raise ValueError(f"--{name.replace('_', '-')} must be an integer, got {text!r}") from None
        models.append(ModelShapes.from_dict(entry))
    return models or None


if __name__ == "__main__":
    sys.exit(main())
