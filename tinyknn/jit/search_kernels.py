"""Every kernel a search of (metric, dtype, dim, k) may launch, on one architecture: the specs `tinyknn cache warm`
builds. The top of the spec layers: it gathers render.py's (ingest, scan, tiled, verify, band, range, selection),
render_single.py's (one query) and render_screen.py's (the Hopper screen) and defines none of its own.
"""

from __future__ import annotations

from ..spec import KernelSpec, parse_arch, parse_dim, parse_dtype, parse_k, parse_metric
from . import render, render_screen, render_single


def specs_for_search(metric, dtype, dim, k, arch) -> list[KernelSpec]:
    """Every KernelSpec a search of (metric, dtype, dim, k) may launch: what `tinyknn cache warm` builds.

    The database ingest (dtype), the query ingest (float32, for CUDA queries), the single-query
    kernel (k <= SINGLE_MAX_K), the scan (small batches, one query alone beyond that k, and large ones
    when k > TILED_MAX_K), the tiled kernel (large batches, in each
    block size TILED_SMALL_BQ adds; for l2 also with the filter key), the verify step after each, and the
    band search; for sm_90a also the Hopper screen's kernels; and the filtered searches' kernels that read a
    position list in place (listed_specs).
    """
    metric, dtype, dim, k, arch = parse_metric(metric), parse_dtype(dtype), parse_dim(dim), parse_k(k), parse_arch(arch)
    specs = [render.norms_spec(dtype, dim, arch)]
    if dtype != "float32":
        specs.append(render.norms_spec("float32", dim, arch))
    mains = [render.scan_spec(metric, dtype, dim, k, arch)]
    # one query alone: the single-query kernel up to SINGLE_MAX_K, else a scan block of one
    if k > render_single.SINGLE_MAX_K:
        mains.append(render.scan_spec(metric, dtype, dim, k, arch, n_queries=1))
    if k <= render.TILED_MAX_K:
        mains += (render.tiled_specs(metric, dtype, dim, k, arch, exact=True)
                  + render.tiled_specs(metric, dtype, dim, k, arch))
    for main in dict.fromkeys(mains):
        specs += [main, render.verify_spec(main)]
    if k <= render_single.SINGLE_MAX_K:
        specs += render_single.single_specs(metric, dtype, dim, k, arch)
    specs += [render.band_spec(metric, dtype, arch), render.rows_spec(arch),
              render.range_spec(metric, dtype, dim, arch)]
    specs += render.selection_specs(arch) + listed_specs(metric, dtype, dim, k, arch)
    if arch == render_screen.HOPPER_ARCH:   # sm_90a: the Hopper screen of batches (gpu/screen_hopper.py)
        specs += hopper_specs(metric, dtype, dim, arch)
    return list(dict.fromkeys(specs))


def listed_specs(metric: str, dtype: str, dim: int, k: int, arch: str) -> list[KernelSpec]:
    """The selection kernels of a filtered search that reads the rows a position list names (searcher.py's
    "list" view): single (and its float16 shadow for float32 l2), scan and tiled with listed=True; the verify
    step after scan and tiled is the unfiltered one."""
    mains = [render.scan_spec(metric, dtype, dim, k, arch, listed=True)]
    if k > render_single.SINGLE_MAX_K:
        mains.append(render.scan_spec(metric, dtype, dim, k, arch, n_queries=1, listed=True))
    else:
        mains += render_single.single_specs(metric, dtype, dim, k, arch, listed=True)
    if k <= render.TILED_MAX_K:
        mains += render.tiled_specs(metric, dtype, dim, k, arch, listed=True)
    return list(dict.fromkeys(mains))


def hopper_specs(metric: str, dtype: str, dim: int, arch: str) -> list[KernelSpec]:
    """The Hopper screen's kernels for an index of (metric, dtype, dim) on sm_90 / sm_90a (none where the
    screen never runs: other metrics, dim < 16)."""
    if metric not in ("l2", "ip", "cosine") or dim < 16 or render_screen.hopper_arch(arch) is None:
        return []
    stride = render.row_layout(dim, render_screen.element_of(metric, dtype))[1]
    keeps = range(1, render_screen.HOPPER_MAX_KEEP + 1)      # k = 1, and larger k
    return render_screen.hopper_kernels(metric, dtype, stride, arch, keeps)


__all__ = ["hopper_specs", "listed_specs", "specs_for_search"]
