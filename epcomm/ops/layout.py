"""get_dispatch_layout on the GPU: one launch of cuda_src/layout.cu (see its header for the method).

Outputs are allocated on the current torch stream and the kernel runs on it. The host path of a
call is on the critical path of every MoE layer, so it is kept to: the backend's lookup of the cached
plan (kernel, launch shape), the output allocations (three or four torch.empty: the kernel zeroes
what it accumulates into, so there is no memset and no fill kernel) and one launch. Everything a
plan fixes (dtype, device, K, E, R, L, the load width) is checked once, when the plan is made.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import List, NamedTuple, Optional, Tuple

import torch

from ..runtime.arch import device_arch
from ..runtime import cuda_decls
from ..runtime.compiler import KernelSource
from ..runtime.module import get_kernel
from ._common import INDEX_TYPES, current_stream, plan_for

_DECLS = cuda_decls.header("layout.cu")
THREADS = _DECLS.constant("kDataThreads")
# Up to this many tokens one block does everything (no global atomics, plain launch); above it the
# token range is spread over up to one block per SM (a cooperative launch, see layout.cu).
SINGLE_BLOCK_TOKENS = THREADS
_I32, _BOOL = torch.int32, torch.bool


LayoutParams = _DECLS.struct("LayoutParams")


def layout_source(num_topk: int, num_experts: int, num_ranks: int, num_local_ranks: int,
                  index_dtype: torch.dtype, load_bytes: int) -> KernelSource:
    kernel = (f"epcomm::layout_kernel<{num_topk}, {num_experts}, {num_ranks}, {num_local_ranks}, "
              f"{INDEX_TYPES[index_dtype]}, {load_bytes}, {THREADS}>")
    return KernelSource("layout.cu", (kernel,))


def representative_sources() -> List[KernelSource]:
    """For `python -m epcomm.jit --precompile`: DeepSeek-V3-like routing, intranode (8 ranks, one
    node) and internode (16 ranks, 2 nodes), both index types."""
    return [layout_source(8, 256, 8, 8, torch.int64, 16),
            layout_source(8, 256, 16, 8, torch.int32, 16)]


def _shared_bytes(num_experts: int, num_ranks: int, num_local_ranks: int) -> int:
    # One int per expert, per rank and per node: the kernel's dynamic shared memory.
    return 4 * (num_experts + num_ranks + num_ranks // num_local_ranks)


def _load_bytes(row_bytes: int, address: int) -> int:
    """Widest vector load (16, 8 or 4 bytes) that divides a token's row and its alignment."""
    for width in (16, 8, 4):
        if row_bytes % width == 0 and address % width == 0:
            return width
    raise ValueError("get_dispatch_layout: topk_idx is not 4-byte aligned")


class _Plan:
    """One specialisation: its kernel and launch constants, and the shapes of its outputs.
    `counts` / `flags`: empty int32 / bool tensors on the device, whose new_empty allocates the
    outputs (cheaper than torch.empty, which parses dtype and device on every call)."""
    __slots__ = ("kernel", "smem", "counts", "flags", "num_nodes", "max_blocks")

    def __init__(self, kernel, smem: int, device: torch.device, num_nodes: int, max_blocks: int):
        self.kernel, self.smem, self.num_nodes, self.max_blocks = kernel, smem, num_nodes, max_blocks
        self.counts = torch.empty(0, dtype=_I32, device=device)
        self.flags = torch.empty(0, dtype=_BOOL, device=device)


class LayoutSpec(NamedTuple):
    num_topk: int
    num_experts: int
    num_ranks: int
    num_local_ranks: int
    index_dtype: torch.dtype
    device_index: int            # -1: not a CUDA tensor (the build rejects it)
    feature: Optional[int]
    misalignment: int            # topk_idx's address % 16: the load width depends on it


# The plan cache of callers without a Buffer (tests, benchmarks); a GpuBackend passes itself.
_NO_BACKEND = SimpleNamespace(plans={})


def _make_plan(owner, spec: LayoutSpec) -> _Plan:
    num_topk, num_experts, num_ranks, num_local_ranks, dtype, device_index, feature, misalign = spec
    if dtype not in INDEX_TYPES or device_index < 0:
        device = f"cuda:{device_index}" if device_index >= 0 else "cpu"
        raise ValueError(f"get_dispatch_layout: topk_idx must be a 2-D int64/int32 CUDA tensor, got "
                         f"{dtype} with {num_topk} columns on {device}")
    if num_topk < 1:
        raise ValueError("get_dispatch_layout: topk_idx needs at least one column")
    if num_ranks < 1 or num_local_ranks < 1 or num_ranks % num_local_ranks:
        raise ValueError(f"get_dispatch_layout: num_ranks ({num_ranks}) must be a positive multiple "
                         f"of num_local_ranks ({num_local_ranks})")
    if num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"get_dispatch_layout: num_experts ({num_experts}) must be a positive "
                         f"multiple of num_ranks ({num_ranks})")
    smem = _shared_bytes(num_experts, num_ranks, num_local_ranks)
    if smem > 200 * 1024:
        raise ValueError(f"get_dispatch_layout: {num_experts} experts need more shared memory than "
                         f"a block has (4 bytes per expert, at most ~50k experts)")
    load_bytes = _load_bytes(num_topk * dtype.itemsize, misalign)
    arch = device_arch(device_index)
    src = layout_source(num_topk, num_experts, num_ranks, num_local_ranks, dtype, load_bytes)
    kernel = get_kernel(src, 0, device_index, feature or arch.feature)
    kernel.set_max_dynamic_smem(smem)
    # A cooperative grid must be co-resident: at most one block per SM, fewer if even that
    # does not fit (Kernel.launch checks it again).
    max_blocks = max(1, min(arch.num_sms, kernel.max_active_blocks_per_sm(THREADS, smem) * arch.num_sms))
    return _Plan(kernel, smem, torch.device("cuda", device_index), num_ranks // num_local_ranks, max_blocks)


def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                        num_local_ranks: int, feature: Optional[int] = None, backend=None
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """topk_idx [N, K] int64/int32 CUDA, -1 = no expert ->
    (num_tokens_per_rank [R] i32, num_tokens_per_rdma_rank [R / num_local_ranks] i32 or None when
    num_ranks == num_local_ranks, num_tokens_per_expert [E] i32, is_token_in_rank [N, R] bool).
    A token counts once per rank and once per node; per expert, once per top-k slot.
    `feature` (80/90) overrides the device's feature set for this call (tests); None reads
    EPCOMM_ARCH / the device's at each call. `backend`: the GpuBackend whose plans hold this call's
    (None: this module's own, for callers without a Buffer)."""
    if topk_idx.dim() != 2:
        raise ValueError(f"get_dispatch_layout: topk_idx must be a 2-D int64/int32 CUDA tensor, got "
                         f"{topk_idx.dtype} {tuple(topk_idx.shape)} on {topk_idx.device}")
    if not topk_idx.is_contiguous():
        topk_idx = topk_idx.contiguous()
    num_tokens, num_topk = topk_idx.shape
    device_index = topk_idx.get_device()
    address = topk_idx.data_ptr()
    if feature is None:
        feature = device_arch(device_index).feature if device_index >= 0 else None
    key = (num_topk, num_experts, num_ranks, num_local_ranks, topk_idx.dtype, device_index, feature, address & 15)
    plan = plan_for(_NO_BACKEND if backend is None else backend, LayoutSpec, key, _make_plan)

    counts, num_nodes = plan.counts, plan.num_nodes
    if num_tokens == 0:
        per_node = counts.new_zeros(num_nodes) if num_nodes > 1 else None
        return counts.new_zeros(num_ranks), per_node, counts.new_zeros(num_experts), plan.flags.new_empty(0, num_ranks)
    per_rank = counts.new_empty(num_ranks)
    per_node = counts.new_empty(num_nodes) if num_nodes > 1 else None
    per_expert = counts.new_empty(num_experts)
    in_rank = plan.flags.new_empty(num_tokens, num_ranks)
    params = LayoutParams(address, per_rank.data_ptr(), 0 if per_node is None else per_node.data_ptr(),
                          per_expert.data_ptr(), in_rank.data_ptr(), num_tokens)
    if num_tokens <= SINGLE_BLOCK_TOKENS:
        plan.kernel.launch((1, 1, 1), (THREADS, 1, 1), params, current_stream(device_index), plan.smem)
    else:
        blocks = min(-(-num_tokens // THREADS), plan.max_blocks)
        plan.kernel.launch((blocks, 1, 1), (THREADS, 1, 1), params, current_stream(device_index),
                           plan.smem, cooperative=blocks > 1)
    return per_rank, per_node, per_expert, in_rank
