"""The single-query kernel's slices sharing a bound (render_single.single_params shared_bound, single.cuh's GT; a knob):
a slice that finds another slice's KL-th key published lists only its keys under it, with no select. With
several waves of slices, the later ones find one; their lists are then short (padded with position -1), and
the answers must be the default kernel's, bit for bit, and the float64 oracle's: every storage type and metric,
k 1 / 10 / 100, ties, a filter's rows read in place, and query after query (each launch's last block zeroes the
bound, so a near query's tight bound must never filter the far query after it)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact
from test_gpu_single_staged import _rows    # clustered rows with ties, in each storage type's range

pytestmark = pytest.mark.gpu

CASES = [("l2", "float32", 128), ("l2", "float16", 100), ("ip", "bfloat16", 64), ("cosine", "float32", 96),
         ("l2", "uint8", 130), ("ip", "int8", 33)]
SLICES = 600        # several waves of blocks on any GPU: the later slices find a bound published


def _queries(rng, db: np.ndarray, dtype: str) -> np.ndarray:
    """A row of the index (a tight bound), a query far from every row, then near ones: alternating."""
    n, dim = db.shape
    far = db[7] + (60.0 if dtype in ("uint8", "int8") else 40.0)
    if dtype == "uint8":
        far = np.full(dim, 255.0 if db[7].mean() < 128 else 0.0)
    elif dtype == "int8":
        far = np.full(dim, 127.0 if db[7].mean() < 0 else -128.0)
    near = db[rng.integers(0, n, 2)]
    return np.stack([db[5], far, near[0], far, db[5], near[1]]).astype(np.float32)


def _answers(index, queries, k: int, shared: bool, **filters):
    searcher = index._searcher
    searcher.single_overrides = (("shared_bound", shared),)
    searcher.slices_override = SLICES
    searcher._forget_plans()
    try:
        return [index.search(q[None], k, **filters) for q in queries]
    finally:
        searcher.single_overrides = ()
        searcher.slices_override = None
        searcher._forget_plans()


def _short_lists(index, k: int) -> int:
    """Lists of the last search's slices (of more than KL rows each) that hold a padding position (-1): slices
    that listed their keys under another's bound. The plan is built again with the same knobs (the same slices
    and layout) and the candidates buffer read as that search left it."""
    searcher = index._searcher
    searcher.single_overrides = (("shared_bound", True),)
    searcher.slices_override = SLICES
    try:
        with searcher._lock, searcher._reading(None):
            plan = searcher._host_batch(1, k).plan
            kl = searcher._main_spec(1, k, False).param("kl")
        slices, rows = plan.slices, plan.rows_per_slice
        lists = np.zeros(2 * slices * kl, np.int32)
        searcher._buffers["candidates"].copy_to_host(lists, lists.nbytes)
        positions = lists[slices * kl:].reshape(slices, kl)
        full = positions[:-1] if rows > kl else positions[:0]       # the last slice may hold fewer rows
        return int((full < 0).any(axis=1).sum())
    finally:
        searcher.single_overrides = ()
        searcher.slices_override = None


@pytest.mark.parametrize("metric,dtype,dim", CASES)
def test_slices_under_a_shared_bound_answer_as_the_default_kernel(metric, dtype, dim, rng):
    n = 120_000
    db = _rows(rng, n, dim, dtype)
    queries = _queries(rng, db, dtype)
    with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
        index.add(db)
        for k in (1, 10, 100):
            plain = _answers(index, queries, k, False)
            shared = _answers(index, queries, k, True)
            for q, (d0, i0), (d1, i1) in zip(queries, plain, shared):
                assert_exact(d1, i1, db, q[None], k, metric, dtype)
                assert np.array_equal(i0, i1) and np.array_equal(d0.view(np.int32), d1.view(np.int32)), k
            _answers(index, queries[:1], k, True)            # the last search: a row of the index, a tight bound
            assert _short_lists(index, k) > 0, "no slice listed its keys under a shared bound"
        ran = {s.param("gt", 0) for s in index._searcher._kernels if s.variant == "single"}
        assert ran == {0, 1}


def test_slices_under_a_shared_bound_read_a_filters_rows_in_place(rng):
    dim, n = 64, 200_000
    db = _rows(rng, n, dim, "float32")
    allowed = np.sort(rng.choice(n, 150_000, replace=False))
    queries = np.concatenate([db[allowed[:2]], db[allowed[:1]] + 40.0]).astype(np.float32)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        plain = _answers(index, queries, 10, False, filter=allowed)
        shared = _answers(index, queries, 10, True, filter=allowed)
        for q, (d0, i0), (d1, i1) in zip(queries, plain, shared):
            assert_exact(d1, i1, db[allowed], q[None], 10, "l2", id_map=allowed)
            assert np.array_equal(i0, i1) and np.array_equal(d0.view(np.int32), d1.view(np.int32))


def test_a_slice_with_too_many_keys_under_the_bound_selects_as_usual(rng):
    """Early slices of far rows publish a loose bound; the later slices of near rows have more keys under it than
    the gather holds (512), so they fall back to their own select: the answers are still the default's."""
    dim, n = 16, 400_000
    db = rng.standard_normal((n, dim)).astype(np.float32)
    db[: n * 7 // 10] += 50.0                                # the first wave of slices and more: far rows
    queries = np.stack([db[n - 1], db[n - 7], db[3]]).astype(np.float32)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        searcher = index._searcher
        searcher.slices_override = 300                        # slices of more than 512 rows, in several waves
        try:
            searcher.single_overrides = (("shared_bound", False),)
            searcher._forget_plans()
            plain = [index.search(q[None], 10) for q in queries]
            searcher.single_overrides = (("shared_bound", True),)
            searcher._forget_plans()
            shared = [index.search(q[None], 10) for q in queries]
            with searcher._lock, searcher._reading(None):       # a search's view of the rows, as in a search
                rows = searcher._host_batch(1, 10).plan.rows_per_slice
        finally:
            searcher.single_overrides, searcher.slices_override = (), None
            searcher._forget_plans()
        assert rows > 512, rows
        for q, (d0, i0), (d1, i1) in zip(queries, plain, shared):
            assert_exact(d1, i1, db, q[None], 10, "l2")
            assert np.array_equal(i0, i1) and np.array_equal(d0.view(np.int32), d1.view(np.int32))


@pytest.mark.parametrize("limit", [1 << 20, 1 << 40])
def test_the_default_shares_the_bound_where_a_query_streams_enough_bytes(rng, monkeypatch, limit):
    """render_single.single_shares_bound picks the knob by the bytes one query streams (on Hopper): the default search
    of an index past the limit runs the shared-bound kernel, one under it the plain one, exact either way."""
    from tinyknn.jit import render_single

    monkeypatch.setattr(render_single, "SINGLE_SHARED_BOUND_BYTES", limit)
    db = _rows(rng, 100_000, 64, "float16")                 # 12.8 MB of float16 rows
    queries = _queries(rng, db, "float16")
    with tinyknn.Index(64, "l2", "float16", device="cuda") as index:
        index.add(db)
        searcher = index._searcher
        for q in queries:
            d, ids = index.search(q[None], 10)
            assert_exact(d, ids, db, q[None], 10, "l2", "float16")
        ran = {s.param("gt", 0) for s in searcher._kernels if s.variant == "single"}     # what the searches ran
        assert ran == {int(limit < db.size * 2 and searcher._arch in render_single.SINGLE_STAGE_ARCHS)}
