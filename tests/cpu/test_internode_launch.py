"""The internode launcher's host path without a GPU: kernels and launches are replaced by recorders,
so every branch of epcomm/ops/internode.py (fresh exact / num_worst_tokens, cached, combine, the
buffer checks) runs on CPU tensors, and the Params it fills are checked against the handle and
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
    monkeypatch.setattr(internode, "_kernel", lambda gb, name, trace=False: name)
    monkeypatch.setattr(internode, "launch_1d", lambda gb, kernel, grid, threads, params:
                        calls.append((kernel, grid, params)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return calls


class FakeRdma:   # what the launcher reads of runtime.symmetric.SymmetricBuffer (weakref-able)
    def __init__(self, nbytes, first=8192):
        self.nbytes, self.ptr, self.peer_ptrs = nbytes, first // 2, [first * (r + 1) for r in range(RANKS)]


def fake_backend(rank=1, rdma_bytes=64 << 20, nvl_bytes=64 << 20, **options):
    return SimpleNamespace(
        nvl=FakeRdma(nvl_bytes, first=1 << 40) if nvl_bytes else None,
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
    chunks = plan.num_channels(8)   # two blocks per channel: grid 8
    nodes = RANKS // LOCAL
    shapes = [(64, RANKS), (nodes, chunks + 1), (RANKS + 1,), (RANKS, chunks + 1), (nodes,), (RANKS, 1), (RANKS,),
              (37, 3), (64, nodes), (64, RANKS)]
    assert [tuple(t.shape) for t in handle] == shapes
    assert (notify.rdma_channel_prefix, notify.send_rdma_head, notify.send_nvl_head) == \
        (handle[1].data_ptr(), handle[8].data_ptr(), handle[9].data_ptr())
    assert (p.rdma_channel_prefix, p.recv_rdma_channel_prefix, p.recv_gbl_rank_prefix_sum, p.recv_src_meta) == \
        (handle[1].data_ptr(), handle[3].data_ptr(), handle[6].data_ptr(), handle[7].data_ptr())
    config = Config(8)
    rings = plan.dispatch_rings(config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
    record = plan.dispatch_record_bytes(HIDDEN * 2, 0, TOPK, LOCAL)
    layout = plan.DispatchLayout(RANKS, LOCAL, record, chunks, rings)
    assert (p.recv_offset, p.stage_offset, p.record_bytes) == (layout.recv_offset, layout.stage_offset, record)
    assert (p.ring, p.stage, p.chunk) == (258, 12, 6) == (rings.ring, rings.stage, rings.chunk)   # 256 rounded up to whole chunks
    assert (p.num_channels, p.tokens_per_channel) == (chunks, 16) and notify.tokens_per_channel == 16
    assert (p.num_topk, p.num_out_rows, p.num_local_experts, p.rank) == (TOPK, 37, 4, 1)
    assert result.num_recv_tokens_per_expert_list == [3] * 4
    # the own entry is the heap address (NVSHMEM translates puts relative to it), the other local
    # rank's its nvshmem_ptr; other nodes' are null (puts) unless allow_mnnvl (test below)
    assert peer_bases(p) == peer_bases(notify) == [8192, 4096, 0, 0]
    assert notify.notify_ints == plan.notify_ints(RANKS)
    assert (notify.area_offset, notify.stage_offset) == plan.notify_offsets(RANKS, nodes)[:2]
    # the token format goes into the count rows (checked equal on every rank by the notify kernel)
    assert (notify.num_topk, notify.num_scales, notify.row_bytes) == (TOPK, 0, HIDDEN * 2)
    assert notify.gbl_channel_prefix == handle[2].data_ptr()


def test_worst_and_cached_dispatch_and_combine(launches):
    gb = fake_backend()
    x = (torch.zeros(64, HIDDEN, dtype=torch.float8_e4m3fn), torch.ones(HIDDEN // 128, 64).t())
    worst = dispatch(gb, *x, num_worst_tokens=500)
    assert len(launches) == 2 and worst.recv_x.shape == (500, HIDDEN) and worst.recv_x_scales.shape == (500, 2)
    assert worst.num_recv_tokens_per_expert_list == []
    assert launches[0][2].num_scales == 2 and launches[0][2].row_bytes == HIDDEN
    p = launches[-1][2]
    assert (p.scale_stride_token, p.scale_stride_group) == (1, 64)   # column-major scales as given
    assert launches[-1][0] == plan.dispatch_kernel(RANKS, LOCAL, HIDDEN, 2, "long long", True)

    cached = dispatch(gb, *x, handle=worst.handle)
    assert len(launches) == 3 and cached.recv_x.shape == (500, HIDDEN) and cached.handle is None
    p = launches[-1][2]
    assert launches[-1][0] == plan.dispatch_kernel(RANKS, LOCAL, HIDDEN, 2, "int", False)
    assert not p.recv_src_meta and not p.topk_idx and p.num_topk == 0   # ctypes reads a null as None
    # the channels of the handle's fresh dispatch, whatever this call's Config.num_sms
    assert launches[-1][1] == 8 and p.num_channels == 4
    dispatch(gb, *x, handle=worst.handle, config=Config(20))
    assert launches[-1][1] == 8 and launches[-1][2].num_channels == 4
    rebuilt = list(worst.handle)
    rebuilt[3] = rebuilt[3][:, :2]
    with pytest.raises(ValueError, match=r"handle\[1\] / handle\[3\] must be \[2, G\+1\] / \[4, G\+1\]"):
        dispatch(gb, *x, handle=tuple(rebuilt))

    rows = torch.randn(500, HIDDEN).bfloat16()
    bias = torch.randn(64, HIDDEN).bfloat16()
    combined, weights = internode.combine(gb, rows, worst.handle, torch.rand(500, TOPK), (bias, None), Config(6))
    assert combined.shape == (64, HIDDEN) and weights.shape == (64, TOPK)
    name, grid, p = launches[-1]
    assert name == plan.combine_kernel(RANKS, LOCAL, HIDDEN * 2) and grid == 8   # the handle's 4 channels
    config = Config(6)
    rings = plan.combine_rings(config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
    pushes = plan.push_rings(config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens)
    layout = plan.CombineLayout(RANKS, LOCAL, HIDDEN * 2, 4, rings, pushes, gb.nvl.nbytes)
    assert layout.push_in_nvl and p.push_offset == 0
    assert (p.partial_stage_offset, p.partial_recv_offset, p.partial_bytes, p.push_bytes) == \
        (layout.partial_stage_offset, layout.partial_recv_offset, layout.partial_bytes, layout.push_bytes)
    assert (p.ring, p.stage, p.chunk, p.push_ring, p.push_chunk) == (129, 12, 6, 256, 6)
    # push FIFOs in the NVL buffer of this node's ranks
    assert list((ctypes.c_int64 * RANKS).from_address(p.push_bases)) == [1 << 40, 1 << 39, 0, 0]
    assert (p.bias0, p.bias1, p.num_channels) == (bias.data_ptr(), None, 4)
    assert p.rdma_channel_prefix == worst.handle[1].data_ptr() and p.num_topk == TOPK
    with pytest.raises(ValueError, match="x has 499 rows"):
        internode.combine(gb, rows[:499], worst.handle, None, (None, None), Config(6))


def test_buffer_errors_come_before_any_launch(launches, monkeypatch):
    x = torch.randn(64, HIDDEN).bfloat16()
    with pytest.raises(ValueError, match="smaller than the .* bytes 4 channels of Rings"):
        dispatch(fake_backend(rdma_bytes=plan.header_bytes(RANKS, RANKS // LOCAL) + 1024), x)
    with pytest.raises(ValueError, match="Config.num_sms=258 gives 129 channels; internode mode supports up to 128"):
        gb = fake_backend()
        gb.arch.num_sms = 300
        dispatch(gb, x, config=Config(258))
    assert launches == []
    # the rings do not depend on N: a buffer that holds them carries any N, exact or worst mode
    config = Config(8)
    need = plan.rdma_bytes_needed(config, HIDDEN * 2, 0, TOPK, RANKS, LOCAL)
    gb = fake_backend(rdma_bytes=need)
    answer_counts(monkeypatch, 100000, 5)
    dispatch(gb, x, config=config)
    dispatch(gb, torch.randn(5000, HIDDEN).bfloat16(), num_tokens=5000, num_worst_tokens=20000, config=config)
    assert len(launches) == 4
    launches.clear()
    topk_idx, weights, per_rank, per_node, _, in_rank = routing(64)
    too_many = torch.zeros(RANKS * (plan.MAX_LOCAL_EXPERTS + 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="1025 experts per rank; internode mode supports up to 1024"):
        internode.dispatch(gb, x, None, None, per_rank, per_node, in_rank, too_many, topk_idx, weights, 1, 0, Config(8))
    assert launches == []
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


def test_combine_push_fifos_fall_back_to_the_rdma_buffer(launches):
    """An NVL buffer too small for the push FIFOs: they go after the rings in the RDMA buffer; if that
    cannot hold them either, ValueError before the launch naming both."""
    config = Config(8)
    gb = fake_backend(nvl_bytes=1 << 20)
    worst = dispatch(gb, torch.randn(64, HIDDEN).bfloat16(), num_worst_tokens=500, config=config).handle
    launches.clear()
    rows = torch.randn(500, HIDDEN).bfloat16()
    internode.combine(gb, rows, worst, None, (None, None), config)
    p = launches[-1][2]
    assert p.push_offset > p.partial_stage_offset and p.push_offset % 256 == 0
    assert list((ctypes.c_int64 * RANKS).from_address(p.push_bases)) == [8192, 4096, 0, 0]
    rings = plan.combine_rings(config.num_max_rdma_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens)
    pushes = plan.push_rings(config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens)
    end = plan.CombineLayout(RANKS, LOCAL, HIDDEN * 2, 4, rings, pushes, 0).end
    small = fake_backend(nvl_bytes=0, rdma_bytes=end - 128)
    with pytest.raises(ValueError, match="as num_nvl_bytes=0 cannot hold them"):
        internode.combine(small, rows, worst, None, (None, None), config)
    assert len(launches) == 1
    internode.combine(fake_backend(nvl_bytes=0, rdma_bytes=end), rows, worst, None, (None, None), config)
    assert len(launches) == 2


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
    assert list(gb.plans[internode.DispatchSpec]) == \
        [internode.DispatchSpec(HIDDEN * 2, 0, TOPK, "long long", True, 4, 258, 6)]
    (_, _, first), (_, _, second) = launches[1], launches[3]
    assert first is not second and (first.num_out_rows, second.num_out_rows) == (37, 100)
    assert first.ring == second.ring > 0 and first.peer_bases == second.peer_bases != 0
