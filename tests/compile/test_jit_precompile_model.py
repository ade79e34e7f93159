"""`python -m epcomm.jit --precompile` with a model's shapes: the planned kernel set (validation,
files, modes, topologies) and the CLI building exactly that set into a fresh cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from epcomm.ops.model_kernels import ModelShapes, kernel_sources, load_shapes
from epcomm.runtime import cache, compiler

from tests.conftest import ROOT
SMALL = dict(hidden=256, num_topk=2, num_experts=4, num_ranks=2)


def _files(sources):
    return [src.source for src in sources]


def test_normal_mode_intranode_and_internode():
    intra = kernel_sources(ModelShapes(**SMALL, modes=("normal",)))
    # the poison fill every call queues, layout, notify, fresh + cached dispatch, combine
    assert _files(intra) == ["poison.cu", "layout.cu"] + ["intranode.cu"] * 4
    inter = kernel_sources(ModelShapes(**dict(SMALL, num_ranks=4, num_experts=8), num_local_ranks=2,
                                       modes=("normal",), dtypes=("bf16", "fp8")))
    assert _files(inter) == ["poison.cu", "layout.cu"] + ["internode.cu"] * 6   # + FP8 fresh and cached
    assert all(src.uses_nvshmem for src in inter[2:])
    assert len(set(inter)) == len(inter)


def test_low_latency_variants_and_dedup():
    base = dict(SMALL, num_max_dispatch_tokens_per_rank=32, modes=("low_latency",))
    bf16 = kernel_sources(ModelShapes(**base))
    assert _files(bf16) == ["poison.cu"] + ["low_latency.cu"] * 2          # dispatch, combine
    fp8 = kernel_sources(ModelShapes(**dict(base, hidden=512), dtypes=("fp8",),
                                     ll_scales=("float", "pow2", "ue8m0")))
    assert len(fp8) == 5 and len({src.kernels for src in fp8}) == 5
    both = kernel_sources(ModelShapes(**base, dtypes=("bf16", "fp8", "fp8")))
    assert len(both) == 4                                  # repeated dtypes build once
    everything = kernel_sources(ModelShapes(**dict(base, modes=("normal", "low_latency"))))
    assert set(bf16) < set(everything) and len(everything) == 1 + 5 + 2   # poison, layout + 4 intranode, 2 low-latency


@pytest.mark.parametrize("bad, match", [
    (dict(num_experts=5), "multiple of num_ranks"),
    (dict(num_local_ranks=3), "multiple of num_local_ranks"),
    (dict(modes=("normal", "fast")), "modes"),
    (dict(dtypes=("fp16",)), "dtypes"),
    (dict(hidden=200, dtypes=("fp8",)), "multiple of 128"),
    (dict(modes=("low_latency",)), "num_max_dispatch_tokens_per_rank"),
    (dict(hidden=0), "hidden must be a positive integer"),
    (dict(index_dtype="int16"), "index_dtype"),
    (dict(hidden=1280, modes=("low_latency",), num_max_dispatch_tokens_per_rank=8,
          ll_scales=("ue8m0",)), "multiple of 512"),
])
def test_bad_shapes_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelShapes(**{**SMALL, "modes": ("normal",), **bad})


def test_shape_files(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(dict(SMALL, modes=["normal"])))
    (tmp_path / "two.json").write_text(json.dumps([dict(SMALL, modes=["normal"]),
                                                   dict(SMALL, hidden=512, modes=["normal"])]))
    (tmp_path / "m.toml").write_text('[[model]]\nhidden = 256\nnum_topk = 2\nnum_experts = 4\n'
                                     'num_ranks = 2\nmodes = ["normal"]\n')
    (tmp_path / "bad.json").write_text(json.dumps(dict(SMALL, hiden=1)))
    assert load_shapes(tmp_path / "one.json") == [ModelShapes(**SMALL, modes=("normal",))]
    assert [m.hidden for m in load_shapes(tmp_path / "two.json")] == [256, 512]
    assert load_shapes(tmp_path / "m.toml") == load_shapes(tmp_path / "one.json")
    with pytest.raises(ValueError, match="hiden"):
        load_shapes(tmp_path / "bad.json")


def _cli(args, cache_dir):
    env = dict(os.environ, EPCOMM_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT)
    for name in ("EPCOMM_ASSERT_NO_COMPILE", "EPCOMM_ARCH", "EPCOMM_JIT_DUMP"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "epcomm.jit", "--precompile", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


def test_cli_builds_exactly_the_planned_set(tmp_path, monkeypatch):
    shapes_file = tmp_path / "model.json"
    shapes_file.write_text(json.dumps(dict(SMALL, modes=["normal"])))
    proc = _cli(["--arch", "sm_90", "--jobs", "1", "--shapes", str(shapes_file)], tmp_path / "cache")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    planned = kernel_sources(ModelShapes(**SMALL, modes=("normal",)))
    monkeypatch.setenv("EPCOMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EPCOMM_ARCH", raising=False)
    want = set()
    for src in planned:
        plan = compiler.plan_build(src, 90, 90)
        want.add(cache.entry_path(plan, cache.cache_key(plan)).name)
    built = {p.name for p in (tmp_path / "cache" / "cubin").glob("*.bin")}
    assert built == want, f"built {sorted(built)}\nplanned {sorted(want)}"
    assert sum(line.startswith("ok ") for line in proc.stdout.splitlines()) == len(planned)


def test_cli_shape_options_and_errors(tmp_path):
    proc = _cli(["--arch", "sm_90", "--hidden", "256", "--num-topk", "2", "--num-experts", "5",
                 "--num-ranks", "2", "--modes", "normal"], tmp_path / "cache")
    assert proc.returncode == 2 and "multiple of num_ranks" in proc.stderr, proc.stderr
    proc = _cli(["--arch", "sm_90", "--hidden", "x"], tmp_path / "cache")
    assert proc.returncode == 2 and "--hidden must be an integer" in proc.stderr, proc.stderr
    assert not (tmp_path / "cache").exists(), "nothing may be built when the shapes are bad"
