"""Differentiable dispatch and combine for training: `Buffer` calls that autograd can go through.

    from epcomm import autograd as ep
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = ep.dispatch(
        buffer, x, num_tokens_per_rank=..., is_token_in_rank=..., num_tokens_per_expert=...,
        topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, _, event = ep.combine(buffer, expert_out, handle)

Each function takes the Buffer first, then exactly the arguments of the Buffer method of the same
name, and returns the same tuple; recv_x / recv_topk_weights / combined_x (and combined_topk_weights)
carry gradients back to x, topk_weights and bias.

The gradients (the two operations are each other's transpose):
  * dispatch copies token n to every rank its experts live on, so the gradient of x[n] is the sum of
    the gradients of those copies: a combine of grad(recv_x) through the same handle. recv_topk_weights
    holds topk_weights[n, k] on the rank of expert k and a constant 0 elsewhere, so grad(topk_weights)
    is the same combine of grad(recv_topk_weights) with the constant entries zeroed.
  * combine sums each token's rows (plus bias), so every row's gradient is the gradient of its token:
    a cached dispatch of grad(combined_x) through the handle; bias gets grad(combined_x) itself; the
    gradient of combine's topk_weights is a cached dispatch of grad(combined_topk_weights) (float32,
    moved as raw bits in a BF16 payload, so it arrives exact).
  Both backward calls are host-synchronisation-free (a combine, or a cached dispatch: the row count
  is the handle's).

Collective in backward too: autograd issues the backward calls, so every rank must run backward
through the same differentiable calls in the same order (the same graph; inputs requiring grad on
every rank or on none); a rank that skips one leaves the others waiting.

Streams: previous_event / async_finish / allocate_on_comm_stream behave as on the Buffer in the
forward call (with async_finish the caller waits on the returned event before using the outputs, as
usual). Backward calls are synchronous, on the stream autograd runs the backward on (it first waits
for the forward's event, so the handle is ready); they use the default Config of their operation.

FP8: dispatch accepts the (e4m3 [N, H], scales) pair; the received pair is not differentiable
(quantisation has no gradient) and comes back without requires_grad; topk_weights still gets its
gradient. A pair that requires grad raises ValueError instead of silently dropping the gradient:
dispatch the BF16 tensor when x needs a gradient.

Inputs that do not require grad (or grad mode off) take the plain Buffer call, so CuPy / DLPack
arrays pass through as they do there, without gradients.

Low-latency mode (decoding, serving): low_latency_dispatch / low_latency_combine here are the Buffer
calls for inference only; they raise RuntimeError when grad mode is on and an input requires grad
(use torch.no_grad() / torch.inference_mode(), or detach), so a gradient is never silently lost.
"""
from __future__ import annotations

from typing import Optional

import torch

from .event import stream_wait_event


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _wait_forward(ctx) -> None:
    """Backward starts after the forward's async work (the handle and outputs it reads)."""
    if ctx.forward_event is not None:
        stream_wait_event(None, ctx.forward_event)


class _Call:
    """The non-differentiable arguments of one call going in, and its non-tensor outputs coming out
    (autograd.Function moves only tensors)."""

    __slots__ = ("kwargs", "bias_pair", "result")

    def __init__(self, kwargs: dict, bias_pair: bool = False) -> None:
        self.kwargs = kwargs
        self.bias_pair = bias_pair   # combine: hand bias to the Buffer as the caller gave it
        self.result = None


# ---- normal mode ---------------------------------------------------------------------------------
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, call: _Call, x, x_fp8, topk_weights):
        result = buffer.dispatch(x if x_fp8 is None else x_fp8, topk_weights=topk_weights, **call.kwargs)
        call.result = result
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = result
        ctx.buffer, ctx.forward_event = buffer, event.event
        ctx.handle = call.kwargs["handle"] if handle is None else handle
        ctx.recv_topk_idx = recv_topk_idx
        ctx.num_rows = (recv_x if x_fp8 is None else recv_x[0]).shape[0]
        outputs = (recv_x,) if x_fp8 is None else tuple(recv_x)
        # Outputs of inputs without gradient are constants: nothing downstream computes their gradient.
        constant = list(outputs) if x_fp8 is not None or not x.requires_grad else []
        if recv_topk_weights is not None:
            outputs += (recv_topk_weights,)
            constant += [] if topk_weights.requires_grad else [recv_topk_weights]
        ctx.mark_non_differentiable(*constant)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        _wait_forward(ctx)
        x_grad_needed, weights_grad_needed = ctx.needs_input_grad[2], ctx.needs_input_grad[4]
        if x_grad_needed:
            payload = grads[0].contiguous()
        else:
            # Only the weights need the combine: a 16-byte payload row instead of the hidden size.
            payload = torch.zeros(ctx.num_rows, 8, dtype=torch.bfloat16, device=grads[-1].device)
        weights = None
        if weights_grad_needed:
            # Entries of experts on other ranks were constant zeros in the forward: no gradient.
            weights = grads[-1].masked_fill(ctx.recv_topk_idx < 0, 0.0).contiguous()
        grad_x, grad_weights, _ = ctx.buffer.combine(payload, ctx.handle, topk_weights=weights)
        return None, None, grad_x if x_grad_needed else None, None, grad_weights


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, call: _Call, x, topk_weights, bias0, bias1):
        bias = (bias0, bias1) if call.bias_pair else bias0
        combined_x, combined_topk_weights, event = buffer.combine(x, topk_weights=topk_weights, bias=bias,
                                                                  **call.kwargs)
        call.result = (combined_x, combined_topk_weights, event)
        ctx.buffer, ctx.forward_event, ctx.handle = buffer, event.event, call.kwargs["handle"]
        x_side = any(t is not None and t.requires_grad for t in (x, bias0, bias1))
        constant = [] if x_side else [combined_x]
        if combined_topk_weights is None:
            ctx.mark_non_differentiable(*constant)
            return (combined_x,)
        ctx.mark_non_differentiable(*constant, *([] if topk_weights.requires_grad else [combined_topk_weights]))
        return combined_x, combined_topk_weights

    @staticmethod
    def backward(ctx, grad_combined_x, grad_combined_weights=None):
        _wait_forward(ctx)
        needs = ctx.needs_input_grad
        grad_x = grad_weights = None
        if needs[2]:
            grad_x = ctx.buffer.dispatch(grad_combined_x.contiguous(), handle=ctx.handle)[0]
        if needs[3]:
            grad_weights = _dispatch_float32(ctx.buffer, ctx.handle, grad_combined_weights)
        return (None, None, grad_x, grad_weights,
                grad_combined_x if needs[4] else None, grad_combined_x if needs[5] else None)


def _dispatch_float32(buffer, handle, values: torch.Tensor) -> torch.Tensor:
    """A cached dispatch of float32 [N, K] rows, exact: dispatch moves BF16 rows as bytes, so the
    float32 bits travel as pairs of BF16 lanes (rows padded to 16 bytes, dispatch's row unit)."""
    num_tokens, k = values.shape
    padded = torch.zeros(num_tokens, -(-k // 4) * 4, dtype=torch.float32, device=values.device)
    padded[:, :k] = values
    rows = buffer.dispatch(padded.view(torch.bfloat16), handle=handle)[0]
    return rows.view(torch.float32)[:, :k]


def dispatch(buffer, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
             is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
             expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
             async_finish: bool = False, allocate_on_comm_stream: bool = False):
    """`buffer.dispatch(...)` (same arguments after the Buffer, same return tuple) with gradients:
    recv_x -> x (BF16 only, see the module doc for FP8), recv_topk_weights -> topk_weights.
    Cached mode (handle given) is differentiable as well: its backward is a combine."""
    op = "epcomm.autograd.dispatch"
    fp8 = isinstance(x, (tuple, list))
    if fp8 and _needs_grad(*x):
        raise ValueError(f"{op}: x is an FP8 pair that requires grad; quantised rows have no gradient, so "
                         f"dispatch the BF16 tensor for a gradient of x, or detach the pair")
    kwargs = dict(handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                  num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                  num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                  expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, config=config,
                  previous_event=previous_event, async_finish=async_finish,
                  allocate_on_comm_stream=allocate_on_comm_stream)
    if not _needs_grad(x if not fp8 else None, topk_weights):
        return buffer.dispatch(x, topk_weights=topk_weights, **kwargs)
    call = _Call(kwargs)
    outputs = _Dispatch.apply(buffer, call, None if fp8 else x, tuple(x) if fp8 else None, topk_weights)
    _, recv_topk_idx, _, counts, new_handle, event = call.result
    recv_x = outputs[0] if not fp8 else (outputs[0], outputs[1])
    recv_topk_weights = outputs[-1] if call.result[2] is not None else None
    return recv_x, recv_topk_idx, recv_topk_weights, counts, new_handle, event


def combine(buffer, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
            async_finish: bool = False, allocate_on_comm_stream: bool = False):
    """`buffer.combine(...)` (same arguments after the Buffer, same return tuple) with gradients:
    combined_x -> x and bias (a tensor or each of a 2-tuple), combined_topk_weights -> topk_weights."""
    biases = tuple(bias) if isinstance(bias, (tuple, list)) else (bias, None)
    kwargs = dict(handle=handle, config=config, previous_event=previous_event, async_finish=async_finish,
                  allocate_on_comm_stream=allocate_on_comm_stream)
    # A bias tuple of another length goes to the Buffer as well, which rejects it.
    if not _needs_grad(x, topk_weights, *biases) or len(biases) != 2:
        return buffer.combine(x, topk_weights=topk_weights, bias=bias, **kwargs)
    call = _Call(kwargs, bias_pair=isinstance(bias, (tuple, list)))
    outputs = _Combine.apply(buffer, call, x, topk_weights, *biases)
    event = call.result[2]
    return outputs[0], outputs[1] if len(outputs) > 1 else None, event


# ---- low-latency mode: inference only ------------------------------------------------------------
def _inference_only(op: str, **tensors) -> None:
    wanting = [name for name, t in tensors.items() if _needs_grad(t)]
    if wanting:
        raise RuntimeError(f"{op}: low-latency calls are for inference and have no gradient, but "
                           f"{', '.join(wanting)} requires grad; run them under torch.no_grad() or "
                           f"torch.inference_mode(), or detach the inputs")


def low_latency_dispatch(buffer, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *args, **kwargs):
    """`buffer.low_latency_dispatch(...)` for inference: raises RuntimeError if x requires grad."""
    _inference_only("epcomm.autograd.low_latency_dispatch", x=x)
    return buffer.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *args, **kwargs)


def low_latency_combine(buffer, x, topk_idx, topk_weights, handle, *args, out: Optional[torch.Tensor] = None,
                        **kwargs):
    """`buffer.low_latency_combine(...)` for inference: raises RuntimeError if x, topk_weights or out
    requires grad."""
    _inference_only("epcomm.autograd.low_latency_combine", x=x, topk_weights=topk_weights, out=out)
    return buffer.low_latency_combine(x, topk_idx, topk_weights, handle, *args, out=out, **kwargs)
