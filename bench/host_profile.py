"""Where the host time of a call goes (the Python and driver work to issue it), on the GPU machine:
    torchrun --standalone --nproc_per_node=2 -m bench.host_profile
For a cached FP8 intranode dispatch, an intranode combine (N=4096, H=7168, K=8, E=256, 24 SMs) and
the low-latency dispatch / combine (N=T=128, H=7168, K=8, E=288), and the poison launch that ends each
of them (bench/poison_host.py: its Python side on any machine): host us per call (median, p10,
p90 of perf_counter around 200 calls, each issued while the GPU sleeps, so no launch waits on the
device), then cProfile of 300 more calls, the 18 largest own times. Rank 0 prints.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics

import torch
import torch.distributed as dist

from bench.harness import host_issue_times, low_latency_setup

SLEEP_CYCLES = 2_000_000   # ~1 ms: longer than any call's host issue


def profile(name: str, fn, say) -> None:
    times = sorted(host_issue_times(fn, 200, SLEEP_CYCLES))
    say(f"== {name}: host us median {statistics.median(times):.1f} p10 {times[len(times) // 10]:.1f} "
        f"p90 {times[9 * len(times) // 10]:.1f}")
    profiler = cProfile.Profile()
    for _ in range(300):
        torch.cuda._sleep(SLEEP_CYCLES)
        profiler.enable()
        fn()
        profiler.disable()
        torch.cuda.synchronize()
        dist.barrier()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    say(text.getvalue())


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    import epcomm
    from bench.intranode import fp8_cast

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    world = dist.get_world_size()
    torch.manual_seed(rank)
    N, H, K, E = 4096, 7168, 8, 256
    normal = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=int(1e9), explicitly_destroy=True)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    topk_idx = torch.randn(N, E, device="cuda").abs().add(1).topk(K, dim=1).indices.to(epcomm.topk_idx_t)
    topk_w = torch.rand(N, K, device="cuda")
    config = epcomm.Config(24)
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk_idx, E)
    recv_x, _, recv_w, _, handle, _ = normal.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                      topk_weights=topk_w, config=config)
    x8 = fp8_cast(x)
    for _ in range(20):
        normal.dispatch(x8, handle=handle, config=config)
    torch.cuda.synchronize()
    profile("intranode FP8 cached dispatch", lambda: normal.dispatch(x8, handle=handle, config=config), say)
    profile("intranode combine", lambda: normal.combine(recv_x, handle, topk_weights=recv_w, config=config), say)
    # Every call above ends with this launch (ops/poison.py); alone, with a dispatch's outputs:
    poison = normal._backend._poisoned()
    profile("poison launch alone", lambda: poison.after(recv_x, None, None, recv_w), say)

    T, E2 = 128, 288
    ll = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, world, E2),
                       low_latency_mode=True, explicitly_destroy=True)
    inputs, ll_handle, expert_out = low_latency_setup(ll, T, T, H, K, E2, rank, torch.device("cuda"))
    xl, ti, tw = inputs.x, inputs.topk_idx, inputs.topk_weights
    for _ in range(10):
        ll.low_latency_combine(expert_out, ti, tw, ll_handle)
    torch.cuda.synchronize()
    profile("low-latency dispatch", lambda: ll.low_latency_dispatch(xl, ti, T, E2, use_fp8=True), say)
    profile("low-latency combine", lambda: ll.low_latency_combine(expert_out, ti, tw, ll_handle), say)
    torch.cuda.synchronize()
    dist.barrier()
    ll.destroy()
    normal.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
