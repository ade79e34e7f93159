"""The host reads the kernels' declarations from cuda_src/ (epcomm.runtime.cuda_decls): the parser on
a small header, and what every family takes from its headers. Compiles nothing; the compile tests
(test_*_plan.py: offsetof / static_assert) check the same mirrors against NVRTC."""
import ctypes

import pytest

from epcomm.ops import internode_plan, intranode_plan, layout, low_latency, low_latency_layout
from epcomm.runtime import cuda_decls

HEADER = r"""
#pragma once
#include "base.cuh"
namespace demo {
constexpr int kWarps = kThreads / 32, kLanes = 32;   // kThreads: base.cuh
constexpr long long kBig = 1LL << 40;
struct Params {
    const void *x;            // pointer
    const int *a, *b;         // two pointers in one declaration
    unsigned long long timeout_ns;
    int n, m;
    float scale;
    bool flag;
    unsigned int *counter;
};
template <int kRanks> struct Header {
    static constexpr long long kDone = 64;
    static constexpr long long kReady = (kDone + 8LL * kRanks + 127) / 128 * 128;
    static constexpr int kWarps = 3;   // shadows the namespace-scope kWarps inside the struct
    static constexpr long long kBytes = kReady + kWarps;
};
enum Phase : int {
    kPhaseA = 0,   // the first phase
    kPhaseB = 1,   // the second, whose comment
                   // goes on below
    kPhaseC        // implicit value
};
enum Counter { kOne = 3, kTwo, kCount = 8 };
enum TraceSlot : int { kTrStart = 0, kTrFirstData = 1, kTrWaitNs = 2, kTraceSlots = 3 };
}
"""


@pytest.fixture
def demo(tmp_path):
    (tmp_path / "base.cuh").write_text("constexpr int kThreads = 512;\n")
    (tmp_path / "demo.cuh").write_text(HEADER)
    return cuda_decls.header("demo.cuh", str(tmp_path))


def test_struct_fields_in_order_with_c_padding(demo):
    params = demo.struct("Params")
    assert [name for name, _ in params._fields_] == ["x", "a", "b", "timeout_ns", "n", "m", "scale", "flag",
                                                     "counter"]
    assert dict(params._fields_)["b"] is ctypes.c_void_p and dict(params._fields_)["flag"] is ctypes.c_bool
    assert params.counter.offset == 48 and ctypes.sizeof(params) == 56   # 3 bytes after flag, as C pads


def test_constants_members_and_enums(demo):
    assert demo.constant("kWarps") == 16 and demo.constant("kLanes") == 32 and demo.constant("kBig") == 1 << 40
    assert demo.constant("kThreads") == 512          # from the included header
    assert demo.constant("kCount") == 8 and demo.constant("kTwo") == 4
    assert demo.member("Header", "kReady", kRanks=1) == 128 and demo.member("Header", "kReady", kRanks=8) == 128
    assert demo.member("Header", "kReady", kRanks=9) == 256
    assert demo.member("Header", "kBytes", kRanks=9) == 259   # the member kWarps, not the namespace one
    assert [(e.name, e.value) for e in demo.enum("Phase")] == [("kPhaseA", 0), ("kPhaseB", 1), ("kPhaseC", 2)]
    assert demo.enum("Phase")[1].comment == "the second, whose comment goes on below"
    assert demo.enum_comments("Phase")[2] == "implicit value"
    with pytest.raises(ValueError, match="each with a comment"):
        demo.enum_comments("Counter")   # neither 0, 1, 2 nor commented
    assert demo.enum_names("TraceSlot", "kTr") == ["start", "first_data", "wait_ns"]
    with pytest.raises(ValueError, match="demo.cuh: no struct Nope"):
        demo.struct("Nope")
    with pytest.raises(ValueError, match="no integer constexpr kNope"):
        demo.constant("kNope")


def test_unsupported_fields_are_refused(tmp_path):
    (tmp_path / "bad.cuh").write_text("struct P { int f(int); };\nstruct Q { Thing t; };\n"
                                      "struct R { Thing t[2]; };\n")
    bad = cuda_decls.header("bad.cuh", str(tmp_path))
    with pytest.raises(ValueError, match="only scalar, pointer, struct and array"):
        bad.struct("P")
    with pytest.raises(ValueError, match="'Thing', not mirrored"):
        bad.struct("Q")
    with pytest.raises(ValueError, match="'Thing', not mirrored"):
        bad.struct("R")


def test_struct_and_array_fields(tmp_path):
    (tmp_path / "nest.cuh").write_text("constexpr int kSlots = 3;\n"
                                       "struct Slot { void *data; unsigned int n; };\n"
                                       "struct Table { int count; Slot slots[kSlots]; int tail[2]; Slot last; };\n")
    table = cuda_decls.header("nest.cuh", str(tmp_path)).struct("Table")
    kinds = dict(table._fields_)
    assert [name for name, _ in table._fields_] == ["count", "slots", "tail", "last"]
    assert kinds["slots"]._length_ == 3 and ctypes.sizeof(kinds["slots"]) == 3 * 16
    assert kinds["tail"]._length_ == 2 and ctypes.sizeof(table) == 8 + 48 + 8 + 16
    assert table.slots.offset == 8 and table.last.offset == 64


def test_poison_params_come_from_its_source():
    from epcomm.ops import poison
    assert ctypes.sizeof(poison.PoisonParams) == 160 and poison.MAX_TARGETS == 6
    assert [name for name, _ in poison.PoisonParams._fields_] == ["err", "num_targets", "reserved", "targets"]


def test_every_params_struct_is_read_without_padding_fields():
    structs = [*intranode_plan.PARAMS.values(), *internode_plan.PARAMS.values(), low_latency.DispatchParams,
               low_latency.CombineParams, layout.LayoutParams]
    assert len(structs) == 9
    for struct in structs:
        names = [name for name, _ in struct._fields_]
        assert names and not any(name.startswith("pad") for name in names), struct
        assert "op" in names or struct is layout.LayoutParams


def test_limits_are_declared_once():
    limits = cuda_decls.header("common/limits.cuh")
    top_k, threads = limits.constant("kMaxTopk"), limits.constant("kDataThreads")
    assert intranode_plan.MAX_TOPK == internode_plan.MAX_TOPK == low_latency_layout.MAX_TOPK == top_k
    assert intranode_plan.THREADS == internode_plan.THREADS == low_latency_layout.THREADS == layout.THREADS == threads
    assert low_latency_layout.RECORD_BYTES == 16 * top_k


def test_trace_slot_names_come_from_the_enums():
    assert intranode_plan.TRACE_SLOTS[:4] == ["start", "idle", "sent", "first_data"]
    assert len(intranode_plan.TRACE_SLOTS) == cuda_decls.header("intranode_protocol.cuh").constant("kTraceSlots")
    assert low_latency.TRACE_SLOTS[-4:] == ["aux_a", "aux_b", "aux_c", "count"]
    assert len(low_latency.TRACE_SLOTS) == cuda_decls.header("low_latency_protocol.cuh").constant("kTraceSlots")


def test_phase_names_come_from_the_enums():
    for phases, count in ((intranode_plan.PHASES, 7), (internode_plan.PHASES, 8),
                          (low_latency.DISPATCH_PHASES, 3), (low_latency.COMBINE_PHASES, 4)):
        assert len(phases) == count and all(len(p) > 10 for p in phases), phases
    assert "num_nvl_bytes too small" in intranode_plan.PHASES[4]
    assert "free ring slots" in internode_plan.PHASES[7]
    assert low_latency.DISPATCH_PHASES[0] == low_latency.COMBINE_PHASES[0]


def test_header_offsets_follow_the_cuda_formulas():
    # Spot values of the headers' own formulas: the compile tests check them against NVRTC too.
    # 64 + 8 * 2R (done, notify), to 128; 16 * R * G (G = 1024 chunks); 4R of wait notes, to 128
    assert intranode_plan.header_bytes(1) == 128 + 16 * 1024 + 128
    assert intranode_plan.header_bytes(8) == 256 + 16 * 8 * 1024 + 128
    # R = 8, M = 2, L = 4, C = 128 channels: 64 + 8 * (3R + M*C + C*R + 2*C*L + 2*M*C), to 256
    assert internode_plan.header_bytes(8, 2) == 22784
    assert internode_plan.header_bytes(64, 8) == -(-(64 + 8 * (3 * 64 + 8 * 128 + 128 * 64 + 2 * 128 * 8 + 2 * 8 * 128))
                                                   // 256) * 256


def test_member_values_are_remembered_per_template_arguments(monkeypatch):
    """Layouts are read on per-call host paths: a second read must not evaluate the header's
    formula again (parsing it cost ~400 us per call)."""
    from epcomm.ops import intranode_plan
    decls = intranode_plan._DECLS
    evaluated = []
    real = decls._member
    monkeypatch.setattr(decls, "_member", lambda *a: evaluated.append(a) or real(*a))
    first = intranode_plan.header_bytes(6)
    for _ in range(5):
        assert intranode_plan.header_bytes(6) == first
    assert intranode_plan.header_bytes(7) != first           # other arguments: evaluated on their own
    assert len(evaluated) <= 2, evaluated
