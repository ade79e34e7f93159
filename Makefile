# epcomm: `make test` (CPU, CI) and `make bench` (GPU if present, else the CPU backend).
PYTHON  ?= python3
# The GPU machines forbid NVLink multicast; keep it off wherever epcomm runs GPU work.
GPU_ENV := NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$(CURDIR)
# `make deps` installs only what the suite lacks, in the CUDA flavour already installed (CUDA 13
# when there is none): torch 2.13.0 (CPU wheel), NVRTC, nvJitLink, headers and NVSHMEM 3.4.5 (the
# GPU image's), so every kernel is compiled and linked in the suite (.ci/deps.py).
FLAVOURS_DIR ?= $(CURDIR)/build/flavours

.PHONY: test test-gpu test-flavours bench deps precompile nvshmem-carry clean

deps:
	@missing="$$($(PYTHON) .ci/deps.py missing)"; \
	  if [ -n "$$missing" ]; then echo "make deps ($$($(PYTHON) .ci/deps.py flavour)): $$missing"; \
	    eval $(PYTHON) -m pip install -q $$missing; fi

test: deps
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -rs tests

# Compile, link and ABI tests against CUDA 12 + NVSHMEM 3.8 and CUDA 13 + NVSHMEM 3.8 (venvs and
# unpacked NVSHMEM releases under $(FLAVOURS_DIR); the shared environment is left as it is).
test-flavours: deps
	$(PYTHON) .ci/flavours.py $(FLAVOURS_DIR)

# NVSHMEM 3.8 (headers, host library, bootstrap plugin, device archive) as a tarball to carry to
# the GPU machine: .nv38/ is git-ignored (/.nv38/ in .git/info/exclude).
nvshmem-carry:
	$(PYTHON) .ci/nvshmem_release.py pack 3.8.0 cu13 .nv38/nvshmem-cu13-3.8.0.tar.xz

precompile: deps
	PYTHONPATH=$(CURDIR) $(PYTHON) -m epcomm.jit --precompile --arch sm_80,sm_90

# GPU tests: each test runs collectively on every rank. RANKS_PER_GPU=N (default 1) runs N ranks on
# every GPU under CUDA MPS (gloo bootstrap, SM partition per rank): 2, 4, 8 ranks and internode
# topologies on one GPU, for correctness. GPU_TEST_JOBS=J runs J groups of ranks at once, each on
# every J-th test (a cold JIT cache compiles on J cores). GPU_TESTS narrows the selection (pytest paths / -k ...).
RANKS_PER_GPU ?= 1
GPU_TEST_JOBS ?= 1
GPU_TESTS     ?= tests
test-gpu:
	$(GPU_ENV) $(PYTHON) -m tests.gpu_session --ranks-per-gpu $(RANKS_PER_GPU) --jobs $(GPU_TEST_JOBS) \
	  -q -rs -m gpu -p no:cacheprovider $(GPU_TESTS)

bench:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(MAKE) deps
	$(GPU_ENV) $(PYTHON) -m bench

clean:
	rm -rf .pytest_cache build dist *.egg-info
