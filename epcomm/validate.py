"""Validation of every Buffer call's arguments, done before anything is launched or changed.

Each failure raises TypeError (wrong Python type or dtype) or ValueError (anything else: shape,
device, contiguity, range, flags that do not go together) with a message that names the call, the
argument, what was expected and what was given. A rejected call leaves the Buffer untouched.

This runs on every call, on the host's critical path (a low-latency dispatch + combine pair has
a budget of tens of microseconds on the host), so each check has a fast path for the valid case:
a tensor is checked with one boolean expression over cheap attribute reads (dtype, device,
contiguity, dim) and its fixed sizes are compared directly; only when that fails does the slow
path work out which rule was broken, in a fixed order (dtype, device, shape, contiguity), and
build the message.

Values inside tensors (topk_idx in [-1, E)) are checked only for CPU tensors: on a GPU the check
would need a device-to-host synchronisation, which would break async overlap and CUDA graphs.
"""
from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch

from .config import Config
from .runtime import cuda_decls
from .event import EventOverlap
from .ops import intranode_plan
from .ops._common import FP8_BLOCK, UE8M0_PER_INT

TOPK_IDX_DTYPE = torch.int64      # epcomm.topk_idx_t


def _normal_index_dtype(topk_idx) -> torch.dtype:
    """Normal mode (layout, dispatch) takes int32 top-k ids as well as topk_idx_t; the
    kernels are specialised on the index type and recv_topk_idx keeps it."""
    return torch.int32 if getattr(topk_idx, "dtype", None) is torch.int32 else TOPK_IDX_DTYPE
MAX_TOPK = cuda_decls.header("common/limits.cuh").constant("kMaxTopk")   # one kernel lane per slot
INT32_MAX = 2 ** 31 - 1           # kernels take counts and sizes as 32-bit ints
BF16, FP8, F32, I32, I64, BOOL = (torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32,
                                  torch.int64, torch.bool)
_Tensor = torch.Tensor


class Call:
    """Validation context of one call: converts DLPack inputs to torch (remembering the caller's
    framework, so `output` can hand results back in it) and checks them against the Buffer's device
    and rank count. Every message starts with the operation's name."""

    __slots__ = ("op", "device", "num_ranks", "framework", "check_values")

    def __init__(self, op: str, device: torch.device, num_ranks: int, check_values: Optional[bool] = None) -> None:
        """check_values: whether values are checked (default: for a CPU device, as they need the
        data on the host, see the module doc); a Buffer passes it precomputed."""
        self.op = op
        self.device = device
        self.num_ranks = num_ranks
        self.framework = None
        self.check_values = device.type == "cpu" if check_values is None else check_values

    def error(self, name: str, message: str, exc=ValueError) -> Exception:
        return exc(f"{self.op}: {name} {message}")

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(f"{self.op}: {message}")

    # ---- scalars -------------------------------------------------------------------------------
    def integer(self, name: str, value, minimum: Optional[int] = None) -> int:
        if type(value) is not int:
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise self.error(name, f"must be an int, got {type(value).__name__} {value!r}", TypeError)
            value = operator.index(value)
        if minimum is not None and value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value}")
        return value

    def flag(self, name: str, value) -> bool:
        if value is True or value is False:
            return value
        numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
        if numpy_bool or (isinstance(value, int) and not isinstance(value, bool) and value in (0, 1)):
            return bool(value)
        raise self.error(name, f"must be a bool, got {type(value).__name__} {value!r}", TypeError)

    def event(self, name: str, value) -> Optional[EventOverlap]:
        if value is not None and not isinstance(value, EventOverlap):
            raise self.error(name, f"must be None or an EventOverlap (from Buffer.capture() or a previous "
                                   f"call), got {type(value).__name__}", TypeError)
        inner = None if value is None else value.event
        if inner is not None and not (isinstance(inner, torch.Event) or hasattr(inner, "wait")
                                      or hasattr(inner, "current_stream_wait")):
            raise self.error(name, f"must wrap a torch.cuda.Event (or None), got an EventOverlap of "
                                   f"{type(inner).__name__}", TypeError)
        return value

    def config(self, name: str, value, default: Config) -> Config:
        if value is None:
            return default
        if not isinstance(value, Config):
            raise self.error(name, f"must be None or an epcomm.Config, got {type(value).__name__}", TypeError)
        return value

    def bounded(self, name: str, value, minimum: int = 0) -> int:
        """An int that kernels take as a 32-bit count (so sizes derived from it stay in range)."""
        value = self.integer(name, value, minimum)
        if value > INT32_MAX:
            raise self.error(name, f"must be at most {INT32_MAX} (a 32-bit count), got {value}")
        return value

    def num_experts(self, name: str, value) -> int:
        value = self.bounded(name, value, minimum=1)
        if value % self.num_ranks:
            raise self.error(name, f"must be divisible by the number of ranks ({self.num_ranks}), got {value}")
        return value

    # ---- tensors -------------------------------------------------------------------------------
    def as_tensor(self, name: str, value) -> torch.Tensor:
        """`value` as a torch tensor: torch tensors as they are, DLPack producers (CuPy) zero-copy.
        The first tensor argument converted decides the framework of the outputs."""
        if isinstance(value, _Tensor):
            if self.framework is None:
                self.framework = "torch"
            return value
        if not hasattr(value, "__dlpack__"):
            raise self.error(name, f"must be a torch.Tensor or a DLPack array, got {type(value).__name__}",
                             TypeError)
        from .runtime.dlpack import to_torch
        tensor, framework = to_torch(value)
        if self.framework is None:
            self.framework = framework
        return tensor

    def tensor(self, name: str, value, dtype, shape: Tuple[Optional[int], ...], dims: str,
               contiguous: bool = True) -> torch.Tensor:
        """Check `value` is a tensor of `dtype` on the Buffer's device, with len(shape) dims, each
        equal to shape[i] unless None (`dims` names them), and contiguous (unless told otherwise)."""
        if type(value) is _Tensor:
            t = value
            if self.framework is None:
                self.framework = "torch"
        elif value is None:
            raise self.error(name, f"must be a {dtype} tensor {dims}, got None", TypeError)
        else:
            t = self.as_tensor(name, value)
        if (t.dtype is not dtype or t.device != self.device or t.dim() != len(shape)
                or (contiguous and not t.is_contiguous())):
            self._reject(name, t, dtype, shape, dims, contiguous)
        # Sizes: a fully fixed shape is one tuple comparison; wildcards (None) appear only in 1-D
        # and 2-D shapes, where (None,) and (None, None) fix nothing.
        if None not in shape:
            if t.shape != shape:
                self._reject(name, t, dtype, shape, dims, contiguous)
        elif len(shape) == 2:
            w0, w1 = shape
            if w0 is not None or w1 is not None:
                s0, s1 = t.shape
                if (w0 is not None and w0 != s0) or (w1 is not None and w1 != s1):
                    self._reject(name, t, dtype, shape, dims, contiguous)
        elif len(shape) != 1:
            raise AssertionError(f"{self.op}: {name}: wildcard sizes are for 1-D and 2-D shapes only")
        return t

    def _reject(self, name, t, dtype, shape, dims, contiguous):
        """Raise the first rule `t` breaks: dtype, device, shape, contiguity."""
        if t.dtype != dtype:
            raise self.error(name, f"must have dtype {dtype}, got {t.dtype}", TypeError)
        if t.device != self.device:
            raise self.error(name, f"must be on the Buffer's device {self.device}, got {t.device}")
        actual = t.shape
        if len(actual) != len(shape) or any(w is not None and w != a for w, a in zip(shape, actual)):
            expected = ", ".join("*" if s is None else str(s) for s in shape)
            raise self.error(name, f"must have shape {dims} = [{expected}], got {list(actual)}")
        if contiguous and not t.is_contiguous():
            raise self.error(name, f"must be contiguous, got strides {t.stride()} for shape {list(actual)}")
        raise AssertionError(f"{self.op}: {name} was rejected without a reason")

    def optional_tensor(self, name, value, dtype, shape, dims, contiguous=True) -> Optional[torch.Tensor]:
        return None if value is None else self.tensor(name, value, dtype, shape, dims, contiguous)

    def topk(self, name: str, t: torch.Tensor, max_topk: int = MAX_TOPK, mode: str = "") -> int:
        k = t.shape[1]
        if not 1 <= k <= max_topk:
            raise self.error(name, f"must have 1 to {max_topk} columns (num_topk){mode}, got {k}")
        return k

    def values_in(self, name: str, t: torch.Tensor, low: int, high: int) -> None:
        """Every value of `t` lies in [low, high) (checked for CPU tensors only, see module doc)."""
        if not self.check_values or t.device.type != "cpu" or t.numel() == 0:
            return
        lo, hi = int(t.min()), int(t.max())
        if lo < low or hi >= high:
            raise self.error(name, f"values must lie in [{low}, {high}), got values in [{lo}, {hi}]")

    def handle_element(self, value):
        """A handle element: tensors (or DLPack arrays) converted to torch; other values as they are."""
        if isinstance(value, _Tensor) or not hasattr(value, "__dlpack__"):
            return value
        return self.as_tensor("handle", value)

    # ---- outputs -------------------------------------------------------------------------------
    def output(self, value):
        """`value` (a tensor, tuple / list of them, or anything else) in the caller's framework."""
        if self.framework is None or self.framework == "torch":
            return value
        if isinstance(value, _Tensor):
            from .runtime.dlpack import from_torch
            return from_torch(value, self.framework)
        if isinstance(value, (tuple, list)):
            items = [self.output(v) for v in value]
            make = getattr(type(value), "_make", None)   # a NamedTuple takes its fields one by one
            return make(items) if make is not None else type(value)(items)
        return value


# ---- handles -----------------------------------------------------------------------------------
class Handle(tuple):
    """A handle as a Buffer's dispatch returns it (normal or low-latency): a tuple to the caller
    (with the field names of the backend's handle type, epcomm.backend), marked with the Buffer's
    token (`owner`). Its elements were made by that Buffer's backend, so when the tuple comes back
    to the same Buffer (combine, cached dispatch, get_next_low_latency_combine_buffer) its tensors
    are not checked again. Changing them in place (resize_, set_) is not supported; any other tuple
    (a copy, a slice, a list) is fully checked. num_tokens: the N of the low-latency dispatch
    that made it (its combine must pass N rows)."""
    owner = None
    num_tokens = None

    def __reduce__(self):
        # A pickled or copied handle comes back as the backend's type, unmarked (checked in full).
        kind = type(self).__mro__[1]
        return (kind._make, (tuple(self),)) if hasattr(kind, "_make") else (tuple, (tuple(self),))


_MARKED_TYPES: dict = {}   # a backend's handle type -> its Handle subclass


def owned_handle(handle: tuple, owner, num_tokens: Optional[int] = None) -> Handle:
    marked_type = _MARKED_TYPES.get(type(handle))
    if marked_type is None:
        kind = type(handle)
        marked_type = _MARKED_TYPES[kind] = Handle if kind is tuple else \
            type(kind.__name__, (kind, Handle), {"__module__": kind.__module__})
    marked = tuple.__new__(marked_type, handle)
    marked.owner = owner
    if num_tokens is not None:
        marked.num_tokens = num_tokens
    return marked


# ---- normal mode -------------------------------------------------------------------------------
def stream_args(c: Call, previous_event, async_finish, allocate_on_comm_stream):
    previous_event = c.event("previous_event", previous_event)
    async_finish = c.flag("async_finish", async_finish)
    allocate_on_comm_stream = c.flag("allocate_on_comm_stream", allocate_on_comm_stream)
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise c.error("allocate_on_comm_stream=True", f"needs previous_event and async_finish=True, got "
                                                      f"previous_event={previous_event!r}, async_finish={async_finish}")
    return previous_event, async_finish, allocate_on_comm_stream


def layout_args(c: Call, topk_idx, num_experts) -> Tuple[torch.Tensor, int]:
    # The valid case in one expression (layout is the cheapest call: its host time is mostly this
    # and the launch); anything else takes the checks below, which raise the precise error.
    if (type(num_experts) is int and type(topk_idx) is _Tensor and not c.check_values and 1 <= num_experts <= INT32_MAX
            and not num_experts % c.num_ranks and topk_idx.dtype is TOPK_IDX_DTYPE and topk_idx.device == c.device
            and topk_idx.dim() == 2 and topk_idx.is_contiguous() and 1 <= topk_idx.shape[1] <= MAX_TOPK):
        if c.framework is None:
            c.framework = "torch"
        return topk_idx, num_experts
    num_experts = c.num_experts("num_experts", num_experts)
    topk_idx = c.tensor("topk_idx", topk_idx, _normal_index_dtype(topk_idx), (None, None),
                        "[num_tokens, num_topk]")
    c.topk("topk_idx", topk_idx)
    c.values_in("topk_idx", topk_idx, -1, num_experts)
    return topk_idx, num_experts


def dispatch_x(c: Call, x) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x: BF16 [N, H] with H * 2 % 16 == 0, or (FP8 e4m3 [N, H], float32 scales [N, H / 128])."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise c.error("x", f"as a tuple must be (x_fp8, x_scales), got {len(x)} elements", TypeError)
        data = c.tensor("x[0]", x[0], FP8, (None, None), "[num_tokens, hidden]")
        n, hidden = data.shape
        if hidden == 0 or hidden % FP8_BLOCK:
            raise c.error("x[0]", f"hidden size must be a positive multiple of {FP8_BLOCK} for FP8, got {hidden}")
        # Scales may have any strides (e.g. a column-major slice), as in DeepEP.
        scales = c.tensor("x[1]", x[1], F32, (n, hidden // FP8_BLOCK), "[num_tokens, hidden / 128]",
                          contiguous=False)
        return data, scales
    if isinstance(x, _Tensor) and x.dtype is not BF16:
        raise c.error("x", f"must be a torch.bfloat16 tensor or a tuple (float8_e4m3fn tensor, float32 "
                           f"scales), got a {x.dtype} tensor", TypeError)
    data = c.tensor("x", x, BF16, (None, None), "[num_tokens, hidden]")
    hidden = data.shape[1]
    if hidden == 0 or hidden % 8:
        raise c.error("x", f"hidden size must be a positive multiple of 8 (16-byte rows), got {hidden}")
    return data, None


def normal_handle(c: Call, handle, internode: bool, owner=None) -> tuple:
    """The intranode 6-tuple or internode 10-tuple of dispatch, with the elements the contract fixes
    checked (the other elements belong to the mode's ops module); a Handle of `owner` as it is."""
    if isinstance(handle, Handle) and owner is not None and handle.owner is owner:
        return handle
    mode, length = ("an internode", 10) if internode else ("an intranode", 6)
    if not isinstance(handle, (tuple, list)):
        raise c.error("handle", f"must be the tuple returned by dispatch, got {type(handle).__name__}", TypeError)
    if len(handle) != length:
        raise c.error("handle", f"must be the {length}-tuple {mode} dispatch returns, got {len(handle)} elements")
    if isinstance(handle, tuple) and _all_torch_or_plain(handle):
        items = handle
    else:
        items = tuple([c.handle_element(v) for v in handle])
    r = c.num_ranks
    if internode:
        c.tensor("handle[6] (recv_gbl_rank_prefix_sum)", items[6], I32, (r,), "[num_ranks]")
    else:
        c.tensor("handle[0] (rank_prefix_matrix)", items[0], I32, (r, r), "[num_ranks, num_ranks]")
        c.tensor("handle[3] (recv_src_idx)", items[3], I32, (None,), "[num_recv_tokens]")
        c.tensor("handle[4] (is_token_in_rank)", items[4], BOOL, (None, r), "[num_tokens, num_ranks]")
    return items


def is_owned(handle, owner) -> bool:
    """The handle object one of this Buffer's calls returned (its routing needs no check)."""
    return isinstance(handle, Handle) and handle.owner is owner


def handle_routing(c: Call, items: tuple, internode: bool, rank: int, num_local_ranks: int) -> None:
    """Full check of a normal-mode handle that is not one this Buffer returned (a rebuilt tuple):
    its routing must be consistent with its counts and ranges, in the layout both backends share
    (the backend-specific elements are checked by shape and the totals they must hold). Reads GPU
    tensors back to the host: this is the slow path of a rebuilt handle only."""
    host = [v.cpu() if isinstance(v, _Tensor) else v for v in items]
    r = c.num_ranks

    def bad(element: str, why: str):
        raise c.error("handle", f"is not a consistent dispatch handle: {element} {why}")

    if internode:
        in_rank, sent_per_rank, recv_prefix, src_meta = host[0], host[2], host[6], host[7]
        send_node_head, send_rank_head = host[8], host[9]
        c.tensor("handle[0] (is_token_in_rank)", items[0], BOOL, (None, r), "[num_tokens, num_ranks]")
        n, nodes = in_rank.shape[0], r // num_local_ranks
        if tuple(send_rank_head.shape) != (n, r) or tuple(send_node_head.shape) != (n, nodes):
            bad("handle[8] / handle[9] (send heads)", f"must have shapes [{n}, {nodes}] and [{n}, {r}], got "
                f"{list(send_node_head.shape)} and {list(send_rank_head.shape)}")
        in_node = in_rank.view(n, nodes, num_local_ranks).any(-1)
        if not torch.equal(send_node_head >= 0, in_node):
            bad("handle[8] (send_rdma_head)", "is not >= 0 exactly where handle[0] sends to the node")
        sent = in_rank.sum(0, dtype=torch.int32)
        if sent_per_rank.numel() < r or not torch.equal(sent_per_rank.flatten()[:r].int(), sent):
            bad("handle[2] (gbl_channel_prefix_matrix)", f"must start with the tokens handle[0] sends to each "
                f"rank, {sent.tolist()}, got {sent_per_rank.flatten()[:r].tolist()}")
        received = torch.diff(recv_prefix.long(), prepend=recv_prefix.new_zeros(1).long())
        rows_meta = src_meta[:, 1] if src_meta.dim() == 2 and src_meta.shape[1] >= 2 else None
        if rows_meta is None:
            bad("handle[7] (recv_src_meta)", f"must be [num_recv_tokens, >= 2], got {list(src_meta.shape)}")
        _check_received_rows(bad, "handle[6] (recv_gbl_rank_prefix_sum)", "handle[7] (recv_src_meta)",
                             received, rows_meta, src_meta[:, 0])
    else:
        prefix, channel, recv_channel, recv_src, in_rank, send_head = host
        n = in_rank.shape[0]
        if (prefix < 0).any() or (prefix.diff(dim=0) < 0).any():
            bad("handle[0] (rank_prefix_matrix)", "must be non-negative and non-decreasing down each column")
        sent = in_rank.sum(0, dtype=torch.int32)
        mine = prefix[rank] - (prefix[rank - 1] if rank else 0)
        if not torch.equal(mine, sent):
            bad("handle[4] (is_token_in_rank)", f"sends {sent.tolist()} tokens to the ranks, handle[0] "
                f"(rank_prefix_matrix) says this rank sends {mine.tolist()}")
        for index, name, table in ((1, "channel_prefix_matrix", channel),
                                   (2, "recv_channel_prefix_matrix", recv_channel)):
            if not isinstance(table, _Tensor) or table.dim() != 2 or table.shape[0] != r:
                bad(f"handle[{index}] ({name})", f"must be [num_ranks={r}, channels]")
        if not torch.equal(channel[:, -1].int(), sent):
            bad("handle[1] (channel_prefix_matrix)", f"must end with the tokens sent to each rank, {sent.tolist()}")
        if not isinstance(send_head, _Tensor) or tuple(send_head.shape) != (n, r):
            bad("handle[5] (send_head)", f"must be [{n}, {r}]")
        if not torch.equal(send_head >= 0, in_rank):
            bad("handle[5] (send_head)", "is not >= 0 exactly where handle[4] sends the token")
        received = torch.diff(prefix[:, rank].long(), prepend=prefix.new_zeros(1).long())
        _check_received_rows(bad, "handle[0] (rank_prefix_matrix)", "handle[3] (recv_src_idx)", received,
                             recv_src, None)


def _check_received_rows(bad, counts_name: str, rows_name: str, received, src_token, src_rank) -> None:
    """The received rows: per-source counts >= 0, then as many valid rows (token ids >= 0, increasing
    within each source's block, the block's source rank where the handle stores it), then padding (-1)."""
    if (received < 0).any():
        bad(counts_name, f"gives negative row counts per source {received.tolist()}")
    valid = int(received.sum())
    if src_token.shape[0] < valid:
        bad(rows_name, f"has {src_token.shape[0]} rows, the counts of {counts_name} need {valid}")
    if (src_token[valid:] != -1).any() or (src_rank is not None and (src_rank[valid:] != -1).any()):
        bad(rows_name, f"must be -1 on the padding rows past the {valid} received")
    begin = 0
    for source, count in enumerate(received.tolist()):
        block = src_token[begin:begin + count].long()
        if (block < 0).any() or (block.diff() <= 0).any():
            bad(rows_name, f"rows {begin}..{begin + count - 1} (from rank {source}) must hold increasing "
                           f"token indices >= 0")
        if src_rank is not None and (src_rank[begin:begin + count] != source).any():
            bad(rows_name, f"rows {begin}..{begin + count - 1} must name source rank {source}")
        begin += count


def _all_torch_or_plain(items) -> bool:
    """No element needs a DLPack conversion (torch tensors, ints, None, ...)."""
    for v in items:
        if type(v) is not _Tensor and hasattr(v, "__dlpack__"):
            return False
    return True


def dispatch_args(c: Call, internode: bool, num_local_ranks: int, x, handle, num_tokens_per_rank,
                  num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                  expert_alignment, num_worst_tokens, owner=None) -> tuple:
    """-> the arguments of Backend.dispatch before config, normalised."""
    r = c.num_ranks
    x, x_scales = dispatch_x(c, x)
    n = x.shape[0]
    expert_alignment = c.integer("expert_alignment", expert_alignment, minimum=1)
    num_worst_tokens = c.bounded("num_worst_tokens", num_worst_tokens, minimum=0)
    if handle is not None:
        if topk_idx is not None or topk_weights is not None:
            raise c.error("topk_idx", "and topk_weights must be None when a cached handle is given (the "
                                      "handle fixes the routing)")
        handle = normal_handle(c, handle, internode, owner)
        if not internode and handle[4].shape[0] != n:
            raise c.error("x", f"must have as many rows as the handle's is_token_in_rank "
                               f"({handle[4].shape[0]}), got {n}")
        return (x, x_scales, handle, None, None, None, None, None, None, expert_alignment, num_worst_tokens)

    if (num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None
            or (internode and num_tokens_per_rdma_rank is None)):
        required = [("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                    ("num_tokens_per_expert", num_tokens_per_expert)]
        if internode:
            required.append(("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank))
        missing = [name for name, value in required if value is None]
        raise ValueError(f"{c.op}: {', '.join(missing)} must be given when handle is None "
                         f"(get them from Buffer.get_dispatch_layout)")
    num_tokens_per_rank = c.tensor("num_tokens_per_rank", num_tokens_per_rank, I32, (r,), "[num_ranks]")
    if internode:
        num_tokens_per_rdma_rank = c.tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, I32,
                                            (r // num_local_ranks,), "[num_rdma_ranks]")
    else:
        num_tokens_per_rdma_rank = None   # unused intranode, as in DeepEP
    is_token_in_rank = c.tensor("is_token_in_rank", is_token_in_rank, BOOL, (n, r), "[num_tokens, num_ranks]")
    num_tokens_per_expert = c.tensor("num_tokens_per_expert", num_tokens_per_expert, I32, (None,),
                                     "[num_experts]")
    num_experts = c.num_experts("num_tokens_per_expert.shape[0] (num_experts)", num_tokens_per_expert.shape[0])

    if (topk_idx is None) != (topk_weights is None):
        raise c.error("topk_idx", f"and topk_weights must be given together, got topk_idx "
                                  f"{'None' if topk_idx is None else 'set'} and topk_weights "
                                  f"{'None' if topk_weights is None else 'set'}")
    if topk_idx is not None:
        topk_idx = c.tensor("topk_idx", topk_idx, _normal_index_dtype(topk_idx), (n, None),
                            "[num_tokens, num_topk]")
        k = c.topk("topk_idx", topk_idx)
        topk_weights = c.tensor("topk_weights", topk_weights, F32, (n, k), "[num_tokens, num_topk]")
        c.values_in("topk_idx", topk_idx, -1, num_experts)
    elif num_worst_tokens > 0:
        raise c.error("num_worst_tokens > 0", "needs topk_idx and topk_weights")
    return (x, x_scales, None, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens)


def combine_args(c: Call, internode: bool, x, handle, topk_weights, bias, owner=None) -> tuple:
    """-> (x, handle, topk_weights, (bias_0, bias_1)), the arguments of Backend.combine before config."""
    if type(x) is not _Tensor:
        x = c.as_tensor("x", x)   # first, so x decides the framework of the outputs
    handle = normal_handle(c, handle, internode, owner)
    num_recv = None if internode else handle[3].shape[0]
    num_tokens = None if internode else handle[4].shape[0]
    x = c.tensor("x", x, BF16, (num_recv, None), "[num_recv_tokens of the handle, hidden]")
    hidden = x.shape[1]
    if hidden == 0 or hidden % 8:
        raise c.error("x", f"hidden size must be a positive multiple of 8 (16-byte rows), got {hidden}")
    if topk_weights is not None:
        topk_weights = c.tensor("topk_weights", topk_weights, F32, (x.shape[0], None),
                                "[num_recv_tokens, num_topk]")
        c.topk("topk_weights", topk_weights)
    if bias is None:
        return x, handle, topk_weights, (None, None)
    if isinstance(bias, _Tensor) or hasattr(bias, "__dlpack__"):
        biases, names = (bias, None), ("bias", "bias")
    elif isinstance(bias, (tuple, list)) and len(bias) == 2:
        biases, names = tuple(bias), ("bias[0]", "bias[1]")
    else:
        raise c.error("bias", f"must be None, a tensor or a 2-tuple of tensors, got {type(bias).__name__}",
                      TypeError)
    biases = (c.optional_tensor(names[0], biases[0], BF16, (num_tokens, hidden), "[num_tokens, hidden]"),
              c.optional_tensor(names[1], biases[1], BF16, (num_tokens, hidden), "[num_tokens, hidden]"))
    return x, handle, topk_weights, biases


def intranode_fits(c: Call, num_nvl_bytes: int, args: tuple, combine: bool, passed: set) -> None:
    """The NVL buffer must hold the intranode kernels' signal header and one record per peer: a
    rule on the sizes alone, checked here for both backends so that what a CPU run accepts the
    GPU accepts too. args: dispatch_args' or combine_args' result; `passed` remembers the shapes
    that fit (the common path is one set lookup)."""
    if combine:
        x, _, topk_weights, _ = args
        row_bytes, num_scales, fresh = x.shape[1] * 2, 0, False
        num_topk = 0 if topk_weights is None else topk_weights.shape[1]
        num_local_experts = 0
    else:
        x, x_scales, handle = args[0], args[1], args[2]
        fresh = handle is None
        row_bytes = x.shape[1] * x.element_size()
        num_scales = 0 if x_scales is None else x_scales.shape[1]
        num_topk = 0 if not fresh or args[7] is None else args[7].shape[1]
        num_local_experts = args[6].shape[0] // c.num_ranks if fresh else 0
    key = (combine, row_bytes, num_scales, num_topk, num_local_experts, fresh)
    if key in passed:
        return
    r = c.num_ranks
    header = intranode_plan.header_bytes(r)
    if header > num_nvl_bytes:
        raise c.error("num_nvl_bytes", f"(the Buffer's, {num_nvl_bytes}) is smaller than the {header}-byte "
                                       f"signal header of {r} ranks (Config.get_nvl_buffer_size_hint)")
    if combine:
        staging, record = (intranode_plan.combine_staging_offset(r),
                           intranode_plan.combine_record_bytes(row_bytes, num_topk))
    else:
        staging = intranode_plan.dispatch_staging_offset(r, num_local_experts) if fresh \
            else intranode_plan.combine_staging_offset(r)
        record = intranode_plan.dispatch_record_bytes(row_bytes, num_scales, num_topk)
    intranode_plan.ring_rows(num_nvl_bytes, staging, record, r, c.op)
    passed.add(key)


# ---- low-latency mode --------------------------------------------------------------------------
def exclusive_hook(c: Call, async_finish, return_recv_hook) -> Tuple[bool, bool]:
    async_finish = c.flag("async_finish", async_finish)
    return_recv_hook = c.flag("return_recv_hook", return_recv_hook)
    if async_finish and return_recv_hook:
        raise c.error("return_recv_hook=True", "cannot be combined with async_finish=True (the hook is "
                                          "how the receive is completed)")
    return async_finish, return_recv_hook


def ll_shape(c: Call, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> Tuple[int, int, int]:
    """(T, H, E) of a low-latency call, as clean_low_latency_buffer and handles carry them."""
    t = c.bounded("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
    h = c.bounded("hidden", hidden, minimum=1)
    if h % 8:
        raise c.error("hidden", f"must be a multiple of 8, got {h}")
    return t, h, c.num_experts("num_experts", num_experts)


def ll_dispatch_args(c: Call, max_topk: int, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale,
                     use_ue8m0) -> tuple:
    """-> the arguments of Backend.low_latency_dispatch before return_recv_hook, normalised."""
    r = c.num_ranks
    # Scalars: plain ints and bools pass inline checks (the low-latency host budget is tight);
    # anything else goes through the general checks, which convert or raise.
    t, e = num_max_dispatch_tokens_per_rank, num_experts
    if type(t) is not int or t < 1 or t > INT32_MAX:
        t = c.bounded("num_max_dispatch_tokens_per_rank", t, minimum=1)
    if type(e) is not int or e < 1 or e % r or e > INT32_MAX:
        e = c.num_experts("num_experts", e)
    if not (type(use_fp8) is bool and type(round_scale) is bool and type(use_ue8m0) is bool):
        use_fp8, round_scale, use_ue8m0 = (c.flag("use_fp8", use_fp8), c.flag("round_scale", round_scale),
                                           c.flag("use_ue8m0", use_ue8m0))
    x = c.tensor("x", x, BF16, (None, None), "[num_tokens, hidden]")
    n, hidden = x.shape
    if n > t:
        raise c.error("x", f"must have at most num_max_dispatch_tokens_per_rank ({t}) rows, got {n}")
    multiple = 8
    if use_fp8:
        multiple = FP8_BLOCK * UE8M0_PER_INT if use_ue8m0 else FP8_BLOCK
        if use_ue8m0 and not round_scale:
            raise c.error("use_ue8m0=True", "needs round_scale=True (UE8M0 stores power-of-two scales)")
    if hidden == 0 or hidden % multiple:
        what = "UE8M0 scales" if use_fp8 and use_ue8m0 else "FP8" if use_fp8 else "BF16"
        raise c.error("x", f"hidden size must be a positive multiple of {multiple} with {what}, got {hidden}")
    topk_idx = c.tensor("topk_idx", topk_idx, TOPK_IDX_DTYPE, (n, None), "[num_tokens, num_topk]")
    c.topk("topk_idx", topk_idx, max_topk, " in low-latency mode")
    c.values_in("topk_idx", topk_idx, -1, e)
    cumulative = wait_stats = None
    if cumulative_local_expert_recv_stats is not None:
        cumulative = c.tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                              I32, (e // r,), "[num_local_experts]")
    if dispatch_wait_recv_cost_stats is not None:
        wait_stats = c.tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, I64, (r,),
                              "[num_ranks]")
    return x, topk_idx, t, e, cumulative, wait_stats, use_fp8, round_scale, use_ue8m0


def ll_handle(c: Call, handle, owner=None) -> tuple:
    """(src_info [E_l, R*T] int32, layout_range [E_l, R] int64, T, H, E) of low_latency_dispatch;
    a Handle of `owner` as it is."""
    if isinstance(handle, Handle) and owner is not None and handle.owner is owner:
        return handle
    if not isinstance(handle, (tuple, list)) or len(handle) != 5:
        got = f"{len(handle)} elements" if isinstance(handle, (tuple, list)) else type(handle).__name__
        raise c.error("handle", f"must be the 5-tuple (src_info, layout_range, num_max_dispatch_tokens_per_rank, "
                                f"hidden, num_experts) low_latency_dispatch returns, got {got}", TypeError)
    t, h, e = handle[2], handle[3], handle[4]
    r = c.num_ranks
    if not (type(t) is int and type(h) is int and type(e) is int and t >= 1 and h >= 1 and not h % 8
            and e >= 1 and not e % r):
        t, h, e = ll_shape(c, t, h, e)
    src_info = c.tensor("handle[0] (src_info)", handle[0], I32, (e // r, r * t),
                        "[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]")
    layout_range = c.tensor("handle[1] (layout_range)", handle[1], I64, (e // r, r), "[num_local_experts, num_ranks]")
    return src_info, layout_range, t, h, e


def ll_combine_args(c: Call, max_topk: int, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out,
                    combine_wait_recv_cost_stats, owner=None) -> tuple:
    """-> (x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out, wait_stats), normalised."""
    if type(x) is not _Tensor:
        x = c.as_tensor("x", x)   # first, so x decides the framework of the outputs
    handle = ll_handle(c, handle, owner)
    _, _, t, hidden, e = handle
    r = c.num_ranks
    x = c.tensor("x", x, BF16, (e // r, r * t, hidden),
                 "[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden of the handle]")
    topk_idx = c.tensor("topk_idx", topk_idx, TOPK_IDX_DTYPE, (None, None), "[num_tokens, num_topk]")
    n = topk_idx.shape[0]
    if n > t:
        raise c.error("topk_idx", f"must have at most num_max_dispatch_tokens_per_rank ({t}) rows, got {n}")
    k = c.topk("topk_idx", topk_idx, max_topk, " in low-latency mode")
    c.values_in("topk_idx", topk_idx, -1, e)
    topk_weights = c.tensor("topk_weights", topk_weights, F32, (n, k), "[num_tokens, num_topk]")
    if out is not None:
        out = c.tensor("out", out, BF16, (n, hidden), "[num_tokens, hidden]")
    wait_stats = None
    if combine_wait_recv_cost_stats is not None:
        wait_stats = c.tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, I64, (r,),
                              "[num_ranks]")
    if not (type(use_logfmt) is bool and type(zero_copy) is bool):
        use_logfmt, zero_copy = c.flag("use_logfmt", use_logfmt), c.flag("zero_copy", zero_copy)
    return x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out, wait_stats


# ---- signatures of the per-call fast path --------------------------------------------------------
# A Buffer remembers the signature of each call that passed the checks above and ran; a later call
# with an equal signature skips them (Buffer's fast path). A signature holds everything the checks
# read: each tensor's shape, dtype, device and contiguity (strides where any are allowed), the
# scalars, the handle's sizes. Only plain arguments have one (torch tensors, ints, bools, Config):
# anything else (DLPack arrays, numpy scalars, rebuilt handles) returns None and is checked in full
# on every call. Signatures never meet values, which only CPU tensors have checked (a Buffer on a
# CPU device takes no fast path).
def _tensor_signature(t):
    """None for None, False for anything but a torch tensor (no fast path), else the signature."""
    if t is None:
        return None
    if type(t) is not _Tensor:
        return False
    return t.shape, t.dtype, t.device, t.is_contiguous()


def _tensors_signature(*tensors) -> tuple:
    """_tensor_signature of each of `tensors` (known to be torch tensors), in one flat tuple."""
    fields: tuple = ()
    for t in tensors:
        fields += _tensor_signature(t)
    return fields


def ll_dispatch_signature(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats,
                          wait_stats, use_fp8, round_scale, use_ue8m0):
    if (type(x) is not _Tensor or type(topk_idx) is not _Tensor or type(num_max_dispatch_tokens_per_rank) is not int
            or type(num_experts) is not int or type(use_fp8) is not bool or type(round_scale) is not bool
            or type(use_ue8m0) is not bool):
        return None
    cumulative, wait = _tensor_signature(cumulative_stats), _tensor_signature(wait_stats)
    if cumulative is False or wait is False:
        return None
    return _tensors_signature(x, topk_idx) + (num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                              use_ue8m0, cumulative, wait)


def ll_combine_signature(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, out, wait_stats, owner):
    if (type(x) is not _Tensor or type(topk_idx) is not _Tensor or type(topk_weights) is not _Tensor
            or not isinstance(handle, Handle) or handle.owner is not owner or type(use_logfmt) is not bool
            or type(zero_copy) is not bool):
        return None
    out_signature, wait = _tensor_signature(out), _tensor_signature(wait_stats)
    if out_signature is False or wait is False:
        return None
    return _tensors_signature(x, topk_idx, topk_weights) + (handle[2], handle[3], handle[4], handle.num_tokens,
                                                            use_logfmt, zero_copy, out_signature, wait)


def _intranode_handle_sizes(handle, owner):
    """(N, M, G + 1) of an intranode handle this Buffer returned, None for any other handle."""
    if not isinstance(handle, Handle) or handle.owner is not owner:
        return None
    return handle[4].shape[0], handle[3].shape[0], handle[1].shape[1]


def cached_dispatch_signature(x, handle, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                              owner, default_sms: int):
    """Intranode cached dispatch (a handle of `owner`) only; default_sms: what a config of None
    resolves to depends on (Buffer.num_sms)."""
    if (topk_idx is not None or topk_weights is not None or type(expert_alignment) is not int
            or type(num_worst_tokens) is not int or (config is not None and type(config) is not Config)):
        return None
    sizes = _intranode_handle_sizes(handle, owner)
    if sizes is None:
        return None
    if type(x) is _Tensor:
        data, scales = x, None
    elif type(x) is tuple and len(x) == 2 and type(x[0]) is _Tensor and type(x[1]) is _Tensor:
        data, scales = x
        scales = (scales.shape, scales.dtype, scales.device, scales.stride())
    else:
        return None
    return (data.shape, data.dtype, data.device, data.is_contiguous(), scales, sizes, expert_alignment,
            num_worst_tokens, default_sms if config is None else config)


def combine_signature(x, handle, topk_weights, bias, config, owner, default_sms: int):
    """Intranode combine with a handle of `owner` only (see cached_dispatch_signature)."""
    if type(x) is not _Tensor or (config is not None and type(config) is not Config):
        return None
    sizes = _intranode_handle_sizes(handle, owner)
    weights = _tensor_signature(topk_weights)
    if sizes is None or weights is False:
        return None
    if bias is None or type(bias) is _Tensor:
        biases = _tensor_signature(bias)
    elif type(bias) in (tuple, list) and len(bias) == 2:
        biases = (type(bias), _tensor_signature(bias[0]), _tensor_signature(bias[1]))
        if False in biases:
            return None
    else:
        return None
    return (x.shape, x.dtype, x.device, x.is_contiguous(), weights, biases, sizes,
            default_sms if config is None else config)
