"""Buffer.destroy() lets go of the process group: no epcomm object refers to it afterwards, so
destroy_process_group() is the group's end, not interpreter exit (where a gloo group's worker
threads can abort the process: "terminate called without an active exception")."""
from __future__ import annotations

import gc

import torch

import epcomm
from tests.conftest import run_ranks


def _destroyed_buffer_holds_no_group(rank, world, group):
    buf = epcomm.Buffer(group, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    x = torch.randn(8, 64).bfloat16()
    topk_idx = torch.randint(0, 4 * world, (8, 2)).to(epcomm.topk_idx_t)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, 4 * world)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                              topk_weights=torch.rand(8, 2))
    buf.combine(recv_x, handle)
    buf.destroy()
    gc.collect()
    referrers = gc.get_referrers(group)
    referrers += [owner for d in referrers if isinstance(d, dict) for owner in gc.get_referrers(d)]  # __dict__s
    holders = [type(r).__qualname__ for r in referrers if type(r).__module__.startswith("epcomm")]
    assert not holders, holders


def test_a_destroyed_buffer_holds_no_reference_to_its_group():
    run_ranks(_destroyed_buffer_holds_no_group, 2)
