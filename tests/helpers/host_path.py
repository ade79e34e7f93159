"""What the host-path tests without a GPU share (test_api_host_path.py, test_fast_path.py): shapes,
meta-device tensors (the Buffer's device, so validation treats them as device tensors and reads no
values) and a backend that returns preallocated outputs at once and records its calls."""
from __future__ import annotations

import torch
import torch.distributed as dist

import epcomm.buffer as buffer_module
from epcomm import Buffer
from epcomm.backend import DispatchResult, IntranodeHandle, LowLatencyDispatchResult, LowLatencyHandle

R, N, H, K, E, T, M = 2, 16, 256, 4, 8, 32, 24
E_L = E // R
META = torch.device("meta")


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device=META)


class InstantBackend:
    """Returns preallocated outputs and records what it was called with."""

    rank, num_ranks, num_local_ranks, device = 0, R, R, META

    def __init__(self):
        self.calls = []
        self.layout = (meta(R, dtype=torch.int32), None, meta(E, dtype=torch.int32), meta(N, R, dtype=torch.bool))
        # Named handles, as both real backends return them (the Buffer's mark must survive that type).
        self.handle = IntranodeHandle(meta(R, R, dtype=torch.int32), meta(R, 5, dtype=torch.int32),
                                      meta(R, 5, dtype=torch.int32), meta(M, dtype=torch.int32), self.layout[3],
                                      meta(N, R, dtype=torch.int32))
        self.dispatched = DispatchResult(meta(M, H, dtype=torch.bfloat16), None, meta(M, K, dtype=torch.int64),
                                         meta(M, K), [3, 4, 5, 6], self.handle)
        self.combined = (meta(N, H, dtype=torch.bfloat16), meta(N, K))
        self.ll_handle = LowLatencyHandle(meta(E_L, R * T, dtype=torch.int32), meta(E_L, R, dtype=torch.int64), T, H, E)
        self.ll_dispatched = LowLatencyDispatchResult(meta(E_L, R * T, H, dtype=torch.bfloat16), None,
                                                      meta(E_L, dtype=torch.int32), self.ll_handle, None)

    def check_errors(self):
        self.calls.append(("check_errors",))

    def get_dispatch_layout(self, *args):
        self.calls.append(("get_dispatch_layout",) + args)
        return self.layout

    def dispatch(self, *args):
        self.calls.append(("dispatch",) + args)
        return self.dispatched if args[2] is None else DispatchResult(self.dispatched.recv_x, None, None, None,
                                                                      None, None)

    def combine(self, *args):
        self.calls.append(("combine",) + args)
        return self.combined

    def low_latency_dispatch(self, *args):
        self.calls.append(("low_latency_dispatch",) + args)
        return self.ll_dispatched

    def low_latency_combine(self, *args):
        self.calls.append(("low_latency_combine",) + args)
        return self.combined[0], None


def instant_buffer(monkeypatch):
    """(a low-latency-capable Buffer whose backend is a new InstantBackend, that backend)."""
    backend = InstantBackend()
    monkeypatch.setattr(buffer_module, "_make_backend", lambda *args: backend)
    group = dist.ProcessGroup(dist.HashStore(), 0, R)
    return Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 30, low_latency_mode=True), backend
