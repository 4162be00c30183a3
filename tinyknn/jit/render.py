"""Which kernels a search launches and with which compile-time parameters: KernelSpecs (pure Python; no NVRTC,
no GPU). jit/cuda_source.py turns a spec into the source and name expression NVRTC builds.

Every tuning knob (tile sizes, lanes per row, queries per block, dynamic shared memory) is chosen here, in
Python, and handed to the template as a compile-time argument; the C++ side `static_assert`s that the shared
memory it is given covers its layout, so a mismatch fails the compile (in CI) instead of corrupting memory.

Variants (spec.variant):
- "norms":  ingest_kernel<T>: copies rows of any float dtype and row stride into the padded
            storage layout, converting the dtype, computing inverse norms and flagging NaN / inf /
            out-of-range values. Used for the database at add() and for CUDA queries.
- "scan":   scan_kernel: small batches. The database is split into slices across many blocks; each
            block streams its slice once for QB queries and keeps the k best per query.
- "single": single_kernel: one query. Like scan (one block a slice), but each block keeps its slice's
            keys in shared memory and selects its list once, and the last block to finish runs the
            verify step: one launch.
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
a tuning change and its spec change together (the screen's are in render_screen.py).
"""

from __future__ import annotations

from ..spec import KernelSpec, parse_arch, parse_dim, parse_dtype, parse_k, parse_metric
from . import render_screen

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}   # bytes per stored element

# Tuning (see bench/NOTES_GPU.md for the measurements behind each number).
SCAN_WARPS = 8                  # warps per scan block (8: half the slices of 4 at the same occupancy)
SCAN_CHUNKS_PER_LANE = 8        # a row is split across the fewest lanes that keep <= this many 16-byte loads each
SCAN_QUERY_SMEM = 16 * 1024     # shared memory for a scan block's queries
SINGLE_WARPS = 16               # warps per single-query block (16: 0.057 ms on 100k x 128; 8: 0.073, 4: 0.13)
SINGLE_MAX_ROWS = 8192          # rows per single-query slice (its keys in shared memory): 1M rows in one wave of
                                # 132 slices, not 4 of 521 (1M x 768 float16: 384 -> 375 us); fewer rows keep theirs
SINGLE_MIN_LANES = 4            # lanes a row at least, for rows of 16+ chunks (100k x 128 float16 shadow: 2 lanes
                                # 22.2 us, 4 lanes 20.3): more rows in flight a warp than the scan's 8 chunks a lane
SINGLE_UNROLL = 2               # rows per lane whose loads are in flight together (1 for 8-bit rows: their
                                # 16-element chunks unpack into too many registers at 2; 1 where a lane holds
                                # more than SCAN_CHUNKS_PER_LANE chunks of a row, the lanes capped at 32: float32
                                # rows past 1,024 dims, whose 2 x 12 chunks spilled beside bounded_gather)
# The last block copies the lists to shared memory up to this many entries (170 slices of 18), beside
# bounded_gather's scratch: together the 32 KB the copy alone took at 4,096 entries.
SINGLE_COPY_MAX = 3072
SINGLE_STAGE_MAX_SMEM = 200 * 1024   # the staged verify step's shared memory at most (an H100/H200 block: 227 KB)
SINGLE_STAGE_ARCHS = ("sm_90", "sm_90a")   # where the verify step stages its rows by default, where they fit (H200,
                                # 1M x 768 kernel: float32 through its shadow 383.2 -> 376.4 us, float16 374.6 -> 372.2;
                                # 100k x 128 20.2 both): measured on Hopper only, whose blocks get 227 KB
SINGLE_STAGE_AHEAD = 4          # the staged chain's chunks loaded a step by default (H200, four interleaved rounds:
                                # kernel 100k x 128 19.6 -> 18.6 us, 1M x 768 float16 370.8 -> 368.3, float32
                                # through its shadow 375.9 -> 369.8; 8 the same as 4)
SINGLE_SHARED_BOUND_BYTES = 128 << 20   # on SINGLE_STAGE_ARCHS, one query that streams at least this many bytes
                                # has its slices share a bound (single_shares_bound)
SINGLE_MAX_K = 128              # the single-query kernel up to this k (its last block verifies k + margin)
SINGLE_SHADOW_MARGIN = 8        # candidates beyond k when streaming a float32 index's float16 shadow (its bound is
                                # looser than float32's: 2 extra would send more near-ties to the band search)
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


# -- the plans: which specs a search launches, with their parameters ------------------------------
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
    query_floats = _query_floats(chunks, stride, lanes)
    kp = padded_k(kl)
    if qb is None:
        qb = max(1, min(8, REGISTER_LIST_SLOTS // kp, _pow2_floor(SCAN_QUERY_SMEM // (4 * query_floats))))
    smem = _align16(qb * query_floats * 4) + _align16(qb * 4) + warps * qb * kp * 8
    return _listed({"qb": qb, "lanes": lanes, "warps": warps, "smem": smem, "kl": kl}, listed)


def _listed(params: dict[str, int], listed: bool) -> dict[str, int]:
    """A selection kernel's parameters, with "listed" only where it reads a position list (so the unfiltered
    specs, their name expressions and cache keys stay what they were)."""
    return {**params, "listed": 1} if listed else params


def _query_floats(chunks: int, stride: int, lanes: int) -> int:
    """Floats of one query row in shared memory: padded so that each of `lanes` lanes reads whole chunks."""
    return lanes * -(-chunks // lanes) * (stride // chunks)


def _sort_slots(kl: int) -> int:
    """The power of two the verify step sorts kl candidates in (next_pow2 in merge.cuh)."""
    return max(2, 1 << (kl - 1).bit_length())


_RADIX_BYTES = (256 + 4) * 4    # the radix histogram and gather counters (MERGE_SHARED_FIXED in merge.cuh)
_BOUNDED_BYTES = 4 * 1024 + 8 * 512 + 16   # bounded_gather's scratch (BOUNDED_SHARED in merge.cuh)


def single_params(dtype: str, dim: int, k: int, *, lanes: int | None = None, warps: int = SINGLE_WARPS,
                  rmax: int = SINGLE_MAX_ROWS, unroll: int | None = None,
                  cmax: int = SINGLE_COPY_MAX, shadow: bool = False, listed: bool = False,
                  stage: int | None = 0, shared_bound: bool = False) -> dict[str, int]:
    """Parameters of the single-query kernel: the scan kernel's lanes per row, a slice of at most
    `rmax` rows whose keys and positions sit in shared memory, and room for the verify step after.
    shadow: a float32 l2 index streams its float16 shadow (single.cuh's ShadowKeyBound), with a wider margin.
    listed: it reads the rows a position list names (a filter's, in place). stage=1: the verify step stages
    its candidates' rows in shared memory, a thread a candidate (verify.cuh's verify_distances_staged;
    ValueError where they do not fit in SINGLE_STAGE_MAX_SMEM); stage=2 to 16: staged, the chain loading that
    many chunks a step (its AHEAD); stage=None: staged where they fit, SINGLE_STAGE_AHEAD chunks a step.
    shared_bound (a knob, "gt"): a slice that finds another's KL-th key published lists only its keys under it
    (single.cuh's GT)."""
    if shadow and dtype != "float32":
        raise ValueError(f"only a float32 index streams a float16 shadow; got dtype {dtype!r}")
    streamed = "float16" if shadow else dtype
    kl = k + SINGLE_SHADOW_MARGIN if shadow else list_length(k)
    chunks, stride = row_layout(dim, streamed)
    if lanes is None:
        lanes = scan_params(streamed, dim, k)["lanes"]
        if chunks >= 4 * SINGLE_MIN_LANES:
            lanes = max(lanes, SINGLE_MIN_LANES)
    if unroll is None:
        unroll = SINGLE_UNROLL if ITEMSIZE[streamed] > 1 and -(-chunks // lanes) <= SCAN_CHUNKS_PER_LANE else 1
    query_bytes = _align16(_query_floats(chunks, stride, lanes) * 4) + 16
    slice_bytes = _align16(query_bytes + rmax * 8 + _sort_slots(kl) * 8 + _RADIX_BYTES) + _BOUNDED_BYTES
    verify_own = _align16(verify_params(kl, False)["smem"])       # verify_shared_bytes<KL> (single.cuh)
    verify_bytes = verify_own + cmax * 8 + _BOUNDED_BYTES             # + the lists, bounded_gather's scratch
    params = {"kl": kl, "lanes": lanes, "warps": warps, "rmax": rmax, "unroll": unroll, "cmax": cmax,
              "smem": max(slice_bytes, verify_bytes)}
    if stage is not None and not 0 <= stage <= 16:
        raise ValueError(f"stage is 0 (no staging), 1 or the staged chain's chunks a step up to 16; got {stage}")
    if stage != 0:
        row_bytes = row_layout(dim, dtype)[1] * ITEMSIZE[dtype]      # the stored rows, as verify reads them
        staged = verify_own + _align16(dim * 8) + kl * ((row_bytes // 4) | 1) * 4
        fits = staged <= SINGLE_STAGE_MAX_SMEM
        if stage is None:
            stage = SINGLE_STAGE_AHEAD if fits else 0
        elif not fits:
            raise ValueError(f"stage={stage} needs {staged} bytes of shared memory for {kl} rows of {row_bytes} bytes; "
                             f"at most {SINGLE_STAGE_MAX_SMEM} fit")
        if stage:
            params = {**params, "smem": max(params["smem"], staged), "stage": stage}
    if shared_bound:
        params = {**params, "gt": 1}
    return _listed({**params, "shadow": 1} if shadow else params, listed)


def single_spec(metric: str, dtype: str, dim: int, k: int, arch: str, **overrides) -> KernelSpec:
    """The single-query kernel (selection and verify step in one launch); shadow=True only for l2. On
    SINGLE_STAGE_ARCHS its verify step stages its rows where they fit, SINGLE_STAGE_AHEAD chunks a step
    (stage=0, or 1 to 16, to choose)."""
    if overrides.get("shadow") and metric != "l2":
        raise ValueError(f"the single-query kernel streams a float16 shadow for l2 only; got metric {metric!r}")
    overrides.setdefault("stage", None if arch in SINGLE_STAGE_ARCHS else 0)
    return KernelSpec(metric, dtype, dim, k, "single", arch, tuple(single_params(dtype, dim, k, **overrides).items()))


def single_shares_bound(arch: str, dtype: str, dim: int, n_rows: int, shadow: bool = False) -> bool:
    """Whether one query's slices share a bound by default (single_params shared_bound): on SINGLE_STAGE_ARCHS,
    where the rows streamed reach SINGLE_SHARED_BOUND_BYTES, whose slices' streams end further apart than the
    select a published bound saves. H200, kernel medians of four interleaved rounds (bench/probes/single_ab.py):
    1M x 128 float32 94.7 -> 90.6 us, 1M x 768 float16 361.3 -> 357.1, float32 363.2 -> 359.0, 2M x 768
    float16 698.5 -> 691.0; but 100k x 128 float32 (26 MB of shadow) 18.9 -> 19.4."""
    streamed = "float16" if shadow else dtype
    row_bytes = row_layout(dim, streamed)[1] * ITEMSIZE[streamed]
    return arch in SINGLE_STAGE_ARCHS and n_rows * row_bytes >= SINGLE_SHARED_BOUND_BYTES


def single_spec_over(n_rows: int, metric: str, dtype: str, dim: int, k: int, arch: str, **overrides) -> KernelSpec:
    """The single-query kernel a search over `n_rows` rows runs: single_spec, with the slices' shared bound where
    single_shares_bound says unless `overrides` name it."""
    shadow = bool(overrides.get("shadow", False))
    overrides.setdefault("shared_bound", single_shares_bound(arch, dtype, dim, n_rows, shadow))
    return single_spec(metric, dtype, dim, k, arch, **overrides)


def single_specs(metric: str, dtype: str, dim: int, k: int, arch: str, listed: bool = False) -> list[KernelSpec]:
    """Every single-query kernel a search of (metric, dtype, dim, k) may pick: the rows themselves and, for
    float32 l2, the float16 shadow; on SINGLE_STAGE_ARCHS each also with the slices' shared bound."""
    shadows = (False, True) if metric == "l2" and dtype == "float32" else (False,)
    shared = (False, True) if arch in SINGLE_STAGE_ARCHS else (False,)
    knobs = [{"shadow": True} if shadow else {} for shadow in shadows]
    knobs = [dict(knob, shared_bound=True) if bound else knob for bound in shared for knob in knobs]
    return [single_spec(metric, dtype, dim, k, arch, **knob, **({"listed": True} if listed else {})) for knob in knobs]


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
    staging = _align16(depth * (bq + 4 + bn + 4) * 4)
    smem = lists + staging + _align16(bq * 4)
    params = {"bq": bq, "bn": bn, "warps": warps, "depth": depth, "reglists": int(reglists), "smem": smem, "kl": kl}
    if filter_key:
        params["filter"] = 1
    return _listed(params, listed)


def verify_params(kl: int, filter_key: bool, warps: int = VERIFY_WARPS) -> dict[str, int]:
    """verify_kernel's layout over kl candidates: float64 keys, ids, float32 keys, positions (each
    next_pow2(kl) slots), the radix histogram and the query's float64 sum of squares."""
    params = {"kl": kl, "warps": warps, "smem": _sort_slots(kl) * 24 + _RADIX_BYTES + 16}
    if filter_key:
        params["filter"] = 1
    return params


def _align16(nbytes: int) -> int:
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
    specs = [norms_spec(dtype, dim, arch)]
    if dtype != "float32":
        specs.append(norms_spec("float32", dim, arch))
    mains = [scan_spec(metric, dtype, dim, k, arch)]
    if k > SINGLE_MAX_K:    # one query alone: the single-query kernel up to SINGLE_MAX_K, else a scan block of one
        mains.append(scan_spec(metric, dtype, dim, k, arch, n_queries=1))
    if k <= TILED_MAX_K:
        mains += tiled_specs(metric, dtype, dim, k, arch, exact=True) + tiled_specs(metric, dtype, dim, k, arch)
    for main in dict.fromkeys(mains):
        specs += [main, verify_spec(main)]
    if k <= SINGLE_MAX_K:
        specs += single_specs(metric, dtype, dim, k, arch)
    specs += [band_spec(metric, dtype, arch), rows_spec(arch), range_spec(metric, dtype, dim, arch)]
    specs += selection_specs(arch) + listed_specs(metric, dtype, dim, k, arch)
    if arch == render_screen.HOPPER_ARCH:   # sm_90a: the Hopper screen of batches (gpu/screen_hopper.py)
        specs += hopper_specs(metric, dtype, dim, arch)
    return list(dict.fromkeys(specs))


def listed_specs(metric: str, dtype: str, dim: int, k: int, arch: str) -> list[KernelSpec]:
    """The selection kernels of a filtered search that reads the rows a position list names (searcher.py's
    "list" view): single (and its float16 shadow for float32 l2), scan and tiled with listed=True; the verify
    step after scan and tiled is the unfiltered one."""
    mains = [scan_spec(metric, dtype, dim, k, arch, listed=True)]
    if k > SINGLE_MAX_K:
        mains.append(scan_spec(metric, dtype, dim, k, arch, n_queries=1, listed=True))
    else:
        mains += single_specs(metric, dtype, dim, k, arch, listed=True)
    if k <= TILED_MAX_K:
        mains += tiled_specs(metric, dtype, dim, k, arch, listed=True)
    return list(dict.fromkeys(mains))


def hopper_specs(metric: str, dtype: str, dim: int, arch: str) -> list[KernelSpec]:
    """The Hopper screen's kernels for an index of (metric, dtype, dim) on sm_90 / sm_90a (none where the
    screen never runs: other metrics, dim < 16)."""
    if metric not in ("l2", "ip", "cosine") or dim < 16 or render_screen.hopper_arch(arch) is None:
        return []
    stride = row_layout(dim, render_screen.element_of(metric, dtype))[1]
    keeps = range(1, render_screen.HOPPER_MAX_KEEP + 1)      # k = 1, and larger k
    return render_screen.hopper_kernels(metric, dtype, stride, arch, keeps)


__all__ = [
    "ITEMSIZE", "RANGE_QB", "band_spec", "hopper_specs", "list_length", "listed_specs", "norms_spec", "range_spec",
    "row_layout", "rows_spec", "scan_spec", "selection_spec", "selection_specs", "single_shares_bound", "single_spec",
    "single_spec_over", "single_specs", "specs_for_search", "tiled_spec", "tiled_specs", "uses_filter_key",
    "verify_spec",
]
