"""CPU checks of the runtime pieces above the NVSHMEM library: SymmetricBuffer views and validation
(over a stand-in world whose heaps are CPU tensors), the op registry and StatusRecord decoding
(over ordinary host memory in place of mapped pinned memory), and the host layout rule."""
from __future__ import annotations

import ctypes

import pytest
import torch

from epcomm.errors import BufferUnusable, PeerTimeout
from epcomm.runtime.topology import local_rank_count
from epcomm.runtime import status
from epcomm.runtime.symmetric import SymmetricBuffer


class CpuWorld:
    """What SymmetricBuffer uses of Nvshmem, for PE `my_pe` of `n_pes`, with every PE's copy of
    each block held in this process as a CPU tensor (so peer writes can be checked)."""

    def __init__(self, n_pes=2, my_pe=0, reachable=True):
        self.n_pes, self.my_pe, self.reachable = n_pes, my_pe, reachable
        self.blocks = {}  # local ptr -> [tensor per PE]
        self.freed = []

    def malloc(self, nbytes):
        copies = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(self.n_pes)]
        ptr = copies[self.my_pe].data_ptr()
        self.blocks[ptr] = copies
        return ptr

    def free(self, ptr):
        self.freed.append(ptr)

    def peer_ptr(self, ptr, pe):
        if pe != self.my_pe and not self.reachable:
            return 0
        return self.blocks[ptr][pe].data_ptr()

    def track(self, buffer):
        pass


# ---- SymmetricBuffer ---------------------------------------------------------------------------
def test_views_alias_the_local_copy():
    world = CpuWorld()
    buf = SymmetricBuffer(world, 1024, "cpu")
    local = world.blocks[buf.ptr][0]
    v = buf.view(torch.bfloat16, (4, 8), offset_bytes=64)
    assert v.data_ptr() == buf.ptr + 64 and v.shape == (4, 8) and v.dtype == torch.bfloat16
    v.fill_(1.5)
    assert torch.equal(local[64:128].view(torch.bfloat16), torch.full((32,), 1.5, dtype=torch.bfloat16))
    assert buf.view(torch.float8_e4m3fn, 16).dtype == torch.float8_e4m3fn


def test_peer_table_and_peer_view_write_the_peers_copy():
    world = CpuWorld(n_pes=3, my_pe=1)
    buf = SymmetricBuffer(world, 256, "cpu")
    copies = world.blocks[buf.ptr]
    assert buf.peer_ptrs == [c.data_ptr() for c in copies] and buf.peer_ptrs[1] == buf.ptr
    assert buf.peer_table.dtype == torch.int64 and buf.peer_table.tolist() == buf.peer_ptrs
    buf.peer_view(2, torch.int32, (8,), offset_bytes=32).copy_(torch.arange(8, dtype=torch.int32))
    assert torch.equal(copies[2][32:64].view(torch.int32), torch.arange(8, dtype=torch.int32))
    assert not copies[0].any() and not copies[1].any()


def test_unreachable_peer_has_null_pointer_and_no_view():
    buf = SymmetricBuffer(CpuWorld(reachable=False), 256, "cpu")
    assert buf.peer_ptrs[1] == 0 and buf.peer_ptrs[0] == buf.ptr
    with pytest.raises(ValueError, match="PE 1 is not reachable"):
        buf.peer_view(1, torch.uint8, 16)
    with pytest.raises(ValueError, match=r"pe must be in \[0, 2\)"):
        buf.peer_view(2, torch.uint8, 16)


@pytest.mark.parametrize("dtype, shape, offset, message", [
    (torch.uint8, (257,), 0, "257 B exceeds the buffer size 256 B"),
    (torch.float32, (1,), 256, "260 B exceeds the buffer size 256 B"),
    (torch.bfloat16, (2,), 3, "not a multiple of the torch.bfloat16 element size 2"),
    (torch.uint8, (2,), -1, "offset_bytes must be a non-negative int"),
    (torch.uint8, (-1,), 0, "shape must be non-negative ints"),
])
def test_view_validation_names_what_exceeded_what(dtype, shape, offset, message):
    buf = SymmetricBuffer(CpuWorld(), 256, "cpu")
    with pytest.raises(ValueError, match=message):
        buf.view(dtype, shape, offset)


def test_full_buffer_and_empty_views_are_allowed():
    buf = SymmetricBuffer(CpuWorld(), 256, "cpu")
    assert buf.view(torch.float64, 32).numel() == 32
    assert buf.view(torch.uint8, 0, offset_bytes=256).numel() == 0


def test_free_is_idempotent_and_ends_views():
    world = CpuWorld()
    buf = SymmetricBuffer(world, 128, "cpu")
    ptr = buf.ptr
    buf.free()
    buf.free()
    assert world.freed == [ptr] and buf.peer_ptrs == [0, 0]
    with pytest.raises(BufferUnusable):
        buf.view(torch.uint8, 1)


def test_bad_size_is_rejected_before_allocating():
    world = CpuWorld()
    with pytest.raises(ValueError, match="positive int"):
        SymmetricBuffer(world, 0, "cpu")
    assert world.blocks == {}


# ---- op registry ------------------------------------------------------------------------------
def test_register_op_is_idempotent_and_names_phases():
    op = status.register_op("test_registry_op", ["wait counts", "wait data"])
    assert status.register_op("test_registry_op", ["wait counts", "wait data"]) == op
    assert status.op_id("test_registry_op") == op and status.op_name(op) == "test_registry_op"
    assert status.phase_name(op, 1) == "wait data" and status.phase_name(op, 7) == "phase 7"
    assert status.op_name(10_000) == "op 10000"
    with pytest.raises(ValueError, match="already registered"):
        status.register_op("test_registry_op", ["other"])
    with pytest.raises(KeyError, match="not registered"):
        status.op_id("test_never_registered")


# ---- StatusRecord over ordinary host memory -----------------------------------------------------
@pytest.fixture
def host_record(monkeypatch):
    memory = ctypes.create_string_buffer(ctypes.sizeof(status.ErrorRecord))
    released = []
    monkeypatch.setattr(status, "_alloc_mapped", lambda nbytes, device: (
        ctypes.addressof(memory), ctypes.addressof(memory), lambda: released.append(True)))
    yield memory, released


def _kernel_records(address, op, rank, peer, phase):
    # The order WaitContext::record uses: elect with code, then the details.
    record = status.ErrorRecord.from_address(address)
    record.code = status.CODE_PEER_TIMEOUT
    record.op, record.rank, record.peer, record.phase, record.reporter = op, rank, peer, phase, -1


def test_status_record_raises_peer_timeout_once_then_unusable(host_record):
    memory, released = host_record
    op = status.register_op("test_status_op", ["wait layout", "wait tail"])
    rec = status.StatusRecord("cpu", timeout_s=7.5)
    assert rec.device_ptr == ctypes.addressof(memory)
    rec.check()
    _kernel_records(rec.host_ptr, op, rank=1, peer=0, phase=1)
    with pytest.raises(PeerTimeout) as info:
        rec.check()
    e = info.value
    assert (e.op, e.rank, e.peer, e.phase, e.timeout_s) == ("test_status_op", 1, 0, "wait tail", 7.5)
    assert "rank 1" in str(e) and "peer 0" in str(e) and "wait tail" in str(e)
    with pytest.raises(BufferUnusable, match="earlier failure"):
        rec.check()
    rec.reset()
    rec.check()
    rec.free()
    rec.free()
    assert released == [True]
    with pytest.raises(BufferUnusable, match="released"):
        rec.check()


def test_reset_record_reads_as_ok_with_unset_details(host_record):
    rec = status.StatusRecord("cpu", timeout_s=1.0)
    raw = status.ErrorRecord.from_address(rec.host_ptr)
    assert raw.code == status.CODE_OK and not status._details_written(raw)


def test_unknown_code_is_reported_not_ignored():
    record = status.ErrorRecord(code=9, op=0, rank=0, peer=1, phase=0)
    err = status.error_from_record(record, 1.0)
    assert "unknown code 9" in str(err) and not isinstance(err, PeerTimeout)


def test_device_check_code_names_op_rank_peer_and_phase():
    from epcomm.errors import DeviceCheckFailed
    op = status.register_op("test_device_check_op", ["ring too small"])
    record = status.ErrorRecord(code=status.CODE_DEVICE_CHECK_FAILED, op=op, rank=1, peer=0, phase=0)
    err = status.error_from_record(record, 1.0)
    assert isinstance(err, DeviceCheckFailed) and not isinstance(err, PeerTimeout)
    assert (err.op, err.rank, err.peer, err.phase) == ("test_device_check_op", 1, 0, "ring too small")


def test_reported_timeout_names_the_culprit_and_the_reporter():
    """A rank told by rank 5 that 5 timed out waiting for rank 7 raises PeerTimeout naming 7 (the
    rank everyone waited for) and 5 (who told it); a check outside any wait has no phase."""
    op = status.register_op("test_reported_op", ["wait counts"])
    record = status.ErrorRecord(code=status.CODE_PEER_REPORTED_TIMEOUT, op=op, rank=2, peer=7, phase=-1,
                                reporter=5)
    err = status.error_from_record(record, 3.0)
    assert isinstance(err, PeerTimeout) and (err.rank, err.peer, err.reported_by) == (2, 7, 5)
    assert err.phase == "between waits" and "rank 5 timed out" in str(err) and "peer 7" in str(err)
    record.phase = 0
    assert status.error_from_record(record, 3.0).phase == "wait counts"
    own = status.ErrorRecord(code=status.CODE_PEER_TIMEOUT, op=op, rank=2, peer=7, phase=0, reporter=-1)
    assert status.error_from_record(own, 3.0).reported_by is None


def test_reported_violation_is_peer_failed_naming_the_reporter():
    from epcomm.errors import PeerFailed
    op = status.register_op("test_reported_violation_op", ["counts"])
    record = status.ErrorRecord(code=status.CODE_PEER_REPORTED_VIOLATION, op=op, rank=0, peer=3, phase=0,
                                reporter=1)
    err = status.error_from_record(record, 3.0)
    assert isinstance(err, PeerFailed) and not isinstance(err, PeerTimeout)
    assert (err.rank, err.peer) == (0, 1) and "data of rank 3" in str(err)


def test_error_codes_are_the_kernels():
    """The host's codes are read from timeout.cuh, not restated: a renumbering there moves them."""
    from epcomm.runtime import cuda_decls
    decl = cuda_decls.header("common/timeout.cuh")
    assert [e.name for e in decl.enum("ErrorCode")] == ["kOk", "kPeerTimeout", "kDeviceCheckFailed",
                                                        "kPeerReportedTimeout", "kPeerReportedViolation"]
    assert (status.CODE_PEER_REPORTED_TIMEOUT, status.CODE_PEER_REPORTED_VIOLATION) == (3, 4)
    assert [name for name, _ in status.ErrorRecord._fields_][:6] == ["code", "op", "rank", "peer", "phase",
                                                                      "reporter"]


# ---- host layout --------------------------------------------------------------------------------
def test_local_rank_count():
    assert local_rank_count(["a"] * 4) == 4
    assert local_rank_count(["a", "a", "b", "b"]) == 2
    with pytest.raises(ValueError, match="contiguous"):
        local_rank_count(["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="same number of ranks"):
        local_rank_count(["a", "a", "a", "b"])
