"""CPU checks of the NVSHMEM host binding: the ctypes mirrors against the real headers (compiled by
NVRTC, which needs no GPU), the library loading without a GPU, the missing-library error, and the
environment defaults."""
from __future__ import annotations

import ctypes
import os

import pytest

from epcomm.errors import NvshmemError
from epcomm.runtime import nvshmem, status, toolchain

# (C type name, ctypes mirror) for every struct epcomm shares with C.
MIRRORS = [
    ("nvshmemx_uniqueid_t", nvshmem.UniqueId),
    ("nvshmemx_uniqueid_args_t", nvshmem.UniqueIdArgs),
    ("nvshmemx_init_args_t", nvshmem.InitArgs),
    ("nvshmemx_init_attr_t", nvshmem.InitAttr),
    ("epcomm::ErrorRecord", status.ErrorRecord),
]

_HEADERS = """
#include <bootstrap_device_host/nvshmem_uniqueid.h>
#include <device_host/nvshmem_types.h>
#include "common/timeout.cuh"
"""


def _layout_asserts(c_name, mirror, size_delta=0) -> str:
    lines = [f'static_assert(sizeof({c_name}) == {ctypes.sizeof(mirror) + size_delta}, '
             f'"sizeof {c_name}");']
    for field, *_ in mirror._fields_:
        offset = getattr(mirror, field).offset
        lines.append(f'static_assert(__builtin_offsetof({c_name}, {field}) == {offset}, '
                     f'"offsetof {c_name}::{field}");')
    return "\n".join(lines)


def _nvrtc_compile(source: str) -> tuple:
    """(ok, log) of compiling source for compute_90 with the NVSHMEM, CUDA and cuda_src includes."""
    try:
        nvrtc = toolchain.nvrtc()
        includes = [toolchain.nvshmem_include_dir(), *toolchain.cuda_include_dirs()]
    except Exception as e:  # ToolchainError: the CI installs these; say what is missing
        pytest.skip(f"NVRTC toolchain not available: {e}")
    cuda_src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda_src")
    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"abi_check.cu", 0, [], [])
    opts = [b"-std=c++17", b"-default-device", b"-arch=compute_90", f"-I{cuda_src}".encode()]
    opts += [f"-I{d}".encode() for d in includes]
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # not b" " * size: NVRTC would write into an interned bytes object
        nvrtc.nvrtcGetProgramLog(prog, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return result == nvrtc.nvrtcResult.NVRTC_SUCCESS, bytes(log).decode(errors="replace")


def test_ctypes_layouts_match_headers():
    source = _HEADERS + "\n".join(_layout_asserts(c, m) for c, m in MIRRORS)
    ok, log = _nvrtc_compile(source)
    assert ok, log


def test_layout_check_detects_a_wrong_size():
    # The check above can fail: the same unit with one size off by 8 must not compile.
    source = _HEADERS + _layout_asserts("nvshmemx_init_attr_t", nvshmem.InitAttr, size_delta=8)
    ok, log = _nvrtc_compile(source)
    assert not ok and "sizeof nvshmemx_init_attr_t" in log


def test_struct_versions_follow_the_initializer_convention():
    # (1 << 16) + sizeof, as NVSHMEMX_*_INITIALIZER write them (platform.md (a)).
    assert nvshmem._struct_version(nvshmem.UniqueId) == 65664
    assert nvshmem._struct_version(nvshmem.UniqueIdArgs) == 65560
    assert nvshmem._struct_version(nvshmem.InitArgs) == 65664
    assert nvshmem._struct_version(nvshmem.InitAttr) == 65680


# ---- the library, without a GPU -------------------------------------------------------------------
def _library_or_skip():
    try:
        return nvshmem.library()
    except NvshmemError as e:
        pytest.skip(f"libnvshmem_host not loadable here: {e}")


def test_library_loads_without_gpu_and_matches_headers():
    _library_or_skip()
    assert nvshmem.library_version() == toolchain.nvshmem_version()
    assert nvshmem.init_status() == nvshmem.STATUS_NOT_INITIALIZED


def test_cumodule_init_before_init_raises():
    _library_or_skip()
    with pytest.raises(NvshmemError, match="not initialised"):
        nvshmem.cumodule_init(0x1234)


def test_missing_library_names_the_pip_package(tmp_path, monkeypatch):
    monkeypatch.setenv("EPCOMM_NVSHMEM_HOME", str(tmp_path))
    toolchain.nvshmem_home.cache_clear()
    try:
        with pytest.raises(NvshmemError, match="nvidia-nvshmem-cu13"):
            nvshmem.library_path()
        (tmp_path / "include").mkdir()
        (tmp_path / "include" / "nvshmem.h").write_text("")  # headers but no host library
        toolchain.nvshmem_home.cache_clear()
        with pytest.raises(NvshmemError, match="libnvshmem_host.so.3"):
            nvshmem.library_path()
    finally:
        monkeypatch.delenv("EPCOMM_NVSHMEM_HOME")
        toolchain.nvshmem_home.cache_clear()


# ---- environment defaults -------------------------------------------------------------------------
def test_env_defaults_fill_only_unset_variables():
    environ = {"NVSHMEM_SYMMETRIC_SIZE": "4G", "NVSHMEM_DISABLE_NVLS": ""}
    applied = nvshmem.apply_env_defaults(single_host=True, environ=environ)
    assert environ == {"NVSHMEM_SYMMETRIC_SIZE": "4G", "NVSHMEM_DISABLE_NVLS": "1",
                       "NVSHMEM_REMOTE_TRANSPORT": "none"}
    assert applied == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none"}


def test_env_defaults_keep_user_values():
    user = {"NVSHMEM_DISABLE_NVLS": "0", "NVSHMEM_REMOTE_TRANSPORT": "ibrc",
            "NVSHMEM_SYMMETRIC_SIZE": "256M"}
    environ = dict(user)
    assert nvshmem.apply_env_defaults(single_host=True, environ=environ) == {}
    assert environ == user


def test_env_defaults_leave_remote_transport_alone_across_hosts():
    environ = {}
    nvshmem.apply_env_defaults(single_host=False, environ=environ)
    assert environ == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_SYMMETRIC_SIZE": "1G"}


def test_env_defaults_are_listed_in_the_module_docstring():
    for name, value in nvshmem.env_defaults(single_host=True).items():
        assert f"{name}={value}" in nvshmem.__doc__
