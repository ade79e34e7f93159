"""epcomm's GPU runtime: JIT (toolchain, options, compiler, cache), device arch, module loading and
launches, NVSHMEM host API, symmetric memory, DLPack. Nothing here touches CUDA at import time."""
