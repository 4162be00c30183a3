"""The GPU's device-side selection (kernels/select.cuh, tinyknn/gpu/ranges.py) and removals that leave no trace:
k beyond the selection kernels (2,049 up to n and beyond) and range search (no hit, a few, ~100, thousands, ties at
the radius), every metric and dtype, bit for bit against the float64 oracle (tests/reference.py), also under
threads; a removal then a search (1 query and a batch) bit-identical to a fresh index of the remaining rows."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tinyknn
from tinyknn.spec import numpy_dtype
from reference import LARGER_IS_BETTER, assert_exact, contract_distances, exact_range, searched, stored

pytestmark = pytest.mark.gpu
METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8")


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    from gpu_warm import warm
    from tinyknn.gpu.device import current_device
    from tinyknn.jit import render

    arch = current_device().arch
    extra = [render.range_spec(m, t, d, arch) for m in METRICS for t in DTYPES for d in (12, 32)]
    warm([("l2", "float32", 32, k) for k in (1, 10)], extra + render.selection_specs(arch))


def small_integers(rng, n, dim, dtype):
    """Rows of small integers (every dtype holds them exactly): many equal distances, so ties everywhere."""
    low = 0 if dtype == "uint8" else -3
    x = rng.integers(low, 4, (n, dim)).astype(np.float32)
    if n >= 200:
        x[n // 2: n // 2 + 50] = x[:50]                     # duplicated rows too
    return x


def build(rng, metric, dtype, x):
    index = tinyknn.Index(x.shape[1], metric, dtype, device="cuda")
    ids = rng.permutation(4 * len(x))[:len(x)].astype(np.int64)   # ids not in row order: ties by id, not row
    index.add(stored(x, dtype).astype(numpy_dtype(dtype)), ids=ids)
    return index, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_large_k_is_exact_with_ties(metric, dtype, rng):
    n = 12_000
    x = small_integers(rng, n, 12, dtype)
    index, ids = build(rng, metric, dtype, x)
    q = np.vstack([small_integers(rng, 3, 12, dtype), rng.standard_normal((2, 12)).astype(np.float32)])
    for k in (2049, 5000, 10_000, n, n + 777):
        d, i = index._searcher.search(q, k)
        assert_exact(d, i, x, q, k, metric, dtype, id_map=ids)
    index.close()


@pytest.mark.parametrize("metric", METRICS)
def test_large_k_over_random_rows_in_chunks(metric, rng, monkeypatch):
    from tinyknn.gpu import ranges

    x = rng.standard_normal((9000, 32)).astype(np.float32)
    index, ids = build(rng, metric, "float32", x)
    q = rng.standard_normal((7, 32)).astype(np.float32)
    monkeypatch.setattr(ranges, "KEY_CHUNK_BYTES", 3 * 9000 * 8)      # three queries' keys a chunk
    for k in (2049, 4096, 4097, 9000):
        d, i = index._searcher.search(q, k)
        assert_exact(d, i, x, q, k, metric, id_map=ids)
    index.close()


def assert_range(index, x, q, radius, metric, dtype, ids, rows=None):
    lims, d, i = index._searcher.range_search(q, radius, rows=rows)
    sub_x, sub_ids = (x, ids) if rows is None else (x[rows], ids[rows])
    want = exact_range(sub_x, q, radius, metric, dtype, sub_ids)
    np.testing.assert_array_equal(lims, want[0])
    np.testing.assert_array_equal(i, want[2])
    np.testing.assert_array_equal(d.view(np.uint32), want[1].view(np.uint32))
    return np.diff(lims)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_range_hits_none_few_about_a_hundred_and_thousands(metric, dtype, rng):
    x = small_integers(rng, 20_000, 12, dtype)
    index, ids = build(rng, metric, dtype, x)
    q = small_integers(rng, 9, 12, dtype)
    dist = contract_distances(stored(x, dtype), searched(q), metric)
    larger = LARGER_IS_BETTER[metric]
    ranked = np.sort(-dist if larger else dist, axis=None)
    seen = []
    for hits in (0, 3, 100, 5000):       # radii at a distance some rows have exactly: ties at the radius
        key = ranked[min(hits * len(q), ranked.size - 1)] if hits else ranked[0]
        radius = float(-key if larger else key)
        seen.append(int(assert_range(index, x, q, radius, metric, dtype, ids).sum()))
        assert_range(index, x, q, radius, metric, dtype, ids, rows=np.arange(0, len(x), 7, dtype=np.int64))
    assert seen[0] == 0 and seen[-1] > 1000, seen
    index.close()


def test_range_pool_overflow_and_split(rng, monkeypatch):
    from tinyknn.gpu import ranges

    x = small_integers(rng, 6000, 12, "float32")
    index, ids = build(rng, "l2", "float32", x)
    q = small_integers(rng, 40, 12, "float32")
    monkeypatch.setattr(ranges, "POOL_FIRST", 16)                        # overflows at once
    monkeypatch.setattr(ranges, "POOL_PER_QUERY", 0)
    monkeypatch.setattr(ranges, "POOL_MAX_BYTES", 500 * ranges.HIT_BYTES)   # then splits the queries
    counts = assert_range(index, x, q, 30.0, "l2", "float32", ids)
    assert counts.sum() > 500                     # more hits than the largest pool allowed: the queries were split
    index.close()


def test_selection_under_threads(rng):
    x = small_integers(rng, 8000, 12, "float32")
    index, ids = build(rng, "l2", "float32", x)
    q = small_integers(rng, 4, 12, "float32")
    failures = []

    def work(seed):
        local = np.random.default_rng(seed)
        try:
            for _ in range(4):
                k = int(local.integers(2049, 9000))
                d, i = index._searcher.search(q, k)
                assert_exact(d, i, x, q, k, "l2", id_map=ids)
                assert_range(index, x, q, float(local.integers(5, 40)), "l2", "float32", ids)
        except AssertionError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
    index.close()


def search_both(index, one, batch):
    return index.search(one, 10), index.search(batch, 10)


def assert_same(got, want):
    for (got_d, got_i), (want_d, want_i) in zip(got, want):
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_d.view(np.uint32), want_d.view(np.uint32))


def fresh_answers(x, kept, one, batch):
    fresh = tinyknn.Index(x.shape[1], "l2", device="cuda")
    fresh.add(x[kept], ids=kept)
    try:
        return search_both(fresh, one, batch)
    finally:
        fresh.close()


def test_remove_leaves_no_trace(rng):
    """After a removal the one-query host batch is still cached with its graph, the screen's row terms are in
    step (where the screen moves them), and searches of 1 query and a batch (the screen's) equal a fresh index
    of the remaining rows bit for bit; with threads searching while a second removal happens, each answer is
    the one before it or the one after it."""
    from tinyknn.gpu import plan as plans

    n, dim = 40_000, 32
    x = rng.standard_normal((n, dim)).astype(np.float32)
    index = tinyknn.Index(dim, "l2", device="cuda")
    index.add(x, ids=np.arange(n))
    searcher = index._searcher
    one, batch = rng.standard_normal((1, dim)).astype(np.float32), rng.standard_normal((200, dim)).astype(np.float32)
    for _ in range(3):                                   # warm: plans, graphs, the screen's row terms
        search_both(index, one, batch)
    kept = np.arange(n)
    for threads_search in (False, True):
        gone = rng.choice(kept, n // 100, replace=False)
        before = search_both(index, one, batch)
        kept = np.setdiff1d(kept, gone)
        after = fresh_answers(x, kept, one, batch)
        answers, stop = [], threading.Event()

        def search():
            while not stop.is_set():
                answers.append(search_both(index, one, batch))

        threads = [threading.Thread(target=search) for _ in range(3 if threads_search else 0)]
        for thread in threads:
            thread.start()
        assert index.remove(gone) == len(gone)
        stop.set()
        for thread in threads:
            thread.join()
        if not threads_search:
            if hasattr(searcher._screen, "move_rows"):
                assert searcher._screen.ready == len(kept)   # moved with the rows, not recomputed
            assert any(isinstance(b, plans.HostBatch) and b.plan.n_queries == 1 and b.graph is not None
                       for b in searcher._plans.values())
        for got in answers:                           # each search (the pair's two apart) before or after
            for got_one, before_one, after_one in zip(got, before, after):
                try:
                    assert_same([got_one], [before_one])
                except AssertionError:
                    assert_same([got_one], [after_one])
        assert_same(search_both(index, one, batch), after)
        assert_exact(*index.search(batch, 10), x[kept], batch, 10, "l2", id_map=kept)
    index.close()
