"""epcomm.autograd on the CPU backend (2 and 3 gloo ranks; internode semantics on 2), against
gradients derived by hand from the routing.

Gradcheck in exact arithmetic: inputs and upstream gradients are small integers, so every sum the
forward and backward compute (BF16 rows, fp32 accumulation) is exact and the gradients can be
compared bit for bit with the analytic ones. The analytic gradient is brute force from the
all-gathered inputs: a received row is token n of source rank s, so d recv_x[row] / d x_s[n] = I,
and combine's rows each take their token's gradient (the transpose). The upstream gradient of each
rank is rebuilt on every rank from (kind, rank, shape), so no gradient is exchanged.

Each world size is one run through every scenario (starting gloo processes costs seconds); a
failure's traceback names the scenario. The scenarios live in tests/helpers/autograd.py;
tests/gpu/test_autograd_gpu.py runs them on GPUs."""
import os

import pytest

from tests.conftest import run_ranks
from tests.helpers import autograd as scenarios


def _run(rank, world, group, modes):
    import epcomm
    from epcomm import autograd as ep
    w = scenarios.World(rank, world)
    for num_local_ranks in modes:
        os.environ["EPCOMM_NUM_LOCAL_RANKS"] = str(num_local_ranks)
        internode = num_local_ranks < world
        buf = epcomm.Buffer(group, 1 << 20, (1 << 20) if internode else 0, explicitly_destroy=True)
        assert (w.layout(buf)["num_tokens_per_rdma_rank"] is not None) == internode
        scenarios.normal_mode_scenarios(w, buf, ep)
        buf.destroy()
    t = 16
    buf = epcomm.Buffer(group, 0, epcomm.Buffer.get_low_latency_rdma_size_hint(t, scenarios.HIDDEN, world,
                                                                                 w.num_experts),
                        low_latency_mode=True, explicitly_destroy=True)
    scenarios.low_latency_inference_only(w, buf, ep, t)
    buf.destroy()


@pytest.mark.parametrize("world, modes", [(2, (2, 1)), (3, (3,))], ids=["2-ranks-intra-and-internode", "3-ranks"])
def test_autograd_cpu(world, modes):
    run_ranks(_run, world, modes, timeout=300)
