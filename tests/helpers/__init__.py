"""Helpers that more than one test file uses (no test file imports another): GPU inputs and checks
(gpu), the internode inputs and checks (internode), the autograd scenarios (autograd), the
validation cases both backends run (validation) and the NVRTC check units (nvrtc). The collective
machinery (run_ranks, on_all_ranks, dist_env) is in tests/conftest.py, the topology sizes in
tests/topology.py."""
