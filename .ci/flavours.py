"""`make test-flavours`: the compile, link and ABI tests against the other stacks pip installs
(CUDA 12 and 13 wheels, each with NVSHMEM 3.8.0), beside the pinned set that `make test` runs.

A leg whose CUDA flavour is this environment's runs in it; the other flavour gets a venv under
DIR (made once, reused). NVSHMEM is unpacked under DIR and reached through EPCOMM_NVSHMEM_HOME,
never installed over the environment's own. Each leg runs the ABI and JIT compile tests (both
link modes on probes, the Params mirrors), then builds every kernel for sm_90 in link mode "lib"
(the mode that links NVSHMEM's device archive of that release).

    python .ci/flavours.py DIR [LEG ...]     # LEG: cu13-3.8.0, cu12-3.8.0 (default: both)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import deps  # noqa: E402
import nvshmem_release  # noqa: E402

LEGS = ("cu13-3.8.0", "cu12-3.8.0")
TESTS = ("tests/compile/test_nvshmem_abi.py", "tests/compile/test_jit_compile.py")


def _python_for(flavour: str, folder: str) -> str:
    if deps.flavour() == flavour and not deps.missing():
        return sys.executable
    venv = os.path.join(folder, f"venv-{flavour}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    requirements = [req for dist, req in deps.COMMON + deps.FLAVOURS[flavour]
                    if not dist.startswith("nvidia-nvshmem")]   # NVSHMEM: EPCOMM_NVSHMEM_HOME
    subprocess.run([python, "-m", "pip", "install", "-q", *requirements], check=True)
    return python


def run_leg(leg: str, folder: str) -> bool:
    flavour, version = leg.split("-", 1)
    start = time.monotonic()
    home = nvshmem_release.unpack(version, flavour, os.path.join(folder, f"nvshmem-{leg}"))
    python = _python_for(flavour, folder)
    env = dict(os.environ, EPCOMM_NVSHMEM_HOME=home, PYTHONPATH=ROOT,
               EPCOMM_CACHE_DIR=os.path.join(folder, f"cache-{leg}"))
    print(f"== leg {leg}: {python}, EPCOMM_NVSHMEM_HOME={home}", flush=True)
    # The inline-mode build of every kernel for sm_80 and sm_90 is make test's; here every kernel
    # is built once, for sm_90 in link mode "lib" (below), which compiles and links them all.
    tests = subprocess.run([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TESTS,
                            "-k", "not precompile_cli_exits_zero and not every_registered_source_was_built"],
                           cwd=ROOT, env=env)
    link = subprocess.run([python, "-m", "epcomm.jit", "--precompile", "--arch", "sm_90"], cwd=ROOT,
                          env=dict(env, EPCOMM_NVSHMEM_LINK="lib"))
    ok = tests.returncode == 0 and link.returncode == 0
    print(f"== leg {leg}: {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s", flush=True)
    return ok


def main(argv) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    folder = os.path.abspath(argv[1])
    os.makedirs(folder, exist_ok=True)
    legs = argv[2:] or LEGS
    failed = [leg for leg in legs if not run_leg(leg, folder)]
    if failed:
        print(f"test-flavours: failed legs {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
