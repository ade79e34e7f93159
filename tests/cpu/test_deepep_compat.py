"""DeepEP V1 surface that unmodified clients reach for beyond Buffer's main calls:
`Buffer.internode_dispatch` / `internode_combine` (same results as dispatch / combine on a
multi-domain Buffer, a clear error on a single-domain one), `epcomm.utils` (Megatron-LM's
`from deep_ep.utils import EventHandle, EventOverlap`), and the opt-in `import deep_ep` alias."""
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_ranks

HIDDEN, TOPK, TOKENS = 128, 2, 5


def _inputs(rank, num_experts):
    gen = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    weights, idx = torch.rand(TOKENS, num_experts, generator=gen).topk(TOPK, dim=-1)
    return x, idx, weights


def _round_trip(buffer, dispatch, combine, x, idx, weights, num_experts, **stream):
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = dispatch(
        x, None, per_rank, per_rdma, in_rank, per_expert, idx, weights, **stream)
    cached = dispatch(x, handle)[0]
    combined, combined_w, _ = combine(recv_x, handle, recv_w, **stream)
    return recv_x, recv_idx, recv_w, counts, cached, combined, combined_w


def _internode_entry_points(rank, world, group):
    import epcomm
    from epcomm.utils import EventHandle, EventOverlap
    num_experts = 2 * world
    inputs = _inputs(rank, num_experts)
    single = epcomm.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 20, explicitly_destroy=True)
    with pytest.raises(ValueError, match="Buffer.internode_dispatch: .* one NVLink domain"):
        single.internode_dispatch(inputs[0])
    with pytest.raises(ValueError, match="Buffer.internode_combine: .* one NVLink domain"):
        single.internode_combine(inputs[0], None)
    single.destroy()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPCOMM_NUM_LOCAL_RANKS", "1")
        buffer = epcomm.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 20, explicitly_destroy=True)
    assert buffer.runtime.get_num_rdma_ranks() == world
    want = _round_trip(buffer, buffer.dispatch, buffer.combine, *inputs, num_experts)
    # as Megatron-LM calls them: a captured EventHandle as previous_event, async_finish
    stream = dict(previous_event=EventOverlap(EventHandle()), async_finish=True)
    got = _round_trip(buffer, buffer.internode_dispatch, buffer.internode_combine, *inputs, num_experts,
                      **stream)
    assert len(want[4]) == len(got[4])
    for a, b in zip(want, got):
        assert a == b if isinstance(a, list) else torch.equal(a, b)
    buffer.destroy()
    with pytest.raises(Exception, match="destroyed"):
        buffer.internode_dispatch(inputs[0])


def test_internode_dispatch_and_combine():
    run_ranks(_internode_entry_points, 2)


def test_utils_exports_the_classes_buffer_uses():
    import epcomm
    import epcomm.utils
    from epcomm.event import EventOverlap
    assert epcomm.utils.EventOverlap is EventOverlap is epcomm.EventOverlap
    assert epcomm.utils is epcomm.__getattr__("utils")
    handle = epcomm.utils.EventHandle()
    if not torch.cuda.is_available():
        assert handle.event is None    # nothing is queued anywhere: waiting is a no-op
    handle.current_stream_wait()
    with EventOverlap(handle):
        pass


# ---- the opt-in alias ---------------------------------------------------------------------------
def _python(code, site_dir, extra_path=None):
    """Run code in a fresh interpreter that processes site_dir's .pth files like site-packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, ROOT) if p)
    prelude = f"import site; site.addsitedir({str(site_dir)!r}); "
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=site_dir, env=env,
                          capture_output=True, text=True)


def _alias(*args):
    out = subprocess.run([sys.executable, "-m", "epcomm.deep_ep_alias", *args], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    return out.stdout


RESOLVES = ("import deep_ep, epcomm, epcomm.utils; from deep_ep.utils import EventHandle, EventOverlap; "
            "from deep_ep.buffer import Buffer; "
            "assert deep_ep.Buffer is epcomm.Buffer is Buffer and EventOverlap is epcomm.utils.EventOverlap; "
            "assert EventHandle is epcomm.utils.EventHandle and deep_ep.topk_idx_t is epcomm.topk_idx_t; "
            "print(deep_ep.__file__)")


def test_deep_ep_is_not_importable_unless_asked(tmp_path):
    out = _python("import deep_ep", tmp_path)
    assert out.returncode != 0 and "No module named 'deep_ep'" in out.stderr


def test_alias_install_uninstall(tmp_path):
    assert "not installed" in _alias("status", "--site", str(tmp_path))
    _alias("install", "--site", str(tmp_path))
    out = _python(RESOLVES, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "deep_ep_alias" in out.stdout
    assert "installed" in _alias("status", "--site", str(tmp_path))
    assert "removed" in _alias("uninstall", "--site", str(tmp_path))
    assert _python("import deep_ep", tmp_path).returncode != 0


def test_alias_does_not_shadow_a_real_deep_ep_unless_asked(tmp_path):
    real = tmp_path / "real"
    (real / "deep_ep").mkdir(parents=True)
    (real / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    site_dir = tmp_path / "site"
    _alias("install", "--site", str(site_dir))
    out = _python("import deep_ep; print(getattr(deep_ep, 'REAL', False))", site_dir, extra_path=str(real))
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
    _alias("install", "--site", str(site_dir), "--shadow")
    out = _python(RESOLVES, site_dir, extra_path=str(real))
    assert out.returncode == 0 and "deep_ep_alias" in out.stdout, out.stderr


def test_alias_path_for_pythonpath(tmp_path):
    folder = _alias("path").strip()
    out = _python(RESOLVES, tmp_path, extra_path=folder)
    assert out.returncode == 0, out.stderr
