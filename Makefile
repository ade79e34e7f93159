# epcomm: `make test` (CPU, CI) and `make bench` (GPU if present, else the CPU backend).
PYTHON  ?= python3
# The GPU machines forbid NVLink multicast; keep it off wherever epcomm runs GPU work.
GPU_ENV := NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$(CURDIR)
# CPU CI installs: torch 2.13.0 (CPU wheel, served locally) and the CUDA 13 compile toolchain
# (NVRTC, nvJitLink, headers, NVSHMEM) so every kernel is compiled and linked in the suite.
DEPS    := torch==2.13.0 numpy pytest "cuda-bindings>=13,<14" cuda-pathfinder \
           "nvidia-cuda-nvrtc>=13,<14" "nvidia-nvjitlink>=13,<14" "nvidia-cuda-runtime>=13,<14" \
           "nvidia-cuda-cccl>=13,<14" "nvidia-nvshmem-cu13==3.4.5"

.PHONY: test test-gpu bench deps precompile clean

deps:
	@$(PYTHON) -c "import torch, numpy, pytest, cuda.bindings.nvrtc, cuda.bindings.nvjitlink; \
	  import nvidia.nvshmem, nvidia.cu13" 2>/dev/null \
	  || $(PYTHON) -m pip install -q $(DEPS)

test: deps
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -rs tests

precompile: deps
	PYTHONPATH=$(CURDIR) $(PYTHON) -m epcomm.jit --precompile --arch sm_80,sm_90

# GPU tests: each test runs collectively on every rank. RANKS_PER_GPU=N (default 1) runs N ranks on
# every GPU under CUDA MPS (gloo bootstrap, SM partition per rank): 2, 4, 8 ranks and internode
# topologies on one GPU, for correctness. GPU_TESTS narrows the selection (pytest paths / -k ...).
RANKS_PER_GPU ?= 1
GPU_TESTS     ?= tests
test-gpu:
	$(GPU_ENV) $(PYTHON) -m tests.gpu_session --ranks-per-gpu $(RANKS_PER_GPU) \
	  -q -rs -m gpu -p no:cacheprovider $(GPU_TESTS)

bench:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(MAKE) deps
	$(GPU_ENV) $(PYTHON) -m bench

clean:
	rm -rf .pytest_cache build dist *.egg-info
