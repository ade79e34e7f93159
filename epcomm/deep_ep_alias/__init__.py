"""Opt-in `import deep_ep` -> epcomm, for code that cannot be edited (otherwise write
`import epcomm as deep_ep`).

    python -m epcomm.deep_ep_alias install [--site DIR] [--shadow]
    python -m epcomm.deep_ep_alias uninstall [--site DIR]
    python -m epcomm.deep_ep_alias status | path

`install` writes a .pth file into DIR (default: this interpreter's site-packages) naming the folder
that holds a tiny `deep_ep` package re-exporting epcomm. Python appends .pth folders to the end of
sys.path, so a real DeepEP install still wins; `--shadow` puts the folder first instead, making
`import deep_ep` load epcomm even where DeepEP is installed. `path` prints the folder, for a
one-off `PYTHONPATH=$(python -m epcomm.deep_ep_alias path)` (that also shadows DeepEP).
Nothing happens unless one of these is run: importing epcomm never touches sys.path.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional

PTH_NAME = "epcomm_deep_ep_alias.pth"


def shim_dir() -> Path:
    """The folder holding the `deep_ep` package that re-exports epcomm."""
    return Path(__file__).resolve().parent / "shim"


def default_site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def pth_text(shadow: bool) -> str:
    folder = str(shim_dir())
    if shadow:
        # An `import` line is executed by site.py: it may put the folder ahead of site-packages.
        return f"import sys; sys.path.insert(0, {folder!r})\n"
    return folder + "\n"


def install(site_dir: Path, shadow: bool = False) -> Path:
    site_dir.mkdir(parents=True, exist_ok=True)
    path = site_dir / PTH_NAME
    path.write_text(pth_text(shadow))
    return path


def uninstall(site_dir: Path) -> bool:
    path = site_dir / PTH_NAME
    if path.exists():
        path.unlink()
        return True
    return False


def resolved_deep_ep() -> Optional[str]:
    """Where `import deep_ep` would load from in this process (None: nowhere)."""
    spec = importlib.util.find_spec("deep_ep")
    return None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epcomm.deep_ep_alias",
                                     description="Opt-in `import deep_ep` -> epcomm.")
    parser.add_argument("command", choices=["install", "uninstall", "status", "path"])
    parser.add_argument("--site", type=Path, default=None,
                        help="folder processed by site.py (default: this interpreter's site-packages)")
    parser.add_argument("--shadow", action="store_true",
                        help="install: take precedence over a real DeepEP install")
    args = parser.parse_args(argv)
    site_dir = args.site or default_site()
    if args.command == "path":
        print(shim_dir())
    elif args.command == "install":
        path = install(site_dir, args.shadow)
        print(f"wrote {path}: new interpreters resolve `import deep_ep` to epcomm"
              + ("" if args.shadow else " unless a real DeepEP is installed (--shadow to override)"))
        real = resolved_deep_ep()
        if real is not None and not args.shadow and not real.startswith(str(shim_dir())):
            print(f"note: a real deep_ep is installed ({real}); it keeps precedence")
    elif args.command == "uninstall":
        print(f"removed {site_dir / PTH_NAME}" if uninstall(site_dir) else
              f"nothing to remove: no {PTH_NAME} in {site_dir}")
    else:
        path = site_dir / PTH_NAME
        print(f"{path}: {'installed' if path.exists() else 'not installed'}; "
              f"import deep_ep -> {resolved_deep_ep()}")
    return 0
