# epcomm: `make test` (CPU, CI) and `make bench` (GPU if present, else the CPU backend).
PYTHON  ?= python3
NGPUS   ?= $(shell $(PYTHON) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
# The GPU machines forbid NVLink multicast; keep it off wherever epcomm runs GPU work.
GPU_ENV := NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$(CURDIR)
# `make deps` installs only what the suite lacks, in the CUDA flavour already installed (CUDA 13
# when there is none): torch 2.13.0 (CPU wheel), NVRTC, nvJitLink, headers and NVSHMEM 3.4.5 (the
# GPU image's), so every kernel is compiled and linked in the suite (scripts/deps.py).
FLAVOURS_DIR ?= $(CURDIR)/build/flavours

.PHONY: test test-gpu test-flavours bench deps precompile nvshmem-carry clean

deps:
	@missing="$$($(PYTHON) scripts/deps.py missing)"; \
	  if [ -n "$$missing" ]; then echo "make deps ($$($(PYTHON) scripts/deps.py flavour)): $$missing"; \
	    eval $(PYTHON) -m pip install -q $$missing; fi

test: deps
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -rs tests

# Compile, link and ABI tests against CUDA 12 + NVSHMEM 3.8 and CUDA 13 + NVSHMEM 3.8 (venvs and
# unpacked NVSHMEM releases under $(FLAVOURS_DIR); the shared environment is left as it is).
test-flavours: deps
	$(PYTHON) scripts/flavours.py $(FLAVOURS_DIR)

# NVSHMEM 3.8 (headers, host library, bootstrap plugin, device archive) as a tarball to carry to
# the GPU machine: .nv38/ is git-ignored (/.nv38/ in .git/info/exclude).
nvshmem-carry:
	$(PYTHON) scripts/nvshmem_release.py pack 3.8.0 cu13 .nv38/nvshmem-cu13-3.8.0.tar.xz

precompile: deps
	PYTHONPATH=$(CURDIR) $(PYTHON) -m epcomm.jit --precompile --arch sm_80,sm_90

# GPU tests: one process per local GPU; each test runs collectively on every rank.
test-gpu:
	@if [ "$(NGPUS)" -lt 1 ]; then echo "make test-gpu: no CUDA GPU found"; exit 1; fi
	$(GPU_ENV) $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=$(NGPUS) --tee 3 \
	  -m pytest -q -rs -m gpu -p no:cacheprovider tests

bench:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(MAKE) deps
	$(GPU_ENV) $(PYTHON) -m bench

clean:
	rm -rf .pytest_cache build dist *.egg-info
