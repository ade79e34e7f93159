"""The per-signature fast path of Buffer calls (epcomm/buffer.py `_remember`, validate.*_signature,
the ops modules' runners), without a GPU.

A call with the signature of an earlier call that passed every check skips the checks; any change
of shape, dtype, device, contiguity, flag or scalar type makes another signature, so the call is
checked in full again and bad input raises exactly what it raises on a Buffer that never took the
fast path. With the instant backend of tests/helpers/host_path.py (meta tensors) the backend must get the
same arguments on both paths; with the real GpuBackend over bench.host_model's stand-in driver the
runners must launch the same Params bytes as the checked path."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.distributed as dist

import epcomm.buffer as buffer_module
from epcomm import Buffer, Config
from tests.helpers.host_path import E, E_L, H, K, M, N, R, T, InstantBackend, instant_buffer, meta


@pytest.fixture
def make(monkeypatch):
    return lambda: instant_buffer(monkeypatch)


class Calls:
    """The four fast-path calls on `buf` with good arguments; `bad` replaces some of them."""

    def __init__(self, buf, backend):
        self.buf, self.backend = buf, backend
        self.x, self.topk_idx, self.weights = meta(N, H, dtype=torch.bfloat16), meta(N, K, dtype=torch.int64), meta(N, K)
        lay = backend.layout
        self.handle = buf.dispatch(self.x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                   num_tokens_per_expert=lay[2], topk_idx=self.topk_idx, topk_weights=self.weights)[4]
        self.ll_handle = buf.low_latency_dispatch(self.x, self.topk_idx, T, E, use_fp8=False)[2]
        self.recv_weights, self.bias = meta(M, K), meta(N, H, dtype=torch.bfloat16)

    def ll_dispatch(self, **bad):
        a = dict(x=self.x, topk_idx=self.topk_idx, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
        return self.buf.low_latency_dispatch(**{**a, **bad})

    def ll_combine(self, **bad):
        a = dict(x=self.backend.ll_dispatched.recv_x, topk_idx=self.topk_idx, topk_weights=self.weights,
                 handle=self.ll_handle)
        return self.buf.low_latency_combine(**{**a, **bad})

    def cached_dispatch(self, **bad):
        return self.buf.dispatch(**{**dict(x=self.x, handle=self.handle, config=Config(8)), **bad})

    def combine(self, **bad):
        a = dict(x=self.backend.dispatched.recv_x, handle=self.handle, topk_weights=self.recv_weights,
                 bias=(self.bias, None))
        return self.buf.combine(**{**a, **bad})


RUNS = {"ll_dispatch": "_ll_dispatch_runs", "ll_combine": "_ll_combine_runs", "cached_dispatch": "_dispatch_runs",
        "combine": "_combine_runs"}

# (call, argument changes) that the full checks reject
BAD = [
    ("ll_dispatch", dict(topk_idx=meta(N, K, dtype=torch.int32))),
    ("ll_dispatch", dict(x=meta(N, H))),
    ("ll_dispatch", dict(x=meta(N, 100, dtype=torch.bfloat16))),
    ("ll_dispatch", dict(x=meta(T + 1, H, dtype=torch.bfloat16), topk_idx=meta(T + 1, K, dtype=torch.int64))),
    ("ll_dispatch", dict(x=meta(H, N, dtype=torch.bfloat16).t())),
    ("ll_dispatch", dict(num_max_dispatch_tokens_per_rank=float(T))),
    ("ll_dispatch", dict(num_experts=E + 1)),
    ("ll_dispatch", dict(use_fp8=True, x=meta(N, 64, dtype=torch.bfloat16))),
    ("ll_dispatch", dict(use_fp8=2)),
    ("ll_dispatch", dict(cumulative_local_expert_recv_stats=meta(E_L, dtype=torch.int64))),
    ("ll_dispatch", dict(x=torch.zeros(N, H, dtype=torch.bfloat16))),   # another device
    ("ll_combine", dict(topk_weights=meta(N, K + 1))),
    ("ll_combine", dict(x=meta(E_L, R * T, H))),
    ("ll_combine", dict(out=meta(N + 1, H, dtype=torch.bfloat16))),
    ("ll_combine", dict(topk_idx=meta(N - 1, K, dtype=torch.int64), topk_weights=meta(N - 1, K))),
    ("ll_combine", dict(zero_copy="yes")),
    ("cached_dispatch", dict(x=meta(N + 1, H, dtype=torch.bfloat16))),
    ("cached_dispatch", dict(x=(meta(N, H, dtype=torch.float8_e4m3fn), meta(N, H // 128 + 1)))),
    ("cached_dispatch", dict(config=8)),
    ("cached_dispatch", dict(expert_alignment=0)),
    ("combine", dict(bias=(meta(N + 1, H, dtype=torch.bfloat16), None))),
    ("combine", dict(topk_weights=meta(M, K, dtype=torch.float64))),
    ("combine", dict(x=meta(M, H + 4, dtype=torch.bfloat16))),
    ("combine", dict(bias=[meta(N, H, dtype=torch.bfloat16), meta(N, H)])),
]


def _raised(call):
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("name, bad", BAD, ids=[f"{n}-{'-'.join(b)}-{i}" for i, (n, b) in enumerate(BAD)])
def test_a_changed_signature_is_checked_in_full_again(make, name, bad):
    fresh = Calls(*make())
    expected = _raised(lambda: getattr(fresh, name)(**bad))
    warm = Calls(*make())
    for _ in range(3):
        getattr(warm, name)()
    assert getattr(warm.buf, RUNS[name]), f"{name}: no fast path after good calls"
    assert _raised(lambda: getattr(warm, name)(**bad)) == expected
    getattr(warm, name)()   # and the good signature still passes


def test_the_fast_path_skips_the_checks_and_hands_the_backend_the_same_arguments(make, monkeypatch):
    from epcomm import validate
    calls = Calls(*make())
    checked = []
    for fn in ("ll_dispatch_args", "ll_combine_args", "dispatch_args", "combine_args"):
        real = getattr(validate, fn)
        monkeypatch.setattr(validate, fn, lambda *a, real=real, fn=fn, **k: checked.append(fn) or real(*a, **k))
    for name, runs in RUNS.items():
        getattr(calls.buf, runs).clear()   # forget the signatures of Calls' own first calls
        calls.backend.calls.clear()
        checked.clear()
        first = getattr(calls, name)()
        slow = calls.backend.calls[-1]
        assert len(checked) == 1, name
        second = getattr(calls, name)()
        fast = calls.backend.calls[-1]
        assert len(checked) == 1, f"{name}: the second call was checked again"
        same = [a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(slow, fast)]
        assert len(slow) == len(fast) and all(same), (name, slow, fast)
        assert len(first) == len(second) and type(first) is type(second)
        for a, b in zip(first, second):
            assert type(a) is type(b) and (not isinstance(a, tuple) or tuple(a) == tuple(b)), name
    # the handle the fast path returns is marked like the checked path's, with its token count
    handle = calls.ll_dispatch()[2]
    assert validate.is_owned(handle, calls.buf._handle_owner) and handle.num_tokens == N


def test_calls_outside_the_fast_path_are_checked_every_time(make, monkeypatch):
    from epcomm import validate
    calls = Calls(*make())
    checked = []
    real = validate.ll_combine_args
    monkeypatch.setattr(validate, "ll_combine_args", lambda *a, **k: checked.append(1) or real(*a, **k))
    for _ in range(3):
        calls.ll_combine(handle=tuple(calls.ll_handle))        # a rebuilt handle
        calls.ll_combine(return_recv_hook=True)
        calls.ll_combine(async_finish=True)
    assert len(checked) == 9


def test_num_sms_changes_the_default_config_of_a_remembered_signature(make, monkeypatch):
    calls = Calls(*make())
    calls.cached_dispatch(config=None)
    calls.cached_dispatch(config=None)
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms + 2)
    calls.cached_dispatch(config=None)
    assert calls.backend.calls[-1][-1] == Buffer.get_dispatch_config(R)


def test_a_destroyed_buffer_raises_on_the_fast_path_too(monkeypatch):
    from epcomm.errors import BufferUnusable
    backend = InstantBackend()
    backend.destroy = lambda: None
    monkeypatch.setattr(buffer_module, "_make_backend", lambda *args: backend)
    buf = Buffer(dist.ProcessGroup(dist.HashStore(), 0, R), num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 30,
                 low_latency_mode=True, explicitly_destroy=True)
    calls = Calls(buf, backend)
    calls.ll_dispatch()
    calls.ll_dispatch()
    buf.destroy()
    with pytest.raises(BufferUnusable, match="destroyed"):
        calls.ll_dispatch()


# ---- the GPU backend's runners over a stand-in driver ----------------------------------------------
@pytest.fixture
def stand_in():
    import shutil
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no host C compiler to build the stand-in libcuda")
    from bench import host_model
    with host_model.model() as build:
        yield build


def _watch(driver, kernel, params_type):
    ctypes.c_void_p.in_dll(driver, "watch_f").value = kernel.function
    ctypes.c_int.in_dll(driver, "watch_size").value = ctypes.sizeof(params_type)


def _watched(driver, params_type):
    return params_type.from_buffer_copy((ctypes.c_ubyte * ctypes.sizeof(params_type)).in_dll(driver, "watched"))


def _fields(p, skip=()):
    return {name: getattr(p, name) for name, _ in type(p)._fields_ if name not in skip}


def test_low_latency_runners_launch_the_checked_paths_params(stand_in):
    from epcomm.ops import low_latency
    driver = stand_in.driver
    T_, H_, E_, K_ = 16, 256, 8, 4
    buf = stand_in(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(T_, H_, 1, E_), low_latency_mode=True)
    x, topk_idx, weights = torch.randn(5, H_).bfloat16(), torch.randint(0, E_, (5, K_)), torch.rand(5, K_)
    stats = torch.zeros(E_, dtype=torch.int32)
    for fp8 in (True, False):
        def call():
            before = ctypes.c_int.in_dll(driver, "launches").value
            buf.low_latency_dispatch(x, topk_idx, T_, E_, stats, use_fp8=fp8)   # outputs dropped: pooled
            assert ctypes.c_int.in_dll(driver, "launches").value - before == 2   # kernel + poison fill
            return bytes(_watched(driver, low_latency.DispatchParams))
        buf._fast_path = False
        call()                                     # buffer set 0: the plan
        plan = next(p for s, p in buf._backend.plans[low_latency.DispatchSpec].items() if s.use_fp8 == fp8)
        _watch(driver, plan.kernel, low_latency.DispatchParams)
        checked = [call(), call()]                 # sets 1, 0
        buf._fast_path = True
        call()                                     # set 1, checked: the signature remembered
        fast = [call(), call()]                    # sets 0, 1 through the runner
        assert fast == checked[::-1] and fast[0] != fast[1]
        assert len(buf._ll_dispatch_runs) == (1 if fp8 else 2)

    recv_x = torch.randn(E_, T_, H_).bfloat16()
    handle = buf.low_latency_dispatch(x, topk_idx, T_, E_, use_fp8=False)[2]
    for out in (torch.empty(5, H_, dtype=torch.bfloat16), None):
        def call():
            before = ctypes.c_int.in_dll(driver, "launches").value
            combined = buf.low_latency_combine(recv_x, topk_idx, weights, handle, out=out)[0]
            assert out is None or combined is out
            assert ctypes.c_int.in_dll(driver, "launches").value - before == 2   # kernel + poison fill
            return bytes(_watched(driver, low_latency.CombineParams))
        buf._fast_path = False
        call()
        _watch(driver, next(iter(buf._backend.plans[low_latency.CombineSpec].values())).kernel,
               low_latency.CombineParams)
        checked = [call(), call()]
        buf._fast_path = True
        call()
        assert [call(), call()] == checked[::-1]
    assert len(buf._ll_combine_runs) == 2


def test_intranode_runners_launch_the_checked_paths_params(stand_in):
    from epcomm import validate
    from epcomm.backend import IntranodeHandle
    from epcomm.ops import intranode, intranode_plan
    driver = stand_in.driver
    buf = stand_in(num_nvl_bytes=1 << 24)
    n, h, k, chunks = 64, 512, 4, 9
    i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32)
    handle = validate.owned_handle(IntranodeHandle(i32(1, 1), i32(1, chunks + 1), i32(1, chunks + 1), i32(n),
                                                   torch.ones(n, 1, dtype=torch.bool), i32(n, 1)), buf._handle_owner)
    x8 = (torch.zeros(n, h, dtype=torch.float8_e4m3fn), torch.rand(h // 128, n).t())
    x = torch.randn(n, h).bfloat16()
    weights, bias = torch.rand(n, k), torch.randn(n, h).bfloat16()
    config = Config(8)
    outputs = {"DispatchParams": ("recv_x", "recv_x_scales"), "CombineParams": ("combined_x", "combined_weights")}
    for call, spec, params_type in (
            (lambda: buf.dispatch(x8, handle=handle, config=config), intranode.DispatchSpec,
             intranode_plan.DispatchParams),
            (lambda: buf.combine(x, handle, topk_weights=weights, bias=bias, config=config), intranode.CombineSpec,
             intranode_plan.CombineParams)):
        call()
        _watch(driver, next(iter(buf._backend.plans[spec].values())).kernel, params_type)
        buf._fast_path = False
        call()
        checked = _fields(_watched(driver, params_type), outputs[params_type.__name__])
        buf._fast_path = True
        before = ctypes.c_int.in_dll(driver, "launches").value
        call()
        assert ctypes.c_int.in_dll(driver, "launches").value - before == 2   # kernel + poison fill
        assert _fields(_watched(driver, params_type), outputs[params_type.__name__]) == checked
    assert len(buf._dispatch_runs) == 1 and len(buf._combine_runs) == 1
    assert {run.__name__ for run in (*buf._dispatch_runs.values(), *buf._combine_runs.values())} == {"run"}


def test_no_runner_is_made_while_a_profiling_build_is_on(stand_in, monkeypatch):
    """Traced kernels need the per-call trace rows of the backend method: while set_tracing is on,
    the backends make no runner (the Buffer then calls the method itself)."""
    from epcomm.ops import intranode, low_latency
    buf = stand_in(num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(16, 256, 1, 8), low_latency_mode=True)
    x, topk_idx = torch.randn(5, 256).bfloat16(), torch.randint(0, 8, (5, 4))
    gb = buf._backend
    monkeypatch.setattr(low_latency._TRACE, "on", True)
    assert gb.low_latency_dispatch_runner(x, topk_idx, 16, 8, False, False, False) is None
    handle = (torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 1, dtype=torch.int64), 16, 256, 8)
    assert gb.low_latency_combine_runner(topk_idx, handle) is None
    monkeypatch.setattr(intranode._TRACE, "on", True)
    normal = stand_in(num_nvl_bytes=1 << 24)
    i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32)
    intranode_handle = (i32(1, 1), i32(1, 3), i32(1, 3), i32(5), torch.ones(5, 1, dtype=torch.bool), i32(5, 1))
    assert normal._backend.dispatch_runner(x, None, intranode_handle, Config(8)) is None
    assert normal._backend.combine_runner(x, intranode_handle, None, (None, None), Config(8)) is None
