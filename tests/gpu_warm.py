"""Compile a GPU test module's kernels up front, in parallel (NVRTC releases the GIL), so that a fresh
machine's empty cubin cache does not serialise hundreds of compiles inside the tests."""

from __future__ import annotations

import concurrent.futures
import os


def warm(combinations, extra=()) -> None:
    """combinations: (metric, dtype, dim, k) tuples; extra: more KernelSpecs."""
    from tinyknn.gpu.device import current_device
    from tinyknn.jit import search_kernels
    from tinyknn.jit.cache import get_cubin

    arch = current_device().arch
    specs = {spec for c in combinations for spec in search_kernels.specs_for_search(*c, arch)} | set(extra)
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(get_cubin, sorted(specs)))
