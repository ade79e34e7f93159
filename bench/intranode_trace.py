"""Where does an intranode call's time go? Kernel time with the host taken out, and a per-phase trace.

Run on the GPU machine under torchrun (one process per GPU):
    torchrun --standalone --nproc_per_node=2 -m bench.intranode_trace [--out DIR] [--quick]
Per case (cached BF16 dispatch, FP8 dispatch, combine; N=4096 and 128; 24 and 8 SMs) it prints:
  host    us of Python to issue the call (GPU kept busy, so nothing waits on the device), and the
          part of it spent inside epcomm.ops.intranode (ops_module_us);
  whole   us between CUDA events around the call, ranks aligned by an all-reduce first (as bench/);
  kernel  us between CUDA events around the call when the call was issued while the GPU slept
          and both ranks' streams then start together (an all-reduce): the GPU time alone;
then one traced call (intranode.set_tracing: kernels built with EPCOMM_INTRANODE_TRACE): per phase, the time after the
kernel's first warp started (max or min over warps), plus wait / signal sums.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.harness import host_issue_times

SLEEP_CYCLES = 3_000_000   # ~1.5 ms at ~2 GHz: longer than any host issue of one call


def _aligned_times(fn, iters, flush, sleep_first):
    """CUDA-event us around fn per call; before each: L2 flush, optional GPU sleep, all-reduce."""
    token = torch.zeros(1, device="cuda")
    pairs = []
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(iters):
        flush.fill_(1)
        if sleep_first:
            torch.cuda._sleep(SLEEP_CYCLES)
        dist.all_reduce(token)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
        if sleep_first:
            torch.cuda.synchronize()   # next call's sleep must start after this one
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in pairs]


_OPS_US = []   # host us spent inside epcomm.ops.intranode.dispatch / combine, per call


def _time_ops_module():
    """Wrap the ops module's entry points so that their share of the host time is measured."""
    from epcomm.ops import intranode
    for name in ("dispatch", "combine"):
        inner = getattr(intranode, name)

        def timed(*args, _inner=inner, **kwargs):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                _OPS_US.append((time.perf_counter() - t0) * 1e6)
        setattr(intranode, name, timed)


def _host_times(fn, iters):
    _OPS_US.clear()
    return host_issue_times(fn, iters, SLEEP_CYCLES), list(_OPS_US)


def _trace_summary(trace, slots):
    """Per phase: us after the kernel's first warp start; warps that never stamped are left out."""
    t = trace.double()
    idx = {name: i for i, name in enumerate(slots)}
    start = t[..., idx["start"]]
    live = start > 0
    t0 = start[live].min()
    out = {"t0_ns": int(t0)}

    def rel(name, how):
        v = t[..., idx[name]]
        v = v[live & (v > 0)]
        if v.numel() == 0:
            return None
        v = (v - t0) / 1e3
        return round(float(v.max() if how == "max" else v.min() if how == "min" else v.median()), 1)

    for name in ("start", "idle", "sent", "first_data", "received", "end", "published"):
        out[name] = {"min": rel(name, "min"), "median": rel(name, "median"), "max": rel(name, "max")}
    for name in ("wait_ns", "signal_ns"):
        v = t[..., idx[name]][live]
        out[name.replace("_ns", "_us")] = {"sum": round(float(v.sum()) / 1e3, 1),
                                           "max_warp": round(float(v.max()) / 1e3, 1)}
    out["claims"] = int(t[..., idx["claims"]].sum())
    # Chunks per sending block (warp 0 counts every chunk of its block): how evenly the dynamic
    # claims spread them.
    chunks = t[:, 0, idx["chunks"]]
    senders = chunks > 0
    if bool(senders.any()):
        out["chunks_per_send_block"] = {"min": int(chunks[senders].min()), "max": int(chunks[senders].max()),
                                        "blocks": int(senders.sum())}
        # us at which each sending block's last warp left the send loop, in block order
        sent = t[..., idx["sent"]].max(1).values[senders]
        out["sent_by_send_block"] = [round(float(v - t0) / 1e3, 1) for v in sent]
    return out


def run_case(name, fn, rank, flush, iters, results):
    from epcomm.ops import intranode, intranode_plan as plan
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host, ops = _host_times(fn, iters)
    whole = _aligned_times(fn, iters, flush, sleep_first=False)
    kernel = _aligned_times(fn, iters, flush, sleep_first=True)
    intranode.set_tracing(True)
    try:
        for _ in range(2):
            _aligned_times(fn, 1, flush, sleep_first=True)
        trace = intranode.last_trace(torch.cuda.current_device())
    finally:
        intranode.set_tracing(False)
    summary = _trace_summary(trace, plan.TRACE_SLOTS) if trace is not None else None
    med = statistics.median
    rec = {"case": name, "rank": rank, "host_us": round(med(host), 1),
           "ops_module_us": round(med(ops), 1) if ops else None, "whole_us": round(med(whole), 1),
           "whole_mean_us": round(statistics.fmean(whole), 1), "kernel_us": round(med(kernel), 1),
           "kernel_mean_us": round(statistics.fmean(kernel), 1), "trace": summary}
    report(rec, rank, results)


def report(rec: dict, rank: int, results: list) -> None:
    """Collective: every rank's record; rank 0 prints them (one JSON line each) and keeps them."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        for r in gathered:
            print(json.dumps(r), flush=True)
        results.extend(gathered)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    import epcomm
    from bench.intranode import fp8_cast
    _time_ops_module()
    iters = 10 if args.quick else 30
    flush = torch.empty(128 << 20, dtype=torch.int8, device="cuda")
    buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=int(1e9))
    results = []
    torch.manual_seed(rank)
    H, K, E = 7168, 8, 256
    for N in (4096, 128):
        for sms in ((24, 8) if N == 4096 else (24,)):
            x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
            topk_idx = torch.randn(N, E, device="cuda").abs().add(1).topk(K, dim=1).indices.to(epcomm.topk_idx_t)
            topk_w = torch.rand(N, K, device="cuda")
            config = epcomm.Config(sms)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_w, config=config)
            x8 = fp8_cast(x)
            tag = f"N={N} SMs={sms} rows={recv_x.shape[0]}"
            run_case(f"dispatch BF16 cached {tag}", lambda: buf.dispatch(x, handle=handle, config=config),
                     rank, flush, iters, results)
            run_case(f"dispatch FP8 cached {tag}", lambda: buf.dispatch(x8, handle=handle, config=config),
                     rank, flush, iters, results)
            run_case(f"combine {tag}", lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=config),
                     rank, flush, iters, results)
    if rank == 0 and args.out:
        with open(os.path.join(args.out, "intranode_trace.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
