"""GPU backend: owns the per-Buffer device state (NVSHMEM world, symmetric buffers, peer tables,
error record) and hands each operation to its module under epcomm.ops.

State the ops modules may use (and nothing else of this class):
  rank, num_ranks, num_local_ranks, device (torch.device), device_index, arch (runtime.arch.Arch)
  plans : the ops modules' plan cache (epcomm.ops._common.plan_for)
  nvl   : runtime.symmetric.SymmetricBuffer of num_nvl_bytes, or None
  rdma  : runtime.symmetric.SymmetricBuffer of num_rdma_bytes, or None
  status: runtime.status.StatusRecord (host-mapped ErrorRecord; .device_ptr, .check())
  timeout_ns, group, nvshmem (runtime.nvshmem.Nvshmem), options (the Buffer constructor flags)
"""
from __future__ import annotations

import os
import warnings
from typing import NamedTuple, Optional

import torch

from .backend import Backend
from .errors import BufferUnusable, EpcommError, PeerTimeout


class _RankFacts(NamedTuple):
    """What each rank tells the others before any collective allocation."""
    host: str
    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    error: Optional[str]            # repr of this rank's setup failure, or None
    forced_local_ranks: Optional[int]
    token: str                      # rank 0's names this Buffer's keys in the store (recover)


class GpuBackend(Backend):
    def __init__(self, group, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                 options: dict):
        """Collective over `group`. Every check that could fail on one rank only is gathered first,
        so all ranks raise together rather than some waiting forever in NVSHMEM."""
        import torch.distributed as dist
        from . import env
        from .runtime.arch import device_arch
        from .runtime.nvshmem import Nvshmem
        from .runtime.rendezvous import group_rendezvous
        from .runtime.topology import host_key, resolve_local_ranks
        from .runtime.status import StatusRecord
        from .runtime.symmetric import SymmetricBuffer

        self._destroyed = True  # until construction completes, destroy() has nothing to release
        self.group = group
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.device_index = torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        self.low_latency_mode = bool(low_latency_mode)
        self.options = dict(options)
        self.timeout_ns = int(env.timeout_s() * 1e9)
        self.nvl = self.rdma = self._ll = self._normal_ops = self._poison = None
        self.plans = {}   # the ops modules' plans: spec type -> {spec: plan} (ops._common.plan_for)

        local_error, status, forced_local_ranks = None, None, None
        try:
            forced_local_ranks = env.num_local_ranks()
            self.arch = device_arch(self.device_index)
            status = StatusRecord(self.device)
        except Exception as e:  # re-raised below, after the other ranks have heard of it
            local_error = e
        mine = _RankFacts(host_key(), num_nvl_bytes, num_rdma_bytes, self.low_latency_mode,
                          repr(local_error) if local_error else None, forced_local_ranks, os.urandom(8).hex())
        facts = [None] * self.num_ranks
        dist.all_gather_object(facts, mine, group=group)
        if local_error is not None:
            raise local_error
        failed = [f"rank {r}: {f.error}" for r, f in enumerate(facts) if f.error]
        if failed:
            status.free()
            raise EpcommError("GPU backend setup failed on other ranks: " + "; ".join(failed))
        for what in ("num_nvl_bytes", "num_rdma_bytes", "low_latency_mode"):
            values = [getattr(f, what) for f in facts]
            if len(set(values)) != 1:
                status.free()
                raise ValueError(f"{what} must be equal on every rank, got {values} (by rank)")
        try:
            self.num_local_ranks = resolve_local_ranks([f.host for f in facts],
                                                       [f.forced_local_ranks for f in facts])
        except ValueError:
            status.free()
            raise

        self.status = status
        # Bounded meetings of this Buffer's ranks, one sequence of rounds per purpose: recover(),
        # destroy(), and the low-latency argument check (epcomm.agreement, called by the Buffer).
        self._rendezvous = group_rendezvous(group, f"buffer-{facts[0].token}")
        self._teardown = group_rendezvous(group, f"buffer-{facts[0].token}/destroy")
        self.agreement = group_rendezvous(group, f"buffer-{facts[0].token}/agree")
        self._unrecoverable: Optional[EpcommError] = None   # a recover() whose rendezvous failed
        # NVSHMEM init and allocation failures raise on every rank at the same point, so what was
        # already allocated can be freed collectively.
        try:
            self.nvshmem = Nvshmem.init(group, self.device_index)
            if num_nvl_bytes > 0:
                self.nvl = SymmetricBuffer(self.nvshmem, num_nvl_bytes, self.device)
            if num_rdma_bytes > 0:
                self.rdma = SymmetricBuffer(self.nvshmem, num_rdma_bytes, self.device)
            # Kernels keep monotonic call counters and flags in these buffers; a heap address reused
            # from an earlier Buffer must not carry its values, so start from zero on every rank
            # before any peer can write (barrier_all synchronises the device first).
            for buf in (self.nvl, self.rdma):
                if buf is not None:
                    buf.view(torch.uint8, (buf.nbytes,), 0).zero_()
            self.nvshmem.barrier_all()
        except BaseException:
            for buf in (self.nvl, self.rdma):
                if buf is not None:
                    buf.free()
            status.free()
            raise
        self._destroyed = False
        # Buffers not destroyed by the user are destroyed at exit, before NVSHMEM is finalised.
        self.nvshmem.add_teardown(self.destroy)

    def _require_usable(self) -> None:
        if self._destroyed:
            raise BufferUnusable("this Buffer was destroyed")
        if self._unrecoverable is not None:
            raise BufferUnusable(f"this Buffer is unusable: Buffer.recover found a rank missing "
                                 f"({self._unrecoverable})") from self._unrecoverable
        if self.status.error is not None:
            raise BufferUnusable(f"this Buffer is unusable after an earlier failure: {self.status.error} "
                                 f"(Buffer.recover() on every rank makes it usable again)") from self.status.error

    # ---- buffer memory -----------------------------------------------------------------------
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        """Zero-copy view of this rank's NVL (or RDMA) buffer from byte `offset`: `size` elements
        shaped as given, or (size None) every whole element up to the end of the buffer."""
        self._require_usable()
        buf, what = (self.rdma, "rdma") if use_rdma_buffer else (self.nvl, "nvl")
        if buf is None:
            raise ValueError(f"get_local_buffer_tensor: this Buffer has no {what.upper()} buffer "
                             f"(num_{what}_bytes=0)")
        if size is None:
            if not isinstance(offset, int) or not 0 <= offset <= buf.nbytes:
                raise ValueError(f"get_local_buffer_tensor: offset {offset!r} is outside the "
                                 f"{what.upper()} buffer of {buf.nbytes} B")
            size = ((buf.nbytes - offset) // dtype.itemsize,)
        return buf.view(dtype, size, offset)

    def check_errors(self) -> None:
        self._require_usable()
        self.status.check()

    def recover(self, timeout_s: Optional[float]) -> None:
        """Collective: bring every rank's communication state back to that of a new Buffer.
        timeout_s: the bound of the meeting, None = twice the Buffer's EPCOMM_TIMEOUT_S.

        Every wait is bounded, so this rank's kernels wind down; once every rank has synchronised
        its device and met the others (bounded: a rank that does not come raises PeerTimeout on
        every rank and the Buffer stays unusable), no kernel of the failed calls runs anywhere.
        Then each rank zeroes its symmetric buffers: call epochs, signals, work claims and the
        sticky failure flag together, as construction does. Epochs start again from zero on
        every rank at once, and no signal of the old calls survives to pass for a new one; a
        barrier keeps any rank from sending before every rank has cleared. The shrink mask is
        kept (it is the caller's setting)."""
        if self._destroyed:
            raise BufferUnusable("Buffer.recover: this Buffer was destroyed")
        if self._unrecoverable is not None:
            raise BufferUnusable(f"Buffer.recover: an earlier recovery found a rank missing "
                                 f"({self._unrecoverable}); build a new Buffer") from self._unrecoverable
        if timeout_s is None:
            timeout_s = 2 * self.status.timeout_s
        self._synchronize()
        try:
            self._rendezvous.meet("Buffer.recover", "every rank quiesced its device", timeout_s)
        except PeerTimeout as e:
            self._unrecoverable = e   # the missing rank may be alive: destroy() still meets it
            raise
        self.nvshmem.barrier_all()   # also completes transfers the failed calls left in flight
        mask = None if self._ll is None else self._ll.mask_state()
        for buf in (self.nvl, self.rdma):
            if buf is not None:
                buf.view(torch.uint8, (buf.nbytes,), 0).zero_()
        if mask is not None:
            self._ll.restart(mask)
        self.nvshmem.barrier_all()
        self.status.reset()

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device_index)

    def destroy(self) -> None:
        """Collective and idempotent: free the symmetric buffers and the error record. The ranks
        first meet (bounded by twice EPCOMM_TIMEOUT_S): NVSHMEM's barrier and collective free
        wait for every PE without a bound, so only ranks that all met take them together; if a
        rank does not come (it failed, or left), every rank leaves the symmetric memory to process
        exit and warns, naming it. Deciding from what each rank saw of earlier failures instead
        would split the ranks when one saw a failure the others did not, and the ranks that
        barrier would wait for ever."""
        if self._destroyed:
            return
        self._destroyed = True
        self._ll = None
        self.plans = {}   # their Params point into the buffers freed below
        self.nvshmem.remove_teardown(self.destroy)
        if self.nvshmem.live and not self.nvshmem.peer_missing and self._every_rank_tears_down():
            self.nvshmem.barrier_all()  # no peer kernel may still write into what is freed next
            for buf in (self.nvl, self.rdma):
                if buf is not None:
                    buf.free()
        self.status.free()

    def _every_rank_tears_down(self) -> bool:
        self._synchronize()   # this rank's kernels are done before it says so
        try:
            self._teardown.meet("Buffer.destroy", "every rank reached destroy", 2 * self.status.timeout_s)
            return True
        except Exception as e:   # PeerTimeout, or the store itself gone (a peer process exited)
            self.nvshmem.peer_missing = True
            warnings.warn(f"Buffer.destroy: symmetric memory left to process exit ({e})", RuntimeWarning,
                          stacklevel=4)   # the caller of Buffer.destroy
            return False

    # ---- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        self._require_usable()
        from .ops import layout
        return layout.get_dispatch_layout(topk_idx, num_experts, self.num_ranks, self.num_local_ranks,
                                          self.arch.feature, backend=self)

    def _normal_mode(self):
        self._require_usable()
        ops = self._normal_ops
        if ops is None:   # imported once: an import statement per call costs ~1 us
            if self.num_ranks > self.num_local_ranks:
                from .ops import internode as ops
            else:
                from .ops import intranode as ops
            self._normal_ops = ops
        return ops

    # Every call's outputs are followed on the stream by the poison launch (ops/poison.py): after a
    # failed wait they read NaN / -1 rather than passing for data.
    def _poisoned(self):
        poison = self._poison
        if poison is None:
            from .ops.poison import Poison
            poison = self._poison = Poison(self)
        return poison

    def _poisoned_hook(self, hook, *outputs):
        poison = self._poisoned()

        def receive_then_poison():
            hook()
            poison.after(*outputs)
        return receive_then_poison

    def dispatch(self, *args, **kwargs):
        r = self._normal_mode().dispatch(self, *args, **kwargs)
        self._poisoned().after(r.recv_x, r.recv_x_scales, r.recv_topk_idx, r.recv_topk_weights)
        return r

    def combine(self, *args, **kwargs):
        combined_x, combined_weights = self._normal_mode().combine(self, *args, **kwargs)
        self._poisoned().after(combined_x, combined_weights)
        return combined_x, combined_weights

    # ---- per-signature fast paths ------------------------------------------------------------
    # Buffer asks for a runner once it has validated a call signature (arguments as the backend
    # method takes them); the runner launches like the method, poison fill included. None: the
    # signature has no runner (internode, empty tensors), Buffer calls the method itself.
    def dispatch_runner(self, x, x_scales, handle, config):
        ops = self._normal_mode()
        make = getattr(ops, "cached_dispatch_runner", None)
        return None if make is None else make(self, x, x_scales, handle, config, self._poisoned(), self.dispatch)

    def combine_runner(self, x, handle, topk_weights, bias, config):
        ops = self._normal_mode()
        make = getattr(ops, "combine_runner", None)
        return None if make is None else make(self, x, handle, topk_weights, bias, config, self._poisoned(),
                                              self.combine)

    def low_latency_dispatch_runner(self, x, topk_idx, T, E, use_fp8, round_scale, use_ue8m0):
        return self._low_latency().dispatch_runner(x.shape[0], x.shape[1], topk_idx.shape[1], topk_idx.dtype, T, E,
                                                   use_fp8, round_scale, use_ue8m0, self._poisoned(),
                                                   self.low_latency_dispatch)

    def low_latency_combine_runner(self, topk_idx, handle):
        _, _, T, H, E = handle
        return self._low_latency().combine_runner(topk_idx.shape[0], topk_idx.shape[1], topk_idx.dtype, T, H, E,
                                                  self._poisoned(), self.low_latency_combine)

    # ---- low-latency mode --------------------------------------------------------------------
    def _low_latency(self):
        self._require_usable()
        if self._ll is None:
            from .ops.low_latency import LowLatency
            self._ll = LowLatency(self)
        return self._ll

    def low_latency_dispatch(self, *args, **kwargs):
        r = self._low_latency().dispatch(*args, **kwargs)
        if r.hook is None:
            self._poisoned().after(r.recv_x, r.recv_x_scales, r.recv_count)
        else:
            r = r._replace(hook=self._poisoned_hook(r.hook, r.recv_x, r.recv_x_scales, r.recv_count))
        return r

    def low_latency_combine(self, *args, **kwargs):
        combined_x, hook = self._low_latency().combine(*args, **kwargs)
        if hook is None:
            self._poisoned().after(combined_x)
        else:
            hook = self._poisoned_hook(hook, combined_x)
        return combined_x, hook

    def clean_low_latency_buffer(self, *args):
        return self._low_latency().clean_buffer(*args)

    def get_next_low_latency_combine_buffer(self, handle):
        return self._low_latency().next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask):
        return self._low_latency().update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status):
        return self._low_latency().query_mask(mask_status)

    def low_latency_clean_mask_buffer(self):
        return self._low_latency().clean_mask()
