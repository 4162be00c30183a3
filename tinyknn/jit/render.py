"""The kernels' compile-time parameters: a KernelSpec per kernel variant (pure Python; no NVRTC, no GPU).
jit/cuda_source.py turns a spec into the source and name expression NVRTC builds; jit/search_kernels.py lists
the specs a whole search may launch.

Every tuning knob (tile sizes, lanes per row, queries per block, dynamic shared memory) is chosen here (and in
render_single.py, render_screen.py), in Python, and handed to the template as a compile-time argument; the C++
side `static_assert`s that the shared memory it is given covers its layout, so a mismatch fails the compile (in
CI) instead of corrupting memory.

Variants (spec.variant):
- "norms":  ingest_kernel<T>: copies rows of any float dtype and row stride into the padded
            storage layout, converting the dtype, computing inverse norms and flagging NaN / inf /
            out-of-range values. Used for the database at add() and for CUDA queries.
- "scan":   scan_kernel: small batches. The database is split into slices across many blocks; each
            block streams its slice once for QB queries and keeps the k best per query.
- "single": single_kernel: one query. Like scan (one block a slice), but each block keeps its slice's
            keys in shared memory and selects its list once, and the last block to finish runs the
            verify step: one launch (its specs: render_single.py).
            scan, single and tiled take `listed=True` (param "listed"): a filtered search that reads only
            the rows a sorted position list names, in place (the template's LISTED flag).
- "tiled":  tiled_kernel: large batches. Tiles of BQ queries x BN rows are computed from shared
            memory (register tiles, like a GEMM) and selected per tile into per-query lists.
- "verify": verify_kernel: after either selection kernel (which keeps k + margin candidates per
            slice): gathers each query's best candidates, computes their distances in float64 exactly
            as kernels/exact.cuh defines them, sorts them by (float64 distance, id), writes the k first
            as float32 distances and user ids, and flags each query whose answer the selection
            kernel's rounding-error bound (verify.cuh) does not prove.
- "band":   band_kernel: for the flagged queries, every row whose float64 distance is within the
            verify step's k-th one (the searcher sorts those bands on the host).
- "range":  range_kernel: every row within a radius (a pool of hits), or every row's float64 key (large k).
- "select", "scatter", "segment_sort": select.cuh, k beyond the selection kernels and range search's
            hits selected, grouped and sorted by (float64 distance, id) on the device.

Only the scan kernel has the dimension as a template argument (its per-lane loads unroll over it).
The tiled kernel stages a tile 16 dimensions at a time in a loop that does not unroll over the
dimension, and ingest is off the search path, so both take the padded row length at run time and
one instantiation serves every dim: specs that differ only in dim render the same name expression,
hence the same cache key and one cubin. That keeps the default manifest at 1,164 cubins on sm_80 (1,668 on
sm_90, whose one-query kernels also come with the slices' shared bound).

Length: one short params/spec function per kernel variant, kept beside the variant catalogue above so that
a tuning change and its spec change together (the screen's are in render_screen.py, the one-query kernel's in
render_single.py).
"""

from __future__ import annotations

from ..spec import KernelSpec, parse_dim, parse_dtype, parse_metric

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}   # bytes per stored element

# Tuning (see bench/NOTES_GPU.md for the measurements behind each number).
SCAN_WARPS = 8                  # warps per scan block (8: half the slices of 4 at the same occupancy)
SCAN_CHUNKS_PER_LANE = 8        # a row is split across the fewest lanes that keep <= this many 16-byte loads each
SCAN_QUERY_SMEM = 16 * 1024     # shared memory for a scan block's queries
REGISTER_LIST_SLOTS = 256       # QB * padded k up to this: candidate lists in registers, else in shared memory
TILED_MAX_K = 256               # above this a large batch uses the scan kernel, query group by query group
TILED_BN = 128                  # database rows per tile
TILED_WARPS = 8                 # warps per tiled block (one row of the register tile each)
TILED_DEPTH = 16                # dimensions staged per step
TILED_LIST_SMEM = 32 * 1024     # shared memory for a tiled block's per-query lists
TILED_SMALL_BQ = (16, 32)       # queries per tiled block for batches that fill less than the default
VERIFY_MARGIN = 8               # candidates kept beyond k (>= 32) for the verify step to prove the answer
VERIFY_MARGIN_SMALL_K = 2       # ... beyond k < 32 (each one costs insertions; near-ties go to the band search)
FILTER_MAX_LIST = 128           # l2's filter key while k + VERIFY_MARGIN fits the lists topk.cuh rebuilds in bulk
VERIFY_WARPS = 16               # warps per verify block after the scan: few queries, many candidates each (24, 32: spills)
VERIFY_WARPS_BATCH = 8          # ... after the tiled kernel: many queries, so many blocks keep the loads in flight


# -- the specs: each kernel variant and its parameters -------------------------------------------
def row_layout(dim: int, dtype: str) -> tuple[int, int]:
    """(chunks, stride): 16-byte chunks per stored row and the padded row length in elements.

    Database rows and queries (float32) are both padded with zeros to `stride` elements, so every
    row starts 16-byte aligned and zeros add nothing to any metric.
    """
    per_chunk = 16 // ITEMSIZE[dtype]
    chunks = -(-dim // per_chunk)
    return chunks, chunks * per_chunk


def padded_k(k: int) -> int:
    return 32 * max(1, -(-k // 32))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def list_length(k: int) -> int:
    """Candidates a selection kernel keeps per (query, slice): k plus the verify step's margin."""
    return k + (VERIFY_MARGIN_SMALL_K if k < 32 else VERIFY_MARGIN)


def scan_params(dtype: str, dim: int, k: int, *, qb: int | None = None, lanes: int | None = None,
                warps: int = SCAN_WARPS, listed: bool = False) -> dict[str, int]:
    """Parameters of the scan kernel (keyword overrides are for benchmarks); its lists hold
    list_length(k) candidates. listed: it reads the rows a position list names (a filter's, in place)."""
    kl = list_length(k)
    chunks, stride = row_layout(dim, dtype)
    if lanes is None:
        lanes = 1
        while lanes < 32 and -(-chunks // lanes) > SCAN_CHUNKS_PER_LANE:
            lanes *= 2
    floats = query_floats(chunks, stride, lanes)
    kp = padded_k(kl)
    if qb is None:
        qb = max(1, min(8, REGISTER_LIST_SLOTS // kp, _pow2_floor(SCAN_QUERY_SMEM // (4 * floats))))
    smem = align16(qb * floats * 4) + align16(qb * 4) + warps * qb * kp * 8
    return mark_listed({"qb": qb, "lanes": lanes, "warps": warps, "smem": smem, "kl": kl}, listed)


def mark_listed(params: dict[str, int], listed: bool) -> dict[str, int]:
    """A selection kernel's parameters, with "listed" only where it reads a position list (so the unfiltered
    specs, their name expressions and cache keys stay what they were)."""
    return {**params, "listed": 1} if listed else params


def query_floats(chunks: int, stride: int, lanes: int) -> int:
    """Floats of one query row in shared memory: padded so that each of `lanes` lanes reads whole chunks."""
    return lanes * -(-chunks // lanes) * (stride // chunks)


def sort_slots(kl: int) -> int:
    """The power of two the verify step sorts kl candidates in (next_pow2 in merge.cuh)."""
    return max(2, 1 << (kl - 1).bit_length())


RADIX_BYTES = (256 + 4) * 4    # the radix histogram and gather counters (MERGE_SHARED_FIXED in merge.cuh)
BOUNDED_BYTES = 4 * 1024 + 8 * 512 + 16   # bounded_gather's scratch (BOUNDED_SHARED in merge.cuh)


def uses_filter_key(metric: str, k: int) -> bool:
    """Whether a large batch ranks by l2's filter key |x|^2 - 2 q.x (one FMA per element)."""
    return metric == "l2" and list_length(k) <= FILTER_MAX_LIST


def tiled_params(dtype: str, dim: int, k: int, *, filter_key: bool = False, bq: int | None = None,
                 bn: int = TILED_BN, warps: int = TILED_WARPS, depth: int = TILED_DEPTH,
                 reglists: bool = False, listed: bool = False) -> dict[str, int]:
    """Parameters of the tiled kernel (k <= TILED_MAX_K); its lists hold list_length(k) candidates.
    Lists in shared memory by default: in registers they push the k <= 32 kernels past 128
    registers, to one block per SM. filter_key: rank by l2's filter key (uses_filter_key). listed: it reads
    the rows a position list names (a filter's, in place)."""
    kl = list_length(k)
    kp = padded_k(kl)
    if bq is None:
        bq = max(warps, min(64, _pow2_floor(TILED_LIST_SMEM // (kp * 8))))
    reglists = bool(reglists) and (bq // warps) * kp <= REGISTER_LIST_SLOTS
    lists = 0 if reglists else bq * kp * 8
    staging = align16(depth * (bq + 4 + bn + 4) * 4)
    smem = lists + staging + align16(bq * 4)
    params = {"bq": bq, "bn": bn, "warps": warps, "depth": depth, "reglists": int(reglists), "smem": smem, "kl": kl}
    if filter_key:
        params["filter"] = 1
    return mark_listed(params, listed)


def verify_params(kl: int, filter_key: bool, warps: int = VERIFY_WARPS) -> dict[str, int]:
    """verify_kernel's layout over kl candidates: float64 keys, ids, float32 keys, positions (each
    next_pow2(kl) slots), the radix histogram and the query's float64 sum of squares."""
    params = {"kl": kl, "warps": warps, "smem": sort_slots(kl) * 24 + RADIX_BYTES + 16}
    if filter_key:
        params["filter"] = 1
    return params


def align16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def norms_spec(dtype: str, dim: int, arch: str) -> KernelSpec:
    """The ingest kernel for rows stored as `dtype` (metric and k do not change it: canonical 'l2', 0)."""
    return KernelSpec("l2", dtype, dim, 0, "norms", arch)


def scan_spec(metric: str, dtype: str, dim: int, k: int, arch: str, *, n_queries: int | None = None,
              **overrides) -> KernelSpec:
    """The scan kernel. n_queries = 1 gets blocks of one query (no registers or shared memory for
    absent ones: 42 instead of 48 us of kernel on 100k x 128, bench/NOTES_GPU.md)."""
    if n_queries == 1 and "qb" not in overrides:
        overrides = dict(overrides, qb=1)
    return KernelSpec(metric, dtype, dim, k, "scan", arch, tuple(scan_params(dtype, dim, k, **overrides).items()))


def tiled_spec(metric: str, dtype: str, dim: int, k: int, arch: str, *, exact: bool = False,
               n_queries: int | None = None, **overrides) -> KernelSpec:
    """The tiled kernel; for l2 (k + margin <= FILTER_MAX_LIST) it ranks by the filter key unless `exact`.
    n_queries: a batch smaller than the default block of queries gets the smallest TILED_SMALL_BQ
    block that holds it (10 queries computed as 64 cost 2.9 ms on 1M x 768, as 16: 1.8 ms)."""
    filter_key = not exact and uses_filter_key(parse_metric(metric), k)
    params = tiled_params(dtype, dim, k, filter_key=filter_key, **overrides)
    if n_queries is not None and "bq" not in overrides:
        smaller = [bq for bq in TILED_SMALL_BQ if n_queries <= bq < params["bq"] and bq % params["warps"] == 0]
        if smaller:
            params = tiled_params(dtype, dim, k, filter_key=filter_key, bq=smaller[0], **overrides)
    return KernelSpec(metric, dtype, dim, k, "tiled", arch, tuple(params.items()))


def tiled_specs(metric: str, dtype: str, dim: int, k: int, arch: str, *, exact: bool = False,
                listed: bool = False) -> list[KernelSpec]:
    """Every block size tiled_spec may choose for (metric, dtype, dim, k), the default first."""
    extra = {"listed": True} if listed else {}
    return list(dict.fromkeys(tiled_spec(metric, dtype, dim, k, arch, exact=exact, n_queries=n, **extra)
                              for n in (None, *TILED_SMALL_BQ)))


def verify_spec(main: KernelSpec, warps: int | None = None) -> KernelSpec:
    """What runs after the selection kernel `main`: the verify step over its lists (the storage dtype
    matters: it reads rows; the dim does not: canonical 1). Its gather is load-latency bound: 32 warps
    after the scan (a single query's thousands of candidates), 8 after the tiled kernel."""
    if warps is None:
        warps = VERIFY_WARPS_BATCH if main.variant == "tiled" else VERIFY_WARPS
    params = verify_params(main.param("kl"), bool(main.param("filter", 0)), warps)
    return KernelSpec(main.metric, main.dtype, 1, main.k, "verify", main.arch, tuple(params.items()))


def band_spec(metric: str, dtype: str, arch: str) -> KernelSpec:
    """The band search of the queries verify could not prove (k and dim do not change it)."""
    return KernelSpec(metric, dtype, 1, 0, "band", arch)


def rows_spec(arch: str) -> KernelSpec:
    """copy_rows_kernel (whole 16-byte words: no metric, dtype, dim or k)."""
    return KernelSpec("l2", "float32", 1, 0, "rows", arch)


RANGE_QB = (8, 4, 2, 1)         # queries per range_search block (each row is read once per block) ...
RANGE_QUERY_SMEM = 48 * 1024    # ... as many as fit this much shared memory


def range_spec(metric: str, dtype: str, dim: int, arch: str, qb: int | None = None) -> KernelSpec:
    """range_kernel: every row within a radius of QB queries (float32 screen, float64 decision); QB
    from the padded row length (or given: a benchmark's sweep), so the dim matters only through it
    (canonical dim 1 per QB)."""
    stride = row_layout(parse_dim(dim), parse_dtype(dtype))[1]
    if qb is None:
        qb = next((q for q in RANGE_QB if q * stride * 4 <= RANGE_QUERY_SMEM), 1)
    elif not (isinstance(qb, int) and 1 <= qb <= 64 and qb * stride * 4 <= 227 * 1024):
        raise ValueError(f"range_spec: qb must be an int in [1, 64] whose {stride}-float query rows fit 227 KiB of "
                         f"shared memory; got {qb!r}")
    return KernelSpec(metric, dtype, 1, 0, "range", arch, (("qb", qb), ("smem", qb * stride * 4)))


SELECTION_VARIANTS = ("select", "scatter", "segment_sort")


def selection_spec(variant: str, arch: str) -> KernelSpec:
    """One of select.cuh's kernels (float64 keys and int64 ids only: no metric, dtype, dim or k): large k's
    selection, range search's scatter, and the sort of both."""
    if variant not in SELECTION_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, SELECTION_VARIANTS))}; got {variant!r}")
    return KernelSpec("l2", "float32", 1, 0, variant, arch)


def selection_specs(arch: str) -> list[KernelSpec]:
    return [selection_spec(variant, arch) for variant in SELECTION_VARIANTS]


__all__ = [
    "BOUNDED_BYTES", "ITEMSIZE", "RADIX_BYTES", "RANGE_QB", "align16", "band_spec", "list_length", "mark_listed",
    "norms_spec", "query_floats", "range_spec", "row_layout", "rows_spec", "scan_spec", "selection_spec",
    "selection_specs", "sort_slots", "tiled_spec", "tiled_specs", "uses_filter_key", "verify_spec",
]
