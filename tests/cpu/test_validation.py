"""Every public Buffer call rejects bad input before doing anything, with the right exception type
and a message naming the call and the argument; after each rejection the Buffer still works.

Runs the CPU backend on 2 gloo processes (tests/conftest.py run_ranks). Each rank makes the same
bad calls, so the valid collective call that follows every rejection stays in step.
"""
from __future__ import annotations

import numpy as np
import torch

from tests.conftest import run_ranks
from tests.helpers.validation import expect

R = 2                      # ranks
N_BASE, H, K, E = 6, 256, 2, 4
NVL_BYTES = 1 << 20


class Inputs:
    """One rank's valid normal-mode inputs (N differs per rank, so rows mismatches are visible)."""

    def __init__(self, rank: int):
        g = torch.Generator().manual_seed(rank)
        self.n = N_BASE + rank
        self.x = torch.randn(self.n, H, generator=g).bfloat16()
        self.topk_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(self.n)])
        self.topk_idx[0, 1] = -1
        self.topk_weights = torch.rand(self.n, K, generator=g)
        self.x_fp8 = self.x.float().to(torch.float8_e4m3fn)
        # Column-major scales: any strides are allowed.
        self.scales = torch.rand(H // 128, self.n, generator=g).t()


def _layout(buf, inp):
    ntpr, ntprr, ntpe, itir, _ = buf.get_dispatch_layout(inp.topk_idx, E)
    return dict(num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itir,
                num_tokens_per_expert=ntpe)


# ---- constructor, lifetime, buffer memory --------------------------------------------------------
def _constructor_cases(rank, world, group):
    from epcomm import Buffer
    from epcomm.errors import BufferUnusable
    rejected = [
        (dict(num_nvl_bytes=-128), ValueError, "num_nvl_bytes must be >= 0"),
        (dict(num_nvl_bytes=100), ValueError, "num_nvl_bytes must be a multiple of 128"),
        (dict(num_rdma_bytes=1.5), TypeError, "num_rdma_bytes must be an int"),
        (dict(low_latency_mode=True), ValueError, "num_rdma_bytes must be > 0 with low_latency_mode"),
        (dict(low_latency_mode="yes"), TypeError, "low_latency_mode must be a bool"),
        (dict(num_rdma_bytes=1 << 20, low_latency_mode=True, num_qps_per_rank=0), ValueError, "num_qps_per_rank"),
        (dict(explicitly_destroy=None), TypeError, "explicitly_destroy must be a bool"),
    ]
    for kwargs, exc, words in rejected:
        expect(lambda: Buffer(group, **kwargs), exc, "Buffer: ", words)
    expect(lambda: Buffer(None), TypeError, "Buffer: group must be a torch.distributed ProcessGroup")
    expect(lambda: Buffer(group, comm=object()), NotImplementedError, "comm", "ProcessGroup")

    buf = Buffer(group, NVL_BYTES, 0, explicitly_destroy=True)
    assert (buf.rank, buf.group_size, buf.group, buf.num_nvl_bytes, buf.num_rdma_bytes) == (rank, R, group, NVL_BYTES, 0)
    assert (buf.low_latency_mode, buf.explicitly_destroy, buf.enable_shrink) == (False, True, False)
    assert buf.get_comm_stream() is None   # CPU backend
    rt = buf.runtime
    assert rt.is_available() and not rt.is_internode_available()
    assert (rt.get_num_rdma_ranks(), rt.get_rdma_rank(), rt.get_root_rdma_rank(True)) == (1, 0, rank)

    # get_local_buffer_tensor
    view = buf.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), 128)
    assert view.shape == (4, 8) and view.dtype == torch.float32
    assert buf.get_local_buffer_tensor(torch.int32).numel() == NVL_BYTES // 4
    op = "Buffer.get_local_buffer_tensor: "
    expect(lambda: buf.get_local_buffer_tensor("float32"), TypeError, op, "dtype must be a torch.dtype")
    expect(lambda: buf.get_local_buffer_tensor(torch.float32, offset=-4), ValueError, op, "offset must be >= 0")
    expect(lambda: buf.get_local_buffer_tensor(torch.float32, offset=6), ValueError, op, "offset must be a multiple of 4")
    expect(lambda: buf.get_local_buffer_tensor(torch.float32, offset=NVL_BYTES + 4), ValueError, op, "offset")
    expect(lambda: buf.get_local_buffer_tensor(torch.float32, torch.Size([NVL_BYTES])), ValueError, op, "size")
    expect(lambda: buf.get_local_buffer_tensor(torch.float32, 16), TypeError, op, "size must be None or a torch.Size")
    expect(lambda: buf.get_local_buffer_tensor(torch.float32, use_rdma_buffer=True), ValueError, op,
           "num_rdma_bytes=0")

    # mode requirements
    inp = Inputs(rank)
    expect(lambda: buf.low_latency_dispatch(inp.x, inp.topk_idx, 8, E), ValueError,
           "Buffer.low_latency_dispatch: ", "low_latency_mode=True")
    expect(lambda: buf.low_latency_clean_mask_buffer(), ValueError, "Buffer.low_latency_clean_mask_buffer: ",
           "low_latency_mode=True")
    no_nvl = Buffer(group, 0, 0)
    expect(lambda: no_nvl.dispatch(inp.x, **_layout(no_nvl, inp)), ValueError, "Buffer.dispatch: ",
           "num_nvl_bytes > 0")
    expect(lambda: no_nvl.destroy(), RuntimeError, "Buffer.destroy: ", "explicitly_destroy=True")

    # destroy: later calls and a second destroy say the Buffer is gone
    buf.destroy()
    assert buf.runtime is None
    expect(lambda: buf.get_dispatch_layout(inp.topk_idx, E), BufferUnusable, "Buffer.get_dispatch_layout", "destroyed")
    expect(lambda: buf.destroy(), BufferUnusable, "Buffer.destroy", "destroyed")


def test_constructor_lifetime_and_buffer_memory():
    run_ranks(_constructor_cases, R)


# ---- get_dispatch_layout -------------------------------------------------------------------------
def _layout_cases(rank, world, group):
    from epcomm import Buffer, EventOverlap
    buf = Buffer(group, NVL_BYTES)
    inp = Inputs(rank)
    expected = buf.get_dispatch_layout(inp.topk_idx, E)
    t = inp.topk_idx
    out_of_range = t.clone()
    out_of_range[1, 0] = E
    below = t.clone()
    below[0, 0] = -2
    op = "Buffer.get_dispatch_layout: "
    cases = [
        (lambda: buf.get_dispatch_layout(t.short(), E), TypeError, "topk_idx must have dtype torch.int64"),
        (lambda: buf.get_dispatch_layout(t.float(), E), TypeError, "topk_idx"),
        (lambda: buf.get_dispatch_layout(t.tolist(), E), TypeError, "topk_idx must be a torch.Tensor or a DLPack"),
        (lambda: buf.get_dispatch_layout(None, E), TypeError, "topk_idx"),
        (lambda: buf.get_dispatch_layout(t[:, 0], E), ValueError, "topk_idx must have shape [num_tokens, num_topk]"),
        (lambda: buf.get_dispatch_layout(t.t(), E), ValueError, "topk_idx must be contiguous"),
        (lambda: buf.get_dispatch_layout(t[:, :0].contiguous(), E), ValueError, "topk_idx must have 1 to 32 columns"),
        (lambda: buf.get_dispatch_layout(torch.full((inp.n, 33), -1), E), ValueError, "1 to 32 columns"),
        (lambda: buf.get_dispatch_layout(t.to("meta"), E), ValueError, "topk_idx must be on the Buffer's device cpu"),
        (lambda: buf.get_dispatch_layout(out_of_range, E), ValueError, "topk_idx values must lie in [-1, 4)"),
        (lambda: buf.get_dispatch_layout(below, E), ValueError, "topk_idx values must lie in [-1, 4), got values in [-2"),
        (lambda: buf.get_dispatch_layout(t, 0), ValueError, "num_experts must be >= 1"),
        (lambda: buf.get_dispatch_layout(t, 3), ValueError, "num_experts must be divisible by the number of ranks (2)"),
        (lambda: buf.get_dispatch_layout(t, "4"), TypeError, "num_experts must be an int"),
        (lambda: buf.get_dispatch_layout(t, E, previous_event=object()), TypeError, "previous_event must be None or an EventOverlap"),
        (lambda: buf.get_dispatch_layout(t, E, async_finish="no"), TypeError, "async_finish must be a bool"),
        (lambda: buf.get_dispatch_layout(t, E, allocate_on_comm_stream=True), ValueError,
         "allocate_on_comm_stream=True needs previous_event and async_finish=True"),
        (lambda: buf.get_dispatch_layout(t, E, previous_event=EventOverlap(), allocate_on_comm_stream=True),
         ValueError, "allocate_on_comm_stream"),
    ]
    for call, exc, words in cases:
        expect(call, exc, op, words)
        again = buf.get_dispatch_layout(inp.topk_idx, E)
        assert all(torch.equal(a, b) for a, b in zip(again[:4], expected[:4]) if a is not None)
    # numpy scalars, 0/1 ints and numpy arrays (DLPack) are accepted; outputs come back as numpy arrays
    as_numpy = buf.get_dispatch_layout(inp.topk_idx.numpy(), np.int64(E), previous_event=EventOverlap(),
                                       async_finish=np.True_, allocate_on_comm_stream=1)
    assert isinstance(as_numpy[0], np.ndarray) and as_numpy[1] is None
    assert np.array_equal(as_numpy[3], expected[3].numpy())
    assert isinstance(as_numpy[4], EventOverlap)
    # int32 top-k ids are accepted in normal mode and count the same
    as_int32 = buf.get_dispatch_layout(inp.topk_idx.int(), E)
    assert all(torch.equal(a, b) for a, b in zip(as_int32[:4], expected[:4]) if a is not None)


def test_get_dispatch_layout_rejects():
    run_ranks(_layout_cases, R)


# ---- dispatch ------------------------------------------------------------------------------------
def _dispatch_cases(rank, world, group):
    from epcomm import Buffer, Config
    buf = Buffer(group, NVL_BYTES)
    inp = Inputs(rank)
    lay = _layout(buf, inp)
    top = dict(topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    expected = buf.dispatch(inp.x, **lay, **top)
    handle = expected[4]
    n, x, itir, ntpr, ntpe = inp.n, inp.x, lay["is_token_in_rank"], lay["num_tokens_per_rank"], lay["num_tokens_per_expert"]

    def with_layout(**changes):
        return lambda: buf.dispatch(**{"x": x, **lay, **top, **changes})

    bad_idx = inp.topk_idx.clone()
    bad_idx[0, 0] = E
    op = "Buffer.dispatch: "
    cases = [
        (with_layout(x=x.float()), TypeError, "x must be a torch.bfloat16 tensor or a tuple"),
        (with_layout(x=[x]), TypeError, "x must be a torch.Tensor or a DLPack array"),
        (with_layout(x=x[None]), ValueError, "x must have shape [num_tokens, hidden]"),
        (with_layout(x=x[:, ::2]), ValueError, "x must be contiguous"),
        (with_layout(x=x[:, :12].contiguous()), ValueError, "hidden size must be a positive multiple of 8"),
        (with_layout(x=x.to("meta")), ValueError, "x must be on the Buffer's device"),
        (with_layout(x=(inp.x_fp8,)), TypeError, "x as a tuple must be (x_fp8, x_scales), got 1"),
        (with_layout(x=(x, inp.scales)), TypeError, "x[0] must have dtype torch.float8_e4m3fn"),
        (with_layout(x=(inp.x_fp8[:, :64].contiguous(), inp.scales[:, :1])), ValueError,
         "x[0] hidden size must be a positive multiple of 128"),
        (with_layout(x=(inp.x_fp8, inp.scales.double())), TypeError, "x[1] must have dtype torch.float32"),
        (with_layout(x=(inp.x_fp8, inp.scales[:, :1])), ValueError, "x[1] must have shape [num_tokens, hidden / 128]"),
        (with_layout(x=(inp.x_fp8, inp.scales[1:])), ValueError, "x[1] must have shape"),
        (with_layout(num_tokens_per_rank=None), ValueError, "num_tokens_per_rank must be given when handle is None"),
        (with_layout(is_token_in_rank=None, num_tokens_per_expert=None), ValueError,
         "is_token_in_rank, num_tokens_per_expert must be given"),
        (with_layout(num_tokens_per_rank=ntpr.long()), TypeError, "num_tokens_per_rank must have dtype torch.int32"),
        (with_layout(num_tokens_per_rank=ntpr[:1]), ValueError, "num_tokens_per_rank must have shape [num_ranks] = [2]"),
        (with_layout(is_token_in_rank=itir[1:]), ValueError, f"is_token_in_rank must have shape [num_tokens, num_ranks] = [{n}, 2]"),
        (with_layout(is_token_in_rank=itir.int()), TypeError, "is_token_in_rank must have dtype torch.bool"),
        (with_layout(is_token_in_rank=itir.t().contiguous().t()), ValueError, "is_token_in_rank must be contiguous"),
        (with_layout(num_tokens_per_expert=ntpe[:3]), ValueError, "num_experts) must be divisible by the number of ranks"),
        (with_layout(num_tokens_per_expert=ntpe[None]), ValueError, "num_tokens_per_expert must have shape [num_experts]"),
        (with_layout(topk_weights=None), ValueError, "topk_idx and topk_weights must be given together"),
        (with_layout(topk_idx=None), ValueError, "must be given together"),
        (with_layout(topk_idx=inp.topk_idx.short()), TypeError, "topk_idx must have dtype torch.int64"),
        (with_layout(topk_idx=inp.topk_idx[1:]), ValueError, f"topk_idx must have shape [num_tokens, num_topk] = [{n}, *]"),
        (with_layout(topk_idx=bad_idx), ValueError, "topk_idx values must lie in [-1, 4)"),
        (with_layout(topk_weights=inp.topk_weights[:, :1].contiguous()), ValueError,
         f"topk_weights must have shape [num_tokens, num_topk] = [{n}, {K}]"),
        (with_layout(topk_weights=inp.topk_weights.double()), TypeError, "topk_weights must have dtype torch.float32"),
        (with_layout(expert_alignment=0), ValueError, "expert_alignment must be >= 1"),
        (with_layout(expert_alignment=True), TypeError, "expert_alignment must be an int"),
        (with_layout(num_worst_tokens=-1), ValueError, "num_worst_tokens must be >= 0"),
        (lambda: buf.dispatch(x, **lay, num_worst_tokens=64), ValueError, "num_worst_tokens > 0 needs topk_idx"),
        (with_layout(config=(20, 6, 256, 6, 256)), TypeError, "config must be None or an epcomm.Config"),
        (with_layout(previous_event="event"), TypeError, "previous_event must be None or an EventOverlap"),
        (with_layout(allocate_on_comm_stream=True, async_finish=True), ValueError, "allocate_on_comm_stream"),
        # cached mode
        (lambda: buf.dispatch(x, handle, topk_idx=inp.topk_idx), ValueError,
         "topk_idx and topk_weights must be None when a cached handle is given"),
        (lambda: buf.dispatch(x, list(handle)[:5]), ValueError, "handle must be the 6-tuple an intranode dispatch returns, got 5"),
        (lambda: buf.dispatch(x, "handle"), TypeError, "handle must be the tuple returned by dispatch"),
        (lambda: buf.dispatch(x, (handle[0].long(),) + handle[1:]), TypeError, "handle[0] (rank_prefix_matrix) must have dtype torch.int32"),
        (lambda: buf.dispatch(x, (handle[0][:1],) + handle[1:]), ValueError, "handle[0] (rank_prefix_matrix) must have shape"),
        (lambda: buf.dispatch(x, handle[:3] + (None,) + handle[4:]), TypeError, "handle[3] (recv_src_idx)"),
        (lambda: buf.dispatch(x[1:], handle), ValueError, f"x must have as many rows as the handle's is_token_in_rank ({n})"),
    ]
    for call, exc, words in cases:
        expect(call, exc, op, words)
        again = buf.dispatch(x, **lay, **top, config=Config(8))
        assert torch.equal(again[0], expected[0]) and again[3] == expected[3]

    # valid variants: FP8 with column-major scales, cached mode, tuple/list handles
    fp8 = buf.dispatch((inp.x_fp8, inp.scales), **lay, **top)
    dense = buf.dispatch((inp.x_fp8, inp.scales.contiguous()), **lay, **top)
    assert isinstance(fp8[0], tuple) and torch.equal(fp8[0][1], dense[0][1])
    cached = buf.dispatch(x, list(handle))
    assert torch.equal(cached[0], expected[0]) and cached[1:5] == (None, None, None, None)
    # int32 top-k ids: same rows and weights; recv_topk_idx keeps the input's dtype
    as_int32 = buf.dispatch(x, **lay, topk_idx=inp.topk_idx.int(), topk_weights=inp.topk_weights)
    assert torch.equal(as_int32[0], expected[0]) and as_int32[1].dtype == torch.int32
    assert torch.equal(as_int32[1].long(), expected[1]) and torch.equal(as_int32[2], expected[2])
    assert as_int32[3] == expected[3]


def test_dispatch_rejects():
    run_ranks(_dispatch_cases, R)


# ---- combine -------------------------------------------------------------------------------------
def _combine_cases(rank, world, group):
    from epcomm import Buffer
    buf = Buffer(group, NVL_BYTES)
    inp = Inputs(rank)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(inp.x, **_layout(buf, inp), topk_idx=inp.topk_idx,
                                                   topk_weights=inp.topk_weights)
    m, n = recv_x.shape[0], inp.n
    bias = torch.randn(n, H).bfloat16()
    expected = buf.combine(recv_x, handle, recv_w, (bias, bias))
    op = "Buffer.combine: "
    cases = [
        (lambda: buf.combine(recv_x.float(), handle), TypeError, "x must have dtype torch.bfloat16"),
        (lambda: buf.combine(recv_x[1:], handle), ValueError, f"x must have shape [num_recv_tokens of the handle, hidden] = [{m}, *]"),
        (lambda: buf.combine(recv_x[:, ::2], handle), ValueError, "x must be contiguous"),
        (lambda: buf.combine(recv_x[:, :4].contiguous(), handle), ValueError, "hidden size must be a positive multiple of 8"),
        (lambda: buf.combine(None, handle), TypeError, "x must be a torch.Tensor or a DLPack array"),
        (lambda: buf.combine(recv_x, None), TypeError, "handle must be the tuple returned by dispatch"),
        (lambda: buf.combine(recv_x, handle[:4] + (handle[4].int(),) + handle[5:]), TypeError,
         "handle[4] (is_token_in_rank) must have dtype torch.bool"),
        (lambda: buf.combine(recv_x, handle, recv_w[1:]), ValueError, f"topk_weights must have shape [num_recv_tokens, num_topk] = [{m}, *]"),
        (lambda: buf.combine(recv_x, handle, recv_w.half()), TypeError, "topk_weights must have dtype torch.float32"),
        (lambda: buf.combine(recv_x, handle, bias=bias[1:]), ValueError, f"bias must have shape [num_tokens, hidden] = [{n}, {H}]"),
        (lambda: buf.combine(recv_x, handle, bias=(bias, bias.float())), TypeError, "bias[1] must have dtype torch.bfloat16"),
        (lambda: buf.combine(recv_x, handle, bias=(bias, bias, bias)), TypeError, "bias must be None, a tensor or a 2-tuple"),
        (lambda: buf.combine(recv_x, handle, bias="bias"), TypeError, "bias must be None, a tensor or a 2-tuple"),
        (lambda: buf.combine(recv_x, handle, config=8), TypeError, "config must be None or an epcomm.Config"),
        (lambda: buf.combine(recv_x, handle, async_finish=2), TypeError, "async_finish must be a bool"),
        (lambda: buf.combine(recv_x, handle, allocate_on_comm_stream=True), ValueError, "allocate_on_comm_stream"),
    ]
    for call, exc, words in cases:
        expect(call, exc, op, words)
        again = buf.combine(recv_x, handle, recv_w, (bias, bias))
        assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])
    # a single bias tensor and a (bias, None) tuple are the same thing
    assert torch.equal(buf.combine(recv_x, handle, bias=bias)[0], buf.combine(recv_x, handle, bias=(bias, None))[0])


def test_combine_rejects():
    run_ranks(_combine_cases, R)


# ---- internode (two "nodes" of one rank each on the CPU backend) ---------------------------------
def _internode_cases(rank, world, group):
    import os
    os.environ["EPCOMM_NUM_LOCAL_RANKS"] = "1"   # ranks per node: one, so 2 nodes
    from epcomm import Buffer
    no_rdma = Buffer(group, NVL_BYTES)
    buf = Buffer(group, NVL_BYTES, NVL_BYTES)
    assert buf.runtime.is_internode_available() and buf.runtime.get_num_rdma_ranks() == R
    inp = Inputs(rank)
    lay = _layout(buf, inp)
    assert lay["num_tokens_per_rdma_rank"].shape == (R,)
    top = dict(topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    expected = buf.dispatch(inp.x, **lay, **top)
    handle = expected[4]
    assert len(handle) == 10
    combined = buf.combine(expected[0], handle, expected[2])
    op = "Buffer.dispatch: "
    cases = [
        (lambda: no_rdma.dispatch(inp.x, **lay, **top), ValueError, op, "internode mode needs a Buffer with num_rdma_bytes > 0"),
        (lambda: buf.dispatch(inp.x, **{**lay, "num_tokens_per_rdma_rank": None}, **top), ValueError, op,
         "num_tokens_per_rdma_rank must be given when handle is None"),
        (lambda: buf.dispatch(inp.x, **{**lay, "num_tokens_per_rdma_rank": lay["num_tokens_per_rank"][:1]}, **top),
         ValueError, op, "num_tokens_per_rdma_rank must have shape [num_rdma_ranks] = [2]"),
        (lambda: buf.dispatch(inp.x, handle[:6]), ValueError, op, "handle must be the 10-tuple an internode dispatch returns"),
        (lambda: buf.dispatch(inp.x, handle[:6] + (handle[6].long(),) + handle[7:]), TypeError, op,
         "handle[6] (recv_gbl_rank_prefix_sum) must have dtype torch.int32"),
        (lambda: buf.combine(expected[0].float(), handle), TypeError, "Buffer.combine: ", "x must have dtype torch.bfloat16"),
        (lambda: buf.combine(expected[0], handle, bias=torch.zeros(inp.n, H + 8).bfloat16()), ValueError,
         "Buffer.combine: ", f"bias must have shape [num_tokens, hidden] = [*, {H}]"),
    ]
    for call, exc, name, words in cases:
        expect(call, exc, name, words)
        again = buf.combine(buf.dispatch(inp.x, **lay, **top)[0], handle, expected[2])
        assert torch.equal(again[0], combined[0])


def test_internode_rejects():
    run_ranks(_internode_cases, R)


# ---- low-latency mode ----------------------------------------------------------------------------
def _low_latency_cases(rank, world, group):
    from epcomm import Buffer
    from epcomm.ops import low_latency_layout as low_latency
    t, e, h = 8, E, 512
    rdma = Buffer.get_low_latency_rdma_size_hint(t, h, R, e)
    buf = Buffer(group, 0, rdma, low_latency_mode=True, enable_shrink=True)
    g = torch.Generator().manual_seed(rank)
    n = 5 + rank
    x = torch.randn(n, h, generator=g).bfloat16()
    topk_idx = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(n)])
    weights = torch.rand(n, K, generator=g)

    def dispatch(**changes):
        kwargs = dict(x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=t, num_experts=e, use_fp8=False)
        kwargs.update(changes)
        return buf.low_latency_dispatch(**kwargs)

    recv_x, count, handle, _, _ = dispatch()
    expected = buf.low_latency_combine(recv_x, topk_idx, weights, handle)[0]
    bad_idx = topk_idx.clone()
    bad_idx[0, 0] = e
    e_l = e // R
    too_wide = torch.full((n, low_latency.MAX_TOPK + 1), -1)
    op = "Buffer.low_latency_dispatch: "
    cases = [
        (lambda: dispatch(x=x.float()), TypeError, op, "x must have dtype torch.bfloat16"),
        (lambda: dispatch(x=x[:, ::2]), ValueError, op, "x must be contiguous"),
        (lambda: dispatch(num_max_dispatch_tokens_per_rank=4), ValueError, op, "x must have at most num_max_dispatch_tokens_per_rank (4) rows"),
        (lambda: dispatch(num_max_dispatch_tokens_per_rank=0), ValueError, op, "num_max_dispatch_tokens_per_rank must be >= 1"),
        (lambda: dispatch(num_max_dispatch_tokens_per_rank=1 << 16), ValueError, op, "need num_rdma_bytes >="),
        (lambda: dispatch(x=x[:, :100].contiguous(), topk_idx=topk_idx), ValueError, op, "hidden size must be a positive multiple of 8 with BF16"),
        (lambda: dispatch(x=x[:, :136].contiguous(), use_fp8=True), ValueError, op, "multiple of 128 with FP8"),
        (lambda: dispatch(x=x[:, :384].contiguous(), use_fp8=True, round_scale=True, use_ue8m0=True), ValueError, op,
         "multiple of 512 with UE8M0"),
        (lambda: dispatch(use_fp8=True, use_ue8m0=True), ValueError, op, "use_ue8m0=True needs round_scale=True"),
        (lambda: dispatch(use_fp8=1.0), TypeError, op, "use_fp8 must be a bool"),
        (lambda: dispatch(num_experts=5), ValueError, op, "num_experts must be divisible"),
        (lambda: dispatch(topk_idx=topk_idx[1:]), ValueError, op, f"topk_idx must have shape [num_tokens, num_topk] = [{n}, *]"),
        (lambda: dispatch(topk_idx=topk_idx.int()), TypeError, op, "topk_idx must have dtype torch.int64"),
        (lambda: dispatch(topk_idx=bad_idx), ValueError, op, "topk_idx values must lie in [-1, 4)"),
        (lambda: dispatch(topk_idx=too_wide), ValueError, op, f"1 to {low_latency.MAX_TOPK} columns"),
        (lambda: dispatch(cumulative_local_expert_recv_stats=torch.zeros(e_l, dtype=torch.int64)), TypeError, op,
         "cumulative_local_expert_recv_stats must have dtype torch.int32"),
        (lambda: dispatch(cumulative_local_expert_recv_stats=torch.zeros(e, dtype=torch.int32)), ValueError, op,
         f"cumulative_local_expert_recv_stats must have shape [num_local_experts] = [{e_l}]"),
        (lambda: dispatch(dispatch_wait_recv_cost_stats=torch.zeros(R, R, dtype=torch.int64)), ValueError, op,
         "dispatch_wait_recv_cost_stats must have shape [num_ranks] = [2]"),
        (lambda: dispatch(async_finish=True, return_recv_hook=True), ValueError, op,
         "return_recv_hook=True cannot be combined with async_finish=True"),
    ]
    combine_op = "Buffer.low_latency_combine: "
    src_info, layout_range = handle[0], handle[1]
    cases += [
        (lambda: buf.low_latency_combine(recv_x.float(), topk_idx, weights, handle), TypeError, combine_op, "x must have dtype torch.bfloat16"),
        (lambda: buf.low_latency_combine(recv_x[:1], topk_idx, weights, handle), ValueError, combine_op,
         f"x must have shape [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden of the handle] = [{e_l}, {R * t}, {h}]"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, handle[:4]), TypeError, combine_op, "handle must be the 5-tuple"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, (src_info.long(),) + handle[1:]), TypeError, combine_op,
         "handle[0] (src_info) must have dtype torch.int32"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, (src_info, layout_range[:, :1]) + handle[2:]), ValueError,
         combine_op, "handle[1] (layout_range) must have shape"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, handle[:2] + (t, h, 6)), ValueError, combine_op,
         "handle[0] (src_info) must have shape"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights[:, :1].contiguous(), handle), ValueError, combine_op,
         f"topk_weights must have shape [num_tokens, num_topk] = [{n}, {K}]"),
        (lambda: buf.low_latency_combine(recv_x, torch.full((t + 1, K), -1), torch.rand(t + 1, K), handle), ValueError,
         combine_op, f"topk_idx must have at most num_max_dispatch_tokens_per_rank ({t}) rows"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, handle, out=torch.empty(n, h)), TypeError, combine_op,
         "out must have dtype torch.bfloat16"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, handle, out=torch.empty(n + 1, h).bfloat16()), ValueError,
         combine_op, f"out must have shape [num_tokens, hidden] = [{n}, {h}]"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, handle, combine_wait_recv_cost_stats=torch.zeros(R)),
         TypeError, combine_op, "combine_wait_recv_cost_stats must have dtype torch.int64"),
        (lambda: buf.low_latency_combine(recv_x, topk_idx, weights, handle, async_finish=True, return_recv_hook=True),
         ValueError, combine_op, "cannot be combined with async_finish"),
        (lambda: buf.get_next_low_latency_combine_buffer(handle[:2]), TypeError, "Buffer.get_next_low_latency_combine_buffer: ",
         "handle must be the 5-tuple"),
        (lambda: buf.clean_low_latency_buffer(t, 100, e), ValueError, "Buffer.clean_low_latency_buffer: ", "hidden must be a multiple of 8"),
        (lambda: buf.clean_low_latency_buffer(1 << 16, h, e), ValueError, "Buffer.clean_low_latency_buffer: ", "need num_rdma_bytes"),
        (lambda: buf.low_latency_update_mask_buffer(R), ValueError, "Buffer.low_latency_update_mask_buffer: ",
         "rank_to_mask must be a rank in [0, 2)"),
        (lambda: buf.low_latency_update_mask_buffer(0, mask="yes"), TypeError, "Buffer.low_latency_update_mask_buffer: ", "mask must be a bool"),
        (lambda: buf.low_latency_query_mask_buffer(torch.zeros(R)), TypeError, "Buffer.low_latency_query_mask_buffer: ",
         "mask_status must have dtype torch.int32"),
    ]
    for call, exc, name, words in cases:
        expect(call, exc, name, words)
        recv_x, count, handle, _, _ = dispatch()
        assert torch.equal(buf.low_latency_combine(recv_x, topk_idx, weights, handle)[0], expected)
    status = torch.ones(R, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * R
    no_shrink = Buffer(group, 0, buf.num_rdma_bytes, low_latency_mode=True)
    expect(lambda: no_shrink.low_latency_clean_mask_buffer(), ValueError, "Buffer.low_latency_clean_mask_buffer: ",
           "enable_shrink=True")


def test_low_latency_rejects():
    run_ranks(_low_latency_cases, R)
