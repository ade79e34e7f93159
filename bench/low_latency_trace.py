"""Where does a low-latency kernel's time go? GPU time with the host taken out, and a per-phase trace.

Run on the GPU machine under torchrun (one process per GPU):
    torchrun --standalone --nproc_per_node=2 -m bench.low_latency_trace [--out DIR]
Per case (FP8 dispatch and BF16 combine, fused launches, H=7168 K=8 E=288, N = T = 128 and N = 1 of
T = 128) it prints, per rank:
  kernel  us between CUDA events around the call when it was issued while the GPU slept and both
          ranks' streams then start together (an all-reduce): the GPU time alone;
  trace   one call of the tracing build (low_latency.set_tracing: kernels built with
          EPCOMM_LL_TRACE): per phase (low_latency.TRACE_SLOTS, meanings in TRACE_MEANING), us
          after the first warp of this rank's kernel started: min / median / max over the warps
          that reached it. %globaltimer is per GPU, so ranks are not compared with each other.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from bench.harness import low_latency_setup
from bench.intranode_trace import _aligned_times, report


def trace_summary(trace, slots, meaning):
    """Per phase: (min, median, max) us after the kernel's first warp start; unstamped warps left out."""
    t = trace.double()
    start = t[..., slots.index("start")]
    live = start > 0
    if not bool(live.any()):
        return {}
    t0 = start[live].min()
    out = {}
    for i, name in enumerate(slots):
        v = t[..., i]
        if name == "count":   # a number per warp, not a time
            v = v[live & (v > 0)]
            if v.numel():
                out[f"count ({meaning.get(name, name)}): total, min / median / max of warps with any"] = [
                    int(v.sum()), int(v.min()), int(v.median()), int(v.max())]
            continue
        v = v[live & (v > 0)]
        if v.numel() == 0:
            continue
        v = (v - t0) / 1e3
        label = f"{name} ({meaning[name]})" if name in meaning else name
        out[label] = [round(float(v.min()), 1), round(float(v.median()), 1), round(float(v.max()), 1)]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--raw", action="store_true",
                        help="also save every rank's stamp rows (torch.save, [blocks, warps, slots] per case) under --out")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    import epcomm
    from epcomm.ops import low_latency
    world = dist.get_world_size()
    T, H, K, E = 128, 7168, 8, 288
    buf = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, world, E),
                        low_latency_mode=True, explicitly_destroy=True)
    flush = torch.empty(128 << 20, dtype=torch.int8, device="cuda")
    torch.manual_seed(rank)
    results, raw = [], {}
    for N in (T, 1):
        inputs, handle, expert_out = low_latency_setup(buf, N, T, H, K, E, rank, torch.device("cuda"))
        x, topk_idx, topk_w = inputs.x, inputs.topk_idx, inputs.topk_weights
        calls = {"dispatch": lambda: buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True),
                 "combine": lambda: buf.low_latency_combine(expert_out, topk_idx, topk_w, handle)}
        for op, fn in calls.items():
            for _ in range(3):
                fn()
            kernel = _aligned_times(fn, 20, flush, sleep_first=True)
            low_latency.set_tracing(True)
            try:
                for _ in range(3):
                    _aligned_times(fn, 1, flush, sleep_first=True)
                trace = low_latency.last_trace(torch.cuda.current_device())
                raw[f"{op} N={N}"] = trace
            finally:
                low_latency.set_tracing(False)
            rec = {"case": f"{op} N={N} T={T} H={H} K={K} E={E}", "rank": rank,
                   "kernel_us": round(statistics.median(kernel), 1),
                   "trace_us_min_median_max": trace_summary(trace, low_latency.TRACE_SLOTS,
                                                            low_latency.TRACE_MEANING[op])}
            report(rec, rank, results)
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    if args.raw and args.out:
        torch.save({"slots": low_latency.TRACE_SLOTS, "traces": raw}, os.path.join(args.out, f"low_latency_trace_rank{rank}.pt"))
    if rank == 0 and args.out:
        with open(os.path.join(args.out, "low_latency_trace.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
