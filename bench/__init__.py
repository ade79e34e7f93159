"""epcomm's benchmark: `python -m bench` / `make bench` (see bench/__main__.py and bench/NOTES.md).

Case-module protocol. A mode's bench lives in bench/<module>.py (baselines, layout, intranode,
low_latency, internode; reference on the CPU) and defines

    def cases(ctx: bench.harness.BenchContext) -> Iterable[bench.harness.Case]

Building the cases must not touch the GPU (it only lists them, e.g. fewer when `ctx.quick`). Each
`Case(name, run, setting)` is run on every rank, in the same order: `run(ctx)` is collective and
returns one `Record` or several (name, setting, us, logical_gbps, nvlink_gbps, sms, extra, plus
`baseline`: the name of a same-run record to compare with, e.g.
`bench.baselines.torch_moe_name("dispatch", 4096, 7168, 8, 256)`, and `target`:
("us" | "logical_gbps" | "nvlink_gbps" | "speedup", "<=" | ">=", value)).

Raising NotImplementedError (from cases() or run) reports "not implemented"; raising
bench.harness.Skip reports "skipped"; any other exception reports "error: ..." with its traceback in
the JSON, and the bench carries on with the next case (the Buffer is then rebuilt). Use
`ctx.check(ok, what)` for correctness checks: it is collective, so every rank leaves together.
Calls that may raise on one rank only (a path new to the machine) go through bench.harness.Attempts,
whose check fails every rank when one raised.

The context gives: rank, world_size, local_rank, device, group (NCCL; pass it to epcomm.Buffer and
torch collectives), quick, results (records gathered so far, by name, on every rank),
time_stats / time_us (CUDA events per call, L2 flushed, ranks aligned, averaged), kernel_time_us
(torch profiler, kernels whose name contains a string), inputs (deterministic MoE inputs for any
rank), buffer / normal_buffer / low_latency_buffer / internode_buffer (one live epcomm.Buffer,
rebuilt when a request does not fit), progress(message), and the byte formulas of targets.md in
bench.harness (normal_bytes, low_latency_dispatch_bytes, low_latency_combine_bytes, gbps).
"""
