"""One query on a float32 l2 index through its float16 shadow (kernels/single.cuh, ShadowKeyBound): the
kernel streams the screen's float16 copy of the rows, keeps every row its bound cannot rule out and verifies
the candidates in float64 from the float32 rows. Exact answers (tests/reference.py) on data that stresses the
bound: random, clustered, duplicates (ties beyond the margin: the band search, counted), rows one float32 ulp
apart (the same float16 shadow), far from the origin (the shadow's error grows with |x|), tiny values
(float16 subnormals), odd dims, k from 1 to 128; answers bit-identical to the float32 stream; an index with a
value beyond float16's range never streams the shadow; adds and removals after a prepared search."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact

pytestmark = pytest.mark.gpu
DIMS = (3, 100, 128)


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    from gpu_warm import warm

    warm([("l2", "float32", d, k) for d in DIMS for k in (1, 10, 128)])


def _streams_shadow(index, k: int) -> bool:
    """Whether a one-query search of k on this index now goes through the shadow."""
    searcher = index._searcher
    with searcher._lock, searcher._reading(None):
        return bool(searcher._main_spec(1, k, False).param("shadow", 0))


def _both_ways(index, q, k):
    """(shadow answer, float32-stream answer) of the same query."""
    searcher = index._searcher
    shadowed = index.search(q, k)
    searcher.single_shadow = False
    searcher._forget_plans()
    try:
        plain = index.search(q, k)
    finally:
        searcher.single_shadow = True
        searcher._forget_plans()
    return shadowed, plain


def _clustered(rng, n, dim):
    centres = rng.standard_normal((16, dim)) * 4.0
    return (centres[rng.integers(0, 16, n)] + 0.05 * rng.standard_normal((n, dim))).astype(np.float32)


CASES = {
    "random": lambda rng, n, dim: rng.standard_normal((n, dim)).astype(np.float32),
    "clustered": _clustered,
    "far": lambda rng, n, dim: (1000.0 + rng.standard_normal((n, dim))).astype(np.float32),
    "tiny": lambda rng, n, dim: (rng.standard_normal((n, dim)) * 1e-6).astype(np.float32),
    "large": lambda rng, n, dim: (rng.standard_normal((n, dim)) * 3e3).astype(np.float32),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dim", DIMS)
def test_shadow_answers_are_exact(case, dim, rng):
    n = 20_000
    db = CASES[case](rng, n, dim)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        assert _streams_shadow(index, 10)
        for k in (1, 10, 128):
            for i in range(3):
                q = db[rng.integers(0, n, 1)] + 0.01 * rng.standard_normal((1, dim)).astype(np.float32) \
                    if i else CASES[case](rng, 1, dim)
                (d, ids), (d32, ids32) = _both_ways(index, q, k)
                assert_exact(d, ids, db, q, k, "l2")
                assert np.array_equal(ids, ids32) and np.array_equal(d.view(np.int32), d32.view(np.int32))


def test_ties_and_ulp_neighbours(rng):
    """40 copies of a row (ties beyond the margin: the band search, counted) and rows one float32 ulp apart,
    which round to the same float16 shadow: only the float64 verify step orders them."""
    dim = 64
    db = rng.standard_normal((5000, dim)).astype(np.float32)
    db[100:140] = db[3]
    base = db[7].copy()
    for j in range(20):
        row = base.copy()
        row[j % dim] = np.nextafter(row[j % dim], np.float32(np.inf) if j % 2 else np.float32(-np.inf))
        db[200 + j] = row
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        assert _streams_shadow(index, 10)
        before = index._searcher.exact_reruns
        assert_exact(*index.search(db[3:4], 10), db, db[3:4], 10, "l2")
        assert index._searcher.exact_reruns == before + 1
        for k in (5, 10, 30):
            assert_exact(*index.search(base[None], k), db, base[None], k, "l2")


def test_beyond_float16_range_never_streams_the_shadow(rng):
    dim = 32
    db = rng.standard_normal((3000, dim)).astype(np.float32)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        assert _streams_shadow(index, 10)
        q = rng.standard_normal((1, dim)).astype(np.float32)
        assert_exact(*index.search(q, 10), db, q, 10, "l2")
        wide = rng.standard_normal((10, dim)).astype(np.float32)
        wide[3, 5] = 70000.0                       # beyond float16's 65504
        index.add(wide)
        full = np.concatenate([db, wide])
        assert_exact(*index.search(q, 10), full, q, 10, "l2")
        assert not _streams_shadow(index, 10) and not index._searcher._screen.usable
        assert_exact(*index.search(wide[3:4], 10), full, wide[3:4], 10, "l2")


def test_other_metrics_and_dtypes_stream_their_rows(rng):
    for metric, dtype in (("ip", "float32"), ("cosine", "float32"), ("l2", "float16")):
        with tinyknn.Index(16, metric, dtype, device="cuda") as index:
            index.add(rng.standard_normal((500, 16)).astype(np.float32))
            assert not _streams_shadow(index, 10)


def test_prepared_search_follows_adds_and_removals(rng):
    dim = 128
    db = rng.standard_normal((30_000, dim)).astype(np.float32)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        search = index.prepare_search(10, 1)
        q = rng.standard_normal((1, dim)).astype(np.float32)
        assert_exact(*search(q), db, q, 10, "l2")
        near = (q + 1e-3 * rng.standard_normal((5, dim))).astype(np.float32)   # new rows nearest to q
        index.add(near)
        db = np.concatenate([db, near])
        out = np.empty((1, 10), np.float32), np.empty((1, 10), np.int64)
        search(q, out=out)
        assert_exact(*out, db, q, 10, "l2")
        assert set(out[1][0, :5]) == set(range(30_000, 30_005))
        index.remove(np.arange(30_000, 30_003))
        keep = np.setdiff1d(np.arange(len(db)), np.arange(30_000, 30_003))
        d, ids = search(q)
        assert_exact(d, ids, db[keep], q, 10, "l2", id_map=keep)
        assert _streams_shadow(index, 10)


def test_a_shadow_that_does_not_fit_the_device_cap_streams_the_rows(monkeypatch, rng):
    """Under TINYKNN_DEVICE_MEMORY_LIMIT with no room for the shadow, one query streams the float32 rows
    (no MemoryError, exact, the screen's partial buffers given back)."""
    from tinyknn.config import reset_config

    dim = 64
    db = rng.standard_normal((40_000, dim)).astype(np.float32)
    try:
        with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
            index.add(db)
            searcher = index._searcher
            in_use = sum(b.nbytes for b in searcher._buffers.values() if hasattr(b, "fill_bytes"))
            monkeypatch.setenv("TINYKNN_DEVICE_MEMORY_LIMIT", str(in_use + (1 << 20)))   # the shadow needs ~5 MB
            reset_config()
            q = rng.standard_normal((1, dim)).astype(np.float32)
            assert_exact(*index.search(q, 10), db, q, 10, "l2")
            assert not _streams_shadow(index, 10) and "screen_shadow" not in searcher._buffers
    finally:
        monkeypatch.delenv("TINYKNN_DEVICE_MEMORY_LIMIT", raising=False)
        reset_config()


@pytest.mark.parametrize("slices", [100, 400])
def test_the_last_block_gathers_many_lists_as_it_gathers_few(slices, rng):
    """The last block finds its bound over the slices' lists by ranking their minima when there are at most
    256 lists and by the radix select beyond (kernels/merge.cuh, BOUNDED_RANK_LISTS): 79 and 313 slices of
    one index (the slice count forced), clustered rows with duplicates spread over the slices, k from 1 to 128;
    exact answers, and the same ones both ways."""
    dim, n = 128, 80_000
    db = _clustered(rng, n, dim)
    db[rng.integers(0, n, 300)] = db[11]                  # ties in many slices
    queries = [db[11:12], db[rng.integers(0, n, 1)] + 0.01 * rng.standard_normal((1, dim)).astype(np.float32),
               _clustered(rng, 1, dim)]
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        searcher = index._searcher
        answers = {}
        for forced in (None, slices):
            searcher.slices_override = forced
            searcher._forget_plans()
            for k in (1, 10, 128):
                for i, q in enumerate(queries):
                    d, ids = index.search(q, k)
                    assert_exact(d, ids, db, q, k, "l2")
                    answers.setdefault((k, i), []).append((ids, d.view(np.int32)))
            used = [plan.slices for plan in searcher._plans.values() if getattr(plan, "variant", None) == "single"]
            assert used and (forced is None or all(s > 256 for s in used) == (slices > 256))
        searcher.slices_override = None
    for (first, second) in answers.values():
        assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])
