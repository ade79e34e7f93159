"""Decode with low-latency dispatch / combine, the MoE step captured once in a CUDA graph.

Every decode step sends each rank's T new tokens to their top-k experts (low_latency_dispatch packs
them per local expert: [E_l, R*T, H]), runs the experts as one batched matmul over that layout and
brings the outputs back weighted (low_latency_combine). Nothing in the step waits for the host,
so on GPUs it is captured in a CUDA graph and replayed with each step's tokens copied into static
inputs; every replay is checked against the eager result of the same tokens (bit for bit: the
kernels are deterministic). Inference only: the step runs under torch.no_grad()
(epcomm.autograd's low-latency calls refuse inputs that require grad).

    torchrun --nproc_per_node=2 examples/moe_decode.py [--steps 8]

Without GPUs the same command runs the eager steps on epcomm's CPU backend over gloo and says
that the CUDA-graph part needs a GPU (exit status 0).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import epcomm
from epcomm import autograd as ep
from moe_train import setup


def decode_step(layer, buffer, tokens, max_tokens):
    """tokens [T, H] -> this MoE layer's output [T, H] bf16, through the low-latency pair."""
    x = (tokens @ layer.proj).bfloat16()
    idx, weights = layer.route(x)
    recv_x, _, handle, _, _ = ep.low_latency_dispatch(buffer, x, idx, max_tokens, layer.num_experts,
                                                      use_fp8=False)
    # Grouped expert MLP over the packed layout: rows past each expert's recv_count are padding,
    # computed and then ignored by combine (so the step needs no count on the host).
    expert_out = torch.bmm(F.silu(torch.bmm(recv_x.float(), layer.w1)), layer.w2).bfloat16()
    combined, _, _ = ep.low_latency_combine(buffer, expert_out, idx, weights, handle)
    return combined


def main():
    args, device, layer = setup(__doc__, steps=8, tokens=16)
    rank, world = dist.get_rank(), dist.get_world_size()
    t, hidden, num_experts = args.tokens, args.hidden, layer.num_experts
    buffer = epcomm.Buffer(dist.group.WORLD, 0, epcomm.Buffer.get_low_latency_rdma_size_hint(
        t, hidden, world, num_experts), low_latency_mode=True, num_qps_per_rank=args.experts_per_rank,
        explicitly_destroy=True)

    def tokens_of(step):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(t, hidden, generator=gen).to(device)

    with torch.no_grad():
        eager = [decode_step(layer, buffer, tokens_of(s), t) for s in range(args.steps)]   # compiles first
        for s, out in enumerate(eager):
            assert out.shape == (t, hidden) and torch.isfinite(out.float()).all(), f"step {s}: bad output"
        if rank == 0:
            print(f"eager: {args.steps} decode steps of {t} tokens per rank on {world} ranks", flush=True)
        if device.type != "cuda":
            if rank == 0:
                print("CUDA graph replay needs GPUs: skipped on the CPU backend", flush=True)
        else:
            replay_and_check(layer, buffer, tokens_of, eager, t)
    buffer.destroy()
    dist.destroy_process_group()


def replay_and_check(layer, buffer, tokens_of, eager, max_tokens):
    """Capture one decode step with static inputs, replay it for every step's tokens, compare."""
    static_tokens = tokens_of(0).clone()
    buffer.clean_low_latency_buffer(max_tokens, static_tokens.shape[1], layer.num_experts)
    decode_step(layer, buffer, static_tokens, max_tokens)   # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_step(layer, buffer, static_tokens, max_tokens)
    mismatches = 0
    for step, want in enumerate(eager):
        static_tokens.copy_(tokens_of(step))
        graph.replay()
        mismatches += int(not torch.equal(static_out, want))
    torch.cuda.synchronize()
    total = torch.tensor([mismatches], device=static_out.device)
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        print(f"CUDA graph: {len(eager)} replays, {int(total)} differ from eager", flush=True)
    del graph
    assert int(total) == 0, "graph replays differ from the eager steps"


if __name__ == "__main__":
    main()
