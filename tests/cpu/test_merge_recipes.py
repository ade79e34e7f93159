""".ci/merge_recipes.py: the kernels GPU machines built, added to the warm-up list once each."""
from __future__ import annotations

import importlib.util
import os

from tests.conftest import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("merge_recipes", os.path.join(ROOT, ".ci", "merge_recipes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe(source: str, kernel: str) -> dict:
    return {"arch_sm": 90, "defines": [], "feature": 90, "kernels": [kernel], "source": source, "uses_nvshmem": False}


def test_new_recipes_follow_the_known_ones_once_each(tmp_path):
    (tmp_path / "intranode.cu").write_text("")
    (tmp_path / "layout.cu").write_text("")
    known = [_recipe("intranode.cu", "a<1>")]
    found = [[_recipe("intranode.cu", "a<1>"), _recipe("layout.cu", "b<2>")],
             [dict(reversed(list(_recipe("layout.cu", "b<2>").items()))), _recipe("gone.cu", "c<3>"),
              _recipe("intranode.cu", "a<4>")]]
    merged = _module().merge(known, found, str(tmp_path))
    assert [r["kernels"][0] for r in merged] == ["a<1>", "b<2>", "a<4>"]


def test_the_committed_list_holds_only_present_sources():
    import json
    with open(os.path.join(ROOT, ".ci", "gpu-recipes.json")) as f:
        recipes = json.load(f)
    assert recipes and all(os.path.isfile(os.path.join(ROOT, "cuda_src", r["source"])) for r in recipes)
    assert len({json.dumps(r, sort_keys=True) for r in recipes}) == len(recipes)
