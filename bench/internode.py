"""Internode normal-mode dispatch / combine (Buffer.dispatch / Buffer.combine, ranks on several nodes).

Every GPU is its own "node" (EPCOMM_NUM_LOCAL_RANKS=1 while the module's Buffer is built, through
BenchContext.internode_buffer), so every transfer between ranks is the RDMA stage: NVSHMEM
put-with-signal, which on GPUs of one host goes over NVLink P2P, not a network. The figures are of
epcomm's internode kernels on NVLink, not of a NIC (bench/NOTES.md, "Internode bench").

Figures as intranode (targets.md): BF16 dispatch and FP8 dispatch as cached-handle calls, combine
(with weights) as a whole call; CUDA events, L2 flushed, ranks aligned, averaged. Logical bytes =
every received row (own rows included); the remote figure (nvlink_gbps) counts the rows from other
nodes. Each setting is checked first (bench.intranode.run_normal: cached == fresh, combine round
trip) and against epcomm.reference.oracle: the fresh dispatch's rows, top-k ids and weights,
per-expert counts and source tokens bit for bit, the FP8 cached dispatch's rows and scales against
the cast of the received BF16 rows. The internode path is the newest: every call goes through
harness.Attempts, so a call failing on one rank fails the case on every rank; the device waits
end at EPCOMM_TIMEOUT_S. The module runs after intranode and low_latency and releases its Buffer
at the end (a failed case leaves the Buffer forgotten, as the runner does for every case).

Cases: N=4096 (compared with the same-run torch+NCCL MoE) and N=128, H=7168, K=8, E=256, 24 SMs,
one Buffer sized by internode_plan.rdma_bytes_for the cases' Config (any N fits); then N=4096 again on a
Buffer with allow_mnnvl=True, where the "nodes" (mapped GPUs of this host) get stores in place
instead of NVSHMEM puts (on P2P a put is one warp's copy of a whole chunk). Every record's setting
holds its Buffer's num_rdma_bytes and num_nvl_bytes: the JSON shows the memory each N ran in.
"""
from __future__ import annotations

from typing import List

import torch

import epcomm

from .harness import BenchContext, Case, Record, Skip, buffer_bytes
from .intranode import INPUT_SEED, SETTING, TARGET_SMS, fp8_cast, run_normal

CASE_N = (4096, 128)          # the largest first: it sizes the Buffer
OPS = ("dispatch BF16", "dispatch FP8", "combine BF16")


def internode_name(op: str, N: int, H: int, K: int, E: int, sms: int) -> str:
    return f"internode {op} N={N} H={H} K={K} E={E} SMs={sms}"


def _oracle_check(ctx: BenchContext, buffer, N: int, H: int, K: int, E: int):
    """run_normal's `verify`: the fresh dispatch against the oracle (every rank's inputs rebuilt
    here on the CPU), the FP8 cached dispatch against the cast of the received rows."""
    def verify(x, fresh, config) -> List[str]:
        from epcomm.reference import oracle
        every = [ctx.inputs(N, H, E, K, seed=INPUT_SEED, rank=r) for r in range(ctx.world_size)]
        topk_idx = [i.topk_idx.cpu() for i in every]
        routes = [oracle.layout(t, E, ctx.world_size, 1) for t in topk_idx]
        want = oracle.dispatch([i.x.cpu() for i in every], None, topk_idx,
                               [i.topk_weights.cpu() for i in every], [r[3] for r in routes], E, ctx.rank,
                               num_tokens_per_experts=[r[2] for r in routes])
        recv_x, recv_idx, recv_w, counts, handle, _ = fresh
        fp8_data, fp8_scales = buffer.dispatch(fp8_cast(x), handle=handle, config=config)[0]
        want_data, want_scales = fp8_cast(recv_x)
        checks = {
            "recv_x": torch.equal(recv_x.cpu(), want["recv_x"]),
            "recv_topk_idx": torch.equal(recv_idx.long().cpu(), want["recv_topk_idx"].long()),
            "recv_topk_weights": torch.equal(recv_w.cpu(), want["recv_topk_weights"]),
            "num_recv_tokens_per_expert_list": list(counts) == want["num_recv_tokens_per_expert_list"],
            "handle[7] source tokens": torch.equal(handle[7][:, 1].long().cpu(), want["recv_src_idx"].long()),
            "FP8 cached dispatch rows": torch.equal(fp8_data.view(torch.uint8), want_data.view(torch.uint8)),
            "FP8 cached dispatch scales": torch.equal(fp8_scales, want_scales),
        }
        return [f"{what} differs from the oracle" for what, ok in checks.items() if not ok]
    return verify


def _run(ctx: BenchContext, N: int, last: bool, mnnvl: bool = False) -> List[Record]:
    H, K, E = SETTING["H"], SETTING["K"], SETTING["E"]
    buffer = ctx.internode_buffer([epcomm.Config(TARGET_SMS)], H, K, allow_mnnvl=mnnvl)
    name = (lambda op, *rest: internode_name(f"{op} allow_mnnvl", *rest)) if mnnvl else internode_name
    records = run_normal(ctx, buffer, name, N, H, K, E, TARGET_SMS, OPS,
                         with_baseline=N == SETTING["N"], verify=_oracle_check(ctx, buffer, N, H, K, E),
                         setting=dict(nodes=ctx.world_size, local_ranks=1, remote="rows from other nodes",
                                      allow_mnnvl=mnnvl, **buffer_bytes(buffer)))
    if last:
        ctx.release_buffer()   # later modules (and the runner's teardown) start without it
    return records


def _needs_nodes(_ctx):
    raise Skip("internode mode needs 2+ GPUs (one per node)")


def cases(ctx: BenchContext):
    H, K, E = SETTING["H"], SETTING["K"], SETTING["E"]
    if ctx.world_size < 2:
        yield Case(internode_name("targets", SETTING["N"], H, K, E, TARGET_SMS), _needs_nodes, dict(SETTING))
        return
    if E % ctx.world_size:
        return
    for n in CASE_N:
        yield Case(internode_name("setting", n, H, K, E, TARGET_SMS), lambda c, n=n: _run(c, n, False),
                   dict(SETTING, N=n))
    n = SETTING["N"]
    yield Case(internode_name("setting allow_mnnvl", n, H, K, E, TARGET_SMS), lambda c: _run(c, n, True, mnnvl=True),
               dict(SETTING, N=n, allow_mnnvl=True))
