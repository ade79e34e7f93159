"""CPU checks of the NVSHMEM host binding: the ctypes mirrors against the real headers (compiled by
NVRTC, which needs no GPU), the library loading without a GPU, the missing-library error, and the
environment defaults."""
from __future__ import annotations

import ctypes
import re

import pytest

from epcomm.errors import NvshmemError
from epcomm.runtime import compiler, nvshmem, status, toolchain


def _headers_version():
    version = toolchain.nvshmem_version()
    if version is None:
        pytest.skip("NVSHMEM headers not installed here")
    return version


def _mirrors(version):
    """(C type name, ctypes mirror) for every struct epcomm shares with C, for NVSHMEM `version`:
    the init structs the library gets are the ones init_layout picks for it."""
    attr, revision = nvshmem.init_layout(version)
    mirrors = [("nvshmemx_uniqueid_t", nvshmem.UniqueId),
               ("nvshmemx_uniqueid_args_t", nvshmem.UniqueIdArgs),
               ("nvshmemx_init_args_t", attr._fields_[2][1]),
               ("nvshmemx_init_attr_t", attr),
               ("epcomm::ErrorRecord", status.ErrorRecord)]
    if revision >= 2:   # these headers keep the v1 struct too: its mirror must still match
        mirrors.append(("nvshmemx_init_args_v1", nvshmem.InitArgsV1))
    return mirrors


_HEADERS = """
#include <bootstrap_device_host/nvshmem_uniqueid.h>
#include <device_host/nvshmem_types.h>
#include "common/timeout.cuh"
"""


def _layout_asserts(c_name, mirror, size_delta=0) -> str:
    lines = [compiler.OFFSETOF_MACRO.rstrip("\n"),
             f'static_assert(sizeof({c_name}) == {ctypes.sizeof(mirror) + size_delta}, '
             f'"sizeof {c_name}");']
    for field, *_ in mirror._fields_:
        offset = getattr(mirror, field).offset
        lines.append(f'static_assert(EPCOMM_OFFSETOF({c_name}, {field}) == {offset}, '
                     f'"offsetof {c_name}::{field}");')
    return "\n".join(lines)


def _nvrtc_compile(source: str) -> tuple:
    """(ok, log) of compiling source for compute_90 with the NVSHMEM, CUDA and cuda_src includes."""
    try:
        nvrtc = toolchain.nvrtc()
        includes = [toolchain.nvshmem_include_dir(), *toolchain.cuda_include_dirs()]
    except Exception as e:  # ToolchainError: the CI installs these; say what is missing
        pytest.skip(f"NVRTC toolchain not available: {e}")
    cuda_src = compiler.cuda_src_dir()
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
    source = _HEADERS + "\n".join(_layout_asserts(c, m) for c, m in _mirrors(_headers_version()))
    ok, log = _nvrtc_compile(source)
    assert ok, log


def test_init_layout_choice_matches_the_headers_typedef():
    """The headers name the struct revision nvshmemx_init_attr_t is: the version rule agrees."""
    version = _headers_version()
    text = (toolchain.nvshmem_home() / "include" / "device_host" / "nvshmem_types.h").read_text()
    typedefs = re.findall(r"typedef\s+nvshmemx_init_attr_v(\d)\s+nvshmemx_init_attr_t\s*;", text)
    assert len(typedefs) == 1, typedefs
    assert nvshmem.init_layout(version)[1] == int(typedefs[0]), version


def test_init_layout_by_version():
    assert nvshmem.init_layout((3, 4, 5)) == (nvshmem.InitAttrV1, 1)
    for version in ((3, 5, 19), (3, 6, 5), (3, 7, 2), (3, 8, 0), (4, 0, 0)):
        assert nvshmem.init_layout(version) == (nvshmem.InitAttrV2, 2)
    with pytest.raises(NvshmemError, match="NVSHMEM 3.3.24 is too old"):
        nvshmem.init_layout((3, 3, 24))
    v2 = nvshmem.new_init_attr((3, 8, 0))
    assert (v2.version, v2.args.version, v2.args.uid_args.version) == ((2 << 16) + 144, (2 << 16) + 128, 65560)
    assert v2.args.cuda_device_id == -1 and v2.args.uid_args.myrank == v2.args.uid_args.nranks == -1
    assert nvshmem.InitArgsV2.cuda_device_id.offset == 32 and nvshmem.InitArgsV2.content.offset == 36
    v1 = nvshmem.new_init_attr((3, 4, 5))
    assert (v1.version, v1.args.version) == (65680, 65664)


def test_layout_check_detects_a_wrong_size():
    # The check above can fail: the same unit with one size off by 8 must not compile.
    attr = nvshmem.init_layout(_headers_version())[0]
    source = _HEADERS + _layout_asserts("nvshmemx_init_attr_t", attr, size_delta=8)
    ok, log = _nvrtc_compile(source)
    assert not ok and "sizeof nvshmemx_init_attr_t" in log


def test_struct_versions_follow_the_initializer_convention():
    # (1 << 16) + sizeof, as NVSHMEMX_*_INITIALIZER write them (platform.md (a)).
    assert nvshmem._struct_version(nvshmem.UniqueId) == 65664
    assert nvshmem._struct_version(nvshmem.UniqueIdArgs) == 65560
    assert nvshmem._struct_version(nvshmem.InitArgsV1) == 65664
    assert nvshmem._struct_version(nvshmem.InitAttrV1) == 65680
    assert nvshmem._struct_version(nvshmem.InitAttrV2, 2) == (2 << 16) + 144


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
