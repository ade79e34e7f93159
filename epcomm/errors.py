"""Exceptions raised by epcomm. Each names the operation and, where one is involved, rank and peer."""
from __future__ import annotations


class EpcommError(RuntimeError):
    """Base class of epcomm's runtime errors (bad input raises ValueError / TypeError instead)."""


class ToolchainError(EpcommError):
    """NVRTC, nvJitLink, CUDA headers or NVSHMEM could not be found or loaded."""


class CompileError(EpcommError):
    def __init__(self, stage: str, key: str, log: str, unit_path: str | None = None):
        self.stage, self.key, self.log, self.unit_path = stage, key, log, unit_path
        where = f" (unit dumped to {unit_path})" if unit_path else ""
        super().__init__(f"{stage} failed for {key}{where}:\n{log}")


class NvshmemError(EpcommError):
    """NVSHMEM is missing, failed to initialise, or its world does not match the group."""


class PeerTimeout(EpcommError):
    """A wait on another rank ran past EPCOMM_TIMEOUT_S (GPU kernel or CPU backend exchange).
    `peer` is the rank that was waited for. `reported_by` (GPU; None otherwise): this rank's own
    waits had not run out; that rank timed out waiting for `peer` in the same call and told this
    rank, which stopped at once instead of waiting out its own deadline."""

    def __init__(self, op: str, rank: int, peer: int, phase: str, timeout_s: float,
                 reported_by: "int | None" = None):
        self.op, self.rank, self.peer, self.phase, self.timeout_s = op, rank, peer, phase, timeout_s
        self.reported_by = reported_by
        if reported_by is not None:
            text = (f"{op}: rank {rank} stopped ({phase}): rank {reported_by} timed out after "
                    f"{timeout_s:g} s in this call waiting for peer {peer}")
        else:
            text = f"{op}: rank {rank} timed out after {timeout_s:g} s waiting for peer {peer} ({phase})"
        super().__init__(text)


class PeerFailed(EpcommError):
    """The same collective call failed on another rank (its input was rejected, or the exchanged
    data broke a rule there), so this rank's call was abandoned too; `message` is that rank's error."""

    def __init__(self, op: str, rank: int, peer: int, message: str):
        self.op, self.rank, self.peer, self.message = op, rank, peer, message
        super().__init__(f"{op}: rank {rank} stopped because the call failed on rank {peer}: {message}")


class DeviceCheckFailed(EpcommError):
    """A kernel found a size or configuration violation only the GPU can see (a receive chunk larger
    than its ring, more rows than num_worst_tokens, ranks calling with different configs)."""

    def __init__(self, op: str, rank: int, peer: int, phase: str):
        self.op, self.rank, self.peer, self.phase = op, rank, peer, phase
        super().__init__(f"{op}: rank {rank} stopped: {phase} (peer {peer})")


class BufferUnusable(EpcommError):
    """The Buffer saw a peer timeout or was destroyed; its communication state is no longer valid."""
