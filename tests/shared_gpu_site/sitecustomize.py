"""Put first on PYTHONPATH by tests/deep_ep_scripts.py: Python imports this module at start-up in
every process, so the processes a script spawns (torch.multiprocessing.spawn) get the shared-GPU
shim too. It acts only when EPCOMM_SHARED_GPU_SHIM=1, then runs the sitecustomize this one hides."""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chain():
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("EPCOMM_SHARED_GPU_SHIM") == "1":
    import torch
    _load("epcomm_shared_gpu_shim", os.path.join(os.path.dirname(_HERE), "shared_gpu_shim.py")).install(torch)
_chain()
