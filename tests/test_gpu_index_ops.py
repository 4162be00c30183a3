"""The GPU searcher's index operations (row positions; the Index maps ids and labels onto them): filtered
search over gathered rows, swap-remove, get, range search and k beyond the kernels' 2,048, each compared
bit for bit with the float64 oracle (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact, exact_range

pytestmark = pytest.mark.gpu
METRICS = ("l2", "ip", "cosine")


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    from gpu_warm import warm

    warm([(m, t, d, k) for m in METRICS for t in ("float32", "float16") for d in (8, 12, 24)
          for k in (1, 5, 10, 50, 2048)])


def build(rng, metric, dtype="float32", n=3000, dim=24):
    db = rng.standard_normal((n, dim)).astype(np.float32)
    index = tinyknn.Index(dim, metric, dtype, device="cuda")
    ids = rng.permutation(10 * n)[:n].astype(np.int64)
    index._searcher.add(db.astype(dtype), ids)
    return index, db, ids


@pytest.mark.parametrize("metric", METRICS)
def test_search_over_allowed_rows(metric, rng):
    index, db, ids = build(rng, metric)
    q = rng.standard_normal((40, 24)).astype(np.float32)
    for fraction in (0.01, 0.3, 1.0):
        rows = np.flatnonzero(rng.random(len(db)) < fraction).astype(np.int64)
        for k in (1, 10, 50):
            for batch in (q[:1], q):
                d, i = index._searcher.search(batch, k, rows=rows)
                assert_exact(d, i, db[rows], batch, k, metric, id_map=ids[rows])
    d, i = index._searcher.search(q, 5, rows=np.empty(0, np.int64))
    assert np.all(i == -1)
    d, i = index._searcher.search(q, 5)                    # the unfiltered path after filtered ones
    assert_exact(d, i, db, q, 5, metric, id_map=ids)
    index.close()


@pytest.mark.parametrize("metric", METRICS)
def test_remove_rows_moves_the_last_rows_into_the_holes(metric, rng):
    index, db, ids = build(rng, metric, dtype="float16")
    gone = np.unique(rng.choice(len(db), 300, replace=False)).astype(np.int64)
    moved_from, moved_to = index._searcher.remove_rows(gone)
    keep = np.setdiff1d(np.arange(len(db)), gone)
    rows = np.arange(len(db))
    rows[moved_to] = moved_from                            # where each surviving position's row came from
    order = rows[:len(keep)]
    assert sorted(order.tolist()) == keep.tolist()
    vectors, now_ids = index._searcher.export()
    np.testing.assert_array_equal(now_ids, ids[order])
    np.testing.assert_array_equal(vectors, db[order].astype(np.float16))
    q = rng.standard_normal((30, 24)).astype(np.float32)
    d, i = index._searcher.search(q, 10)
    assert_exact(d, i, db[order], q, 10, metric, "float16", id_map=ids[order])
    np.testing.assert_array_equal(index._searcher.get_rows(np.array([0, 5, len(keep) - 1])),
                                  db[order][[0, 5, len(keep) - 1]].astype(np.float16))
    index.close()


@pytest.mark.parametrize("metric,radius", [("l2", 30.0), ("ip", 6.0), ("cosine", 0.5)])
def test_range_search_is_exact(metric, radius, rng):
    index, db, ids = build(rng, metric)
    q = rng.standard_normal((21, 24)).astype(np.float32)
    for rows in (None, np.arange(0, len(db), 3, dtype=np.int64)):
        lims, d, i = index._searcher.range_search(q, radius, rows=rows)
        sub_db, sub_ids = (db, ids) if rows is None else (db[rows], ids[rows])
        want = exact_range(sub_db, q, radius, metric, id_map=sub_ids)
        np.testing.assert_array_equal(lims, want[0])
        np.testing.assert_array_equal(i, want[2])
        np.testing.assert_array_equal(d.view(np.uint32), want[1].view(np.uint32))
    assert lims[-1] > 21                                   # the radius finds hits
    index.close()


def test_range_search_grows_past_its_first_capacity(rng):
    db = np.repeat(rng.standard_normal((1, 8)).astype(np.float32), 1000, axis=0)   # 1,000 identical rows
    index = tinyknn.Index(8, "l2", device="cuda")
    index._searcher.add(db, np.arange(1000))
    lims, d, i = index._searcher.range_search(db[:2], 1e-3)
    np.testing.assert_array_equal(lims, [0, 1000, 2000])
    np.testing.assert_array_equal(i[:1000], np.arange(1000))    # ties in id order
    index.close()


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_k_beyond_the_kernels(metric, rng):
    index, db, ids = build(rng, metric, n=2600, dim=12)
    q = rng.standard_normal((3, 12)).astype(np.float32)
    for k in (2049, 2600, 3000):
        d, i = index._searcher.search(q, k)
        assert_exact(d, i, db, q, k, metric, id_map=ids)
    index.close()
