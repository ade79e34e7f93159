"""The autograd scenarios both autograd test files run (tests/cpu/test_autograd.py on the CPU
backend, tests/gpu/test_autograd_gpu.py on GPUs): exact analytic gradients from the routing
(inputs and upstream gradients are small integers, so every sum is exact and compared bit for bit),
forward outputs equal to the Buffer's own calls. See tests/cpu/test_autograd.py for the method."""
import pytest
import torch
import torch.distributed as dist


HIDDEN, TOPK, LOCAL_EXPERTS = 128, 3, 3   # HIDDEN: one FP8 scale block (the GPU test also runs others);
# LOCAL_EXPERTS >= TOPK so that one rank alone holds enough experts for every top-k slot


def _ints(kind: str, rank: int, shape, low=-3, high=4) -> torch.Tensor:
    """Small integers, the same on every rank for (kind, rank, shape)."""
    seed = sum(map(ord, kind)) * 1000 + rank
    return torch.randint(low, high, tuple(shape), generator=torch.Generator().manual_seed(seed)).float()


def default_tokens(rank, world):
    """Tokens per rank: all different, and none on the last rank when there are more than 2."""
    return 0 if world > 2 and rank == world - 1 else 5 + 4 * rank


def _inputs(rank, num_tokens, hidden, num_experts):
    """x in [-3, 3], weights in [1, 3], 25% of the top-k entries -1, token 0 goes nowhere."""
    n = num_tokens
    gen = torch.Generator().manual_seed(7 + rank)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:TOPK] for _ in range(n)]) \
        if n else torch.zeros(0, TOPK, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=gen) < 0.25] = -1
    if n:
        idx[0] = -1
    return _ints("x", rank, (n, hidden)).bfloat16(), idx, _ints("w", rank, (n, TOPK), 1, 4)


class World:
    """All ranks' inputs (CPU) and, per rank, its received rows [(source rank, token)] in dispatch
    order; x, idx, w are this rank's inputs on `device`, the analytic gradients come back on the CPU."""

    def __init__(self, rank, world, device=torch.device("cpu"), hidden=HIDDEN, tokens=default_tokens):
        self.rank, self.world, self.device, self.hidden = rank, world, device, hidden
        self.num_experts = LOCAL_EXPERTS * world
        x, idx, w = _inputs(rank, tokens(rank, world), hidden, self.num_experts)
        gathered = [None] * world
        dist.all_gather_object(gathered, (x, idx, w))
        self.xs, self.idxs, self.ws = zip(*gathered)
        self.x, self.idx, self.w = x.to(device), idx.to(device), w.to(device)
        self.rows = [[(s, n) for s in range(world) for n in range(len(self.xs[s]))
                      if any(int(g) >= 0 and int(g) // LOCAL_EXPERTS == r for g in self.idxs[s][n])]
                     for r in range(world)]

    def expert_rank(self, s, n, k):
        g = int(self.idxs[s][n, k])
        return None if g < 0 else g // LOCAL_EXPERTS

    def layout(self, buf):
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(self.idx, self.num_experts)
        return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=self.idx)

    def dispatch_grads(self, gx_kind, gw_kind):
        """Analytic grad of x and topk_weights on this rank when rank r's recv_x / recv_topk_weights
        get upstream gradients _ints(gx_kind, r) / _ints(gw_kind, r)."""
        gx = torch.zeros(len(self.x), self.hidden)
        gw = torch.zeros(len(self.x), TOPK)
        for r in range(self.world):
            up_x = _ints(gx_kind, r, (len(self.rows[r]), self.hidden))
            up_w = _ints(gw_kind, r, (len(self.rows[r]), TOPK))
            for row, (s, n) in enumerate(self.rows[r]):
                if s != self.rank:
                    continue
                gx[n] += up_x[row]
                for k in range(TOPK):
                    if self.expert_rank(s, n, k) == r:
                        gw[n, k] = up_w[row, k]
        return gx.bfloat16(), gw

    def combine_grads(self, gc_kind, gcw_kind):
        """Analytic grad of combine's x [M, H] and topk_weights [M, K] on this rank: each row gets the
        upstream gradient of its token on the source rank."""
        mine = self.rows[self.rank]
        up = {s: (_ints(gc_kind, s, (len(self.xs[s]), self.hidden)), _ints(gcw_kind, s, (len(self.xs[s]), TOPK)))
              for s in range(self.world)}
        gx = torch.stack([up[s][0][n] for s, n in mine]) if mine else torch.zeros(0, self.hidden)
        gw = torch.stack([up[s][1][n] for s, n in mine]) if mine else torch.zeros(0, TOPK)
        return gx.bfloat16(), gw


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _up(w, kind, shape, low=-3, high=4):
    """This rank's upstream gradient (or test input) _ints(kind, rank, shape) on w's device."""
    return _ints(kind, w.rank, shape, low, high).to(w.device)


def _equal(name, got, want):
    assert got is not None, f"{name}: no gradient"
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{name}: max |diff| {(got.float() - want.float()).abs().max()} over {tuple(want.shape)}"


# ---- scenarios (each collective: every rank runs it) --------------------------------------------
def dispatch_grads(w, buf, ep):
    layout = w.layout(buf)
    x, weights = _leaf(w.x), _leaf(w.w)
    recv_x, recv_idx, recv_w, counts, handle, _ = ep.dispatch(buf, x, topk_weights=weights, **layout)
    plain = buf.dispatch(w.x, topk_weights=w.w, **layout)
    assert recv_x.requires_grad and recv_w.requires_grad
    assert torch.equal(recv_x, plain[0]) and torch.equal(recv_idx, plain[1]) and torch.equal(recv_w, plain[2])
    assert counts == plain[3] and len(handle) == len(plain[4])
    m = recv_x.shape[0]
    assert m == len(w.rows[w.rank])
    loss = (recv_x.float() * _up(w, "gx", (m, w.hidden))).sum() + (recv_w * _up(w, "gw", (m, TOPK))).sum()
    loss.backward()
    want_x, want_w = w.dispatch_grads("gx", "gw")
    _equal("grad x", x.grad, want_x)
    _equal("grad topk_weights", weights.grad, want_w)
    return handle


def weights_only(w, buf, ep):
    """x needs no gradient: the backward combine carries the weights alone."""
    layout = w.layout(buf)
    weights = _leaf(w.w)
    recv_x, _, recv_w, _, _, _ = ep.dispatch(buf, w.x, topk_weights=weights, **layout)
    assert not recv_x.requires_grad and recv_w.requires_grad
    (recv_w * _up(w, "gw", recv_w.shape)).sum().backward()
    _equal("grad topk_weights", weights.grad, w.dispatch_grads("gx", "gw")[1])


def plain_routing_and_padding(w, buf, ep):
    """Dispatch without top-k (one differentiable output), and with num_worst_tokens: the padding
    rows' upstream gradient goes nowhere."""
    layout = w.layout(buf)
    for worst in (0, sum(len(t) for t in w.xs) + 2):
        x = _leaf(w.x)
        kw = dict(layout, topk_weights=w.w) if worst else dict(layout, topk_idx=None)
        recv_x, recv_idx, recv_w, _, _, _ = ep.dispatch(buf, x, num_worst_tokens=worst, **kw)
        assert (recv_idx is None and recv_w is None) == (not worst)
        assert recv_x.requires_grad and (recv_w is None or not recv_w.requires_grad)
        m = len(w.rows[w.rank])
        up = _up(w, "gx", (m, w.hidden))
        if worst:
            assert recv_x.shape[0] == worst
            up = torch.cat([up, torch.full((worst - m, w.hidden), 5.0, device=w.device)])
        (recv_x.float() * up).sum().backward()
        _equal(f"grad x (num_worst_tokens={worst})", x.grad, w.dispatch_grads("gx", "gw")[0])


def combine_grads(w, buf, ep, handle, bias_pair):
    m, n = len(w.rows[w.rank]), len(w.x)
    y, weights = _leaf(_up(w, "y", (m, w.hidden)).bfloat16()), _leaf(_up(w, "yw", (m, TOPK)))
    b0 = _leaf(_up(w, "b", (n, w.hidden)).bfloat16())
    bias = (b0, None) if bias_pair else b0
    only_weights = ep.combine(buf, y.detach(), handle, topk_weights=weights)
    assert not only_weights[0].requires_grad and only_weights[1].requires_grad
    combined, combined_w, _ = ep.combine(buf, y, handle, topk_weights=weights, bias=bias)
    plain = buf.combine(y.detach(), handle, topk_weights=weights.detach(), bias=b0.detach())
    assert torch.equal(combined, plain[0]) and torch.equal(combined_w, plain[1])
    up_x, up_w = _up(w, "gc", (n, w.hidden)), _up(w, "gcw", (n, TOPK))
    ((combined.float() * up_x).sum() + (combined_w * up_w).sum()).backward()
    want_x, want_w = w.combine_grads("gc", "gcw")
    _equal("grad of combine's x", y.grad, want_x)
    _equal("grad of combine's topk_weights", weights.grad, want_w)
    _equal("grad of bias", b0.grad, up_x.bfloat16())


def cached_dispatch(w, buf, ep, handle):
    x = _leaf(w.x)
    recv_x, none_idx, _, _, none_handle, _ = ep.dispatch(buf, x, handle=handle)
    assert none_idx is None and none_handle is None and recv_x.requires_grad
    (recv_x.float() * _up(w, "gx", recv_x.shape)).sum().backward()
    _equal("grad x (cached dispatch)", x.grad, w.dispatch_grads("gx", "gw")[0])


def moe_chain(w, buf, ep, async_finish):
    """dispatch -> expert (rows times the sum of their local weights) -> combine, against the chain
    rule by hand: combined[n] = x[n] * sum_{k valid} w[n, k], so grad x[n] = g[n] * sum_k w[n, k] and
    grad w[n, k] = <g[n], x[n]> for valid k (0 for -1 entries: those weights never leave the source).
    async_finish: both forward calls on the comm stream, the caller waiting on their events."""
    layout = w.layout(buf)
    x, weights = _leaf(w.x), _leaf(w.w)
    previous = buf.capture() if async_finish else None
    recv_x, _, recv_w, _, handle, event = ep.dispatch(buf, x, topk_weights=weights, previous_event=previous,
                                                      async_finish=async_finish, **layout)
    event.current_stream_wait()
    expert_out = (recv_x.float() * recv_w.sum(1, keepdim=True)).bfloat16()
    combined, _, event = ep.combine(buf, expert_out, handle, async_finish=async_finish)
    event.current_stream_wait()
    up = _up(w, "g", combined.shape)
    (combined.float() * up).sum().backward()
    valid = (w.idx >= 0).float()
    _equal("chain grad x", x.grad, (up * (w.w * valid).sum(1, keepdim=True)).bfloat16())
    _equal("chain grad topk_weights", weights.grad, (up * w.x.float()).sum(1, keepdim=True) * valid)


def fp8_rows(w, buf, ep):
    """FP8 rows arrive without gradient; the weights' gradient still flows; a pair that requires
    grad is refused on every rank before any exchange."""
    layout = w.layout(buf)
    x8 = (w.x.float() / 4).to(torch.float8_e4m3fn)
    scales = torch.ones(len(w.x), w.hidden // 128, device=w.device)
    weights = _leaf(w.w)
    (recv8, recv_scales), _, recv_w, _, _, _ = ep.dispatch(buf, (x8, scales), topk_weights=weights, **layout)
    assert not recv8.requires_grad and not recv_scales.requires_grad and recv_w.requires_grad
    (recv_w * _up(w, "gw", recv_w.shape)).sum().backward()
    _equal("grad topk_weights (FP8 rows)", weights.grad, w.dispatch_grads("gx", "gw")[1])
    with pytest.raises(ValueError, match="FP8 pair that requires grad"):
        ep.dispatch(buf, (x8, scales.requires_grad_(True)), topk_weights=weights, **layout)


def no_grad_is_the_buffer_call(w, buf, ep):
    layout = w.layout(buf)
    with torch.no_grad():
        out = ep.dispatch(buf, _leaf(w.x), topk_weights=_leaf(w.w), **layout)
    assert not out[0].requires_grad and torch.equal(out[0], buf.dispatch(w.x, topk_weights=w.w, **layout)[0])


def normal_mode_scenarios(w, buf, ep, check=lambda fn: fn()):
    """check(fn) runs one scenario (the GPU test makes every rank fail together there)."""
    handles = []
    check(lambda: handles.append(dispatch_grads(w, buf, ep)))
    check(lambda: weights_only(w, buf, ep))
    check(lambda: plain_routing_and_padding(w, buf, ep))
    for bias_pair in (False, True):
        check(lambda: combine_grads(w, buf, ep, handles[0], bias_pair))
    check(lambda: cached_dispatch(w, buf, ep, handles[0]))
    for async_finish in (False, True):
        check(lambda: moe_chain(w, buf, ep, async_finish))
    if w.hidden % 128 == 0:
        check(lambda: fp8_rows(w, buf, ep))
    check(lambda: no_grad_is_the_buffer_call(w, buf, ep))


def low_latency_inference_only(w, buf, ep, max_tokens):
    """Inputs requiring grad are refused before any launch; under no_grad the pair gives what the
    Buffer's own pair gives (pairs back to back, as a decode loop issues them)."""
    def received(recv_x, count):
        return count.clone(), torch.cat([recv_x[e, :int(count[e])] for e in range(LOCAL_EXPERTS)])

    with pytest.raises(RuntimeError, match="x requires grad"):
        ep.low_latency_dispatch(buf, _leaf(w.x), w.idx, max_tokens, w.num_experts)
    with torch.no_grad():
        recv_x, count, handle, _, _ = ep.low_latency_dispatch(buf, _leaf(w.x), w.idx, max_tokens, w.num_experts,
                                                              use_fp8=False)
    got = received(recv_x, count)
    with pytest.raises(RuntimeError, match="topk_weights requires grad"):
        ep.low_latency_combine(buf, recv_x, w.idx, _leaf(w.w), handle)
    with torch.no_grad():   # combine a copy: recv_x is a view of the receive buffer
        got += (ep.low_latency_combine(buf, recv_x.clone(), w.idx, _leaf(w.w), handle)[0],)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(w.x, w.idx, max_tokens, w.num_experts, use_fp8=False)
    want = received(recv_x, count) + (buf.low_latency_combine(recv_x.clone(), w.idx, w.w, handle)[0],)
    for name, a, b in zip(("recv_count", "received rows", "combined_x"), got, want):
        assert torch.equal(a, b), name
