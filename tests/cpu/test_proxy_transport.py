"""The proxy-transport harness (tests/gpu/proxy_transport.py) without a GPU: where it finds UCX (a
wheel with its modes kept, a download folder, a prefix), the environment the ranks get, the verdict
read from the ranks' logs, and NOT RUN (exit 2) with the reason when nothing could be tested."""
from __future__ import annotations

import os
import stat
import zipfile

import pytest

from tests.gpu import proxy_transport as pt


def fake_wheel(folder) -> str:
    path = os.path.join(folder, "libucx_cu13-1.22.0-py3-none-manylinux_2_28_x86_64.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("libucx/lib/libucp.so.0", b"")
        info = zipfile.ZipInfo("libucx/bin/ucx_info")
        info.external_attr = (stat.S_IFREG | 0o755) << 16
        wheel.writestr(info, "#!/bin/sh\necho '#      Transport: tcp'; echo '#      Device: lo'\n")
    return path


def test_a_wheel_is_unpacked_with_its_modes(tmp_path):
    wheel = fake_wheel(str(tmp_path))
    prefix = pt.find_ucx(wheel, str(tmp_path / "out"))
    assert prefix == str(tmp_path / "out" / "libucx")
    assert os.access(os.path.join(prefix, "bin", "ucx_info"), os.X_OK)
    env = dict(os.environ, **pt.transport_env(prefix, {}))
    assert pt.ucx_devices(prefix, env) == (True, "ucx_info -d: transports ['tcp'], devices ['lo']")


def test_a_download_folder_and_a_prefix_are_found(tmp_path):
    fake_wheel(str(tmp_path))
    assert pt.find_ucx(str(tmp_path), str(tmp_path / "out")).endswith(os.path.join("out", "libucx"))
    prefix = tmp_path / "prefix"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libucp.so.0").write_bytes(b"")
    assert pt.find_ucx(str(prefix), str(tmp_path / "unused")) == str(prefix)
    with pytest.raises(pt.NotRun, match="no UCX at .*lib/libucp.so.0"):
        pt.find_ucx(str(tmp_path / "prefix" / "lib"), str(tmp_path / "unused"))


def test_the_ranks_get_the_ucx_over_tcp_settings():
    env = pt.transport_env("/u", {"LD_LIBRARY_PATH": "/a:/b"})
    assert env == {"NVSHMEM_REMOTE_TRANSPORT": "ucx", "NVSHMEM_DISABLE_P2P": "1", "UCX_TLS": "tcp,cuda_copy,self",
                   "UCX_NET_DEVICES": "lo", "LD_LIBRARY_PATH": "/u/lib:/a:/b", "UCX_MODULE_DIR": "/u/lib/ucx",
                   "NVSHMEM_DEBUG": "INFO", "EPCOMM_TEST_PROXY_TRANSPORT": "ucx"}
    assert pt.transport_env("/u", {"UCX_NET_DEVICES": "eth0"})["UCX_NET_DEVICES"] == "eth0"


def test_verdicts_from_the_logs():
    passed = "....\n10 passed in 30.0s\n"
    status, line = pt.verdict(True, [passed, passed])
    assert status == 0 and line.startswith("VERDICT: PASS") and "2 nodes of 1 rank" in line, line
    skipped = ("SKIPPED [9] tests/gpu/test_internode_proxy_gpu.py:60: the proxy-transport check runs under x\n"
               "9 skipped in 1.0s\n")
    status, line = pt.verdict(True, [skipped, skipped])
    assert status == 2 and "NOT RUN" in line and "the proxy-transport check runs under x" in line, line
    amo = ("nvshmemt_ucx_local_amo: AMO 8 not supported with the current configuration (GDRCopy Disabled)\n"
           "process_channel_amo: aborting\n")
    status, line = pt.verdict(False, [amo, ""])
    assert status == 1 and "remote atomic" in line and "AMO 8 not supported" in line, line
    in_init = "proxy step: nvshmem_init: begun\n" + amo
    status, line = pt.verdict(False, [in_init, ""])
    assert status == 2 and line.startswith("VERDICT: NOT RUN: NVSHMEM's own nvshmem_init aborted before any epcomm"), line
    in_malloc = "proxy step: nvshmem_init: begun\nproxy step: nvshmem_init: returned\nproxy step: nvshmem_malloc: begun\n" + amo
    status, line = pt.verdict(False, [in_malloc, ""])
    assert status == 2 and "NVSHMEM's own nvshmem_malloc aborted before any epcomm kernel" in line, line
    allocated = ("proxy step: nvshmem_malloc: begun\nproxy step: nvshmem_malloc: returned\n"
                 "proxy step: nvshmem_free: begun\nproxy step: nvshmem_free: returned\n") + amo
    status, line = pt.verdict(False, [allocated, ""])
    assert status == 1 and "before any epcomm kernel" not in line and "AMO 8" in line, line
    status, line = pt.verdict(False, [passed, "F\n1 failed, 9 passed in 3.0s\n"])
    assert (status, line) == (1, "VERDICT: FAIL: rank 1: 1 failed, 9 passed in 3.0s"), line


def test_nothing_to_test_is_not_run(tmp_path, capsys):
    assert pt.main(["--ranks", "1", "--log-dir", str(tmp_path)]) == 2
    assert "VERDICT: NOT RUN: --ranks must be at least 2" in capsys.readouterr().out
    assert pt.main(["--ucx", str(tmp_path / "nothing"), "--log-dir", str(tmp_path)]) == 2
    assert "VERDICT: NOT RUN: no UCX at" in capsys.readouterr().out
