"""The internode launcher's host path without a GPU: kernels and launches are replaced by recorders,
so every branch of epcomm/ops/internode.py (fresh exact / num_worst_tokens, cached, combine, the
capacity checks) runs on CPU tensors, and the Params it fills are checked against the handle and
the buffer layout."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from epcomm.config import Config
from epcomm.ops import internode
from epcomm.ops import internode_plan as plan
from epcomm.reference import oracle

RANKS, LOCAL, HIDDEN, EXPERTS, TOPK = 4, 2, 256, 16, 4


@pytest.fixture
def launches(monkeypatch):
    """[(kernel name, grid, Params)] of every launch; exact-mode host reads answered from the
    notify call's inputs (as the GPU would: N max, rank prefix, expert counts of this rank)."""
    calls = []
    monkeypatch.setattr(internode, "_kernel", lambda gb, name: name)
    monkeypatch.setattr(internode, "launch_1d", lambda gb, kernel, grid, threads, params:
                        calls.append((kernel, grid, params)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return calls


class FakeRdma:   # what the launcher reads of runtime.symmetric.SymmetricBuffer (weakref-able)
    def __init__(self, nbytes):
        self.nbytes, self.ptr, self.peer_ptrs = nbytes, 4096, [8192 * (r + 1) for r in range(RANKS)]


def fake_backend(rank=1, rdma_bytes=64 << 20, **options):
    return SimpleNamespace(
        rank=rank, num_ranks=RANKS, num_local_ranks=LOCAL, device=torch.device("cpu"), device_index=0,
        arch=SimpleNamespace(num_sms=132, feature=90), low_latency_mode=False, timeout_ns=123,
        rdma=FakeRdma(rdma_bytes), status=SimpleNamespace(device_ptr=0), check_errors=lambda: None,
        options=options, plans={})


def peer_bases(params):
    """The [R] table the launch passed, read back (CPU tensors stand in for device memory)."""
    import ctypes
    return list((ctypes.c_int64 * RANKS).from_address(params.peer_bases))


def routing(num_tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    topk_idx = torch.randint(-1, EXPERTS, (num_tokens, TOPK), generator=gen)
    per_rank, per_node, per_expert, in_rank = oracle.layout(topk_idx, EXPERTS, RANKS, LOCAL)
    return topk_idx, torch.rand(num_tokens, TOPK, generator=gen), per_rank, per_node, per_expert, in_rank


def dispatch(gb, x, scales=None, handle=None, num_worst_tokens=0, num_tokens=64, config=Config(8)):
    topk_idx, weights, per_rank, per_node, per_expert, in_rank = routing(num_tokens)
    if handle is not None:
        return internode.dispatch(gb, x, scales, handle, None, None, None, None, None, None, 1, 0, config)
    return internode.dispatch(gb, x, scales, None, per_rank, per_node, in_rank, per_expert, topk_idx, weights,
                              1, num_worst_tokens, config)


def answer_counts(monkeypatch, max_tokens, received):
    values = [max_tokens] + [0] * (RANKS * RANKS) + [3] * (EXPERTS // RANKS)
    values[1 + (RANKS - 1) * RANKS + 1] = received   # rank_prefix[R-1][rank 1]
    monkeypatch.setattr(internode, "host_ints", lambda gb, ints: values)


def test_fresh_exact_dispatch_fills_params_from_the_handle(launches, monkeypatch):
    gb = fake_backend()
    answer_counts(monkeypatch, 64, 37)
    x = torch.randn(64, HIDDEN).bfloat16()
    result = dispatch(gb, x)
    (notify_name, notify_grid, notify), (data_name, grid, p) = launches
    assert notify_name == plan.notify_kernel(RANKS, LOCAL) and notify_grid == 1
    assert data_name == plan.dispatch_kernel(RANKS, LOCAL, HIDDEN * 2, 0, "long long", True) and grid == 8
    handle = result.handle
    assert len(handle) == 10 and result.recv_x.shape == (37, HIDDEN) and handle[7].shape == (37, 3)
    chunks = plan.num_chunks(8)
    nodes = RANKS // LOCAL
    shapes = [(64, RANKS), (nodes, chunks + 1), (RANKS + 1,), (RANKS, chunks + 1), (nodes,), (RANKS, 1), (RANKS,),
              (37, 3), (64, nodes), (64, RANKS)]
    assert [tuple(t.shape) for t in handle] == shapes
    assert (notify.rdma_channel_prefix, notify.send_rdma_head, notify.send_nvl_head) == \
        (handle[1].data_ptr(), handle[8].data_ptr(), handle[9].data_ptr())
    assert (p.rdma_channel_prefix, p.recv_rdma_channel_prefix, p.recv_gbl_rank_prefix_sum, p.recv_src_meta) == \
        (handle[1].data_ptr(), handle[3].data_ptr(), handle[6].data_ptr(), handle[7].data_ptr())
    layout = plan.DispatchLayout(gb.rdma.nbytes, RANKS, LOCAL, plan.dispatch_record_bytes(HIDDEN * 2, 0, TOPK, LOCAL))
    assert (p.recv_offset, p.stage_offset, p.capacity, p.record_bytes) == \
        (layout.recv_offset, layout.stage_offset, layout.capacity, layout.record_bytes)
    assert (p.num_chunks, p.num_topk, p.num_out_rows, p.num_local_experts, p.rank) == (chunks, TOPK, 37, 4, 1)
    assert result.num_recv_tokens_per_expert_list == [3] * 4
    # the own entry is the heap address (NVSHMEM translates puts relative to it), the other local
    # rank's its nvshmem_ptr; other nodes' are null (puts) unless allow_mnnvl (test below)
    assert peer_bases(p) == peer_bases(notify) == [8192, 4096, 0, 0]
    assert notify.notify_ints == plan.notify_ints(RANKS)
    assert (notify.area_offset, notify.stage_offset) == plan.notify_offsets(RANKS, nodes)[:2]
    # the token format goes into the count rows (checked equal on every rank by the notify kernel)
    assert (notify.num_topk, notify.num_scales, notify.row_bytes) == (TOPK, 0, HIDDEN * 2)
    # the data kernel checks the largest N of all ranks, handle[2][R] (written by notify)
    assert notify.gbl_channel_prefix == handle[2].data_ptr() and p.max_tokens == handle[2].data_ptr() + 4 * RANKS
    assert internode._host_max_tokens(handle) == 64   # exact mode: read on the host after notify


def test_worst_and_cached_dispatch_and_combine(launches):
    gb = fake_backend()
    x = (torch.zeros(64, HIDDEN, dtype=torch.float8_e4m3fn), torch.ones(HIDDEN // 128, 64).t())
    worst = dispatch(gb, *x, num_worst_tokens=500)
    assert len(launches) == 2 and worst.recv_x.shape == (500, HIDDEN) and worst.recv_x_scales.shape == (500, 2)
    assert worst.num_recv_tokens_per_expert_list == []
    assert internode._host_max_tokens(worst.handle) is None   # never read on the host: device check only
    assert launches[0][2].num_scales == 2 and launches[0][2].row_bytes == HIDDEN
    p = launches[-1][2]
    assert p.max_tokens == worst.handle[2].data_ptr() + 4 * RANKS
    assert (p.scale_stride_token, p.scale_stride_group) == (1, 64)   # column-major scales as given
    assert launches[-1][0] == plan.dispatch_kernel(RANKS, LOCAL, HIDDEN, 2, "long long", True)

    cached = dispatch(gb, *x, handle=worst.handle)
    assert len(launches) == 3 and cached.recv_x.shape == (500, HIDDEN) and cached.handle is None
    p = launches[-1][2]
    assert launches[-1][0] == plan.dispatch_kernel(RANKS, LOCAL, HIDDEN, 2, "int", False)
    assert not p.recv_src_meta and not p.topk_idx and p.num_topk == 0   # ctypes reads a null as None
    assert p.max_tokens == worst.handle[2].data_ptr() + 4 * RANKS

    rows = torch.randn(500, HIDDEN).bfloat16()
    bias = torch.randn(64, HIDDEN).bfloat16()
    combined, weights = internode.combine(gb, rows, worst.handle, torch.rand(500, TOPK), (bias, None), Config(6))
    assert combined.shape == (64, HIDDEN) and weights.shape == (64, TOPK)
    name, grid, p = launches[-1]
    assert name == plan.combine_kernel(RANKS, LOCAL, HIDDEN * 2) and grid == 6
    layout = plan.CombineLayout(gb.rdma.nbytes, RANKS, LOCAL, HIDDEN * 2)
    assert (p.push_offset, p.partial_stage_offset, p.partial_recv_offset, p.capacity, p.chunk_records) == \
        (layout.push_offset, layout.partial_stage_offset, layout.partial_recv_offset, layout.capacity,
         layout.chunk_records)
    assert (p.bias0, p.bias1, p.num_chunks) == (bias.data_ptr(), None, plan.num_chunks(8))
    assert p.max_tokens == worst.handle[2].data_ptr() + 4 * RANKS and p.num_topk == TOPK
    with pytest.raises(ValueError, match="x has 499 rows"):
        internode.combine(gb, rows[:499], worst.handle, None, (None, None), Config(6))


def test_capacity_and_buffer_errors_come_before_any_launch(launches, monkeypatch):
    x = torch.randn(64, HIDDEN).bfloat16()
    with pytest.raises(ValueError, match="smaller than the .* bytes the count exchange of 4 ranks needs"):
        dispatch(fake_backend(rdma_bytes=plan.header_bytes(RANKS, RANKS // LOCAL) + 1024), x)
    small = plan.header_bytes(RANKS, RANKS // LOCAL) + 2 * 2 * 40 * plan.dispatch_record_bytes(HIDDEN * 2, 0, TOPK, LOCAL)
    gb = fake_backend(rdma_bytes=small)
    assert launches == []
    # num_worst_tokens: this rank's N is no collective-safe host check (the other ranks would launch
    # and wait for it): both kernels launch, the data kernel checks the largest N of all ranks
    dispatch(gb, x, num_worst_tokens=300)
    assert len(launches) == 2 and launches[-1][2].capacity == 40
    # exact mode learns the largest N of all ranks from notify: every rank raises there alike
    launches.clear()
    answer_counts(monkeypatch, 64, 5)
    with pytest.raises(ValueError, match="the largest N of all ranks"):
        dispatch(gb, x)
    assert len(launches) == 1   # notify only
    topk_idx, weights, per_rank, per_node, _, in_rank = routing(64)
    too_many = torch.zeros(RANKS * (plan.MAX_LOCAL_EXPERTS + 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="1025 experts per rank; internode mode supports up to 1024"):
        internode.dispatch(gb, x, None, None, per_rank, per_node, in_rank, too_many, topk_idx, weights, 1, 0, Config(8))
    assert len(launches) == 1
    gb = fake_backend()
    gb.low_latency_mode = True
    with pytest.raises(NotImplementedError, match="low_latency_mode"):
        dispatch(gb, x)
    gb = fake_backend()
    gb.rdma.peer_ptrs = [1, 1, 0, 1]   # rank 1's node is ranks 0 and 1: fine
    answer_counts(monkeypatch, 64, 5)
    dispatch(gb, x)
    gb.rdma.peer_ptrs = [0, 1, 1, 1]
    with pytest.raises(ValueError, match=r"ranks \[0\] of this node are not reachable"):
        dispatch(gb, x)


def test_later_calls_check_capacity_on_the_host_only_where_every_rank_knows_n(launches, monkeypatch):
    """An exact-mode handle carries the largest N of all ranks (read after notify): a cached dispatch
    or a combine that cannot hold it raises on every rank before any launch. A num_worst_tokens
    handle does not: the kernel checks it (every rank alike), never this rank's N on the host."""
    gb = fake_backend(rdma_bytes=16 << 20)
    x = torch.randn(64, HIDDEN).bfloat16()
    answer_counts(monkeypatch, 3000, 37)
    exact = dispatch(gb, x).handle   # 3000 fits the 16 MiB dispatch capacity, not combine's
    combine = plan.CombineLayout(gb.rdma.nbytes, RANKS, LOCAL, HIDDEN * 2).capacity
    assert combine < 3000 <= launches[-1][2].capacity
    launches.clear()
    with pytest.raises(ValueError, match=f"3000 tokens per rank do not fit .* holds {combine} .*largest N"):
        internode.combine(gb, torch.randn(37, HIDDEN).bfloat16(), exact, None, (None, None), Config(6))
    assert launches == []
    small = fake_backend(rdma_bytes=plan.header_bytes(RANKS, RANKS // LOCAL) +
                         2 * 2 * 2000 * plan.dispatch_record_bytes(HIDDEN * 2, 0, 0, LOCAL))
    with pytest.raises(ValueError, match="3000 tokens per rank do not fit"):
        dispatch(small, x, handle=exact)
    assert launches == []
    worst = dispatch(gb, x, num_worst_tokens=500).handle
    launches.clear()
    internode.combine(gb, torch.randn(500, HIDDEN).bfloat16(), worst, None, (None, None), Config(6))
    dispatch(small, x, handle=worst)
    assert [p.max_tokens for _, _, p in launches] == [worst[2].data_ptr() + 4 * RANKS] * 2


def test_combine_bias_must_cover_every_token(launches):
    """The kernel reads a bias row for every token: fewer rows (or another hidden) raise first."""
    gb = fake_backend()
    worst = dispatch(gb, torch.randn(64, HIDDEN).bfloat16(), num_worst_tokens=500).handle
    launches.clear()
    rows = torch.randn(500, HIDDEN).bfloat16()
    for bias in ((torch.zeros(63, HIDDEN).bfloat16(), None), (None, torch.zeros(64, HIDDEN - 8).bfloat16()),
                 (torch.zeros(64, HIDDEN).bfloat16(), torch.zeros(65, HIDDEN).bfloat16())):
        with pytest.raises(ValueError, match=r"bias must be \[num_tokens, hidden\] = \[64, 256\]"):
            internode.combine(gb, rows, worst, None, bias, Config(6))
    assert launches == []
    internode.combine(gb, rows, worst, None, (torch.zeros(64, HIDDEN).bfloat16(), None), Config(6))
    assert len(launches) == 1


def test_allow_mnnvl_puts_other_nodes_mapped_buffers_in_the_peer_table():
    """allow_mnnvl=True: the kernels get every mapped rank's buffer, other nodes included (they then
    store in place instead of putting); a rank nvshmem_ptr cannot map stays null either way."""
    from epcomm.ops import internode
    gb = fake_backend(allow_mnnvl=True)
    gb.rdma.peer_ptrs[3] = 0   # not reachable from this GPU
    table = (ctypes.c_int64 * RANKS).from_address(internode.peer_table(gb).data_ptr())
    assert list(table) == [8192, 4096, 8192 * 3, 0]


def test_plans_are_the_backends_and_each_call_fills_its_own_params(launches, monkeypatch):
    """Kernels and fixed Params fields are planned once per spec in gb.plans; every launch gets its
    own Params (a copy of the plan's template), so no call changes what an earlier one launched."""
    gb = fake_backend()
    answer_counts(monkeypatch, 64, 37)
    x = torch.randn(64, HIDDEN).bfloat16()
    dispatch(gb, x)
    dispatch(gb, x, num_worst_tokens=100)
    assert set(gb.plans) == {internode.PeerTableSpec, internode.NotifySpec, internode.DispatchSpec}
    assert list(gb.plans[internode.DispatchSpec]) == [internode.DispatchSpec(HIDDEN * 2, 0, TOPK, "long long", True)]
    (_, _, first), (_, _, second) = launches[1], launches[3]
    assert first is not second and (first.num_out_rows, second.num_out_rows) == (37, 100)
    assert first.capacity == second.capacity > 0 and first.peer_bases == second.peer_bases != 0
