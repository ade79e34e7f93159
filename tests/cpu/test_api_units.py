"""Config, EventOverlap, the stream scope on CPU and the Buffer's static helpers (single process)."""
from __future__ import annotations


import pytest
import torch

import epcomm
from epcomm import Buffer, Config, EventOverlap
from epcomm.config import COMBINE_CHUNKS, DISPATCH_CHUNKS
from epcomm.event import stream_wait_event
from epcomm.streams import AsyncScope, new_comm_stream, tensors_in, wait_previous


# ---- Config ------------------------------------------------------------------------------------
def test_config_defaults_and_rdma_rounding():
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens) == (20, 6, 256, 6)
    # DeepEP rounds the RDMA queue up to a whole number of send chunks.
    assert c.num_max_rdma_chunked_recv_tokens == 258
    assert Config(24, 8, 128, 16, 128).num_max_rdma_chunked_recv_tokens == 128
    assert Config(num_sms=8) == Config(8, 6, 256, 6, 256) and hash(Config(8)) == hash(Config(8))
    assert Config(8) != Config(10)
    assert "num_sms=8" in repr(Config(8))
    with pytest.raises(AttributeError):
        c.num_sms = 4


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(num_sms=21), ValueError, "num_sms must be even"),
    (dict(num_sms=0), ValueError, "num_sms must be > 0"),
    (dict(num_sms=2.0), TypeError, "num_sms must be an int"),
    (dict(num_sms=True), TypeError, "num_sms must be an int"),
    (dict(num_max_nvl_chunked_send_tokens=0), ValueError, "num_max_nvl_chunked_send_tokens must be > 0"),
    (dict(num_max_nvl_chunked_send_tokens=256), ValueError, "num_max_nvl_chunked_send_tokens (256) must be <"),
    (dict(num_max_nvl_chunked_recv_tokens=-1), ValueError, "num_max_nvl_chunked_recv_tokens must be > 0"),
    (dict(num_max_rdma_chunked_send_tokens=300), ValueError, "num_max_rdma_chunked_send_tokens (300) must be <="),
    (dict(num_max_rdma_chunked_recv_tokens="256"), TypeError, "num_max_rdma_chunked_recv_tokens must be an int"),
])
def test_config_rejects(kwargs, exc, words):
    with pytest.raises(exc) as info:
        Config(**kwargs)
    assert words in str(info.value) and str(info.value).startswith("Config")


def test_config_size_hints_delegate(monkeypatch):
    from epcomm.ops import intranode_plan
    calls = []
    monkeypatch.setattr(intranode_plan, "nvl_size_hint",
                        lambda config, hb, r: calls.append((config, hb, r)) or 4000)
    config = Config(8)
    assert config.get_nvl_buffer_size_hint(7168 * 2, 4) == 4096   # rounded up to a valid Buffer size
    assert calls == [(config, 7168 * 2, 4)]
    # One NVLink domain: the RDMA buffer is unused by normal mode, as DeepEP's hint says.
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    with pytest.raises(ValueError, match="hidden_bytes must be > 0"):
        config.get_nvl_buffer_size_hint(0, 4)
    with pytest.raises(TypeError, match="num_ranks must be an int"):
        config.get_rdma_buffer_size_hint(64, 2.5)


def test_config_rdma_hint_beyond_one_domain():
    from epcomm.ops import internode_plan
    hint = Config().get_rdma_buffer_size_hint(7168 * 2, 16)
    assert hint == internode_plan.rdma_size_hint(Config(), 7168 * 2, 16) and hint % 128 == 0


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 5, 8, 9, 16, 100, 160, 1000])
def test_recommended_configs_cover_every_rank_count(num_ranks):
    for getter, table in ((Buffer.get_dispatch_config, DISPATCH_CHUNKS), (Buffer.get_combine_config, COMBINE_CHUNKS)):
        config = getter(num_ranks)
        assert isinstance(config, Config) and config.num_sms == Buffer.num_sms
        if num_ranks in table:
            assert config == Config(Buffer.num_sms, *table[num_ranks])


def test_set_num_sms_changes_recommended_configs():
    saved = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24 and Buffer.get_dispatch_config(2).num_sms == 24
        for bad, exc in ((3, ValueError), (0, ValueError), (-2, ValueError), ("8", TypeError), (8.0, TypeError)):
            with pytest.raises(exc, match="Buffer.set_num_sms: new_num_sms"):
                Buffer.set_num_sms(bad)
        assert Buffer.num_sms == 24
    finally:
        Buffer.num_sms = saved
    with pytest.raises(ValueError, match="num_ranks must be > 0"):
        Buffer.get_combine_config(0)


# ---- EventOverlap ------------------------------------------------------------------------------
class HandleLikeDeepEP:
    """DeepEP's EventHandle: knows only the current stream."""
    def __init__(self):
        self.waits = 0

    def current_stream_wait(self):
        self.waits += 1


class TorchLikeEvent:
    def __init__(self):
        self.streams = []

    def wait(self, stream=None):
        self.streams.append(stream)


def test_event_overlap_without_event_is_a_no_op():
    e = EventOverlap()
    assert e.event is None and e.extra_tensors is None
    e.current_stream_wait()
    with e as entered:
        assert entered is e


def test_event_overlap_waits_on_exit_and_keeps_tensors():
    handle = HandleLikeDeepEP()
    t = torch.zeros(2)
    e = EventOverlap(handle, (t,))
    assert e.extra_tensors[0] is t
    with e:
        assert handle.waits == 0
    assert handle.waits == 1
    e.current_stream_wait()
    assert handle.waits == 2
    torch_like = TorchLikeEvent()
    EventOverlap(torch_like).current_stream_wait()
    assert torch_like.streams == [None]
    stream_wait_event("a stream", torch_like)
    assert torch_like.streams == [None, "a stream"]
    with pytest.raises(TypeError, match="cannot make a stream wait"):
        stream_wait_event("a stream", HandleLikeDeepEP())


def test_event_overlap_waits_even_when_the_body_raises():
    handle = HandleLikeDeepEP()
    with pytest.raises(KeyError):
        with EventOverlap(handle):
            raise KeyError("x")
    assert handle.waits == 1


# ---- streams on CPU ----------------------------------------------------------------------------
def test_async_scope_is_synchronous_without_a_stream():
    a, b = torch.zeros(1), torch.ones(2)
    previous = HandleLikeDeepEP()
    with AsyncScope(None, EventOverlap(previous)) as scope:
        event = scope.finish((a,), (b,))
    assert isinstance(event, EventOverlap) and event.event is None and previous.waits == 0
    assert new_comm_stream(torch.device("cpu")) is None
    assert list(tensors_in([a, None, (b, None, [a]), 3, "x"])) == [a, b, a]


def test_synchronous_call_waits_for_previous_event_on_the_current_stream():
    previous = HandleLikeDeepEP()
    wait_previous(EventOverlap(previous))
    assert previous.waits == 1
    wait_previous(EventOverlap())       # no event: nothing to wait for
    wait_previous(None)


def test_capture_without_cuda_gives_an_empty_event():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: capture records a real event (covered by the GPU tests)")
    assert Buffer.capture().event is None


# ---- static hints ------------------------------------------------------------------------------
def test_low_latency_size_hint_validates_then_delegates(monkeypatch):
    from epcomm.ops import low_latency_layout
    monkeypatch.setattr(low_latency_layout, "rdma_size_hint", lambda t, h, r, e: t * h * r * e + 1)
    # rounded up to a multiple of 128, so that it is a valid Buffer size as it is
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 288) == 128 * 7168 * 2 * 288 + 128
    for args, exc, words in [((0, 7168, 2, 288), ValueError, "num_max_dispatch_tokens_per_rank must be >= 1"),
                             ((128, 100, 2, 288), ValueError, "hidden must be a multiple of 8"),
                             ((128, 7168, 0, 288), ValueError, "num_ranks must be >= 1"),
                             ((128, 7168, 7, 288), ValueError, "num_experts must be divisible"),
                             ((128, 7168, 2, 288.0), TypeError, "num_experts must be an int")]:
        with pytest.raises(exc) as info:
            Buffer.get_low_latency_rdma_size_hint(*args)
        assert str(info.value).startswith("Buffer.get_low_latency_rdma_size_hint: ") and words in str(info.value)


def test_topk_idx_t_is_the_layout_dtype():
    assert epcomm.topk_idx_t == torch.int64


# ---- handles -----------------------------------------------------------------------------------
def test_handles_are_named_tuples_at_deepep_positions():
    """A returned handle keeps its backend type's field names and DeepEP's positions, is marked as
    its Buffer's (so it is not checked again), and a copy or a pickle is the unmarked type."""
    import copy
    import pickle
    from epcomm.backend import InternodeHandle, IntranodeHandle, LowLatencyHandle, named
    from epcomm.validate import Handle, owned_handle
    tensors = [torch.full((1,), float(i)) for i in range(10)]
    intranode = IntranodeHandle(*tensors[:6])
    assert intranode[3] is intranode.recv_src_idx and intranode[4] is intranode.is_token_in_rank
    internode = InternodeHandle(*tensors)
    assert internode[0] is internode.is_token_in_rank and internode[7] is internode.recv_src_meta
    assert LowLatencyHandle(tensors[0], tensors[1], 128, 7168, 288)[2:] == (128, 7168, 288)
    owner = object()
    marked = owned_handle(internode, owner)
    assert isinstance(marked, Handle) and isinstance(marked, InternodeHandle) and marked.owner is owner
    assert tuple(marked) == tuple(internode) and marked.send_nvl_head is tensors[9]
    for clone in (copy.copy(marked), pickle.loads(pickle.dumps(marked))):
        assert type(clone) is InternodeHandle and not isinstance(clone, Handle)
    assert named(IntranodeHandle, tuple(intranode)) == intranode
    assert type(owned_handle((1, 2), owner)) is Handle


def test_call_output_rebuilds_named_tuples_field_by_field():
    from epcomm.backend import LowLatencyHandle
    from epcomm.validate import Call
    c = Call("Buffer.test", torch.device("cpu"), 1)
    c.framework = "numpy-like"   # any non-torch framework walks the tuple; non-tensors pass through
    handle = LowLatencyHandle(1, 2, 3, 4, 5)
    assert c.output(handle) == handle and type(c.output(handle)) is LowLatencyHandle
    assert c.output([1, (2, 3)]) == [1, (2, 3)]
