"""The CPU library's row-major copy (kernels/cpu/row_copy.h) and the filtered search that reads it
(kernels/cpu/direct.h: every allowed row's float64 distance, no screen), compared bit for bit with the float64
oracle (tests/reference.py): every metric and storage dtype, allow-lists of many sizes, ties, duplicates, k beyond
the allowed rows, zero and tiny rows; the copy kept in step by adds, removals, reorders, truncation and reset;
when it is built (ski rental: not before the gathered searches have lost about its cost, never for contiguous
rows); concurrent searches while it is built. Sizes follow the build's panel width (tk_build_param)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tinyknn.cpu import library
from tinyknn.cpu.searcher import CpuSearcher
from reference import assert_exact
from test_cpu_index_ops import METRICS, NUMPY, data  # the dtypes' exact rows, shared with the gather's tests

def build(rng, metric, dtype, db, mode="always"):
    searcher = CpuSearcher(db.shape[1], metric, dtype)
    ids = rng.permutation(10 * len(db))[:len(db)].astype(np.int64)     # id order is not row order
    searcher.add(np.ascontiguousarray(db.astype(NUMPY[dtype])), ids)
    searcher.row_copy(mode)
    return searcher, ids


def panel() -> int:
    return library.build_param("panel_rows")


def allow_lists(rng, n):
    """Allowed row positions (sorted, unique): single rows, fewer and more than a panel, 1 %, 30 %, a run."""
    sizes = (1, 3, panel() - 1, panel() + 1, max(2, n // 100), n * 3 // 10)
    lists = [np.sort(rng.choice(n, size, replace=False)).astype(np.int64) for size in sizes]
    return lists + [np.arange(n // 3, n // 3 + 2 * panel() + 5, dtype=np.int64)]


@pytest.mark.parametrize("dtype", list(NUMPY))
@pytest.mark.parametrize("metric", METRICS)
def test_direct_search_is_the_oracles(metric, dtype, rng):
    n, dim = 20 * panel() + 5, 37
    db = data(rng, n, dim, dtype)
    if metric == "cosine" and dtype in ("float32", "float16", "bfloat16"):
        db[3] = 0.0                       # similarity 0 with everything
        db[5] = 0.0
        db[5, 0] = 1e-30 if dtype == "float32" else 0.0   # norm below 2^-126 (the screen cannot bound it)
    searcher, ids = build(rng, metric, dtype, db)
    q = data(rng, library.build_param("direct_max_queries"), dim, dtype)
    stored = db.astype(NUMPY[dtype])
    searches = 0
    for rows in allow_lists(rng, n) + [np.array([3, 5, 7], dtype=np.int64)]:
        for k in (1, 10, len(rows) + 5):
            for batch in (q[:1], q[:3], q):
                d, i = searcher.search(batch, k, rows=rows)
                assert_exact(d, i, stored[rows], batch, k, metric, dtype, id_map=ids[rows])
                searches += 1
    assert searcher.row_copy_counts() == (n, searches, 1)
    searcher.close()


@pytest.mark.parametrize("dim", [1, 2, 15, 16, 17, 1000])
def test_direct_search_for_rows_of_any_length(dim, rng):
    """Rows shorter than a cache line (several in one line) and rows of many lines (prefetched ahead)."""
    n = 12 * panel() + 3
    for metric, dtype in (("l2", "float32"), ("cosine", "float16"), ("ip", "int8")):
        db = data(rng, n, dim, dtype)
        searcher, ids = build(rng, metric, dtype, db)
        q = data(rng, 4, dim, dtype)
        for rows in allow_lists(rng, n):
            d, i = searcher.search(q, 7, rows=rows)
            assert_exact(d, i, db[rows].astype(NUMPY[dtype]), q, 7, metric, dtype, id_map=ids[rows])
        searcher.close()


@pytest.mark.parametrize("metric", METRICS)
def test_ties_and_duplicates_go_by_the_smaller_id(metric, rng):
    """Integer rows in a small range (many equal distances) and exact copies of rows: k cuts through groups of
    equal float64 distances, which must come back in id order, whatever slice of the search found them."""
    n, dim = 40 * panel(), 4
    db = rng.integers(-2, 3, size=(n, dim)).astype(np.float32)
    db[::7] = db[1]                       # many copies of one row
    searcher, ids = build(rng, metric, "float32", db)
    q = np.vstack([db[1], db[1] + 0.5, rng.integers(-2, 3, size=(2, dim))]).astype(np.float32)
    for fraction in (0.05, 0.5):
        rows = np.flatnonzero(rng.random(n) < fraction).astype(np.int64)
        for k in (1, 5, 33, 200):
            d, i = searcher.search(q, k, rows=rows)
            assert_exact(d, i, db[rows], q, k, metric, id_map=ids[rows])
    searcher.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8"])
@pytest.mark.parametrize("metric", METRICS)
def test_the_copy_follows_every_change_of_the_rows(metric, dtype, rng):
    """Adds, swap-removals, reorders and truncation keep the copy in step with the panels; a reset drops it (and
    "always" builds it again for the next filtered search)."""
    dim = 9
    db = data(rng, 6 * panel() + 1, dim, dtype)
    searcher, ids = build(rng, metric, dtype, db)
    q = data(rng, 3, dim, dtype)
    rows_db, rows_ids = db, ids

    def check():
        n = len(rows_db)
        assert searcher.row_copy_counts()[0] == n
        for rows in (np.sort(rng.choice(n, n // 3, replace=False)), np.arange(1, n, 2), np.array([n - 1])):
            rows = rows.astype(np.int64)
            d, i = searcher.search(q, 6, rows=rows)
            assert_exact(d, i, rows_db[rows].astype(NUMPY[dtype]), q, 6, metric, dtype, id_map=rows_ids[rows])

    searcher.search(q, 6, rows=np.arange(3, dtype=np.int64))      # (the copy exists before the changes)
    more = data(rng, 3 * panel() + 2, dim, dtype)
    more_ids = np.arange(10 * len(db), 10 * len(db) + len(more), dtype=np.int64)
    searcher.add(np.ascontiguousarray(more.astype(NUMPY[dtype])), more_ids)
    rows_db, rows_ids = np.vstack([rows_db, more]), np.concatenate([rows_ids, more_ids])
    check()
    gone = np.sort(rng.choice(len(rows_db), len(rows_db) // 4, replace=False)).astype(np.int64)
    moved_from, moved_to = searcher.remove_rows(gone)
    order = np.arange(len(rows_db))
    order[moved_to] = moved_from
    order = order[:len(rows_db) - len(gone)]
    rows_db, rows_ids = rows_db[order], rows_ids[order]
    check()
    order = rng.permutation(len(rows_db)).astype(np.int64)
    searcher.permute_rows(order)
    rows_db, rows_ids = rows_db[order], rows_ids[order]
    check()
    searcher.truncate(len(rows_db) - panel() - 1)
    rows_db, rows_ids = rows_db[:len(rows_db) - panel() - 1], rows_ids[:len(rows_ids) - panel() - 1]
    check()
    builds = searcher.row_copy_counts()[2]
    searcher.reset()
    assert searcher.row_copy_counts()[0] == -1
    searcher.add(np.ascontiguousarray(db.astype(NUMPY[dtype])), ids)
    rows_db, rows_ids = db, ids
    searcher.search(q, 6, rows=np.arange(3, dtype=np.int64))      # builds it again
    check()
    assert searcher.row_copy_counts()[2] == builds + 1
    searcher.close()


def test_auto_builds_the_copy_once_scattered_searches_have_paid_for_it(rng):
    """TK_ROW_COPY_AUTO (the default): searches of scattered allowed rows are gathered until their estimated
    loss against the copy reaches its cost, then the copy is built once and answers the later ones; searches of
    contiguous rows (which the gather reads a line per dimension) never build it."""
    n, dim = 300 * panel(), 64
    db = data(rng, n, dim, "float32")
    q = data(rng, 2, dim, "float32")
    searcher, ids = build(rng, "l2", "float32", db, mode="auto")
    assert searcher.row_copy_counts() == (-1, 0, 0)
    gathered = 0
    while searcher.row_copy_counts()[2] == 0 and gathered < 2000:
        rows = np.sort(rng.choice(n, n // 100, replace=False)).astype(np.int64)
        d, i = searcher.search(q[:1], 10, rows=rows)
        assert_exact(d, i, db[rows], q[:1], 10, "l2", id_map=ids[rows])
        gathered += 1
    rows_held, searches, builds = searcher.row_copy_counts()
    assert builds == 1 and rows_held == n and searches == 1, (gathered, searcher.row_copy_counts())
    assert gathered > 2                 # not built at the first filtered search
    for batch in (q[:1], q):
        d, i = searcher.search(batch, 10, rows=rows)
        assert_exact(d, i, db[rows], batch, 10, "l2", id_map=ids[rows])
    assert searcher.row_copy_counts()[1] == 3
    many = data(rng, 200, dim, "float32")  # beyond direct_max_queries: always gathered
    d, i = searcher.search(many, 10, rows=rows)
    assert_exact(d, i, db[rows], many, 10, "l2", id_map=ids[rows])
    assert searcher.row_copy_counts()[1] == 3
    searcher.close()

    searcher, ids = build(rng, "l2", "float32", db, mode="auto")
    run = np.arange(n // 2, n // 2 + n // 100, dtype=np.int64)
    for _ in range(300):
        searcher.search(q[:1], 10, rows=run)
    assert searcher.row_copy_counts() == (-1, 0, 0)
    searcher.close()


def test_off_drops_the_copy_and_never_builds_it(rng):
    n, dim = 40 * panel(), 8
    db = data(rng, n, dim, "float32")
    searcher, ids = build(rng, "ip", "float32", db)
    assert searcher.row_copy_counts()[0] == n
    searcher.row_copy("off")
    assert searcher.row_copy_counts()[0] == -1
    q = data(rng, 1, dim, "float32")
    for _ in range(200):
        rows = np.sort(rng.choice(n, 3, replace=False)).astype(np.int64)
        d, i = searcher.search(q, 2, rows=rows)
        assert_exact(d, i, db[rows], q, 2, "ip", id_map=ids[rows])
    assert searcher.row_copy_counts() == (-1, 0, 1)
    with pytest.raises(ValueError, match="row copy mode"):
        searcher.row_copy("sometimes")
    searcher.close()


def test_searches_from_several_threads_while_the_copy_is_built(rng):
    """The copy is built under the shared gate by one search while others run (gathered until it is published,
    then from it); every answer is exact and it is built once."""
    n, dim = 200 * panel(), 32
    db = data(rng, n, dim, "float32")
    searcher, ids = build(rng, "l2", "float32", db, mode="auto")
    q = data(rng, 4, dim, "float32")
    lists = [np.sort(rng.choice(n, n // 50, replace=False)).astype(np.int64) for _ in range(8)]

    def work(j):
        for step in range(60):
            rows = lists[(j + step) % len(lists)]
            batch = q[:1 + (j + step) % 4]
            d, i = searcher.search(batch, 10, rows=rows)
            assert_exact(d, i, db[rows], batch, 10, "l2", id_map=ids[rows])

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(work, range(6)))
    assert searcher.row_copy_counts()[2] == 1
    searcher.close()


def test_reorders_of_every_shape_permute_the_copy_in_place(rng):
    """permute_rows follows each cycle of the order through the copy with one row set aside: the identity, a
    reversal (cycles of two), one cycle through every row, fixed points among long cycles; each followed by a
    filtered search over all rows but one (so it reads the copy) against the oracle."""
    n, dim = 9 * panel() + 3, 11
    db = data(rng, n, dim, "float32")
    searcher, ids = build(rng, "l2", "float32", db)
    q = data(rng, 2, dim, "float32")
    state_db, state_ids = db, ids
    mixed = np.arange(n)                          # every fifth row stays, the others are shuffled
    moved = np.flatnonzero(np.arange(n) % 5 != 0)
    mixed[moved] = rng.permutation(moved)
    for order in (np.arange(n), np.arange(n)[::-1], np.roll(np.arange(n), 1), mixed, rng.permutation(n)):
        order = np.ascontiguousarray(order, dtype=np.int64)
        searcher.permute_rows(order)
        state_db, state_ids = state_db[order], state_ids[order]
        rows = np.delete(np.arange(n), rng.integers(n)).astype(np.int64)
        before = searcher.row_copy_counts()[1]
        d, i = searcher.search(q, 9, rows=rows)
        assert_exact(d, i, state_db[rows], q, 9, "l2", id_map=state_ids[rows])
        assert searcher.row_copy_counts()[1] == before + 1
    searcher.close()
