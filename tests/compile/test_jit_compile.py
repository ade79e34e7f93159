"""The JIT compiles and links without a GPU: every registered kernel family (through
`python -m epcomm.jit --precompile`), the NVSHMEM prelude in both link modes, the arch.cuh helpers,
and errors come back as CompileError with the compiler's log."""
from __future__ import annotations

import importlib
import os
import struct
import subprocess
import sys

import pytest

from epcomm.errors import CompileError, ToolchainError
from epcomm.runtime import cache, compiler, options, toolchain
from epcomm.runtime.compiler import KernelSource

from tests.conftest import ROOT
from tests.helpers.kernels import cuda_src_with
TARGETS = [(80, 80), (90, 90), (90, 80)]     # (compile target, feature set)


def cubin_target(cubin: bytes) -> int:
    """The SM a cubin was built for (ELF e_machine EM_CUDA). Where e_flags keeps it depends on the
    CUDA ELF ABI version (e_ident[8]): bits 0-7 up to version 7 (CUDA 12), bits 8-15 from 8 (CUDA 13)."""
    assert cubin[:4] == b"\x7fELF", "not an ELF cubin"
    assert struct.unpack_from("<H", cubin, 18)[0] == 190, "ELF machine is not EM_CUDA"
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Builds and failed units go to a per-test directory, never the user's cache."""
    monkeypatch.setenv("EPCOMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EPCOMM_JIT_DUMP", raising=False)


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory):
    """Runs the CLI once into a fresh cache; the tests below read what it built."""
    cache_dir = tmp_path_factory.mktemp("epcomm-cache")
    env = dict(os.environ, EPCOMM_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT)
    env.pop("EPCOMM_ASSERT_NO_COMPILE", None)
    proc = subprocess.run([sys.executable, "-m", "epcomm.jit", "--precompile", "--arch", "sm_80,sm_90"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return cache_dir, proc


def test_precompile_cli_exits_zero(precompiled):
    _, proc = precompiled
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    from epcomm.ops.registry import representative_sources
    expected = sum(len(src.kernels) for _, src in representative_sources()) * len(TARGETS)
    ok_lines = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(ok_lines) == expected, proc.stdout
    assert "FAIL" not in proc.stdout


def test_every_registered_source_was_built(precompiled, monkeypatch):
    """Each registered source has a cache entry per target (proved with ASSERT_NO_COMPILE), for the
    right SM, holding every kernel's lowered name."""
    cache_dir, proc = precompiled
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setenv("EPCOMM_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("EPCOMM_ASSERT_NO_COMPILE", "1")
    cache.clear_memo()
    from epcomm.ops.registry import representative_sources
    for module, src in representative_sources():
        for arch_sm, feature in TARGETS:
            built = cache.get_cubin(src, arch_sm, feature)
            assert built.from_cache, (module, src, arch_sm, feature)
            assert cubin_target(built.cubin) == arch_sm
            assert set(built.lowered) == set(src.kernels)
            for mangled in built.lowered.values():
                assert mangled.encode() in built.cubin, f"{mangled} missing from the cubin"
    cache.clear_memo()


# ---- the kernel sources' shared headers --------------------------------------------------------
_ARCH_PROBE = r"""
#include "common/arch.cuh"
namespace epcomm {
struct CopyParams { int4 *dst; const int4 *src; int n16; };
__global__ void warp_copy_probe(const __grid_constant__ CopyParams p) {
    warp_copy(p.dst, p.n16, lane_id(), [&](int i) { return ld_nc_v4(p.src + i); });
    static_assert(kFeature == 80 || kFeature == 90, "feature macros");
}
}
"""

_NVSHMEM_PROBE = r"""
#include "common/nvshmem.cuh"
#include "common/arch.cuh"
namespace epcomm {
struct PutParams { int *dst; const int *src; unsigned long long *signal; int peer; };
template <int kBytes>
__global__ void put_probe(const __grid_constant__ PutParams p) {
    if (nvshmem_ptr(p.dst, p.peer) == nullptr)
        nvshmemx_putmem_signal_block(p.dst, p.src, kBytes, (uint64_t *)p.signal, 1, NVSHMEM_SIGNAL_ADD, p.peer);
    nvshmem_quiet();
}
}
"""


@pytest.mark.parametrize("arch_sm,feature", TARGETS)
def test_arch_helpers_compile_for_each_feature_set(tmp_path, arch_sm, feature):
    src = KernelSource("probe.cu", ("epcomm::warp_copy_probe",))
    with compiler.cuda_src_override(cuda_src_with(str(tmp_path), "probe.cu", _ARCH_PROBE)):
        built = compiler.compile_cubin(src, arch_sm, feature)
    assert cubin_target(built.cubin) == arch_sm


@pytest.mark.parametrize("link_mode,arch_sm", [("inline", 90), ("lib", 90), ("lib", 80)])
def test_nvshmem_prelude_links_in_both_modes(tmp_path, monkeypatch, link_mode, arch_sm):
    monkeypatch.setenv("EPCOMM_NVSHMEM_LINK", link_mode)
    src = KernelSource("probe.cu", ("epcomm::put_probe<256>",), uses_nvshmem=True)
    with compiler.cuda_src_override(cuda_src_with(str(tmp_path), "probe.cu", _NVSHMEM_PROBE)):
        built = compiler.compile_cubin(src, arch_sm, arch_sm)
    assert cubin_target(built.cubin) == arch_sm
    # nvshmemx_cumodule_init finds the device state by name in either mode.
    assert b"nvshmemi_device_state_d" in built.cubin


# ---- errors ---------------------------------------------------------------------------------------
def test_syntax_error_gives_compile_error_with_log(tmp_path):
    text = "namespace epcomm {\ntemplate <int N> __global__ void broken(int *p) { p[0] = N + ; }\n}\n"
    src = KernelSource("broken.cu", ("epcomm::broken<1>",))
    with compiler.cuda_src_override(cuda_src_with(str(tmp_path), "broken.cu", text)), \
            pytest.raises(CompileError) as info:
        compiler.compile_cubin(src, 90, 90)
    err = info.value
    assert err.stage == "NVRTC"
    assert "broken.cu" in err.log and "expected an expression" in err.log, err.log
    assert "broken.cu" in err.key
    assert err.unit_path and os.path.exists(err.unit_path)
    assert "-DEPCOMM_FEATURE_SM90=1" in open(err.unit_path).read()


def test_precompile_reports_a_failure_and_exits_nonzero(tmp_path, monkeypatch, capsys):
    from epcomm import jit
    from epcomm.ops import registry
    text = "template <int N> __global__ void bad(int *p) { p[0] = undefined_name; }\n"
    src = KernelSource("bad.cu", ("bad<1>",))
    monkeypatch.setattr(registry, "representative_sources", lambda: [("tests.fake", src)])
    with compiler.cuda_src_override(cuda_src_with(str(tmp_path), "bad.cu", text)):
        assert jit.precompile([90], jobs=1) == 1
    out = capsys.readouterr()
    assert "FAIL sm_90/f90" in out.out and "FAIL sm_90/f80" in out.out and "0/2 builds ok" in out.out
    assert "undefined_name" in out.err


def test_undefined_device_symbol_fails_at_link(tmp_path):
    text = ("extern __device__ int epcomm_missing(int);\n"
            "template <int N> __global__ void calls_missing(int *p) { p[0] = epcomm_missing(N); }\n")
    src = KernelSource("missing.cu", ("calls_missing<2>",))
    with compiler.cuda_src_override(cuda_src_with(str(tmp_path), "missing.cu", text)), \
            pytest.raises(CompileError) as info:
        compiler.compile_cubin(src, 90, 90)
    assert info.value.stage == "nvJitLink"
    assert "epcomm_missing" in info.value.log, info.value.log


def test_unknown_name_expression_is_a_compile_error():
    src = KernelSource("layout.cu", ("epcomm::no_such_kernel<1>",))
    with pytest.raises(CompileError) as info:
        compiler.compile_cubin(src, 90, 90)
    assert "no_such_kernel" in info.value.log


def test_missing_source_file():
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        compiler.plan_build(KernelSource("nope.cu", ("k",)), 90, 90)


# ---- options and toolchain -------------------------------------------------------------------------
def test_nvrtc_options_follow_the_target(monkeypatch):
    monkeypatch.delenv("EPCOMM_JIT_LINEINFO", raising=False)
    plain = options.nvrtc_options(options.Target.make(90, 80), "/src")
    assert "-arch=compute_90" in plain and "-DEPCOMM_FEATURE_SM80=1" in plain
    assert "-I/src" in plain and "-lineinfo" not in plain
    assert not any(o.startswith("-DEPCOMM_ARCH") for o in plain), "no kernel reads the compile target"
    assert not any("nvshmem" in o for o in plain)
    monkeypatch.setenv("EPCOMM_JIT_LINEINFO", "1")
    monkeypatch.setenv("EPCOMM_NVSHMEM_LINK", "lib")
    target = options.Target.make(90, 90, uses_nvshmem=True, defines=(("EXTRA", 3),))
    full = options.nvrtc_options(target, "/src")
    assert "-lineinfo" in full and "-DEPCOMM_NVSHMEM_LIB=1" in full and "-DEXTRA=3" in full
    assert f"-I{toolchain.nvshmem_include_dir()}" in full
    assert options.nvjitlink_options(target)[:3] == ["-arch=sm_90", "-lto", "-O3"]
    assert options.link_libraries(target)[0].endswith(".a")
    with pytest.raises(ValueError, match="sm90"):
        options.Target.make(80, 90)


def test_toolchain_versions_and_headers():
    assert toolchain.nvrtc_version()[0] >= 12
    assert toolchain.nvjitlink_version() >= toolchain.nvrtc_version()[:1] + (0,)
    includes = toolchain.cuda_include_dirs()
    assert any(os.path.exists(os.path.join(d, "cuda_runtime.h")) for d in includes)
    assert any(os.path.isdir(os.path.join(d, "cuda", "std")) for d in includes)
    assert toolchain.nvshmem_version() >= (3, 0, 0)


def test_bad_homes_raise_toolchain_error_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("EPCOMM_CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("EPCOMM_NVSHMEM_HOME", str(tmp_path))
    toolchain.cuda_include_dirs.cache_clear()
    toolchain.nvshmem_home.cache_clear()
    try:
        with pytest.raises(ToolchainError, match="EPCOMM_CUDA_HOME"):
            toolchain.cuda_include_dirs()
        with pytest.raises(ToolchainError, match="EPCOMM_NVSHMEM_HOME"):
            toolchain.nvshmem_home()
    finally:
        monkeypatch.undo()
        toolchain.cuda_include_dirs.cache_clear()
        toolchain.nvshmem_home.cache_clear()


# ---- Params mirrors -----------------------------------------------------------------------------------
def test_layout_params_mirror_matches_cpp():
    from epcomm.ops.layout import LayoutParams
    compiler.check_params_layout("layout.cu", "epcomm::LayoutParams", LayoutParams)


def test_poison_params_mirror_matches_cpp():
    from epcomm.ops.poison import PoisonParams, PoisonTarget
    compiler.check_params_layout("poison.cu", "epcomm::PoisonTarget", PoisonTarget)
    compiler.check_params_layout("poison.cu", "epcomm::PoisonParams", PoisonParams)


def test_params_check_catches_a_drifted_mirror():
    import ctypes

    class Drifted(ctypes.Structure):   # num_tokens moved to the front
        _fields_ = [("num_tokens", ctypes.c_longlong), ("topk_idx", ctypes.c_void_p),
                    ("num_tokens_per_rank", ctypes.c_void_p),
                    ("num_tokens_per_rdma_rank", ctypes.c_void_p),
                    ("num_tokens_per_expert", ctypes.c_void_p), ("is_token_in_rank", ctypes.c_void_p)]
    with pytest.raises(CompileError, match="offsetof"):
        compiler.check_params_layout("layout.cu", "epcomm::LayoutParams", Drifted)


@pytest.mark.parametrize("module, name, source, kernel", [
    ("tests.gpu.test_wait_chain_gpu", "wait_chain.cu", "CHAIN_SRC", "epcomm::wait_for_peer"),
    ("tests.gpu.test_sms_held_gpu", "hold_sms.cu", "HOLD_SRC", "epcomm::hold_sms")])
@pytest.mark.parametrize("arch_sm", [80, 90])
def test_the_gpu_tests_own_kernels_compile(tmp_path, module, name, source, kernel, arch_sm):
    """The kernels GPU tests build beside cuda_src/ (tests.helpers.kernels) compile here too."""
    text = getattr(importlib.import_module(module), source)
    with compiler.cuda_src_override(cuda_src_with(str(tmp_path), name, text)):
        built = compiler.compile_cubin(KernelSource(name, (kernel,)), arch_sm, arch_sm)
    assert cubin_target(built.cubin) == arch_sm
