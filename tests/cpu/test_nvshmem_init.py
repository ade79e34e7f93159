"""The collective logic of Nvshmem.init on 2 gloo processes, with a stand-in for libnvshmem_host
(no GPU here): unique-ID exchange, the init attributes handed to NVSHMEM, environment defaults,
reuse of the world, a mismatched group, consistent failure on every rank, finalize order."""
from __future__ import annotations

import ctypes
import os

import torch

from tests.conftest import run_ranks

_NVSHMEM_VARS = ("NVSHMEM_DISABLE_NVLS", "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_SYMMETRIC_SIZE")


class FakeLibrary:
    """Answers the calls Nvshmem makes, the way libnvshmem_host does, and records them."""

    def __init__(self, uid_rc=0):
        self.status, self.pe, self.n_pes, self.uid_rc = 0, -1, -1, uid_rc
        self.uid_args, self.init_flags, self.attr_versions, self.finalized = None, [], None, 0

    def nvshmemx_init_status(self):
        return self.status

    def nvshmem_my_pe(self):
        return self.pe

    def nvshmem_n_pes(self):
        return self.n_pes

    def nvshmemx_vendor_get_version_info(self, major, minor, patch):
        major._obj.value, minor._obj.value, patch._obj.value = 3, 4, 5

    def nvshmemx_get_uniqueid(self, uid_ref):
        uid_ref._obj.internal = f"uid-of-pid-{os.getpid()}".encode()
        return self.uid_rc

    def nvshmemx_set_attr_uniqueid_args(self, rank, size, uid_ref, attr_ref):
        self.uid_args = (rank, size, uid_ref._obj.version, bytes(uid_ref._obj.internal))
        return 0

    def nvshmemx_hostlib_init_attr(self, flags, attr_ref):
        attr = attr_ref._obj
        self.init_flags.append(flags)
        self.attr_versions = (attr.version, attr.args.version, attr.args.uid_args.version)
        self.status, self.pe, self.n_pes = 2, self.uid_args[0], self.uid_args[1]
        return 0

    def nvshmemx_hostlib_finalize(self):
        self.finalized += 1


def _expect_error(fn, text):
    from epcomm.errors import NvshmemError
    try:
        fn()
    except NvshmemError as e:
        assert text in str(e), f"{text!r} not in {e}"
        return
    raise AssertionError(f"no NvshmemError ({text!r})")


def _install(monkey_lib):
    from epcomm.runtime import nvshmem
    nvshmem.library = lambda: monkey_lib
    nvshmem._make_context_current = lambda device_index: None
    torch.cuda.synchronize = lambda *args: None  # finalize and barriers; nothing queued here
    nvshmem.Nvshmem._instance = None
    return nvshmem


def _init_scenarios(rank, world_size, group):
    import torch.distributed as dist
    for name in _NVSHMEM_VARS:
        os.environ.pop(name, None)
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = "3G"  # a user value must survive

    lib = FakeLibrary()
    nvshmem = _install(lib)
    world = nvshmem.Nvshmem.init(group, 0)
    assert (world.my_pe, world.n_pes, world.owns_world, world.version) == (rank, 2, True, (3, 4, 5))
    assert lib.init_flags == [1 << 3] and lib.attr_versions == (65680, 65664, 65560)
    assert lib.uid_args[:3] == (rank, 2, 65664)
    uids = [None, None]
    dist.all_gather_object(uids, lib.uid_args[3], group=group)
    assert uids[0] == uids[1] and uids[0].startswith(b"uid-of-pid-"), uids  # rank 0's, everywhere
    assert (os.environ["NVSHMEM_DISABLE_NVLS"], os.environ["NVSHMEM_REMOTE_TRANSPORT"],
            os.environ["NVSHMEM_SYMMETRIC_SIZE"]) == ("1", "none", "3G")

    # Reuse, over another group of the same ranks: no second initialisation.
    other = dist.new_group(ranks=[0, 1], backend="gloo")
    assert nvshmem.Nvshmem.init(other, 0) is world and lib.init_flags == [1 << 3]
    # Another device for the same process: refused on every rank.
    _expect_error(lambda: nvshmem.Nvshmem.init(group, 1), "one GPU per process")
    # A group that does not match the world (each rank alone): refused.
    singles = [dist.new_group(ranks=[r], backend="gloo") for r in range(2)]
    _expect_error(lambda: nvshmem.Nvshmem.init(singles[rank], 0), "does not match the group")

    # Finalize: teardown callbacks first, in order, then the library, once.
    calls = []
    world.add_teardown(lambda: calls.append("first"))
    world.add_teardown(lambda: calls.append("second"))
    world.finalize()
    world.finalize()
    assert calls == ["first", "second"] and lib.finalized == 1 and not world.live
    _expect_error(lambda: world.malloc(16), "finalised")

    # A failure on one rank raises on every rank (nobody is left waiting inside NVSHMEM).
    lib = FakeLibrary(uid_rc=7)
    nvshmem = _install(lib)
    _expect_error(lambda: nvshmem.Nvshmem.init(group, 0), "nvshmemx_get_uniqueid on rank 0 returned 7")
    if rank == 1:
        def missing():
            raise nvshmem.NvshmemError("libnvshmem_host.so.3 not found on this rank")
        nvshmem.library = missing
    _expect_error(lambda: nvshmem.Nvshmem.init(group, 0), "rank 1: libnvshmem_host.so.3 not found")


def test_init_reuse_mismatch_and_finalize_on_two_ranks():
    run_ranks(_init_scenarios, 2)


def test_uid_bytes_survive_the_exchange_format():
    from epcomm.runtime.nvshmem import UniqueId
    uid = UniqueId()
    uid.internal = b"\x00\x01abc"  # NUL bytes inside: exchanged as bytes(), not as a C string
    copy = UniqueId()
    ctypes.memmove(ctypes.addressof(copy), bytes(uid), ctypes.sizeof(uid))
    assert bytes(copy) == bytes(uid) and len(bytes(uid)) == 128
