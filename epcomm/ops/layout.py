"""get_dispatch_layout on the GPU: one launch of cuda_src/layout.cu (see its header for the method).

Outputs are allocated on the current torch stream and the kernel runs on it. The three count
vectors are views of one int32 allocation, so a multi-block launch needs a single memset; a
launch of one block writes them directly and needs none.
"""
from __future__ import annotations

import ctypes
import functools
from typing import List, Optional, Tuple

import torch

from ..runtime.arch import device_arch
from ..runtime.compiler import KernelSource
from ..runtime.module import get_kernel

THREADS = 512
# Up to this many tokens one block does everything (no memset, no global atomics); above it the
# token range is spread over up to one block per SM.
SINGLE_BLOCK_TOKENS = THREADS
_INDEX_TYPES = {torch.int64: "long long", torch.int32: "int"}


class LayoutParams(ctypes.Structure):
    """Mirror of epcomm::LayoutParams (cuda_src/layout.cu)."""
    _fields_ = [
        ("topk_idx", ctypes.c_void_p),
        ("num_tokens_per_rank", ctypes.c_void_p),
        ("num_tokens_per_rdma_rank", ctypes.c_void_p),
        ("num_tokens_per_expert", ctypes.c_void_p),
        ("is_token_in_rank", ctypes.c_void_p),
        ("num_tokens", ctypes.c_longlong),
    ]


def layout_source(num_topk: int, num_experts: int, num_ranks: int, num_local_ranks: int,
                  index_dtype: torch.dtype, load_bytes: int) -> KernelSource:
    kernel = (f"epcomm::layout_kernel<{num_topk}, {num_experts}, {num_ranks}, {num_local_ranks}, "
              f"{_INDEX_TYPES[index_dtype]}, {load_bytes}, {THREADS}>")
    return KernelSource("layout.cu", (kernel,))


def representative_sources() -> List[KernelSource]:
    """For `python -m epcomm.jit --precompile`: DeepSeek-V3-like routing, intranode (8 ranks, one
    node) and internode (16 ranks, 2 nodes), both index types."""
    return [layout_source(8, 256, 8, 8, torch.int64, 16),
            layout_source(8, 256, 16, 8, torch.int32, 16)]


def _shared_bytes(num_experts: int, num_ranks: int, num_local_ranks: int) -> int:
    # One int per expert, per rank and per node: the kernel's dynamic shared memory.
    return 4 * (num_experts + num_ranks + num_ranks // num_local_ranks)


def _load_bytes(topk_idx: torch.Tensor) -> int:
    """Widest vector load (16, 8 or 4 bytes) that divides a token's row and its alignment."""
    row = topk_idx.shape[1] * topk_idx.element_size()
    for width in (16, 8, 4):
        if row % width == 0 and topk_idx.data_ptr() % width == 0:
            return width
    raise ValueError("topk_idx is not 4-byte aligned")


@functools.lru_cache(maxsize=None)
def _kernel(num_topk, num_experts, num_ranks, num_local_ranks, index_dtype, load_bytes,
            device_index, feature):
    src = layout_source(num_topk, num_experts, num_ranks, num_local_ranks, index_dtype, load_bytes)
    kernel = get_kernel(src, 0, device_index, feature)
    kernel.set_max_dynamic_smem(_shared_bytes(num_experts, num_ranks, num_local_ranks))
    return kernel


def _check(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_local_ranks: int):
    if topk_idx.dim() != 2 or topk_idx.dtype not in _INDEX_TYPES or not topk_idx.is_cuda:
        raise ValueError(f"get_dispatch_layout: topk_idx must be a 2-D int64/int32 CUDA tensor, got "
                         f"{topk_idx.dtype} {tuple(topk_idx.shape)} on {topk_idx.device}")
    if topk_idx.shape[1] < 1:
        raise ValueError("get_dispatch_layout: topk_idx needs at least one column")
    if num_ranks < 1 or num_local_ranks < 1 or num_ranks % num_local_ranks:
        raise ValueError(f"get_dispatch_layout: num_ranks ({num_ranks}) must be a positive multiple "
                         f"of num_local_ranks ({num_local_ranks})")
    if num_experts < 1 or num_experts % num_ranks:
        raise ValueError(f"get_dispatch_layout: num_experts ({num_experts}) must be a positive "
                         f"multiple of num_ranks ({num_ranks})")
    if _shared_bytes(num_experts, num_ranks, num_local_ranks) > 200 * 1024:
        raise ValueError(f"get_dispatch_layout: {num_experts} experts need more shared memory than "
                         f"a block has (4 bytes per expert, at most ~50k experts)")


def _pad16(n: int) -> int:
    """Count segments start 16-byte aligned so consumers may use vector loads."""
    return (n + 3) // 4 * 4


def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                        num_local_ranks: int, feature: Optional[int] = None
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """topk_idx [N, K] int64/int32 CUDA, -1 = no expert ->
    (num_tokens_per_rank [R] i32, num_tokens_per_rdma_rank [R / num_local_ranks] i32 or None when
    num_ranks == num_local_ranks, num_tokens_per_expert [E] i32, is_token_in_rank [N, R] bool).
    A token counts once per rank and once per node; per expert, once per top-k slot.
    `feature` (80/90) overrides the device's feature set for this call (tests)."""
    _check(topk_idx, num_experts, num_ranks, num_local_ranks)
    topk_idx = topk_idx.contiguous()
    num_tokens, num_topk = topk_idx.shape
    num_nodes = num_ranks // num_local_ranks
    device = topk_idx.device
    blocks = 1 if num_tokens <= SINGLE_BLOCK_TOKENS else \
        min(-(-num_tokens // THREADS), device_arch(device.index).num_sms)
    sizes = (_pad16(num_ranks), _pad16(num_nodes), _pad16(num_experts))
    alloc = torch.empty if blocks == 1 and num_tokens > 0 else torch.zeros
    counts = alloc(sum(sizes), dtype=torch.int32, device=device)
    per_rank = counts[:num_ranks]
    per_node = counts[sizes[0]:sizes[0] + num_nodes]
    per_expert = counts[sizes[0] + sizes[1]:sizes[0] + sizes[1] + num_experts]
    in_rank = torch.empty((num_tokens, num_ranks), dtype=torch.bool, device=device)
    if num_tokens > 0:
        kernel = _kernel(num_topk, num_experts, num_ranks, num_local_ranks, topk_idx.dtype,
                         _load_bytes(topk_idx), device.index, feature or device_arch(device.index).feature)
        params = LayoutParams(topk_idx.data_ptr(), per_rank.data_ptr(), per_node.data_ptr(),
                              per_expert.data_ptr(), in_rank.data_ptr(), num_tokens)
        kernel.launch((blocks, 1, 1), (THREADS, 1, 1), params,
                      torch.cuda.current_stream(device).cuda_stream,
                      smem=_shared_bytes(num_experts, num_ranks, num_local_ranks))
    return per_rank, (per_node if num_nodes > 1 else None), per_expert, in_rank
