"""The cubin cache: memo, disk entries, keys, corruption, concurrent writers, debug dumps."""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os

import pytest

from epcomm.errors import CompileError
from epcomm.runtime import cache, compiler
from epcomm.runtime.compiler import KernelSource

from tests.helpers.kernels import cuda_src_with

PROBE = r"""
#include "common/arch.cuh"
namespace epcomm {
template <int N, class T>
__global__ void fill(T *out) { out[threadIdx.x] = static_cast<T>(N + kFeature); }
}
"""
SRC = KernelSource("probe.cu", ("epcomm::fill<3, int>", "epcomm::fill<4, float>"))


def make_tree(path, edit_header: bool = False) -> str:
    """A copy of cuda_src/ plus the probe source; optionally with an edited common header."""
    root = cuda_src_with(str(path), "probe.cu", PROBE)
    if edit_header:
        with open(os.path.join(root, "common", "ptx.cuh"), "a") as f:
            f.write("\n// an edit that changes no code still invalidates\n")
    return root


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.setenv("EPCOMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EPCOMM_ASSERT_NO_COMPILE", raising=False)
    monkeypatch.delenv("EPCOMM_JIT_DUMP", raising=False)
    cache.clear_memo()
    with compiler.cuda_src_override(make_tree(tmp_path)) as root:
        yield root
    cache.clear_memo()


def entry_of(src=SRC, arch_sm=90, feature=90):
    plan = compiler.plan_build(src, arch_sm, feature)
    key = cache.cache_key(plan)
    return cache.entry_path(plan, key), key


def test_hit_after_miss_keeps_lowered_names(tree, monkeypatch):
    first = cache.get_cubin(SRC, 90, 90)
    assert not first.from_cache and first.nvrtc_s > 0
    assert set(first.lowered) == set(SRC.kernels)
    assert cache.get_cubin(SRC, 90, 90) is first            # in-process memo
    cache.clear_memo()
    monkeypatch.setenv("EPCOMM_ASSERT_NO_COMPILE", "1")     # a compile now would raise
    again = cache.get_cubin(SRC, 90, 90)
    assert again.from_cache
    assert again.cubin == first.cubin and again.lowered == first.lowered


def test_assert_no_compile_raises_on_a_miss(tree, monkeypatch):
    monkeypatch.setenv("EPCOMM_ASSERT_NO_COMPILE", "1")
    with pytest.raises(CompileError, match="EPCOMM_ASSERT_NO_COMPILE"):
        cache.get_cubin(SRC, 90, 90)


def test_key_covers_target_and_feature(tree):
    keys = {entry_of(SRC, a, f)[1] for a, f in [(90, 90), (90, 80), (80, 80)]}
    keys.add(entry_of(KernelSource("probe.cu", ("epcomm::fill<3, int>",)))[1])
    keys.add(entry_of(KernelSource("probe.cu", SRC.kernels, defines=(("X", 1),)))[1])
    assert len(keys) == 5


def test_header_edit_changes_the_key_and_copies_share_it(tmp_path, tree):
    key = entry_of()[1]
    with compiler.cuda_src_override(make_tree(tmp_path / "same")):
        assert entry_of()[1] == key, "an identical copy elsewhere must share entries"
    with compiler.cuda_src_override(make_tree(tmp_path / "edited", edit_header=True)):
        assert entry_of()[1] != key, "editing common/ptx.cuh must invalidate"


def test_only_headers_the_source_includes_enter_its_key(tmp_path, tree):
    key = entry_of()[1]
    closure = {p.relative_to(tree).as_posix() for p in cache.source_closure("probe.cu", tree)}
    assert {"probe.cu", "common/arch.cuh", "common/ptx.cuh"} <= closure
    assert "low_latency_protocol.cuh" not in closure
    root = make_tree(tmp_path / "other")
    with open(f"{root}/low_latency_protocol.cuh", "a") as f:
        f.write("\n// a family the probe does not include\n")
    with compiler.cuda_src_override(root):
        assert entry_of()[1] == key


def test_corrupt_or_torn_entry_is_a_miss_and_is_replaced(tree):
    built = cache.get_cubin(SRC, 90, 90)
    path, key = entry_of()
    good = path.read_bytes()
    for bad in (good[: len(good) // 2],                                  # torn write
                good[:100] + bytes([good[100] ^ 0xFF]) + good[101:],     # flipped byte
                b""):
        path.write_bytes(bad)
        assert cache.read_entry(path, key) is None
    cache.clear_memo()
    rebuilt = cache.get_cubin(SRC, 90, 90)
    assert not rebuilt.from_cache and rebuilt.lowered == built.lowered
    assert cache.read_entry(path, key) is not None                       # replaced by a good one


def test_entry_for_another_key_is_a_miss(tree):
    cache.get_cubin(SRC, 90, 90)
    path, key = entry_of()
    assert cache.read_entry(path, "0" * 64) is None
    assert cache.read_entry(path, key) is not None


def _build_in_child(root, cache_dir, barrier, results):
    import os
    os.environ["EPCOMM_CACHE_DIR"] = cache_dir
    from epcomm.runtime import cache as child_cache, compiler as child_compiler
    with child_compiler.cuda_src_override(root):
        barrier.wait()
        built = child_cache.get_cubin(SRC, 90, 90)
    results.put((built.from_cache, hashlib.sha256(built.cubin).hexdigest()))


def test_concurrent_processes_leave_one_valid_entry(tmp_path, tree):
    ctx = multiprocessing.get_context("spawn")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child,
                         args=(tree, str(tmp_path / "cache"), barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len({digest for _, digest in outcomes}) == 1, "every rank must load the same cubin"
    assert sum(not hit for hit, _ in outcomes) == 1, "the per-key lock lets one process compile"
    path, key = entry_of()
    assert cache.read_entry(path, key) is not None
    assert not list(path.parent.glob("*.tmp")), "no temp files left behind"


def _write_in_child(path, key, seed, rounds):
    from pathlib import Path
    from epcomm.runtime import cache as child_cache
    from epcomm.runtime.compiler import CompiledCubin
    for i in range(rounds):
        blob = bytes([seed]) * (50_000 + 997 * i)
        child_cache.write_entry(Path(path), key, CompiledCubin(blob, {"k": f"w{seed}"}))


def test_racing_writers_never_leave_a_torn_entry(tmp_path):
    path, key = tmp_path / "entry.bin", "k" * 64
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_in_child, args=(str(path), key, seed, 30)) for seed in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entry = cache.read_entry(path, key)
    assert entry is not None and len(set(entry.cubin)) == 1
    assert entry.lowered == {"k": f"w{entry.cubin[0]}"}


def test_dump_and_verbose(tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EPCOMM_JIT_DUMP", str(tmp_path / "dump"))
    monkeypatch.setenv("EPCOMM_JIT_VERBOSE", "1")
    cache.get_cubin(SRC, 90, 90)
    (dump,) = (tmp_path / "dump").iterdir()
    names = {p.name for p in dump.iterdir()}
    assert {"probe_unit.cu", "kernel.cubin", "kernel.ptx"} <= names, names
    assert ".entry" in (dump / "kernel.ptx").read_text()
    err = capsys.readouterr().err
    assert "NVRTC probe.cu" in err and "nvJitLink probe.cu" in err and "-arch=compute_90" in err


# ---- no install path in the key ----------------------------------------------------------------
_TOOLCHAIN_MEMOS = ("cuda_include_dirs", "cuda_header_versions", "nvshmem_home", "nvshmem_version")


def _fake_install(prefix, cudart=13050, cccl=3005000, nvshmem=(3, 4, 5)):
    """The files toolchain.py looks at in a CUDA / NVSHMEM install, under `prefix`, with these
    versions (a key computation reads nothing else from them)."""
    include, nvshmem_inc = prefix / "cuda" / "include", prefix / "nvshmem" / "include"
    (include / "cccl" / "cuda" / "std" / "__cccl").mkdir(parents=True)
    (nvshmem_inc / "non_abi").mkdir(parents=True)
    (include / "cuda_runtime.h").write_text("")
    (include / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION  {cudart}\n")
    (include / "cccl" / "cuda" / "std" / "type_traits").write_text("")
    (include / "cccl" / "cuda" / "std" / "__cccl" / "version.h").write_text(f"#define CCCL_VERSION {cccl}\n")
    (nvshmem_inc / "nvshmem.h").write_text("")
    (nvshmem_inc / "non_abi" / "nvshmem_version.h").write_text("".join(
        f"#define NVSHMEM_VENDOR_{part}_VERSION {v}\n" for part, v in zip(("MAJOR", "MINOR", "PATCH"), nvshmem)))
    return prefix


def _key_in(monkeypatch, prefix):
    from epcomm.runtime import toolchain
    with monkeypatch.context() as m:
        m.setenv("EPCOMM_CUDA_HOME", str(prefix / "cuda"))
        m.setenv("EPCOMM_NVSHMEM_HOME", str(prefix / "nvshmem"))
        for name in _TOOLCHAIN_MEMOS:
            getattr(toolchain, name).cache_clear()
        try:
            plan = compiler.plan_build(KernelSource("probe.cu", SRC.kernels, uses_nvshmem=True), 90, 90)
            assert any(str(prefix) in o for o in plan.nvrtc_options), "the fake install must be used"
            return cache.cache_key(plan)
        finally:
            for name in _TOOLCHAIN_MEMOS:
                getattr(toolchain, name).cache_clear()


def test_key_has_no_install_path(tree, tmp_path, monkeypatch):
    """Same versions under two prefixes: one key. Another CUDA header, CCCL or NVSHMEM version: another."""
    key = _key_in(monkeypatch, _fake_install(tmp_path / "env-a"))
    assert _key_in(monkeypatch, _fake_install(tmp_path / "opt" / "env-b")) == key
    assert _key_in(monkeypatch, _fake_install(tmp_path / "c", cudart=13000)) != key
    assert _key_in(monkeypatch, _fake_install(tmp_path / "d", cccl=3001000)) != key
    assert _key_in(monkeypatch, _fake_install(tmp_path / "e", nvshmem=(3, 5, 0))) != key


def test_entries_record_recipes_and_rebuild_serves_edited_sources(tree, tmp_path, monkeypatch):
    from epcomm import jit
    other = KernelSource("probe.cu", ("epcomm::fill<5, int>",), defines=(("X", 1),))
    cache.get_cubin(SRC, 90, 90)
    cache.get_cubin(other, 80, 80)
    old_dir = tmp_path / "cache"
    assert cache.recipes(old_dir) == sorted([(SRC, 90, 90), (other, 80, 80)],
                                            key=lambda r: entry_of(*r)[0].name)
    # After an edit every old key misses; --rebuild builds the recorded set into a new cache.
    with compiler.cuda_src_override(make_tree(tmp_path / "edited", edit_header=True)):
        cache.clear_memo()
        monkeypatch.setenv("EPCOMM_CACHE_DIR", str(tmp_path / "new"))
        assert jit.precompile([90], jobs=1, rebuild_from=str(old_dir)) == 0
        cache.clear_memo()
        monkeypatch.setenv("EPCOMM_ASSERT_NO_COMPILE", "1")
        assert cache.get_cubin(SRC, 90, 90).from_cache
        assert cache.get_cubin(other, 80, 80).from_cache
    assert jit.precompile([90], jobs=1, rebuild_from=str(tmp_path / "empty")) == 0   # nothing to do


def test_a_recipes_file_keeps_a_caches_kernels_without_their_cubins(tree, tmp_path, monkeypatch, capsys):
    """--list-recipes DIR prints the recorded recipes as JSON; --rebuild FILE builds exactly them."""
    from epcomm import jit
    other = KernelSource("probe.cu", ("epcomm::fill<6, int>",))
    cache.get_cubin(SRC, 90, 90)
    cache.get_cubin(other, 90, 90)
    assert jit.main(["--list-recipes", str(tmp_path / "cache")]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(r["kernels"][0] for r in listed) == sorted([SRC.kernels[0], other.kernels[0]])
    recipes_file = tmp_path / "recipes.json"
    recipes_file.write_text(json.dumps(listed))
    assert cache.recipes(recipes_file) == cache.recipes(tmp_path / "cache")
    cache.clear_memo()
    monkeypatch.setenv("EPCOMM_CACHE_DIR", str(tmp_path / "fresh"))
    assert jit.main(["--rebuild", str(recipes_file), "--jobs", "1"]) == 0
    cache.clear_memo()
    monkeypatch.setenv("EPCOMM_ASSERT_NO_COMPILE", "1")
    assert cache.get_cubin(SRC, 90, 90).from_cache and cache.get_cubin(other, 90, 90).from_cache
