"""One NVSHMEM pip release, unpacked beside the environment instead of installed into it (several
people may share the environment's site-packages): the headers, the host library, the unique-ID
bootstrap plugin and the device archive, which is all epcomm uses on one node. Point
EPCOMM_NVSHMEM_HOME at the unpacked folder.

    python .ci/nvshmem_release.py unpack 3.8.0 cu13 DEST      # -> DEST/include, DEST/lib
    python .ci/nvshmem_release.py pack 3.8.0 cu13 TARBALL     # .tar.xz holding nvshmem/...

`pack` is the recipe for machines without a registry (`make nvshmem-carry`: .nv38/, git-ignored):
carry the tarball there, `tar -xJf nvshmem-cu13-3.8.0.tar.xz -C /tmp/nvshmem38` and run with
EPCOMM_NVSHMEM_HOME=/tmp/nvshmem38/nvshmem.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

PREFIX = "nvidia/nvshmem/"
LIBRARIES = ("lib/libnvshmem_host.so.3", "lib/nvshmem_bootstrap_uid.so.3", "lib/libnvshmem_device.a")
CARRY_LIMIT = 60 << 20    # what may be carried to the GPU machine: 64 MiB in all


def _download(version: str, flavour: str, folder: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder,
                    f"nvidia-nvshmem-{flavour}=={version}"], check=True)
    (wheel,) = glob.glob(os.path.join(folder, "*.whl"))
    return wheel


def unpack(version: str, flavour: str, dest: str) -> str:
    """DEST with include/ and lib/ of the release; reused when already there."""
    marker = os.path.join(dest, "include", "non_abi", "nvshmem_version.h")
    if os.path.exists(marker) and all(os.path.exists(os.path.join(dest, lib)) for lib in LIBRARIES):
        return dest
    with tempfile.TemporaryDirectory() as work:
        wheel = zipfile.ZipFile(_download(version, flavour, work))
        for name in wheel.namelist():
            rel = name[len(PREFIX):] if name.startswith(PREFIX) else ""
            if name.endswith("/") or not (rel.startswith("include/") or rel in LIBRARIES):
                continue
            target = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with wheel.open(name) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    lacking = [lib for lib in LIBRARIES if not os.path.exists(os.path.join(dest, lib))]
    if lacking:
        raise SystemExit(f"nvidia-nvshmem-{flavour} {version} lacks {lacking}")
    return dest


def pack(version: str, flavour: str, tarball: str) -> int:
    with tempfile.TemporaryDirectory() as work:
        folder = unpack(version, flavour, os.path.join(work, "nvshmem"))
        os.makedirs(os.path.dirname(os.path.abspath(tarball)), exist_ok=True)
        with tarfile.open(tarball, "w:xz") as tar:
            tar.add(folder, arcname="nvshmem")
    size = os.path.getsize(tarball)
    print(f"{tarball}: {size / (1 << 20):.1f} MiB")
    if size > CARRY_LIMIT:
        print(f"too large to carry (> {CARRY_LIMIT >> 20} MiB)", file=sys.stderr)
        return 1
    return 0


def main(argv) -> int:
    if len(argv) != 5 or argv[1] not in ("unpack", "pack"):
        print(__doc__, file=sys.stderr)
        return 2
    command, version, flavour, path = argv[1:]
    if command == "unpack":
        print(unpack(version, flavour, path))
        return 0
    return pack(version, flavour, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
