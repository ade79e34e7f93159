"""What a one-GPU host cannot give DeepEP's test scripts when they run N ranks: three torch calls,
rewritten (tests/deep_ep_scripts.py installs this in every process of a shared-GPU run; nothing
else is touched):

- `torch.distributed.init_process_group(backend='nccl', ..., device_id=cuda:i)`: NCCL refuses two
  ranks on one GPU, so an `nccl` backend (also inside a 'cpu:gloo,cuda:nccl' map) becomes `gloo`,
  and `device_id` (a device the host may not have, binding the group to it) is dropped.
- `torch.cuda.set_device(i)`: every index (i >= 0) selects device 0, the one GPU all ranks share.
- `torch.distributed.all_gather_into_tensor(out, x)` with `out` of shape (R, *x.shape), the stacked
  form NCCL accepts (test_low_latency.py gathers every rank's top-k indices so): gloo accepts only
  the concatenated form (R * x.shape[0], ...), so `out` is passed as that view of itself (the same
  memory, the same result).

The other collectives they call on CUDA tensors (all_reduce, all_gather, barrier) have CUDA paths in
torch's gloo backend (staged through host memory) and run as written.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Tuple

MARK = "_epcomm_shared_gpu_shim"


def gloo_backend(backend: Any) -> Any:
    """The backend string with every 'nccl' replaced by 'gloo' (None and objects pass through)."""
    if not isinstance(backend, str):
        return backend
    parts = []
    for part in backend.split(","):
        device, sep, name = part.rpartition(":")
        parts.append(device + sep + ("gloo" if name.strip().lower() == "nccl" else name))
    return ",".join(parts)


def rewrite_init_args(signature: inspect.Signature, args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
    """init_process_group's arguments with the backend moved to gloo and device_id dropped."""
    bound = signature.bind(*args, **kwargs)
    if "backend" in bound.arguments:
        bound.arguments["backend"] = gloo_backend(bound.arguments["backend"])
    bound.arguments.pop("device_id", None)
    return bound.args, bound.kwargs


def wrap_all_gather_into_tensor(real):
    """`real` (torch.distributed.all_gather_into_tensor) also taking the stacked output form."""
    signature = inspect.signature(real)

    @functools.wraps(real)
    def all_gather_into_tensor(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        out, x = bound.arguments["output_tensor"], bound.arguments["input_tensor"]
        if x.dim() >= 1 and out.dim() == x.dim() + 1 and out.is_contiguous():
            bound.arguments["output_tensor"] = out.view(-1, *out.shape[2:])
        return real(*bound.args, **bound.kwargs)

    return all_gather_into_tensor


def install(torch) -> bool:
    """Patch `torch`'s three calls in place; False when already patched (idempotent)."""
    dist, cuda = torch.distributed, torch.cuda
    if getattr(dist.init_process_group, MARK, False):
        return False
    real_init, real_set_device = dist.init_process_group, cuda.set_device
    signature = inspect.signature(real_init)

    # functools.wraps keeps the real signature visible: init_dist inspects it for device_id.
    @functools.wraps(real_init)
    def init_process_group(*args, **kwargs):
        args, kwargs = rewrite_init_args(signature, args, kwargs)
        return real_init(*args, **kwargs)

    @functools.wraps(real_set_device)
    def set_device(device):
        # torch treats a negative index as "leave the device alone"; keep that.
        return real_set_device(device if isinstance(device, int) and device < 0 else 0)

    setattr(init_process_group, MARK, True)
    dist.init_process_group = init_process_group
    cuda.set_device = set_device
    dist.all_gather_into_tensor = wrap_all_gather_into_tensor(dist.all_gather_into_tensor)
    return True
