"""What the internode GPU test files share (test_internode_gpu.py, test_internode_proxy_gpu.py): every
rank's inputs with the internode layout, the dispatch checks against the oracle with the 10-tuple
handle, and the combine / round-trip checks."""
from __future__ import annotations

from typing import List

import torch

from epcomm.reference import oracle
from tests.helpers.gpu import (Inputs, all_inputs, combine_inputs, dev, expected_dispatch,
                               round_trip_want, row_diff)


def inputs_for(dist_env, local: int, ns, **kw):
    """Every rank's inputs (rank r: ns[r % len(ns)] tokens) with the internode layout
    (num_tokens_per_rdma_rank for L). Collective: every rank calls it with the same arguments."""
    world = dist_env.world_size
    return lay_out(all_inputs(dist_env, [ns[r % len(ns)] for r in range(world)], **kw), kw["num_experts"], local)


def lay_out(inputs, num_experts: int, local: int):
    """inputs (every rank's), their layouts recomputed for nodes of `local` ranks."""
    for inp in inputs:
        inp.layout = oracle.layout(inp.topk_idx.long(), num_experts, len(inputs), local)
    return inputs


def dispatch_errors(got, want, fp8: bool, rank: int, inputs, use_topk=True) -> List[str]:
    """got: the public dispatch tuple; want: the oracle's dict; rows, top-k, per-expert counts and
    the handle (10 elements, [-4] = recv_gbl_rank_prefix_sum, [7] = source rank and token) bit-exact."""
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = got
    src = want["recv_src_idx"]
    errors = [row_diff("recv_x (fp8)", recv_x[0], want["recv_x"], src),
              row_diff("recv_x_scales", recv_x[1], want["recv_x_scales"], src)] if fp8 else \
        [row_diff("recv_x", recv_x, want["recv_x"], src)]
    if use_topk:
        errors += [row_diff("recv_topk_idx", recv_topk_idx, want["recv_topk_idx"], src),
                   row_diff("recv_topk_weights", recv_topk_weights, want["recv_topk_weights"], src)]
    if handle is not None:
        received = torch.tensor([int(i.layout[3][:, rank].sum()) for i in inputs])
        sources = torch.repeat_interleave(torch.arange(len(inputs)), received).int()
        meta = handle[7].cpu()
        errors += ["" if len(handle) == 10 else f"the handle has {len(handle)} elements, DeepEP V1's has 10",
                   row_diff("handle[-4] recv_gbl_rank_prefix_sum", handle[-4], received.cumsum(0).int()),
                   row_diff("handle[7][:, 0] source rank", meta[:len(sources), 0].contiguous(), sources),
                   row_diff("handle[7][:, 1] source token", meta[:, 1].contiguous(), src)]
        if counts != want["num_recv_tokens_per_expert_list"]:
            errors.append(f"num_recv_tokens_per_expert_list: got {counts}, want "
                          f"{want['num_recv_tokens_per_expert_list']}")
    return errors


def combine_errors(dist_env, buf, got, inputs, local: int, experts: int, bias=None, config=None) -> List[str]:
    """Combine of distinct per-rank rows (combine_inputs) through `got`'s handle vs the oracle,
    bit-exact (the kernels sum in oracle.combine's order for nodes of `local` ranks)."""
    rank, device = dist_env.rank, dist_env.device
    xs, ws = combine_inputs(inputs, dist_env.world_size, experts)
    on_device = None if bias is None else tuple(dev(b, device) for b in bias)
    combined, weights, _ = buf.combine(dev(xs[rank], device), got[4], topk_weights=dev(ws[rank], device),
                                       bias=on_device, config=config)
    want_x, want_w = oracle.combine(xs, [i.layout[3] for i in inputs], rank, ws,
                                    (None, None) if bias is None else bias, num_local_ranks=local)
    return [row_diff("combined_x", combined, want_x), row_diff("combined_topk_weights", weights, want_w)]


def oracle_round_trip(inputs, rank: int, world: int, experts: int, local: int):
    """oracle.combine of the rows every rank received (dispatch's own output fed back, no bias)."""
    wants = [expected_dispatch(inputs, r, experts, False) for r in range(world)]
    return oracle.combine([w["recv_x"] for w in wants], [i.layout[3] for i in inputs], rank,
                          [w["recv_topk_weights"] for w in wants], (None, None), num_local_ranks=local)


def round_trip_exact_errors(combined, weights, mine: Inputs) -> List[str]:
    """combine(dispatch(x)) and its weights bit-exact against round_trip_want (the oracle's)."""
    want_x, want_w = round_trip_want(mine)
    return [row_diff("combine(dispatch(x))", combined, want_x),
            row_diff("combined_topk_weights", weights, want_w)]
