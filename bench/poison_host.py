"""Host cost of the poison launch that follows every GPU call (epcomm/ops/poison.py), the Python side
only, on any machine (no GPU): `python -m bench.poison_host`.

Poison.after runs with a launch that does nothing, so what is timed is what the launch adds before
the driver: the key of the outputs (data pointer, bytes, dtype of each), the prebuilt launch's
lookup, the stream query and the call. `hit`: the same outputs each call (what a loop of equal
calls sees: the caching allocator hands out the same blocks); `miss`: new outputs each call, so the
Params are built again. The driver's cuLaunchKernel comes on top: bench/host_profile.py measures the
whole launch on the GPU machine ("poison launch alone").
"""
from __future__ import annotations

import statistics
import time

import torch

from epcomm.ops import poison as poison_module


class _NoLaunch:
    """Kernel.launcher's stand-in: the bound launch does nothing."""
    def launcher(self, grid, block, params, smem=0):
        return lambda stream: None


def poison_without_driver() -> poison_module.Poison:
    p = object.__new__(poison_module.Poison)
    p._device_index, p._kernel, p._err, p._launches = 0, _NoLaunch(), 0, {}
    return p


def per_call_us(fn, calls: int = 20000, repeats: int = 7) -> float:
    """Median over repeats of the mean time of one call, in microseconds."""
    means = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(means)


def measure(calls: int = 20000) -> dict:
    stream = poison_module._stream
    poison_module._stream = lambda device_index: 0   # no CUDA here: stream 0
    try:
        p = poison_without_driver()
        # a dispatch's outputs: recv_x bf16, no scales, recv_topk_idx i64, recv_topk_weights f32
        outputs = (torch.empty(64, 128, dtype=torch.bfloat16), None, torch.empty(64, 8, dtype=torch.int64),
                   torch.empty(64, 8))
        hit = per_call_us(lambda: p.after(*outputs), calls)
        pool = [tuple(None if t is None else t.clone() for t in outputs) for _ in range(p._CACHE_LIMIT + 1)]
        cycle = iter(range(10 ** 9))
        miss = per_call_us(lambda: p.after(*pool[next(cycle) % len(pool)]), max(1, calls // 10))
        return {"hit_us": hit, "miss_us": miss}
    finally:
        poison_module._stream = stream


def main() -> None:
    r = measure()
    print(f"poison launch, Python side (no driver call), 4 outputs: {r['hit_us']:.2f} us per call with "
          f"its Params cached, {r['miss_us']:.2f} us when they are built (new outputs)")


if __name__ == "__main__":
    main()
