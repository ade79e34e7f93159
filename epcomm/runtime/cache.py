"""Compiled cubins: an in-process memo over a disk cache under EPCOMM_CACHE_DIR (epcomm.env).

Key = sha256 of: the entry format, the source and every cuda_src/ header it reaches through
quoted #includes (whatever #if guards them: a superset is safe), so editing a header invalidates
exactly the families that include it, the build plan (generated unit, name expressions, NVRTC and
nvJitLink options with every install location replaced by a placeholder, link library names, target arch, feature set,
link mode) and the toolchain versions (NVRTC, nvJitLink, NVSHMEM, CUDA runtime and CCCL headers).
No absolute path enters the key: a cache built in one environment (a container build, another
venv) serves any other with the same sources and versions.

Entry = one file: magic, JSON header (key, lowered names, the recipe: source, kernels, defines,
arch, feature), cubin, sha256 of all that. The recipe lets `python -m epcomm.jit --rebuild DIR`
build the same specialisations again after the sources or the toolchain changed. It is written
to a temp file in the same directory and renamed over the entry (atomic), under a per-key flock so
that N ranks starting together compile once; a torn or corrupt entry reads as a miss and is
replaced. EPCOMM_ASSERT_NO_COMPILE=1 turns a miss into an error (tests prove warm paths with it).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .. import env
from ..errors import CompileError
from . import compiler, toolchain
from .compiler import BuildPlan, CompiledCubin, KernelSource

_FORMAT = b"EPCOMM-CUBIN-1\n"
_MEMO: Dict[str, CompiledCubin] = {}
_SRC_DIGESTS: Dict[Tuple[Path, str], str] = {}


_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.M)


def source_closure(source: str, root: Optional[Path] = None) -> List[Path]:
    """`source` and every file under `root` (cuda_src/) its quoted #includes reach, resolved as
    NVRTC does (the including file's directory, then the root); headers outside the root (NVSHMEM,
    CUDA) are covered by the toolchain versions instead."""
    root = Path(root or compiler.cuda_src_dir())
    seen, todo = {}, [(root / source).resolve()]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen[path] = None
        for name in _INCLUDE.findall(path.read_bytes()):
            name = name.decode()
            for cand in (path.parent / name, root / name):
                if cand.is_file():
                    todo.append(cand.resolve())
                    break
    return sorted(seen, key=lambda p: p.as_posix())


def cuda_src_digest(root: Path, source: str) -> str:
    """Hash of the files `source` compiles from (names relative to cuda_src/ and contents);
    computed once per (directory, source) per process: sources do not change under a running
    process."""
    digest = _SRC_DIGESTS.get((root, source))
    if digest is None:
        h = hashlib.sha256()
        real_root = root.resolve()
        for path in source_closure(source, root):
            data = path.read_bytes()
            h.update(f"{path.relative_to(real_root).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
        digest = _SRC_DIGESTS[(root, source)] = h.hexdigest()
    return digest


def cache_key(plan: BuildPlan) -> str:
    h = hashlib.sha256(_FORMAT)
    h.update(cuda_src_digest(Path(plan.cuda_src), plan.source.source).encode())
    h.update(plan.digest.encode())
    h.update(json.dumps(toolchain.fingerprint(), sort_keys=True).encode())
    return h.hexdigest()


def entry_path(plan: BuildPlan, key: str) -> Path:
    stem = Path(plan.source.source).stem
    return env.cache_dir() / "cubin" / f"{stem}-sm{plan.target.arch_sm}-f{plan.target.feature}-{key[:32]}.bin"


def get_cubin(src: KernelSource, arch_sm: int, feature: int) -> CompiledCubin:
    """The cubin for `src` on sm_<arch_sm> with feature set `feature`: memo, disk, or a build."""
    plan = compiler.plan_build(src, arch_sm, feature)
    key = cache_key(plan)
    hit = _MEMO.get(key)
    if hit is not None:
        return hit
    path = entry_path(plan, key)
    t0 = time.perf_counter()
    hit = read_entry(path, key)
    if hit is None:
        if env.assert_no_compile():
            raise CompileError("cache", plan.describe(),
                               f"EPCOMM_ASSERT_NO_COMPILE=1 and no valid cache entry at {path}")
        with _key_lock(path):
            hit = read_entry(path, key)   # another rank may have built it while we waited
            if hit is None:
                hit = compiler.compile_plan(plan)
                write_entry(path, key, hit, recipe(src, arch_sm, feature))
    else:
        compiler.verbose(f"cache hit {plan.describe()}: {time.perf_counter() - t0:.3f} s ({path})")
    _MEMO[key] = hit
    return hit


def clear_memo() -> None:
    """Forget in-process results (tests: force the disk path)."""
    _MEMO.clear()
    _SRC_DIGESTS.clear()


# ---------------------------------------------------------------------------------------------
# Entry format
# ---------------------------------------------------------------------------------------------
def recipe(src: KernelSource, arch_sm: int, feature: int) -> dict:
    """What get_cubin was asked for, as JSON: enough to ask again (see recipes())."""
    return {"source": src.source, "kernels": list(src.kernels),
            "defines": [[k, v] for k, v in src.defines], "uses_nvshmem": src.uses_nvshmem,
            "arch_sm": arch_sm, "feature": feature}


def recorded_recipes(directory: Path) -> List[dict]:
    """The recipe of every whole entry under `directory` (a cache dir or its cubin/ folder),
    whatever sources or toolchain built it, in name order (JSON: `python -m epcomm.jit
    --list-recipes DIR` writes them, --rebuild FILE builds them)."""
    directory = Path(directory)
    folder = directory / "cubin" if (directory / "cubin").is_dir() else directory
    found = []
    for path in sorted(folder.glob("*.bin")):
        try:
            decoded = _decode(path.read_bytes())
        except OSError:
            continue
        r = decoded[0].get("recipe") if decoded else None
        if r:
            found.append(r)
    return found


def recipes(where: Path) -> List[Tuple[KernelSource, int, int]]:
    """(source, arch, feature) of every recipe, each once: those recorded under a cache directory,
    or those of a JSON file holding a list of recipes (as recorded_recipes gives them)."""
    where = Path(where)
    listed = json.loads(where.read_text()) if where.is_file() else recorded_recipes(where)
    found = {}
    for r in listed:
        src = KernelSource(r["source"], tuple(r["kernels"]),
                           tuple((k, v) for k, v in r["defines"]), bool(r["uses_nvshmem"]))
        found.setdefault((src, r["arch_sm"], r["feature"]), None)
    return list(found)


def _encode(key: str, compiled: CompiledCubin, recipe_: Optional[dict] = None) -> bytes:
    fields = {"key": key, "lowered": compiled.lowered}
    if recipe_ is not None:
        fields["recipe"] = recipe_
    header = json.dumps(fields, sort_keys=True).encode()
    body = (_FORMAT + struct.pack("<I", len(header)) + header
            + struct.pack("<Q", len(compiled.cubin)) + compiled.cubin)
    return body + hashlib.sha256(body).digest()


def _decode(data: bytes) -> Optional[Tuple[dict, bytes]]:
    """(JSON header, cubin) of a whole, uncorrupted entry; None for a torn or corrupt one."""
    body, checksum = data[:-32], data[-32:]
    if len(data) < len(_FORMAT) + 44 or not body.startswith(_FORMAT) \
            or hashlib.sha256(body).digest() != checksum:
        return None
    pos = len(_FORMAT)
    (header_len,) = struct.unpack_from("<I", body, pos)
    header = json.loads(body[pos + 4:pos + 4 + header_len])
    pos += 4 + header_len
    (cubin_len,) = struct.unpack_from("<Q", body, pos)
    cubin = body[pos + 8:pos + 8 + cubin_len]
    return (header, cubin) if len(cubin) == cubin_len else None


def read_entry(path: Path, key: str) -> Optional[CompiledCubin]:
    """The entry at `path` if it is whole, uncorrupted and for `key`; None otherwise."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    decoded = _decode(data)
    if decoded is None:
        compiler.verbose(f"cache entry {path} is torn or corrupt: rebuilding it")
        return None
    header, cubin = decoded
    if header.get("key") != key:
        return None
    return CompiledCubin(bytes(cubin), dict(header["lowered"]), from_cache=True)


def write_entry(path: Path, key: str, compiled: CompiledCubin,
                recipe_: Optional[dict] = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)   # mkstemp makes 0600; other users of a shared cache may read
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(key, compiled, recipe_))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _key_lock(path: Path):
    """Exclusive per-entry lock across processes (flock: released by the OS if a holder dies).
    Where locking is unavailable the build simply runs unlocked: the rename keeps entries whole."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        f = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
