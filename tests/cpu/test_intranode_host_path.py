"""The intranode ops module's host path without a GPU: each plan keeps one Params object and a call
sets only the fields that change (epcomm/ops/intranode.py, _Plan), so every launched
Params must equal the one the call would have built from scratch, field for field, whatever the
calls before it were (no stale pointer, stride or count from an earlier call). The kernel lookup and
the launch are replaced by a recorder; tensors live on the CPU so that every pointer is real."""
from __future__ import annotations

import ctypes

import pytest
import torch

import epcomm
from epcomm.ops import _common, intranode
from epcomm.ops import intranode_plan as plan
from epcomm.runtime.arch import Arch

R, CHUNKS = 2, 4


class _Recorder:
    """Stands in for a loaded kernel: keeps a copy of every launched Params."""

    def __init__(self):
        self.launched = []

    def launch(self, grid, block, params, stream, **kwargs):
        self.launched.append(type(params).from_buffer_copy(params))


class _Nvl:
    nbytes = 1 << 30
    peer_ptrs = [1, 2]

    def __init__(self):
        self.peer_table = torch.zeros(R, dtype=torch.int64)


@pytest.fixture
def setup(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(intranode, "_kernel", lambda gb, name, trace: recorder)
    monkeypatch.setattr(intranode, "_prepare", lambda gb, num_sms, what: None)
    monkeypatch.setattr(_common, "current_stream", lambda device_index: 0)
    nvl = _Nvl()
    gb = type("Gb", (), dict(num_ranks=R, device=torch.device("cpu"), device_index=0, nvl=nvl, rank=1,
                             timeout_ns=123456789, arch=Arch.for_target(90, None, 132), plans={},
                             status=type("Status", (), {"device_ptr": 0xABC000})()))()
    yield gb, recorder


def _handle(num_tokens: int, rows: int):
    return (torch.zeros(R, R, dtype=torch.int32), torch.zeros(R, CHUNKS + 1, dtype=torch.int32),
            torch.zeros(R, CHUNKS + 1, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
            torch.zeros(num_tokens, R, dtype=torch.bool), torch.zeros(num_tokens, R, dtype=torch.int32))


def _fields(params) -> dict:
    return {name: getattr(params, name) for name, _ in params._fields_}


def _expected_plan_fields(gb, planned, op) -> dict:
    return dict(peer_bases=gb.nvl.peer_table.data_ptr(), err=gb.status.device_ptr, timeout_ns=gb.timeout_ns,
                staging_offset=planned.staging, ring_rows=planned.rows, record_bytes=planned.record,
                rank=gb.rank, num_send_blocks=planned.send_blocks, op=op)


def _plan(gb, spec_type, **fields):
    """The one plan of gb's of this spec type whose spec has these field values."""
    found = [p for spec, p in gb.plans[spec_type].items()
             if all(getattr(spec, k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, list(gb.plans[spec_type]))
    return found[0]


def _ptr(t):
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def test_cached_dispatch_params_are_complete_after_any_earlier_call(setup):
    gb, recorder = setup
    config = epcomm.Config(24)
    calls = []
    for n, hidden, rows, fp8 in ((64, 256, 100, True), (48, 256, 70, True), (64, 256, 90, False), (30, 256, 0, True)):
        x = torch.randn(n, hidden).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        scales = torch.rand(hidden // 128, n).t() if fp8 else None   # column-major: strides (1, n)
        handle = _handle(n, rows)
        result = intranode.dispatch(gb, x, scales, handle, None, None, None, None, None, None, 1, 0, config)
        calls.append((x, scales, handle, result))
    assert len(recorder.launched) == len(calls)
    for (x, scales, handle, result), got in zip(calls, recorder.launched):
        planned = _plan(gb, intranode.DispatchSpec, num_scales=0 if scales is None else scales.shape[1])
        n = x.shape[0]
        want = plan.DispatchParams(
            x=_ptr(x), x_scales=_ptr(scales), rank_prefix=handle[0].data_ptr(), channel_prefix=handle[1].data_ptr(),
            recv_channel_prefix=handle[2].data_ptr(), send_head=_ptr(handle[5]), recv_x=_ptr(result.recv_x),
            recv_x_scales=_ptr(result.recv_x_scales),
            scale_stride_token=scales.stride(0) if scales is not None else 0,
            scale_stride_group=scales.stride(1) if scales is not None else 0,
            num_tokens=n, num_chunks=CHUNKS, tokens_per_chunk=plan.tokens_per_chunk(n, CHUNKS),
            num_out_rows=handle[3].shape[0], **_expected_plan_fields(gb, planned, intranode.DISPATCH_OP))
        assert _fields(got) == _fields(want)


def test_combine_params_are_complete_after_any_earlier_call(setup):
    gb, recorder = setup
    config = epcomm.Config(24)
    calls = []
    for n, rows, topk, with_bias in ((64, 100, 8, True), (48, 70, 8, False), (64, 90, 0, True), (40, 60, 8, False)):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        weights = torch.rand(rows, topk) if topk else None
        bias = (torch.randn(n, 256).to(torch.bfloat16), None) if with_bias else (None, None)
        handle = _handle(n, rows)
        combined, combined_weights = intranode.combine(gb, x, handle, weights, bias, config)
        calls.append((x, weights, bias, handle, combined, combined_weights))
    assert len(recorder.launched) == len(calls)
    for (x, weights, bias, handle, combined, combined_weights), got in zip(calls, recorder.launched):
        topk = 0 if weights is None else weights.shape[1]
        planned = _plan(gb, intranode.CombineSpec, num_topk=topk)
        n = handle[4].shape[0]
        want = plan.CombineParams(
            x=_ptr(x), topk_weights=_ptr(weights), bias0=_ptr(bias[0]), bias1=_ptr(bias[1]),
            rank_prefix=handle[0].data_ptr(), channel_prefix=handle[1].data_ptr(),
            recv_channel_prefix=handle[2].data_ptr(), send_head=_ptr(handle[5]), combined_x=_ptr(combined),
            combined_weights=_ptr(combined_weights), num_tokens=n, num_chunks=CHUNKS,
            tokens_per_chunk=plan.tokens_per_chunk(n, CHUNKS), num_topk=topk,
            **_expected_plan_fields(gb, planned, intranode.COMBINE_OP))
        assert _fields(got) == _fields(want)
        assert ctypes.sizeof(got) == ctypes.sizeof(plan.CombineParams)
