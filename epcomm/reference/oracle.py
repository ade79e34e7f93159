"""Reference semantics of every epcomm operation, as plain single-process functions.

Each function takes the GLOBAL inputs (lists indexed by rank) and returns what one rank must get.
They are the definition the GPU kernels are tested against, and the CPU backend
(`epcomm.reference.backend`) computes its results with them, so both share one definition.
Written for obviousness, not speed. All tensors are CPU tensors.

Definitions fixed here (where DeepEP leaves room):
  * received rows of normal dispatch are grouped by source rank ascending, source token order within;
  * internode normal combine (num_local_ranks L < R) sums per node: a partial of the node's ranks
    ascending (from 0), then bias0 + bias1 + the partials of the nodes the token reached, ascending;
  * low-latency rows of one expert: sources ascending, each source's tokens ascending (a token that
    names the same expert in several top-k slots is sent once per slot);
  * rows beyond the valid ones are zero (data, scales), -1 (source indices) and -1 / 0 (top-k);
  * FP8 cast as in DeepEP's kernels: amax = max(|x| over 128 channels, fl32(1e-4)); plain:
    scale_inv = amax * fl32(1/448), values x * fl32(448/amax); round_scale: e = ceil(log2(amax *
    fl32(1/448))) from the float's bits, scale_inv = 2^e, values x * 2^-e; then saturate to +-448
    and round to nearest even e4m3. The stored scale is scale_inv (dequant = fp8 * scale_inv).
  * UE8M0: the byte is the biased exponent of scale_inv (bits 23..30); scale group j goes to byte
    j % 4 (little-endian) of int32 word j // 4; unused bytes of the last word are 0.
  * combine sums in fp32: bias0 + bias1 first, then ranks ascending (normal). Low latency: per
    expert rank d a partial sum over the top-k slots whose expert lives on d, k ascending (w * x
    per term, from +0), then the partials of d ascending (from +0), then one rounding to bf16.
  * every NaN rounds to the one bf16 pattern BF16_NAN_BITS (0x7fff), whatever its sign or payload;
  * rank masks (enable_shrink): rank_masks[r] is rank r's mask buffer [R] (nonzero = masked); the
    link s <-> d is dead when either masks the other; a dead link carries no tokens either way.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

# The reference computes on the host whatever torch's default device is.
CPU = torch.device("cpu")
FP8_MAX = 448.0
CHANNELS_PER_SCALE = 128
_FP8_MARGIN = torch.tensor(1e-4, dtype=torch.float32, device=CPU)    # kernels: fmaxf(1e-4f, |x|)
_FP8_MAX_F32 = torch.tensor(FP8_MAX, dtype=torch.float32, device=CPU)
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=CPU)  # fl32(1/448)


# The bf16 NaN of every combine: what torch's .to(torch.bfloat16) gives on a CUDA device (CUDA's
# canonical NaN) and cuda_src/common/bf16.cuh kBf16NaN. torch on the CPU gives other bits for the
# same NaN (0xffff from its vectorised path, 0x7fc0 from its scalar one), so to_bf16 sets them.
BF16_NAN_BITS = 0x7FFF


def to_bf16(acc: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest even, every NaN as BF16_NAN_BITS."""
    out = acc.to(torch.bfloat16)
    nan = acc.isnan()
    if bool(nan.any()):
        out.view(torch.int16)[nan] = BF16_NAN_BITS
    return out


def _local_experts(num_experts: int, num_ranks: int) -> int:
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks "
                         f"({num_ranks})")
    return num_experts // num_ranks


# ---------------------------------------------------------------------------------------------
# normal mode
# ---------------------------------------------------------------------------------------------
def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_local_ranks: int):
    """-> (num_tokens_per_rank [R] i32, num_tokens_per_rdma_rank [R/L] i32 or None when
    num_ranks == num_local_ranks, num_tokens_per_expert [E] i32, is_token_in_rank [N,R] bool).
    A token counts once per rank and once per node; per expert it counts once per top-k slot."""
    num_local_experts = _local_experts(num_experts, num_ranks)
    if num_ranks % num_local_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of num_local_ranks "
                         f"({num_local_ranks})")
    experts = topk_idx.long()
    if experts.numel() and (experts.min() < -1 or experts.max() >= num_experts):
        raise ValueError(f"topk_idx values must lie in [-1, {num_experts})")
    num_tokens = experts.shape[0]
    valid = experts >= 0
    num_tokens_per_expert = torch.bincount(experts[valid], minlength=num_experts).int()
    is_token_in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=CPU)
    for k in range(experts.shape[1]):
        tokens = valid[:, k].nonzero().flatten()
        is_token_in_rank[tokens, experts[tokens, k] // num_local_experts] = True
    num_tokens_per_rank = is_token_in_rank.sum(0).int()
    num_tokens_per_rdma_rank = None
    if num_local_ranks != num_ranks:
        num_nodes = num_ranks // num_local_ranks
        in_node = is_token_in_rank.view(num_tokens, num_nodes, num_local_ranks).any(-1)
        num_tokens_per_rdma_rank = in_node.sum(0).int()
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank


def rank_prefix_matrix(is_token_in_ranks: Sequence[torch.Tensor]) -> torch.Tensor:
    """[R, R] int32: [i][j] = tokens sent to rank j by ranks 0..i (identical on every rank)."""
    sent = torch.stack([t.sum(0, dtype=torch.int64) for t in is_token_in_ranks])
    return sent.cumsum(0).int()


def dispatch(xs, x_scales, topk_idxs, topk_weights, is_token_in_ranks, num_experts, rank,
             expert_alignment=1, num_worst_tokens=0, num_tokens_per_experts=None):
    """What `rank` receives from a normal-mode dispatch.

    xs: list over source ranks of [N_s, H] (bf16 or fp8); x_scales: list of [N_s, S] or None;
    topk_idxs / topk_weights: lists of [N_s, K] or None; is_token_in_ranks: list of [N_s, R] bool.
    num_worst_tokens > 0 pads the output to that many rows (padding: zero data and scales, top-k
    -1 / 0, recv_src_idx -1, empty per-expert list). num_tokens_per_experts (list of [E]) gives
    the per-expert counts as DeepEP does (the layout tensors, summed over sources); without it they
    are counted from the received top-k; without either the list is empty. num_experts may be None
    when there is no top-k.
    -> dict(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
            num_recv_tokens_per_expert_list, recv_src_idx [M] i32, rank_prefix_matrix [R,R] i32)
    """
    num_ranks = len(xs)
    selected = [t[:, rank].nonzero().flatten() for t in is_token_in_ranks]
    num_recv = sum(len(s) for s in selected)
    padded = max(num_recv, num_worst_tokens)
    if num_worst_tokens and num_recv > num_worst_tokens:
        raise ValueError(f"rank {rank} receives {num_recv} tokens, more than num_worst_tokens "
                         f"({num_worst_tokens})")

    def gather(tensors, fill=0):
        """Selected rows of every source, in order, padded to `padded` rows with `fill`."""
        rows = torch.cat([t[s] for t, s in zip(tensors, selected)])
        out = torch.zeros((padded, *rows.shape[1:]), dtype=rows.dtype, device=CPU)
        if fill:
            out.fill_(fill)
        out[:num_recv] = rows
        return out

    result = dict(recv_x=gather(xs), recv_x_scales=None, recv_topk_idx=None,
                  recv_topk_weights=None, num_recv_tokens_per_expert_list=[],
                  recv_src_idx=gather([torch.arange(len(t), dtype=torch.int32, device=CPU)
                                      for t in is_token_in_ranks], fill=-1),
                  rank_prefix_matrix=rank_prefix_matrix(is_token_in_ranks))
    if x_scales is not None:
        result["recv_x_scales"] = gather(x_scales)
    if topk_idxs is not None or num_tokens_per_experts is not None:
        num_local_experts = _local_experts(num_experts, num_ranks)
        begin = rank * num_local_experts
    if topk_idxs is not None:
        experts = gather([t.long() for t in topk_idxs], fill=-1)
        is_local = (experts >= begin) & (experts < begin + num_local_experts)
        local = torch.where(is_local, experts - begin, -1)
        result["recv_topk_idx"] = local.to(topk_idxs[0].dtype)
        if topk_weights is not None:
            weights = gather([w.float() for w in topk_weights])
            result["recv_topk_weights"] = torch.where(is_local, weights, 0.0)
    if num_worst_tokens == 0:
        counts = None
        if num_tokens_per_experts is not None:
            counts = sum(t.long()[begin:begin + num_local_experts] for t in num_tokens_per_experts)
            counts = counts.tolist()
        elif topk_idxs is not None:
            local = result["recv_topk_idx"].long()
            counts = [int((local == e).sum()) for e in range(num_local_experts)]
        if counts is not None:
            align = expert_alignment
            result["num_recv_tokens_per_expert_list"] = [(c + align - 1) // align * align
                                                         for c in counts]
    return result


def combine(xs, is_token_in_ranks, rank, topk_weights=None, bias=(None, None), num_local_ranks=1):
    """What `rank` gets back from a normal-mode combine.

    xs: list over ranks r of rank r's combine input [M_r, H] in its dispatch row order (rows past
    the received ones are ignored); is_token_in_ranks: the dispatch routing of every rank;
    topk_weights: list over r of [M_r, K] or None; bias: a [N, H] tensor or a 2-tuple of them.
    Order of the fp32 additions: bias0 + bias1, then per node of `num_local_ranks` consecutive
    ranks (nodes ascending) the node's partial sum (from 0, its ranks ascending), added for the
    tokens that reached the node; with 1 (intranode) that is ranks ascending, one by one.
    -> (combined_x [N, H] bf16 = unweighted fp32 sum + bias, combined_topk_weights [N, K] f32 or
    None = sum of the returned weights, in the same order)."""
    if bias is None or isinstance(bias, torch.Tensor):
        bias = (bias, None)
    mine = is_token_in_ranks[rank]
    num_tokens, hidden = mine.shape[0], xs[rank].shape[1]
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=CPU)
    for b in bias:
        if b is not None:
            acc += b.float()
    weights = None
    if topk_weights is not None:
        weights = torch.zeros(num_tokens, topk_weights[rank].shape[1], dtype=torch.float32,
                              device=CPU)
    for first in range(0, len(xs), num_local_ranks):
        node_ranks = range(first, first + num_local_ranks)
        partial = torch.zeros_like(acc)
        partial_weights = None if weights is None else torch.zeros_like(weights)
        for r in node_ranks:
            first_row = sum(int(is_token_in_ranks[s][:, r].sum()) for s in range(rank))
            tokens = mine[:, r].nonzero().flatten()
            rows = first_row + torch.arange(len(tokens), dtype=torch.int64, device=CPU)
            partial[tokens] += xs[r][rows].float()
            if weights is not None:
                partial_weights[tokens] += topk_weights[r][rows].float()
        reached = mine[:, first:first + num_local_ranks].any(1)
        acc[reached] += partial[reached]
        if weights is not None:
            weights[reached] += partial_weights[reached]
    return to_bf16(acc), weights


# ---------------------------------------------------------------------------------------------
# FP8 (e4m3, one scale per token per 128 channels)
# ---------------------------------------------------------------------------------------------
def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    return ((exponent.int() + 127) << 23).view(torch.float32)


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) of positive normal fp32 values, exactly, from the bits."""
    bits = x.view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).int()


def fp8_scales(amax: torch.Tensor, round_scale: bool):
    """amax (already floored at 1e-4) -> (scale applied to x, scale_inv stored) as fp32."""
    if round_scale:
        exponent = _ceil_log2(amax * _FP8_MAX_INV)
        return _pow2(-exponent), _pow2(exponent)
    return _FP8_MAX_F32 / amax, amax * _FP8_MAX_INV


def fp8_cast(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False):
    """x [N, H] (bf16) -> (e4m3 [N, H], scales [N, H/128] f32, or with use_ue8m0 the packed
    int32 [N, ceil(H/512)])."""
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0 needs round_scale=True (UE8M0 holds powers of two only)")
    num_tokens, hidden = x.shape
    if hidden % CHANNELS_PER_SCALE:
        raise ValueError(f"FP8 cast needs hidden % 128 == 0, got hidden={hidden}")
    groups = x.float().reshape(num_tokens, hidden // CHANNELS_PER_SCALE, CHANNELS_PER_SCALE)
    amax = torch.maximum(groups.abs().amax(-1), _FP8_MARGIN)
    scale, scale_inv = fp8_scales(amax, round_scale)
    values = (groups * scale[..., None]).clamp(-FP8_MAX, FP8_MAX)   # clamp = SATFINITE
    values = values.to(torch.float8_e4m3fn).reshape(num_tokens, hidden)
    return values, (pack_ue8m0(scale_inv) if use_ue8m0 else scale_inv)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """f32 [..., S] power-of-two scales -> int32 [..., ceil(S/4)]: group j's biased exponent in
    byte j % 4 (little-endian) of word j // 4 (on the scales' device)."""
    exponents = (scales.float().view(torch.int32) >> 23).long() & 0xFF
    num_scales = scales.shape[-1]
    pad = (-num_scales) % 4
    exponents = torch.nn.functional.pad(exponents, (0, pad)).reshape(
        *scales.shape[:-1], (num_scales + pad) // 4, 4)
    shifts = torch.arange(0, 32, 8, device=scales.device)
    words = (exponents << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)   # reinterpret as signed
    return words.int()


def unpack_ue8m0(packed: torch.Tensor, num_scales: int) -> torch.Tensor:
    """int32 [..., W] -> f32 [..., num_scales] (2^(byte - 127) per group)."""
    words = packed.long() & 0xFFFFFFFF
    exponents = torch.stack([(words[..., j // 4] >> (8 * (j % 4))) & 0xFF
                             for j in range(num_scales)], -1)
    return (exponents.int() << 23).view(torch.float32)


def fp8_dequant(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., H] and f32 scales [..., H/128] -> f32 [..., H]."""
    shape = values.shape
    groups = values.float().reshape(*shape[:-1], shape[-1] // CHANNELS_PER_SCALE,
                                    CHANNELS_PER_SCALE)
    return (groups * scales.float()[..., None]).reshape(shape)


# ---------------------------------------------------------------------------------------------
# low-latency mode
# ---------------------------------------------------------------------------------------------
def link_alive(rank_masks: Optional[Sequence[torch.Tensor]], num_ranks: int) -> torch.Tensor:
    """[R, R] bool: can s and d exchange tokens (neither masks the other)?"""
    if rank_masks is None:
        return torch.ones(num_ranks, num_ranks, dtype=torch.bool, device=CPU)
    masked = torch.stack([m.flatten() != 0 for m in rank_masks])
    return ~(masked | masked.T)


def low_latency_dispatch(xs, topk_idxs, num_max_dispatch_tokens_per_rank, num_experts, rank,
                         use_fp8=True, round_scale=False, use_ue8m0=False, rank_masks=None):
    """What `rank` receives from a low-latency dispatch (xs: list over ranks of [N_s, H] bf16,
    topk_idxs: list of [N_s, K]). -> dict(recv_x [E_l, R*T, H] (fp8 or bf16), recv_x_scales
    (f32 [E_l, R*T, H/128] or int32 [E_l, R*T, ceil(H/512)], column-major in the last two dims;
    None without FP8), recv_count [E_l] i32, src_info [E_l, R*T] i32, layout_range [E_l, R] i64 =
    (begin << 32) | count)."""
    num_ranks, tokens_per_rank = len(xs), num_max_dispatch_tokens_per_rank
    num_local_experts = _local_experts(num_experts, num_ranks)
    hidden = xs[rank].shape[1]
    slots = num_ranks * tokens_per_rank
    alive = link_alive(rank_masks, num_ranks)
    if use_fp8:
        casts = [fp8_cast(x, round_scale, use_ue8m0) for x in xs]
        recv_x = torch.zeros(num_local_experts, slots, hidden, dtype=torch.float8_e4m3fn,
                             device=CPU)
        scale_cols = casts[rank][1].shape[1]
        scale_dtype = torch.int32 if use_ue8m0 else torch.float32
        recv_x_scales = torch.zeros(num_local_experts, scale_cols, slots,
                                    dtype=scale_dtype, device=CPU).transpose(1, 2)
    else:
        casts = [(x, None) for x in xs]
        recv_x = torch.zeros(num_local_experts, slots, hidden, dtype=torch.bfloat16, device=CPU)
        recv_x_scales = None
    src_info = torch.full((num_local_experts, slots), -1, dtype=torch.int32, device=CPU)
    layout_range = torch.zeros(num_local_experts, num_ranks, dtype=torch.int64, device=CPU)
    recv_count = torch.zeros(num_local_experts, dtype=torch.int32, device=CPU)
    for e in range(num_local_experts):
        expert = rank * num_local_experts + e
        begin = 0
        for s in range(num_ranks):
            tokens = torch.zeros(0, dtype=torch.int64, device=CPU)
            if alive[s, rank]:
                hits = (topk_idxs[s].long() == expert).sum(1)   # once per top-k slot
                tokens = torch.repeat_interleave(
                    torch.arange(len(hits), dtype=torch.int64, device=CPU), hits)
            count = len(tokens)
            if count > tokens_per_rank:
                raise ValueError(f"rank {s} sends {count} tokens to expert {expert}, more than "
                                 f"num_max_dispatch_tokens_per_rank ({tokens_per_rank})")
            values, scales = casts[s]
            recv_x[e, begin:begin + count] = values[tokens]
            if scales is not None:
                recv_x_scales[e, begin:begin + count] = scales[tokens]
            src_info[e, begin:begin + count] = tokens.int()
            layout_range[e, s] = (begin << 32) | count
            begin += count
        recv_count[e] = begin
    return dict(recv_x=recv_x, recv_x_scales=recv_x_scales, recv_count=recv_count,
                src_info=src_info, layout_range=layout_range)


def ll_valid_rows(expert_output, src_info, layout_range):
    """The valid rows of one rank's packed [E_l, R*T, H] buffer -> (meta [V, 3] i64 = (local
    expert, source rank, source token index), data [V, H])."""
    metas, rows = [], []
    for e in range(layout_range.shape[0]):
        for s in range(layout_range.shape[1]):
            packed = int(layout_range[e, s])
            begin, count = packed >> 32, packed & 0xFFFFFFFF
            index = torch.arange(begin, begin + count, dtype=torch.int64, device=CPU)
            metas.append(torch.stack([torch.full((count,), e, dtype=torch.int64, device=CPU),
                                      torch.full((count,), s, dtype=torch.int64, device=CPU),
                                      src_info[e, index].long()], 1))
            rows.append(expert_output[e, index])
    return torch.cat(metas), torch.cat(rows)


def ll_combine_rows(rows, topk_idx, topk_weights, rank, num_experts, rank_masks=None):
    """Combine from the valid rows of every rank: rows is a list over expert ranks d of
    ll_valid_rows(...) of d's combine input (rows of other sources are ignored).
    -> [N, H] bf16 = sum_k w[n,k] * row(expert topk_idx[n,k], token n) in fp32, summed as the
    GPU does: per expert rank d the partial sum over the slots whose expert is on d, k ascending,
    then the partials, d ascending (the expert rank sums its rows and sends one fp32 partial per
    token). -1 entries, missing rows and dead links contribute nothing."""
    num_ranks = len(rows)
    num_local_experts = _local_experts(num_experts, num_ranks)
    num_tokens, hidden = topk_idx.shape[0], rows[rank][1].shape[1]
    alive = link_alive(rank_masks, num_ranks)[rank]
    # slot[g, n]: index into `table` of expert g's row for token n; row 0 of table is zeros.
    table = [torch.zeros(1, hidden, dtype=torch.float32, device=CPU)]
    slot = torch.zeros(num_experts, num_tokens, dtype=torch.int64, device=CPU)
    offset = 1
    for d, (meta, data) in enumerate(rows):
        mine = meta[:, 1] == rank
        meta, data = meta[mine], data[mine]
        if len(meta) and int(meta[:, 2].max()) >= num_tokens:
            raise ValueError(f"low_latency_combine: topk_idx has {num_tokens} rows, but rank {d} holds "
                             f"rows of token {int(meta[:, 2].max())} of rank {rank}: pass the topk_idx "
                             f"(all its rows) of the dispatch whose handle this is")
        slot[d * num_local_experts + meta[:, 0], meta[:, 2]] = offset + torch.arange(
            len(meta), dtype=torch.int64, device=CPU)
        table.append(data.float())
        offset += len(meta)
    table = torch.cat(table)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=CPU)
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=CPU)
    for d in range(num_ranks):
        partial = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=CPU)
        for k in range(topk_idx.shape[1]):
            experts = topk_idx[:, k].long()
            safe = experts.clamp_min(0)
            used = (experts >= 0) & (safe // num_local_experts == d) & alive[d]
            term = table[slot[safe, tokens]] * topk_weights[:, k].float()[:, None]
            partial += torch.where(used[:, None], term, 0.0)
        acc += partial
    return to_bf16(acc)


def low_latency_combine(expert_outputs, handles, topk_idx, topk_weights, rank, rank_masks=None):
    """What `rank` gets from a low-latency combine. expert_outputs: list over ranks r of [E_l, R*T,
    H] bf16; handles: list over r of r's (src_info, layout_range, T, H, E); topk_idx /
    topk_weights: this rank's [N, K]. -> [N, H] bf16."""
    num_experts = handles[rank][4]
    rows = [ll_valid_rows(x, h[0], h[1]) for x, h in zip(expert_outputs, handles)]
    return ll_combine_rows(rows, topk_idx, topk_weights, rank, num_experts, rank_masks)
