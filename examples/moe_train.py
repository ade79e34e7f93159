"""Train a mixture-of-experts layer with epcomm's differentiable dispatch and combine.

Each rank holds num_experts / R experts (two-layer MLPs) and replicas of the input projection and
the gate. Tokens go to their top-k experts with epcomm.autograd.dispatch and come back summed with
epcomm.autograd.combine; the gradient flows back through both to the experts (which see every
rank's tokens), the gate (through the top-k weights) and the projection (through the rows).

`torchrun --nproc_per_node=2 examples/moe_train.py [--steps 10]`: one GPU per rank (NCCL), or
without GPUs gloo and epcomm's CPU backend. Prints the loss (mean over ranks) per step and checks
that the replicas stayed equal.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import epcomm
from epcomm import autograd as ep


def init():
    """torchrun's process group: NCCL on one GPU per rank, else gloo on the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


class MoELayer(torch.nn.Module):
    def __init__(self, hidden, ffn, num_experts, topk, device):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        self.num_experts, self.topk, self.num_local = num_experts, topk, num_experts // world
        shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1 + rank)

        def param(gen, *shape):
            return torch.nn.Parameter((torch.randn(*shape, generator=gen) / shape[-2] ** 0.5).to(device))
        self.proj, self.gate = param(shared, hidden, hidden), param(shared, hidden, num_experts)   # replicated
        self.w1, self.w2 = param(own, self.num_local, hidden, ffn), param(own, self.num_local, ffn, hidden)

    def route(self, x):
        """-> topk_idx [N, K] (global expert ids), topk_weights [N, K] float32 (differentiable)."""
        weights, idx = (x.float() @ self.gate).softmax(-1).topk(self.topk, dim=-1)
        return idx, weights

    def experts(self, recv_x, recv_topk_idx, recv_topk_weights):
        """Grouped expert MLP: each received row through each of its local experts, weighted."""
        out = torch.zeros(recv_x.shape, device=recv_x.device)
        for e in range(self.num_local):
            rows, slot = (recv_topk_idx == e).nonzero(as_tuple=True)
            h = F.silu(recv_x[rows].float() @ self.w1[e]) @ self.w2[e]
            out = out.index_add(0, rows, h * recv_topk_weights[rows, slot, None])
        return out.bfloat16()

    def forward(self, buffer, tokens):
        x = (tokens @ self.proj).bfloat16()   # dispatch moves BF16 rows
        idx, weights = self.route(x)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, self.num_experts)
        recv_x, recv_idx, recv_weights, _, handle, _ = ep.dispatch(
            buffer, x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights)
        combined, _, _ = ep.combine(buffer, self.experts(recv_x, recv_idx, recv_weights), handle)
        return combined


def setup(doc, steps, tokens):
    """The command line, the process group and the layer, as both examples use them."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--tokens", type=int, default=tokens, help="tokens per rank (per step: T, decoding)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    args = parser.parse_args()
    device = init()
    num_experts = args.experts_per_rank * dist.get_world_size()
    return args, device, MoELayer(args.hidden, 2 * args.hidden, num_experts, args.topk, device)


def main():
    args, device, layer = setup(__doc__, steps=10, tokens=64)
    rank, world, hidden = dist.get_rank(), dist.get_world_size(), args.hidden
    nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden * 2, world) for cfg in
                    (epcomm.Buffer.get_dispatch_config(world), epcomm.Buffer.get_combine_config(world)))
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=nvl_bytes, explicitly_destroy=True)
    # This rank's batch, and a fixed target map shared by every rank: y = tanh(tokens @ A).
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randn(args.tokens, hidden, generator=gen).to(device)
    target_map = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(99)) / hidden ** 0.5
    target = torch.tanh(tokens @ target_map.to(device))
    optimizer = torch.optim.Adam(layer.parameters(), lr=3e-3)
    for step in range(args.steps):
        loss = F.mse_loss(layer(buffer, tokens).float(), target)
        optimizer.zero_grad()
        loss.backward()                       # runs the backward combine and dispatch on every rank
        for p in (layer.proj, layer.gate):    # replicas: the global loss is the sum of the ranks' losses
            dist.all_reduce(p.grad)
        optimizer.step()
        dist.all_reduce(mean := loss.detach().clone())
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.6f}", flush=True)

    for p in (layer.proj, layer.gate):
        copies = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(copies, p.detach())
        assert all(torch.equal(c, copies[0]) for c in copies), "replicated parameters diverged"
    if rank == 0:
        print("replicated parameters equal on every rank", flush=True)
    buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
