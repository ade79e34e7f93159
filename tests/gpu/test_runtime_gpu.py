"""GPU runtime tests (collective: every rank runs each test; `make test-gpu`): NVSHMEM world over the
NCCL group and reuse, symmetric memory up to 2 GiB, peer mappings and writes, zero-copy views,
CuPy interop, the host-mapped error record, and the GpuBackend life cycle.

Checks that could differ between ranks are combined with `dist_env.all_ok` so that every rank passes
or fails each test together and no rank is left waiting in a collective."""
from __future__ import annotations

import os
import time

import pytest
import torch

from epcomm.errors import BufferUnusable, NvshmemError, PeerTimeout

pytestmark = pytest.mark.gpu

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def world(dist_env):
    from epcomm.runtime.nvshmem import Nvshmem
    return Nvshmem.init(dist_env.group, dist_env.device_index)


def _peers(dist_env):
    """(the rank this one writes to, the rank that writes to this one)."""
    r, n = dist_env.rank, dist_env.world_size
    return (r + 1) % n, (r - 1) % n


def test_init_over_nccl_group(dist_env, world):
    from epcomm.runtime import nvshmem, toolchain
    assert (world.my_pe, world.n_pes) == (dist_env.rank, dist_env.world_size)
    assert nvshmem.init_status() >= nvshmem.STATUS_IS_INITIALIZED
    assert world.version == toolchain.nvshmem_version() and world.owns_world
    assert os.environ.get("NVSHMEM_DISABLE_NVLS") == "1"  # ours or the Makefile's, never multicast


def test_second_init_reuses_the_world_over_any_backend(dist_env, world):
    import torch.distributed as dist
    from epcomm.runtime.nvshmem import Nvshmem
    assert Nvshmem.init(dist_env.group, dist_env.device_index) is world
    gloo = dist.new_group(ranks=list(range(dist_env.world_size)), backend="gloo")
    assert Nvshmem.init(gloo, dist_env.device_index) is world


def test_reuse_with_a_mismatched_group_raises(dist_env, world):
    import torch.distributed as dist
    from epcomm.runtime.nvshmem import Nvshmem
    if dist_env.world_size == 1:
        pytest.skip("needs 2+ ranks: a 1-rank group matches a 1-PE world")
    # Every rank must create every subgroup, in the same order.
    singles = [dist.new_group(ranks=[r], backend="gloo") for r in range(dist_env.world_size)]
    with pytest.raises(NvshmemError, match="does not match the group"):
        Nvshmem.init(singles[dist_env.rank], dist_env.device_index)


@pytest.mark.parametrize("nbytes", [128, 3 * MiB + 16, 2 * GiB])
def test_symmetric_malloc_and_peer_access(dist_env, world, nbytes):
    from epcomm.runtime.symmetric import SymmetricBuffer
    dst, src = _peers(dist_env)
    buf = SymmetricBuffer(world, nbytes, dist_env.device)
    ok = buf.ptr != 0 and buf.ptr % 16 == 0 and buf.peer_ptrs[dist_env.rank] == buf.ptr
    ok &= all(p != 0 for p in buf.peer_ptrs)  # one host: every peer NVLink-mapped
    ok &= buf.peer_table.device == dist_env.device and buf.peer_table.tolist() == buf.peer_ptrs
    tail = min(nbytes, 4096)  # the far end of the block, where a short mapping would fault
    buf.view(torch.uint8, tail, nbytes - tail).fill_(0)
    world.barrier_all()
    buf.peer_view(dst, torch.uint8, tail, nbytes - tail).fill_(dist_env.rank + 1)
    world.barrier_all()
    got = buf.view(torch.uint8, tail, nbytes - tail)
    ok &= bool(torch.all(got == src + 1))
    buf.free()
    assert dist_env.all_ok(ok), f"rank {dist_env.rank}: {buf!r} peers {buf.peer_ptrs}"


def test_peer_write_by_torch_copy_is_seen_by_the_owner(dist_env, world):
    from epcomm.runtime.symmetric import SymmetricBuffer
    dst, src = _peers(dist_env)
    n = MiB  # int32 elements
    buf = SymmetricBuffer(world, 4 * n + 256, dist_env.device)
    buf.view(torch.int32, n, 256).fill_(-1)
    world.barrier_all()
    payload = torch.arange(n, dtype=torch.int32, device=dist_env.device) * 3 + dist_env.rank
    buf.peer_view(dst, torch.int32, n, 256).copy_(payload)
    world.barrier_all()  # synchronises this GPU first, then every PE
    expected = torch.arange(n, dtype=torch.int32, device=dist_env.device) * 3 + src
    ok = torch.equal(buf.view(torch.int32, n, 256), expected)
    buf.free()
    assert dist_env.all_ok(ok)


def test_views_are_zero_copy(dist_env, world):
    from epcomm.runtime.symmetric import SymmetricBuffer
    buf = SymmetricBuffer(world, MiB, dist_env.device)
    raw = buf.view(torch.uint8, MiB)
    bf16 = buf.view(torch.bfloat16, (64, 128), 4096)
    fp8 = buf.view(torch.float8_e4m3fn, (32, 128), 65536)
    ok = raw.data_ptr() == buf.ptr and bf16.data_ptr() == buf.ptr + 4096
    ok &= fp8.data_ptr() == buf.ptr + 65536 and bf16.device == dist_env.device
    raw.zero_()
    bf16.fill_(1.0)  # bf16 1.0 = 0x3F80: little-endian bytes 0x80, 0x3F
    ok &= bool(torch.all(raw[4096:4096 + 2 * 64 * 128].view(torch.int16) == 0x3F80))
    ok &= bool(torch.all(raw[:4096] == 0))
    buf.free()
    assert dist_env.all_ok(ok)


def test_cupy_round_trip_is_zero_copy(dist_env, world):
    cupy = pytest.importorskip("cupy")
    from epcomm.runtime.dlpack import from_torch, to_torch
    from epcomm.runtime.symmetric import SymmetricBuffer
    with cupy.cuda.Device(dist_env.device_index):
        a = cupy.arange(1000, dtype=cupy.float32)
        t, fw = to_torch(a)
        back = from_torch(t, fw)
        ok = fw == "cupy" and t.data_ptr() == a.data.ptr and t.device == dist_env.device
        ok &= isinstance(back, cupy.ndarray) and back.data.ptr == a.data.ptr
        buf = SymmetricBuffer(world, MiB, dist_env.device)
        sym = from_torch(buf.view(torch.float32, 256, 1024), "cupy")  # heap memory seen by CuPy
        ok &= sym.data.ptr == buf.ptr + 1024
        sym[:] = 2.5
        cupy.cuda.get_current_stream().synchronize()
        ok &= bool(torch.all(buf.view(torch.float32, 256, 1024) == 2.5))
        del sym
    buf.free()
    assert dist_env.all_ok(ok)


def _write_record_by_kernel(record_ptr, values, device):
    from epcomm.runtime.dlpack import wrap_pointer
    view = wrap_pointer(record_ptr, torch.int32, (8,), device)
    src = torch.tensor(values + [0] * (8 - len(values)), dtype=torch.int32, device=device)
    torch.mul(src, 1, out=view)  # an elementwise kernel storing into host-mapped memory


def _wait_for_failure(check, seconds=10.0):
    """The exception check() raises once the kernel's write is visible, polling without syncing."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            check()
        except Exception as e:  # noqa: BLE001 - returned to the caller for inspection
            return e
    return None


def test_status_record_sees_a_device_write(dist_env):
    from epcomm.runtime.status import StatusRecord, register_op
    op = register_op("test_gpu_status", ["wait counts", "wait data"])
    dst, _ = _peers(dist_env)
    rec = StatusRecord(dist_env.device, timeout_s=3.0)
    rec.check()
    _write_record_by_kernel(rec.device_ptr, [1, op, dist_env.rank, dst, 1], dist_env.device)
    err = _wait_for_failure(rec.check)
    ok = isinstance(err, PeerTimeout) and (err.op, err.rank, err.peer, err.phase, err.timeout_s) == (
        "test_gpu_status", dist_env.rank, dst, "wait data", 3.0)
    try:
        rec.check()
        ok = False
    except BufferUnusable:
        pass
    torch.cuda.synchronize()
    rec.reset()
    rec.check()
    rec.free()
    assert dist_env.all_ok(ok), f"rank {dist_env.rank}: {err!r}"


def test_gpu_backend_life_cycle(dist_env, world):
    from epcomm.gpu import GpuBackend
    gb = GpuBackend(dist_env.group, 4 * MiB, 2 * MiB, False, {"enable_shrink": False})
    ok = (gb.rank, gb.num_ranks, gb.num_local_ranks) == (dist_env.rank, dist_env.world_size,
                                                         dist_env.world_size)
    ok &= gb.device == dist_env.device and gb.nvshmem is world and gb.arch.cc >= 80
    ok &= gb.timeout_ns > 0 and gb.options == {"enable_shrink": False} and gb._ll is None
    ok &= all(gb.nvl.peer_ptrs) and all(gb.rdma.peer_ptrs) and gb.status.device_ptr != 0
    whole = gb.get_local_buffer_tensor(torch.bfloat16, None, 256, False)
    ok &= whole.numel() == (4 * MiB - 256) // 2 and whole.data_ptr() == gb.nvl.ptr + 256
    shaped = gb.get_local_buffer_tensor(torch.float32, torch.Size([16, 4]), 64, True)
    ok &= shaped.shape == (16, 4) and shaped.data_ptr() == gb.rdma.ptr + 64
    with pytest.raises(ValueError, match="exceeds the buffer size"):
        gb.get_local_buffer_tensor(torch.uint8, torch.Size([2 * MiB + 1]), 0, True)
    gb.check_errors()
    gb.destroy()
    gb.destroy()
    with pytest.raises(BufferUnusable):
        gb.check_errors()
    with pytest.raises(BufferUnusable):
        gb.get_local_buffer_tensor(torch.uint8, None, 0, False)
    with pytest.raises(BufferUnusable):
        gb.dispatch()
    with pytest.raises(BufferUnusable):
        gb.low_latency_dispatch()
    assert dist_env.all_ok(ok)


def test_gpu_backend_without_nvl_buffer_and_mismatched_sizes(dist_env, world):
    from epcomm.gpu import GpuBackend
    gb = GpuBackend(dist_env.group, 0, MiB, True, {})
    assert gb.nvl is None and gb.rdma is not None
    with pytest.raises(ValueError, match="no NVL buffer"):
        gb.get_local_buffer_tensor(torch.uint8, None, 0, False)
    gb.destroy()
    if dist_env.world_size > 1:
        with pytest.raises(ValueError, match="num_nvl_bytes must be equal on every rank"):
            GpuBackend(dist_env.group, (dist_env.rank + 1) * MiB, 0, False, {})


def test_gpu_backend_peer_timeout_makes_it_unusable(dist_env, world):
    from epcomm.gpu import GpuBackend
    from epcomm.runtime.status import register_op
    op = register_op("test_gpu_backend_timeout", ["wait peer"])
    dst, _ = _peers(dist_env)
    gb = GpuBackend(dist_env.group, MiB, 0, False, {})
    _write_record_by_kernel(gb.status.device_ptr, [1, op, dist_env.rank, dst, 0], dist_env.device)
    err = _wait_for_failure(gb.check_errors)
    ok = isinstance(err, PeerTimeout) and err.peer == dst and err.phase == "wait peer"
    with pytest.raises(BufferUnusable):
        gb.dispatch()
    torch.cuda.synchronize()
    gb.destroy()  # every rank comes to destroy's meeting, so the frees stay collective
    ok &= not world.peer_missing
    assert dist_env.all_ok(ok), f"rank {dist_env.rank}: {err!r}"
