"""Does internode normal mode pipeline its chunks? One traced dispatch and combine per case.

Ranks are M nodes of EPCOMM_NUM_LOCAL_RANKS ranks (1 when unset: every rank its own node, so every
transfer between ranks is the RDMA stage). Two ways to run it on the GPU machine:
    python -m bench.internode_trace --ranks 4 [--out DIR]
        4 ranks on one GPU under CUDA MPS: the module starts the control daemon and the ranks itself
        (tests/gpu_session's MpsDaemon and Layout: every rank gets its share of the SMs, the ranks
        bootstrap over gloo with EPCOMM_BACKEND=gpu). All ranks then stamp one GPU's clock.
    EPCOMM_NUM_LOCAL_RANKS=1 torchrun --standalone --nproc_per_node=2 -m bench.internode_trace [--out DIR]
        one GPU per rank, NCCL.
Per case (N=4096 and N=512, H=7168, K=8, E=256, BF16; up to 24 SMs, fewer when MPS gives a rank
fewer) one fresh dispatch and one combine run in the profiling builds (internode.set_tracing:
kernels built with EPCOMM_INTERNODE_TRACE; slots: internode_plan.TRACE_SLOTS). Per rank and role it
prints the first and the last chunk the role completed, in us after the kernel's first warp began
(earliest over the role's leader warps, resp. latest), and the chunks counted; then one verdict line
per kernel. Dispatch overlaps when the NVLink stage (the receivers copying records out of their RDMA
peer's rings) completed a chunk before the RDMA stage (the senders) published its last chunk;
combine when the reducers put a partial-sum chunk before the pushers' last chunk, and the finishing
receivers summed a round before the reducers' last chunk. Per channel (blocks 2g and 2g + 1) the
same comparison is counted too. Stamps under MPS are of kernels sharing one GPU: timings are not
performance figures, the order of the stamps is what this shows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

DISPATCH_ROLES = ("rdma_send", "nvl_recv")
COMBINE_ROLES = ("push", "reduce", "finish")
# (earlier role, later role): the later one completed a chunk before the earlier one's last
OVERLAPS = {"dispatch": (("rdma_send", "nvl_recv"),),
            "combine": (("push", "reduce"), ("reduce", "finish"))}
CASE_N = (4096, 512)
H, K, E = 7168, 8, 256
MAX_SMS = 24


def _slot(role: str, what: str) -> str:
    """The slot of a role's first / last completion or its count (finish counts rounds)."""
    return f"{role}_{'rounds' if role == 'finish' and what == 'chunks' else what}"


def role_summary(trace, slots, roles):
    """Per role: us of its first / last completed chunk after the first warp's start, and the
    chunks (over all rows); per channel pair of blocks the same first / last."""
    t = trace.double()
    idx = {name: i for i, name in enumerate(slots)}
    start = t[..., idx["start"]]
    t0 = start[start > 0].min()
    out = {"t0_ns": int(t0), "roles": {}, "per_block": {}}
    for role in roles:
        first, last = t[..., idx[_slot(role, "first")]], t[..., idx[_slot(role, "last")]]
        chunks = int(t[..., idx[_slot(role, "chunks")]].sum())
        if chunks == 0:
            out["roles"][role] = {"first_us": None, "last_us": None, "chunks": 0}
            continue
        out["roles"][role] = {"first_us": round(float(first[first > 0].min() - t0) / 1e3, 1),
                              "last_us": round(float(last.max() - t0) / 1e3, 1), "chunks": chunks}
        # per block: its earliest first and latest last (0 where the block has no such role)
        earliest = torch.where(first > 0, first, torch.full_like(first, float("inf"))).min(1).values
        out["per_block"][role] = (torch.where(earliest.isinf(), 0.0, earliest), last.max(1).values)
    return out


def verdicts(kernel: str, summary) -> list:
    """One line per (earlier, later) role pair of the kernel: did the later stage complete a chunk
    before the earlier stage's last one, over the rank and per channel."""
    lines = []
    roles, blocks = summary["roles"], summary["per_block"]
    for early, late in OVERLAPS[kernel]:
        a, b = roles[early], roles[late]
        if not a["chunks"] or not b["chunks"]:
            lines.append(f"{kernel}: {late} vs {early}: no chunks to compare")
            continue
        overlap = b["first_us"] < a["last_us"]
        # channel g: blocks 2g and 2g + 1; a role lives in one of them, so take each pair's stamps
        first_late = blocks[late][0].view(-1, 2).max(1).values    # the one non-zero block of the pair
        last_early = blocks[early][1].view(-1, 2).max(1).values
        live = (first_late > 0) & (last_early > 0)
        per_channel = int(((first_late < last_early) & live).sum())
        lines.append(f"{kernel}: {'OVERLAPS' if overlap else 'does not overlap'}: {late}'s first chunk done at "
                     f"{b['first_us']} us, {early}'s last at {a['last_us']} us; channels where {late} completed "
                     f"a chunk before {early}'s last: {per_channel} of {int(live.sum())}")
    return lines


def printable(summary) -> dict:
    return {"t0_ns": summary["t0_ns"], "roles": summary["roles"]}


def worker(args) -> None:
    import torch.distributed as dist
    os.environ.setdefault("EPCOMM_NUM_LOCAL_RANKS", "1")
    import epcomm
    from epcomm.ops import internode, internode_plan as plan
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    shared = world > gpus   # several ranks per GPU (MPS): NCCL refuses them, so gloo
    torch.cuda.set_device(rank // (world // gpus) if shared else int(os.environ.get("LOCAL_RANK", rank)))
    if shared:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    local = int(os.environ["EPCOMM_NUM_LOCAL_RANKS"])
    sms = min(MAX_SMS, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count // 2 * 2)
    config = epcomm.Config(sms)
    nvl = 1 << 20   # the push FIFOs then live in the RDMA buffer, which rdma_bytes_for sizes for them
    rdma = plan.rdma_bytes_for([config], H * 2, 0, K, world, local, nvl)
    buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=nvl, num_rdma_bytes=rdma)
    results = []
    torch.manual_seed(rank)
    for N in CASE_N:
        x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
        topk_idx = torch.randn(N, E, device="cuda").abs().add(1).topk(K, dim=1).indices.to(epcomm.topk_idx_t)
        topk_w = torch.rand(N, K, device="cuda")
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)

        def call():
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_w, config=config)
            dispatch_trace = internode.last_trace(torch.cuda.current_device())   # before combine reuses the rows
            buf.combine(recv_x, handle, topk_weights=recv_w, config=config)
            return recv_x.shape[0], dispatch_trace, internode.last_trace(torch.cuda.current_device())

        call()   # plain builds first: compiles, NVSHMEM warm
        internode.set_tracing(True)
        try:
            call()   # the trace builds compile
            torch.cuda.synchronize()
            dist.barrier()
            rows, dispatch_trace, combine_trace = call()
        finally:
            internode.set_tracing(False)
        d = role_summary(dispatch_trace, plan.TRACE_SLOTS, DISPATCH_ROLES)
        c = role_summary(combine_trace, plan.TRACE_SLOTS, COMBINE_ROLES)
        rec = {"case": f"internode N={N} H={H} K={K} E={E} SMs={sms} {world // local}x{local}", "rank": rank,
               "rows": rows, "dispatch": printable(d), "combine": printable(c),
               "verdicts": verdicts("dispatch", d) + verdicts("combine", c)}
        gathered = [None] * world
        dist.all_gather_object(gathered, rec)
        if rank == 0:
            for r in gathered:
                print(json.dumps({k: v for k, v in r.items() if k != "verdicts"}), flush=True)
                for line in r["verdicts"]:
                    print(f"  rank {r['rank']} {line}", flush=True)
            results.extend(gathered)
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "internode_trace.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()


def launch_under_mps(args) -> int:
    """--ranks R: R ranks of this module on GPU 0 under a private MPS daemon; exit status the worst."""
    from tests.gpu_session import ROOT, SAFE_ENV, Layout, MpsDaemon, free_port
    layout = Layout(gpus=1, ranks_per_gpu=args.ranks)
    port = free_port()
    forwarded = ["--out", args.out] if args.out else []
    with tempfile.TemporaryDirectory(prefix="internode_trace_") as workdir:
        mps = MpsDaemon(workdir)
        procs = []
        try:
            mps.start()
            for rank in range(layout.world_size):
                env = dict(os.environ, **SAFE_ENV, **mps.env, **layout.rank_env(rank, port))
                env.setdefault("EPCOMM_NUM_LOCAL_RANKS", "1")
                env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
                procs.append(subprocess.Popen([sys.executable, "-m", "bench.internode_trace", *forwarded],
                                              cwd=ROOT, env=env))
            return max(p.wait() for p in procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            mps.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--ranks", type=int, default=None,
                        help="start this many ranks on one GPU under MPS (without it: run as a torchrun rank)")
    args = parser.parse_args()
    if args.ranks is not None:
        if args.ranks < 2:
            parser.error("--ranks: internode mode needs at least 2 ranks")
        sys.exit(launch_under_mps(args))
    worker(args)


if __name__ == "__main__":
    main()
