"""Exercise every GPU kernel variant once, at small sizes, for compute-sanitizer.

    python3 tests/gpu_sanitize.py                       # fills the cubin cache (NVRTC is slow under the tool)
    compute-sanitizer --tool memcheck python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize.py single    # one selection kernel's cases
    TINYKNN_SCREEN=wgmma compute-sanitizer ... tests/gpu_sanitize.py biased   # the 8-bit l2 screen with PB
    TINYKNN_SCREEN=wgmma compute-sanitizer ... tests/gpu_sanitize.py consumers   # ... with three consumers (CW)
    TINYKNN_SCREEN=wgmma compute-sanitizer ... tests/gpu_sanitize.py overlap     # ... with the halves' overlap (XO)
    TINYKNN_SCREEN=wgmma compute-sanitizer ... tests/gpu_sanitize.py lean        # ... with lean tiles (LT)

Covers: ingest (host rows, float64/float16 CUDA rows and queries when CuPy is present), scan with
register lists and with shared-memory lists (k = 2048), tiled with shared lists (bulk rebuilds), the
l2 filter key, the verify step after every selection (small and large k, padding) and the band search
of unproven queries (far data, 40 tied copies), the single-query kernel (its last block verifies; its slices'
shared bound, a knob) and tiled blocks of 16, graph
replay, float16 storage and every metric; then the tensor-core screen (float16, bfloat16, int8, uint8
and a float32 index's float16 shadow), filters read in place (a position list read by the LISTED single, scan and
tiled kernels; a run of rows as a view, screened in place from 4,096 rows), the rows permuted on the
device, remove, get, range search (range_kernel, and the screen with the radius as threshold) and
k > 2,048 (SCREEN_AND_OPS), and a batch of 100 queries on the Hopper screen's small tile. Each result is
checked against the float64 oracle (assert_exact), so a broken run also fails without the tool. Exit status 0
means every search was correct.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyknn  # noqa: E402
from reference import assert_exact  # noqa: E402
from tinyknn.gpu import plan  # noqa: E402

CASES = [  # metric, dtype, dim, n, k, n_queries, selection kernel, data offset
    ("l2", "float32", 37, 700, 10, 3, "scan", 0.0),
    ("ip", "float16", 64, 700, 100, 5, "scan", 0.0),
    ("cosine", "float32", 20, 2300, 2048, 2, "scan", 0.0),        # shared-memory lists, big verify
    ("l2", "float16", 130, 300, 10, 70, "tiled", 0.0),           # l2 filter key + verify
    ("l2", "float32", 37, 1500, 100, 40, "tiled", 0.0),          # filter lists of 108, bulk rebuilds
    ("l2", "float32", 20, 800, 5, 30, "tiled", 1e4),             # filter unproven: band search
    ("l2", "float32", 6, 400, 10, 3, "scan", -1.0),              # 40 tied copies: band search
    ("cosine", "float16", 16, 500, 100, 40, "tiled", 0.0),       # tiled with shared-memory lists
    ("ip", "float32", 3, 5, 20, 4, "scan", 0.0),                 # k > ntotal: padding
    ("cosine", "float16", 96, 1200, 10, 1, "single", 0.0),       # one query: single_kernel
    ("l2", "float32", 8, 450_000, 10, 1, "single", 0.0),         # ... one wave of slices of a few thousand rows
    ("l2", "float32", 8, 2_500_000, 10, 1, "single", 0.0),       # ... two waves, more than 256 lists: the radix bound
    ("ip", "float32", 4, 9, 10, 1, "single", 0.0),               # ... slices with fewer rows than a list
    ("l2", "float32", 48, 1000, 10, 9, "tiled", 0.0),            # blocks of 16 queries, filter key
    ("ip", "float16", 64, 900, 10, 12, "tiled", 0.0),            # blocks of 16 queries, exact keys
]


SCREEN_AND_OPS = [  # metric, dtype, dim, n, k, n_queries: >= 64 queries over >= 16,384 rows take the screen
    ("l2", "float16", 64, 20000, 10, 64),
    ("ip", "bfloat16", 48, 17000, 32, 70),
    ("l2", "int8", 64, 17000, 10, 64),
    ("cosine", "uint8", 32, 17000, 10, 64),
    ("cosine", "float32", 40, 17000, 10, 64),
]


def stored(rng, dtype, shape):
    if dtype in ("int8", "uint8"):
        low = -100 if dtype == "int8" else 0
        return rng.integers(low, 100, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def screen_and_ops(rng, cases=SCREEN_AND_OPS) -> None:
    from reference import contract_distances, searched
    from reference import stored as stored64

    for metric, dtype, dim, n, k, n_queries in cases:
        db, q = stored(rng, dtype, (n, dim)), stored(rng, dtype, (n_queries, dim))
        with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
            index.add(db)
            distances, ids = index.search(q, k)
            assert_exact(distances, ids, db, q, k, metric, dtype)
            assert index._searcher._screen.queries > 0, "the screen did not run"
            # a position list; a short run (the other kernels); a run of 6,000 rows (screened in place)
            for allowed in (np.arange(0, n, 3), np.arange(100, 900), np.arange(2000, 8000)):
                for batch in (q[:1], q[:5], q):
                    distances, ids = index.search(batch, k, filter=allowed)
                    assert_exact(distances, ids, db[allowed], batch, k, metric, dtype, id_map=allowed)
            order = rng.permutation(n)
            with index._add_lock, index._view:                 # as LabelLayout.reorder does, ids in step
                index._searcher.permute_rows(order)
                index._ids.apply_permutation(order)
                index._labels.apply_permutation(order)
            assert_exact(*index.search(q, k), db, q, k, metric, dtype)
            index.remove(np.arange(0, n, 7))
            assert not np.isin(index.search(q[:3], k)[1], np.arange(0, n, 7)).any()
            assert np.array_equal(index.get([1, 2]), db[[1, 2]].astype(index._storage))
        print(f"ok screen+ops {metric} {dtype} dim={dim} n={n} k={k} nq={n_queries}", flush=True)
    def check_range(index, db, q, radius):
        lims, _, ids = index.range_search(q, radius)
        keys = contract_distances(stored64(db, "float32"), searched(q), "l2")
        for i in range(len(q)):
            inside = np.flatnonzero(keys[i] < radius)
            inside = inside[np.lexsort((inside, keys[i][inside]))]
            assert np.array_equal(ids[lims[i]:lims[i + 1]], inside)

    db, q = stored(rng, "float32", (6000, 16)), stored(rng, "float32", (3, 16))
    with tinyknn.Index(16, "l2", "float32", device="cuda") as index:     # 3 queries: range_kernel
        index.add(db)
        check_range(index, db, q, 20.0)
        distances, ids = index.search(q, 3000)
        assert_exact(distances, ids, db, q, 3000, "l2", "float32")
    db, q = stored(rng, "float32", (17000, 16)), stored(rng, "float32", (64, 16))
    with tinyknn.Index(16, "l2", "float32", device="cuda") as index:     # 64 queries: through the screen
        index.add(db)
        check_range(index, db, q, 12.0)
        assert index._searcher._screen.range_queries == len(q), "the range screen did not run"
    print("ok range_search (range_kernel and the screen), k=3000", flush=True)
    db, q = stored(rng, "float16", (340_000, 32)), stored(rng, "float16", (100, 32))
    with tinyknn.Index(32, "l2", "float16", device="cuda") as index:      # at most 128 queries x >= 2^25
        index.add(db)                                                     # products: the Hopper screen's
        assert_exact(*index.search(q, 10), db, q, 10, "l2", "float16")   # small tile, on compute capability 9.0
    print("ok screen, 100 queries x 340,000 rows", flush=True)


SCAN_MAX_QUERIES = plan.SCAN_MAX_QUERIES


def shared_bound_single(rng) -> None:
    """The single-query kernel's shared bound (single.cuh's GT, a knob): several waves of slices, the later
    ones listing their keys under another's bound; a near query, then a far one (the bound zeroed between). The
    third case's first 70 % is far rows: their loose bound leaves more than 512 keys under it in the later
    slices (of 1,536 rows), which then select as usual."""
    for metric, dtype, dim, n, slices in (("l2", "float32", 8, 200_000, 400), ("ip", "float16", 16, 150_000, 400),
                                          ("l2", "float32", 16, 300_000, 290)):
        db = rng.standard_normal((n, dim)).astype(np.float32)
        if slices == 290:                                  # the first wave or more: far rows
            db[: n * 7 // 10] += 50.0
        queries = np.stack([db[3], db[3] + 20.0, db[9]]).astype(np.float32)
        with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
            index.add(db)
            searcher = index._searcher
            searcher.single_overrides, searcher.slices_override = (("shared_bound", True),), slices
            searcher._forget_plans()
            for _ in range(2):                              # the second round replays a graph
                for q in queries:
                    assert_exact(*index.search(q[None], 10), db, q[None], 10, metric, dtype)
            slices = [p.slices for p in searcher._plans.values() if getattr(p, "variant", None) == "single"]
        print(f"ok {metric} {dtype} dim={dim} n={n} single, shared bound, slices={slices}", flush=True)


def main(only: str | None = None) -> int:
    """Every case; `only` a selection kernel's name ("single", "scan", "tiled"): its cases alone, no screen;
    "biased": the 8-bit l2 screen's cases with render_screen.HOPPER_PRODUCER_BIAS on (the default), alone;
    "consumers": the 8-bit screen's cases with three consumer warpgroups (render_screen.HOPPER_CONSUMERS = 3);
    "overlap": with the halves' overlap (render_screen.HOPPER_OVERLAP_HALVES), and its 16-bit tiles;
    "lean": with lean tiles (render_screen.HOPPER_LEAN_TILES), three consumers, 900 queries (5 query tiles) too,
    and 16-bit tiles; "half": with half keys (render_screen.HOPPER_HALF_KEYS) and lean tiles, three consumers."""
    if only in ("biased", "consumers", "overlap", "lean", "half"):
        from tinyknn.jit import render_screen

        render_screen.HOPPER_PRODUCER_BIAS = True
        render_screen.HOPPER_CONSUMERS = 3 if only in ("consumers", "lean", "half") else 2
        render_screen.HOPPER_OVERLAP_HALVES = only == "overlap"
        render_screen.HOPPER_LEAN_TILES = only in ("lean", "half")
        render_screen.HOPPER_HALF_KEYS = only == "half"
        param, value = {"consumers": ("cw", 3), "overlap": ("xo", 1), "lean": ("lt", 1),
                        "half": ("hk", 1)}.get(only, ("pb", 1))
        rng = np.random.default_rng(7)
        screen_and_ops(rng, [c for c in SCREEN_AND_OPS if c[:2] == ("l2", "int8")] +
                       [("l2", "uint8", 128, 17000, 10, 64)])
        # 340,000 rows: ~10 tiles a block (~15 with three consumers' 192-query tiles), so each scalar slot and
        # ring stage is reused (its "empty" wait and parity wrap); 250 queries: a tile and a part of one
        # the overlap's 16-bit tiles too (halves of the queries, two k-blocks a half: XO = 2), 300 queries
        cases = (("l2", "uint8", 250), ("ip", "uint8", 250)) if only != "biased" else (("l2", "uint8", 100),)
        cases = (("l2", "uint8", 250), ("l2", "uint8", 900)) if only == "half" else cases   # HK: l2's alone
        cases += (("l2", "float16", 300),) if only == "overlap" else ()
        cases += (("l2", "uint8", 900), ("l2", "float16", 1100)) if only == "lean" else ()
        for metric, dtype, nq in cases:
            db, q = stored(rng, dtype, (340_000, 128)), stored(rng, dtype, (nq, 128))
            with tinyknn.Index(128, metric, dtype, device="cuda") as index:
                index.add(db)
                assert_exact(*index.search(q, 10), db, q, 10, metric, dtype)
                spec = index._searcher._screen.hopper_spec
                expected = 2 if dtype == "float16" and only == "overlap" else value
                assert spec.param(param, 0) == expected, f"{spec} is not the kernel asked for"
            print(f"ok {only} {dtype} {metric} n=340000 nq={nq}", flush=True)
        return 0
    rng = np.random.default_rng(7)
    for metric, dtype, dim, n, k, n_queries, variant, offset in CASES:
        if only is not None and variant != only:
            continue
        plan.SCAN_MAX_QUERIES = 10**9 if variant == "scan" else 0
        db = (rng.standard_normal((n, dim)) + max(offset, 0.0)).astype(np.float32)
        q = (rng.standard_normal((n_queries, dim)) + max(offset, 0.0)).astype(np.float32)
        if offset < 0:                                      # 40 copies of one row, searched at that row
            db[100:140] = db[3]
            q[:] = db[3]
        with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
            index.add(db)
            for _ in range(2):                              # the second search replays a graph
                distances, ids = index.search(q, k)
                assert_exact(distances, ids, db, q, k, metric, dtype)
            slices = [p.slices for p in index._searcher._plans.values() if getattr(p, "variant", None) == variant]
            try:
                import cupy
            except ImportError:
                continue
            index.add(cupy.asarray(rng.standard_normal((50, dim))))   # float64 rows converted on the device
            db = np.concatenate([db, index._searcher.export()[0][n:].astype(np.float32)])
            distances, ids = index.search(cupy.asarray(q.astype(np.float16)), k)
            assert_exact(distances.get(), ids.get(), db, q.astype(np.float16), k, metric, dtype)
        print(f"ok {metric} {dtype} dim={dim} n={n} k={k} nq={n_queries} {variant} slices={slices}", flush=True)
    plan.SCAN_MAX_QUERIES = SCAN_MAX_QUERIES
    if only in (None, "single"):
        shared_bound_single(rng)
    if only is None:
        screen_and_ops(rng)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
