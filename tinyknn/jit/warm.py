"""Warm-up: compile every kernel a set of (metric, dtype, dim, k) may need into the cubin cache.

Parallel with threads, not processes: cuda.bindings releases the GIL inside nvrtcCompileProgram and
NVRTC takes no global lock (two compiling threads sampled from /proc were both runnable in 55 of 61
samples), so threads scale like processes (bench/jit_cache.py, 8 real kernels on 2 cores: serial
2.27 s, 2 threads 1.29 s, 2 processes 1.10 s) while sharing one cache, its counters and its file
locks, and loading NVRTC (80-140 ms) once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from ..errors import CompileError, TinyKnnError
from ..spec import KernelSpec
from .cache import CubinCache


@dataclass(frozen=True)
class WarmOutcome:
    spec: KernelSpec
    status: str          # "compiled" | "cached" | "failed"
    seconds: float
    error: str = ""


def plan_specs(combinations, arches, specs_for=None) -> list[KernelSpec]:
    """Every KernelSpec a search of each (metric, dtype, dim, k) on each arch launches, without repeats."""
    if specs_for is None:
        from .search_kernels import specs_for_search as specs_for
    specs: dict[KernelSpec, None] = {}
    for arch in arches:
        for metric, dtype, dim, k in combinations:
            specs.update(dict.fromkeys(specs_for(metric, dtype, dim, k, arch)))
    return list(specs)


def _warm_one(cache: CubinCache, spec: KernelSpec) -> WarmOutcome:
    start = time.perf_counter()
    try:
        _, origin = cache.lookup(spec)
    except CompileError as exc:
        lines = [line for line in exc.log.splitlines() if line.strip()]
        return WarmOutcome(spec, "failed", time.perf_counter() - start, "\n".join(lines[:6]))
    except (TinyKnnError, ValueError, OSError) as exc:
        return WarmOutcome(spec, "failed", time.perf_counter() - start, str(exc))
    status = "compiled" if origin == "compiled" else "cached"
    return WarmOutcome(spec, status, time.perf_counter() - start)


def warm_specs(cache: CubinCache, specs, *, jobs: int, on_done=None) -> list[WarmOutcome]:
    """Look up (compiling where needed) every spec with `jobs` threads; on_done(outcome) as each ends."""
    if jobs < 1:
        raise ValueError(f"jobs must be a positive integer; got {jobs}")
    outcomes = []
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="tinyknn-warm") as pool:
        for future in as_completed([pool.submit(_warm_one, cache, spec) for spec in specs]):
            outcome = future.result()
            outcomes.append(outcome)
            if on_done is not None:
                on_done(outcome)
    return outcomes
