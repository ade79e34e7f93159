"""The public surface matches DeepEP V1 (`import epcomm as deep_ep`): names, argument order and
defaults of every public callable, static methods, exports; `import epcomm` stays light."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from tests.conftest import ROOT

REQUIRED = inspect.Parameter.empty

# DeepEP V1 (deep_ep/buffer.py, deep_ep/utils.py, the pybind Config): (name, default) per parameter.
DEEPEP_BUFFER = {
    "__init__": [("self", REQUIRED), ("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                 ("low_latency_mode", False), ("num_qps_per_rank", 24),
                 ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False), ("use_fabric", False),
                 ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "destroy": [("self", REQUIRED)],
    "get_comm_stream": [("self", REQUIRED)],
    "get_local_buffer_tensor": [("self", REQUIRED), ("dtype", REQUIRED), ("size", None), ("offset", 0),
                                ("use_rdma_buffer", False)],
    "get_dispatch_layout": [("self", REQUIRED), ("topk_idx", REQUIRED), ("num_experts", REQUIRED),
                            ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": [("self", REQUIRED), ("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                 ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None), ("num_tokens_per_expert", None),
                 ("topk_idx", None), ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0),
                 ("config", None), ("previous_event", None), ("async_finish", False),
                 ("allocate_on_comm_stream", False)],
    "combine": [("self", REQUIRED), ("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None),
                ("config", None), ("previous_event", None), ("async_finish", False),
                ("allocate_on_comm_stream", False)],
    "internode_dispatch": [("self", REQUIRED), ("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                           ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                           ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                           ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                           ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "internode_combine": [("self", REQUIRED), ("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None),
                          ("bias", None), ("config", None), ("previous_event", None), ("async_finish", False),
                          ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("self", REQUIRED), ("num_max_dispatch_tokens_per_rank", REQUIRED),
                                 ("hidden", REQUIRED), ("num_experts", REQUIRED)],
    "low_latency_dispatch": [("self", REQUIRED), ("x", REQUIRED), ("topk_idx", REQUIRED),
                             ("num_max_dispatch_tokens_per_rank", REQUIRED), ("num_experts", REQUIRED),
                             ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
                             ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False),
                             ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("self", REQUIRED), ("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED),
                            ("handle", REQUIRED), ("use_logfmt", False), ("zero_copy", False),
                            ("async_finish", False), ("return_recv_hook", False), ("out", None),
                            ("combine_wait_recv_cost_stats", None)],
    "low_latency_update_mask_buffer": [("self", REQUIRED), ("rank_to_mask", REQUIRED), ("mask", False)],
    "low_latency_query_mask_buffer": [("self", REQUIRED), ("mask_status", REQUIRED)],
    "low_latency_clean_mask_buffer": [("self", REQUIRED)],
    "get_next_low_latency_combine_buffer": [("self", REQUIRED), ("handle", REQUIRED)],
}
DEEPEP_BUFFER_STATIC = {
    "set_num_sms": [("new_num_sms", REQUIRED)],
    "is_sm90_compiled": [],
    "capture": [],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                       ("num_ranks", REQUIRED), ("num_experts", REQUIRED)],
    "get_dispatch_config": [("num_ranks", REQUIRED)],
    "get_combine_config": [("num_ranks", REQUIRED)],
}
DEEPEP_CONFIG = {
    "__init__": [("self", REQUIRED), ("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                 ("num_max_nvl_chunked_recv_tokens", 256), ("num_max_rdma_chunked_send_tokens", 6),
                 ("num_max_rdma_chunked_recv_tokens", 256)],
    "get_nvl_buffer_size_hint": [("self", REQUIRED), ("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)],
    "get_rdma_buffer_size_hint": [("self", REQUIRED), ("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)],
}
DEEPEP_EVENT_HANDLE = {
    "__init__": [("self", REQUIRED)],
    "current_stream_wait": [("self", REQUIRED)],
}
DEEPEP_EVENT_OVERLAP = {
    "__init__": [("self", REQUIRED), ("event", None), ("extra_tensors", None)],
    "current_stream_wait": [("self", REQUIRED)],
    "__enter__": [("self", REQUIRED)],
    "__exit__": [("self", REQUIRED), ("exc_type", REQUIRED), ("exc_val", REQUIRED), ("exc_tb", REQUIRED)],
}


def _parameters(func):
    return [(p.name, p.default) for p in inspect.signature(func).parameters.values()]


def _cases():
    import epcomm
    import epcomm.utils
    for table, owner in ((DEEPEP_BUFFER, "Buffer"), (DEEPEP_BUFFER_STATIC, "Buffer"),
                         (DEEPEP_CONFIG, "Config"), (DEEPEP_EVENT_OVERLAP, "EventOverlap")):
        for name, expected in table.items():
            yield pytest.param(getattr(epcomm, owner), name, expected, id=f"{owner}.{name}")
    for table, owner in ((DEEPEP_EVENT_OVERLAP, "EventOverlap"), (DEEPEP_EVENT_HANDLE, "EventHandle")):
        for name, expected in table.items():
            yield pytest.param(getattr(epcomm.utils, owner), name, expected, id=f"utils.{owner}.{name}")


@pytest.mark.parametrize("cls, name, expected", list(_cases()))
def test_signature_matches_deepep(cls, name, expected):
    func = inspect.getattr_static(cls, name)
    if name in DEEPEP_BUFFER_STATIC and cls.__name__ == "Buffer":
        assert isinstance(func, staticmethod), f"Buffer.{name} must be a staticmethod, as in DeepEP"
    assert _parameters(getattr(cls, name)) == expected


def test_exports_and_class_attributes():
    import torch

    import epcomm
    assert sorted(epcomm.__all__) == ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
    assert epcomm.topk_idx_t is torch.int64
    assert isinstance(epcomm.__version__, str)
    assert epcomm.Buffer.num_sms == 20
    assert epcomm.Buffer.is_sm90_compiled() is True
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        epcomm.nonexistent
    for name in epcomm.__all__:
        assert name in dir(epcomm)


def test_import_is_light():
    """`import epcomm` pulls in no torch / CUDA / numpy and stays under the 0.5 s target. (Modules
    already loaded at start-up do not count: cuda-bindings 12 installs a .pth that imports `cuda`.)"""
    code = ("import sys, time; before = set(sys.modules); t = time.perf_counter(); import epcomm; "
            "dt = time.perf_counter() - t; "
            "heavy = sorted(m for m in ('torch', 'numpy', 'cupy', 'cuda', 'cuda.bindings') "
            "if m in sys.modules and m not in before); "
            "print(dt); print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    seconds, heavy = (out.stdout.splitlines() + [""])[:2]
    assert heavy == "", f"import epcomm imported {heavy}"
    assert float(seconds) < 0.5, f"import epcomm took {float(seconds):.3f} s"
