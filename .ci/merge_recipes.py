"""Adds the kernels a GPU machine built (gpu-call's logs/recipes.json, from `python -m epcomm.jit
--list-recipes`) to .ci/gpu-recipes.json, which the plans' warm task rebuilds on all cores of a
fresh machine. Recipes already there keep their place, new ones follow in the order met; a recipe
whose source is no longer under cuda_src/ is left out.

    python3 .ci/merge_recipes.py /work/.device/*/logs/recipes.json
"""
from __future__ import annotations

import json
import os
import sys
from typing import Iterable, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, ".ci", "gpu-recipes.json")


def _key(recipe: dict) -> str:
    return json.dumps(recipe, sort_keys=True)


def merge(known: List[dict], found: Iterable[List[dict]], sources_dir: str) -> List[dict]:
    merged, seen = list(known), {_key(r) for r in known}
    for recipes in found:
        for recipe in recipes:
            if _key(recipe) in seen or not os.path.isfile(os.path.join(sources_dir, recipe["source"])):
                continue
            seen.add(_key(recipe))
            merged.append(recipe)
    return merged


def main(paths: List[str]) -> int:
    with open(RECIPES) as f:
        known = json.load(f)
    found = []
    for path in paths:
        with open(path) as f:
            found.append(json.load(f))
    merged = merge(known, found, os.path.join(ROOT, "cuda_src"))
    with open(RECIPES, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    print(f"{RECIPES}: {len(known)} recipes, {len(merged) - len(known)} added")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
