"""Where does a call's time go? Host enqueue time vs GPU kernel time, per public call.

Run on the GPU machine under torchrun (one process per GPU):
    torchrun --standalone --nproc_per_node=2 -m bench.profile_calls [--out DIR]
For each call it prints: host us (Python time to issue the call, GPU kept busy so no waiting on the
device shows up), whole-call us (CUDA events, ranks aligned), and the kernels the call ran with their
GPU times (torch profiler). A whole-call time near the host time means the host is the bottleneck.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def _spin(us: float) -> None:
    """Keep the current stream busy for about `us` so host-issue time is measured alone."""
    torch.cuda._sleep(int(us * 1000))  # cycles ~ ns at ~1.9 GHz: good enough for a cushion


def profile(name, fn, rank, iters=30, out=None):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    # host issue time: GPU busy ahead of us, so launches never wait for the device
    host = []
    for _ in range(iters):
        _spin(2000)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        dist.barrier()
    # whole call, CUDA events, ranks aligned by a barrier
    whole = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        whole.append(a.elapsed_time(b) * 1e3)
    from torch.profiler import ProfilerActivity, profile as tprof
    dist.barrier()
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for evt in prof.key_averages():
        dev = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if dev and evt.count and evt.device_type is not None and "cuda" in str(evt.device_type).lower():
            kernels[evt.key[:90]] = (evt.count / 10, dev / evt.count)
    med = lambda v: sorted(v)[len(v) // 2]
    line = (f"[rank {rank}] {name}: host {med(host):.1f} us, whole {med(whole):.1f} us; kernels: "
            + "; ".join(f"{k} x{c:g} {t:.1f}us" for k, (c, t) in sorted(kernels.items(), key=lambda i: -i[1][1])[:6]))
    print(line, flush=True)
    if out:
        with open(os.path.join(out, f"profile_rank{rank}.txt"), "a") as f:
            f.write(line + "\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) + "\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    import epcomm
    torch.manual_seed(rank)
    N, H, K, E = 4096, 7168, 8, 256
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    scores = torch.randn(N, E, device="cuda")
    topk_idx = scores.topk(K, dim=1).indices.to(epcomm.topk_idx_t)
    topk_w = torch.rand(N, K, device="cuda")
    buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=int(1e9))
    config = epcomm.Config(24)
    layout = buf.get_dispatch_layout(topk_idx, E)
    profile("layout N=4096", lambda: buf.get_dispatch_layout(topk_idx, E), rank, out=args.out)
    kw = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
              topk_idx=topk_idx, topk_weights=topk_w, config=config)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kw)
    profile("dispatch fresh N=4096", lambda: buf.dispatch(x, **kw), rank, out=args.out)
    profile("dispatch cached N=4096", lambda: buf.dispatch(x, handle=handle, config=config), rank, out=args.out)
    profile("combine N=4096", lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=config), rank, out=args.out)
    xs, ti = x[:128].contiguous(), topk_idx[:128].contiguous()
    ls = buf.get_dispatch_layout(ti, E)
    kws = dict(num_tokens_per_rank=ls[0], is_token_in_rank=ls[3], num_tokens_per_expert=ls[2], topk_idx=ti,
               topk_weights=topk_w[:128].contiguous(), config=config)
    rs, _, rw, _, hs, _ = buf.dispatch(xs, **kws)
    profile("dispatch cached N=128", lambda: buf.dispatch(xs, handle=hs, config=config), rank, out=args.out)
    profile("combine N=128", lambda: buf.combine(rs, hs, topk_weights=rw, config=config), rank, out=args.out)
    # low latency
    T, E2 = 128, 288
    ll = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, world, E2),
                       low_latency_mode=True)
    ti2 = torch.randn(T, E2, device="cuda").topk(K, dim=1).indices.to(epcomm.topk_idx_t)
    xl = x[:T].contiguous()
    ll.clean_low_latency_buffer(T, H, E2)
    rx, cnt, h2, _, _ = ll.low_latency_dispatch(xl, ti2, T, E2)
    y = torch.randn(E2 // world, world * T, H, device="cuda", dtype=torch.bfloat16)
    profile("ll dispatch", lambda: ll.low_latency_dispatch(xl, ti2, T, E2), rank, out=args.out)
    profile("ll combine", lambda: ll.low_latency_combine(y, ti2, topk_w[:T].contiguous(), h2), rank, out=args.out)
    profile("ll dispatch+combine", lambda: (ll.low_latency_dispatch(xl, ti2, T, E2),
                                            ll.low_latency_combine(y, ti2, topk_w[:T].contiguous(), h2)),
            rank, out=args.out)
    dist.barrier()


if __name__ == "__main__":
    main()
