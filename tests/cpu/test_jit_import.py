"""Importing epcomm (and its runtime modules) touches neither CUDA nor the JIT toolchain: NVRTC,
nvJitLink and libcuda load on first use only."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
HEAVY = ("cuda.bindings.nvrtc", "cuda.bindings.nvjitlink")


def loaded_after(statement: str) -> dict:
    # Modules already loaded at start-up do not count (cuda-bindings 12's .pth imports `cuda`).
    code = (f"import sys, time\nbefore = set(sys.modules)\nt = time.perf_counter()\n{statement}\n"
            "import json\nmaps = open('/proc/self/maps').read()\n"
            "print(json.dumps({'modules': sorted(set(sys.modules) - before), "
            "'seconds': time.perf_counter() - t,"
            " 'libs': [n for n in ('libcuda.so', 'libnvrtc', 'libnvJitLink') if n in maps]}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_epcomm_loads_no_torch_and_no_toolchain():
    result = loaded_after("import epcomm")
    print(f"import epcomm: {result['seconds'] * 1e3:.0f} ms")
    assert "torch" not in result["modules"]
    assert not [m for m in result["modules"] if m.startswith("cuda")]
    assert not result["libs"]


def test_runtime_modules_load_no_toolchain_at_import():
    result = loaded_after("import epcomm.runtime.module, epcomm.runtime.cache, epcomm.runtime.launch, "
                          "epcomm.runtime.arch, epcomm.jit, epcomm.ops.registry, epcomm.ops.layout")
    assert not [m for m in HEAVY if m in result["modules"]]
    assert not result["libs"], f"loaded at import: {result['libs']}"
