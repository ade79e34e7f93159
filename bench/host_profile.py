"""Where the host time of a call goes (the Python and driver work to issue it), on the GPU machine:
    torchrun --standalone --nproc_per_node=1 -m bench.host_profile [--no-profile]
and, as the `host` module, in `make bench` (python -m bench --only host).
For a cached FP8 intranode dispatch, an intranode combine (N=4096, H=7168, K=8, E=256, 24 SMs) and
the low-latency dispatch / combine (N=T=128, H=7168, K=8, E=288): host us per call (median, p10,
p90 of perf_counter around 200 calls, each issued while the GPU sleeps, so no launch waits on the
device), by layer: the Buffer call on its fast path (the signature checked once, then the
backend's runner), the same call checked in full on every call (the fast path off), and the
runner alone (plan, Params pointers, outputs, the two launches: kernel and poison fill). Then
(torchrun only) cProfile of 300 more fast-path calls, the 18 largest own times. Rank 0 prints.
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from bench.harness import Case, Record, host_issue_times, low_latency_setup

SLEEP_CYCLES = 2_000_000   # ~1 ms: longer than any call's host issue
CALLS = 200
N, H, K, E, SMS = 4096, 7168, 8, 256, 24
T, E_LL = 128, 288
TARGET_US = {"intranode FP8 cached dispatch": 15.0, "intranode combine": 15.0, "low-latency dispatch": 12.0,
             "low-latency combine": 12.0}


def experts_for(nominal: int, world: int) -> int:
    """The largest expert count <= nominal that `world` ranks divide (at least one per rank)."""
    return max(world, nominal // world * world)


def _summary(times: List[float]) -> Dict[str, float]:
    times = sorted(times)
    return {"median_us": statistics.median(times), "p10_us": times[len(times) // 10],
            "p90_us": times[9 * len(times) // 10]}


def setups(group, device: torch.device, rank: int, world: int, experts: int, ll_experts: int):
    """-> ({call name: (buffer, fast-path call, runner call or None)}, buffers to destroy)."""
    import epcomm
    from bench.intranode import fp8_cast
    torch.manual_seed(rank)
    normal = epcomm.Buffer(group, num_nvl_bytes=int(1e9) // 128 * 128, explicitly_destroy=True)
    x = torch.randn(N, H, device=device, dtype=torch.bfloat16)
    topk_idx = torch.randn(N, experts, device=device).abs().add(1).topk(K, dim=1).indices.to(epcomm.topk_idx_t)
    topk_w = torch.rand(N, K, device=device)
    config = epcomm.Config(SMS)
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk_idx, experts)
    recv_x, _, recv_w, _, handle, _ = normal.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                      topk_weights=topk_w, config=config)
    x8 = fp8_cast(x)
    ll = epcomm.Buffer(group, num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, world, ll_experts),
                       low_latency_mode=True, explicitly_destroy=True)
    inputs, ll_handle, expert_out = low_latency_setup(ll, T, T, H, K, ll_experts, rank, device)
    xl, ti, tw = inputs.x, inputs.topk_idx, inputs.topk_weights
    calls = {
        "intranode FP8 cached dispatch": (normal, lambda: normal.dispatch(x8, handle=handle, config=config),
                                          lambda run: run(x8[0], x8[1], handle)),
        "intranode combine": (normal, lambda: normal.combine(recv_x, handle, topk_weights=recv_w, config=config),
                              lambda run: run(recv_x, handle, recv_w, None, None)),
        "low-latency dispatch": (ll, lambda: ll.low_latency_dispatch(xl, ti, T, ll_experts, use_fp8=True),
                                 lambda run: run(xl, ti, None, None)),
        "low-latency combine": (ll, lambda: ll.low_latency_combine(expert_out, ti, tw, ll_handle),
                                lambda run: run(expert_out, ti, tw, ll_handle, False, None, None)),
    }
    return calls, (ll, normal)


_RUNS = {"intranode FP8 cached dispatch": "_dispatch_runs", "intranode combine": "_combine_runs",
         "low-latency dispatch": "_ll_dispatch_runs", "low-latency combine": "_ll_combine_runs"}


def measure(name: str, buf, call: Callable, runner_call: Callable, barrier: Callable[[], None]) -> Dict[str, object]:
    """The host figures of one call: fast path, checked in full, the runner alone (us summaries)."""
    for _ in range(20):   # compile, load, remember the signature, warm the allocator
        call()
    torch.cuda.synchronize()
    barrier()
    figures = {"fast path": _summary(host_issue_times(call, CALLS, SLEEP_CYCLES))}
    barrier()
    buf._fast_path = False
    try:
        figures["checked in full"] = _summary(host_issue_times(call, CALLS, SLEEP_CYCLES))
    finally:
        buf._fast_path = True
    barrier()
    runs = getattr(buf, _RUNS[name])
    run = next(iter(runs.values())) if len(runs) == 1 else None
    if run is not None:
        figures["runner alone"] = _summary(host_issue_times(lambda: runner_call(run), CALLS, SLEEP_CYCLES))
        figures["runner"] = getattr(run, "__name__", "?")   # "run": the backend's; else the backend method
    torch.cuda.synchronize()
    barrier()
    return figures


def _line(name: str, figures: dict) -> str:
    parts = [f"{layer} {f['median_us']:.1f} (p10 {f['p10_us']:.1f}, p90 {f['p90_us']:.1f})"
             for layer, f in figures.items() if isinstance(f, dict)]
    return f"== {name}: host us median: " + "; ".join(parts)


# ---- `make bench` (bench/runner.py module "host") ------------------------------------------------
def cases(ctx):
    if not ctx.is_gpu:
        return
    experts, ll_experts = experts_for(E, ctx.world_size), experts_for(E_LL, ctx.world_size)
    setting = dict(N=N, H=H, K=K, E=experts, sms=SMS, T=T, E_ll=ll_experts, calls=CALLS)
    yield Case("host issue time per call (fast path, checked in full, runner)",
               lambda c: _records(c, experts, ll_experts, setting), setting)


def _records(ctx, experts: int, ll_experts: int, setting: dict) -> List[Record]:
    calls, buffers = setups(ctx.group, ctx.device, ctx.rank, ctx.world_size, experts, ll_experts)
    records = []
    try:
        for name, (buf, call, runner_call) in calls.items():
            figures = measure(name, buf, call, runner_call, ctx.barrier)
            records.append(Record(f"host issue time: {name}", setting, us=figures["fast path"]["median_us"],
                                  target=("us", "<=", TARGET_US[name]) if ctx.world_size == 1 else None,
                                  extra=figures))
    finally:
        torch.cuda.synchronize()
        ctx.barrier()
        for buf in buffers:
            buf.destroy()
    return records


# ---- torchrun ------------------------------------------------------------------------------------
def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world = dist.get_world_size()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    calls, buffers = setups(dist.group.WORLD, torch.device("cuda"), rank, world, experts_for(E, world),
                            experts_for(E_LL, world))
    for name, (buf, call, runner_call) in calls.items():
        say(_line(name, measure(name, buf, call, runner_call, dist.barrier)))
        if "--no-profile" in sys.argv:
            continue
        profiler = cProfile.Profile()
        for _ in range(300):
            torch.cuda._sleep(SLEEP_CYCLES)
            profiler.enable()
            call()
            profiler.disable()
            torch.cuda.synchronize()
            dist.barrier()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
        say(text.getvalue())
    # Every call above ends with the poison launch (ops/poison.py); alone, on one dispatch's outputs:
    poison = buffers[0]._backend._poisoned()
    rows = torch.empty(4096, 7168, dtype=torch.bfloat16, device="cuda")
    weights = torch.empty(4096, 8, dtype=torch.float32, device="cuda")
    times = sorted(host_issue_times(lambda: poison.after(rows, None, None, weights), 200, SLEEP_CYCLES))
    say(f"== poison launch alone: host us median {statistics.median(times):.1f} "
        f"p10 {times[len(times) // 10]:.1f} p90 {times[9 * len(times) // 10]:.1f}")
    torch.cuda.synchronize()
    dist.barrier()
    for buf in buffers:
        buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
