"""The CPU searcher's index operations (row positions, the Index maps ids and labels onto them):
filtered search over gathered rows, swap-remove (panels, ids, norms and the float16 sketch), get, range search,
k beyond 2,048 and the bfloat16 / int8 / uint8 storage dtypes, each compared bit for bit with the float64 oracle
(tests/reference.py), and sequences of removes and searches against a model (hypothesis)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyknn.cpu import library
from tinyknn.cpu.searcher import CpuSearcher
from reference import LARGER_IS_BETTER, assert_exact, contract_distances, exact_range, searched, stored

METRICS = ("l2", "ip", "cosine")
NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8,
         "uint8": np.uint8}


def data(rng, n, dim, dtype):
    """Rows the dtype holds exactly (integers for 8-bit dtypes), as float32."""
    if dtype == "int8":
        return rng.integers(-128, 128, size=(n, dim)).astype(np.float32)
    if dtype == "uint8":
        return rng.integers(0, 256, size=(n, dim)).astype(np.float32)
    return rng.standard_normal((n, dim)).astype(np.float32)


def build(rng, metric, dtype="float32", n=3000, dim=24, db=None):
    db = data(rng, n, dim, dtype) if db is None else db
    searcher = CpuSearcher(db.shape[1], metric, dtype)
    ids = rng.permutation(10 * len(db))[:len(db)].astype(np.int64)
    searcher.add(np.ascontiguousarray(db.astype(NUMPY[dtype])), ids)
    return searcher, db, ids


def sketch_rows() -> int:
    """Enough rows that a float32 l2 search of one query goes through the float16 sketch (sketch_search.h)."""
    return (library.build_param("sketch_min_panels") * 5 // 4 + 8) * library.build_param("panel_rows")


@pytest.mark.parametrize("row_copy", ["off", "always"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("metric", METRICS)
def test_search_over_allowed_rows(metric, dtype, row_copy, rng):
    """Gathered ("off") or, for up to direct_max_queries queries, from the row-major copy ("always")."""
    searcher, db, ids = build(rng, metric, dtype)
    searcher.row_copy(row_copy)
    q = data(rng, 40, 24, dtype)
    for fraction in (0.01, 0.3, 1.0):
        rows = np.flatnonzero(rng.random(len(db)) < fraction).astype(np.int64)
        for k in (1, 10, 50):
            for batch in (q[:1], q[:8], q):
                d, i = searcher.search(batch, k, rows=rows)
                assert_exact(d, i, db[rows], batch, k, metric, NUMPY[dtype], id_map=ids[rows])
    d, i = searcher.search(q, 5, rows=np.empty(0, np.int64))
    assert np.all(i == -1)
    assert np.all(d == (-np.inf if LARGER_IS_BETTER[metric] else np.inf))
    d, i = searcher.search(q, 5)                    # the unfiltered path after filtered ones
    assert_exact(d, i, db, q, 5, metric, NUMPY[dtype], id_map=ids)
    searcher.close()


def test_filtered_few_queries_go_through_the_gathered_sketch(rng):
    """Float32 l2, a few queries over enough allowed rows: their float16 sketch rows are gathered (half the bytes)
    and the candidates rescored against the index's own float32 rows; exact, and counted as sketch answers."""
    searcher, db, ids = build(rng, "l2", n=3 * sketch_rows(), dim=32)
    searcher.row_copy("off")                     # (the gather's path, whatever the row copy's cost model says)
    q = data(rng, 8, 32, "float32")
    before = searcher.sketch_counts()[0]
    for rows in (np.arange(1, len(db), 2, dtype=np.int64), np.arange(len(db) // 2, dtype=np.int64)):
        for n_queries, k in ((1, 1), (1, 10), (8, 10)):
            d, i = searcher.search(q[:n_queries], k, rows=rows)
            assert_exact(d, i, db[rows], q[:n_queries], k, "l2", id_map=ids[rows])
    assert searcher.sketch_counts()[0] == before + 6
    searcher.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("metric", METRICS)
def test_runs_of_consecutive_rows_at_every_offset(metric, dtype, rng):
    """Runs of consecutive rows (a label's rows once the Index has put them together) are gathered a panel
    line at a time (database.h copy_panel_of_rows): every start offset in a panel, runs shorter and longer than
    a panel, mixed with single rows, each search exact."""
    panel = library.build_param("panel_rows")
    searcher, db, ids = build(rng, metric, dtype, n=12 * panel + 5, dim=19)
    searcher.row_copy("off")
    q = data(rng, 3, 19, dtype)
    for start in range(panel + 1):
        for length in (panel - 1, panel, panel + 1, 3 * panel + 2):
            run = np.arange(start, start + length, dtype=np.int64)
            mixed = np.concatenate([[0], run + 3, run + 6 * panel, [12 * panel + 4]]).astype(np.int64)
            for rows in (run, np.unique(mixed)):
                d, i = searcher.search(q, 4, rows=rows)
                assert_exact(d, i, db[rows], q, 4, metric, NUMPY[dtype], id_map=ids[rows])
    searcher.close()


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_runs_that_cross_a_block_of_panels(metric, rng):
    """A run whose panels lie in two blocks (database.h kBlockBytes: 64 MiB of panels each) is copied an element
    at a time where the two source panels are not adjacent. 2,048 dims: float32 blocks of 8,192 rows, float16
    sketch blocks (l2 float32, one query) of 16,384 rows; runs across both, long enough for the sketch."""
    dim, boundary, length = 2048, (64 << 20) // (2048 * 2), sketch_rows()
    db = data(rng, boundary + length, dim, "float32")
    base = 10 * data(rng, 1, dim, "float32")[0]
    for edge in (boundary // 2, boundary):      # the 8 rows around each edge are the query's 8 best
        db[edge - 4:edge + 4] = base + data(rng, 8, dim, "float32")
    ids = rng.permutation(10 * len(db))[:len(db)].astype(np.int64)
    searcher = CpuSearcher(dim, metric, "float32")
    for part in (slice(0, boundary // 2), slice(boundary // 2, boundary), slice(boundary, None)):
        searcher.add(db[part], ids[part])     # each add maps its own blocks: block edges are not adjacent
    searcher.row_copy("off")
    q = base[None, :]
    sketched = searcher.sketch_counts()
    for edge in (boundary // 2, boundary):
        for start in (max(0, edge - length + 100), edge - 37, edge - library.build_param("panel_rows")):
            rows = np.arange(start, start + length, dtype=np.int64)
            d, i = searcher.search(q, 8, rows=rows)
            assert_exact(d, i, db[rows], q, 8, metric, id_map=ids[rows])
    # l2: every search went through the gathered sketch (a search it could not prove is answered from the
    # gathered float32 rows, which cross the float32 blocks' edges too)
    assert sum(searcher.sketch_counts()) - sum(sketched) == (6 if metric == "l2" else 0)
    searcher.close()


def test_filtered_searches_from_several_threads_at_once(rng):
    """Each calling thread gathers into its own temporary index (and sketch): concurrent filtered searches with
    different allowed rows never see each other's rows."""
    from concurrent.futures import ThreadPoolExecutor

    searcher, db, ids = build(rng, "l2", n=3 * sketch_rows(), dim=32)
    q = data(rng, 12, 32, "float32")
    masks = [np.flatnonzero(rng.random(len(db)) < fraction).astype(np.int64) for fraction in (0.02, 0.5, 0.9, 0.3)]

    def work(j):
        rows = masks[j % len(masks)]
        for n_queries in (1, 12):
            d, i = searcher.search(q[:n_queries], 10, rows=rows)
            assert_exact(d, i, db[rows], q[:n_queries], 10, "l2", id_map=ids[rows])
        return j

    with ThreadPoolExecutor(4) as pool:
        assert sorted(pool.map(work, range(16))) == list(range(16))
    searcher.close()


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_k_beyond_2048_and_beyond_the_allowed_rows(metric, rng):
    searcher, db, ids = build(rng, metric, n=2600, dim=12)
    q = data(rng, 3, 12, "float32")
    for k in (2049, 2600, 3000):
        d, i = searcher.search(q, k)
        assert_exact(d, i, db, q, k, metric, id_map=ids)
    rows = np.arange(0, 2600, 2, dtype=np.int64)
    for k in (1299, 1300, 2049, 5000):
        d, i = searcher.search(q, k, rows=rows)
        assert_exact(d, i, db[rows], q, k, metric, id_map=ids[rows])
    searcher.close()


def test_bad_rows_are_refused(rng):
    searcher, db, _ = build(rng, "l2", n=100, dim=4)
    q = db[:2]
    for rows, error in (([3, 1], ValueError), ([1, 1], ValueError), ([-1, 2], ValueError), ([5, 100], ValueError),
                        (np.array([0.5, 2.0]), TypeError), (np.zeros((2, 2), np.int64), TypeError)):
        with pytest.raises(error):
            searcher.search(q, 3, rows=np.asarray(rows))
        with pytest.raises(error):
            searcher.range_search(q, 1.0, rows=np.asarray(rows))
    with pytest.raises(ValueError, match="radius"):
        searcher.range_search(q, float("nan"))
    searcher.close()


def order_after(n, moved_from, moved_to, gone):
    """Where each surviving position's row came from, checked against the swap-remove convention."""
    n_new = n - len(gone)
    assert np.all(np.diff(moved_from) > 0) and np.all(np.diff(moved_to) > 0)
    np.testing.assert_array_equal(moved_to, gone[gone < n_new])
    np.testing.assert_array_equal(moved_from, np.setdiff1d(np.arange(n_new, n), gone))
    rows = np.arange(n)
    rows[moved_to] = moved_from
    return rows[:n_new]


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("metric", METRICS)
def test_remove_rows_moves_the_last_rows_into_the_holes(metric, dtype, rng):
    searcher, db, ids = build(rng, metric, dtype)
    gone = np.unique(rng.choice(len(db), 300, replace=False)).astype(np.int64)
    moved_from, moved_to = searcher.remove_rows(gone[::-1].copy())      # any order: the searcher sorts them
    order = order_after(len(db), moved_from, moved_to, gone)
    assert sorted(order.tolist()) == np.setdiff1d(np.arange(len(db)), gone).tolist()
    vectors, now_ids = searcher.export()
    np.testing.assert_array_equal(now_ids, ids[order])
    np.testing.assert_array_equal(vectors, db[order].astype(NUMPY[dtype]))
    q = data(rng, 30, 24, dtype)
    d, i = searcher.search(q, 10)
    assert_exact(d, i, db[order], q, 10, metric, NUMPY[dtype], id_map=ids[order])
    picked = np.array([len(order) - 1, 0, 5])
    np.testing.assert_array_equal(searcher.get_rows(picked), db[order][picked].astype(NUMPY[dtype]))
    searcher.close()


def test_remove_keeps_the_sketch_in_step(rng):
    """Float32 l2: the float16 sketch's residual rows move with the panels, so a one-query search (which
    screens through the sketch) stays exact after removals, and the sketch still answers it."""
    searcher, db, ids = build(rng, "l2", n=sketch_rows(), dim=32)
    q = data(rng, 1, 32, "float32")
    gone = np.unique(rng.choice(len(db), len(db) // 10, replace=False)).astype(np.int64)
    order = order_after(len(db), *searcher.remove_rows(gone), gone)
    before = searcher.sketch_counts()[0]
    for k in (1, 10):
        d, i = searcher.search(q, k)
        assert_exact(d, i, db[order], q, k, "l2", id_map=ids[order])
    assert searcher.sketch_counts()[0] == before + 2
    searcher.close()


def test_bad_removals_change_nothing(rng):
    searcher, db, ids = build(rng, "cosine", n=200, dim=8)
    for positions, error in (([5, 200], ValueError), ([-1], ValueError), (np.array([1.0]), TypeError)):
        with pytest.raises(error):
            searcher.remove_rows(np.asarray(positions))
    with pytest.raises(ValueError):
        searcher.get_rows(np.array([0, 200]))
    vectors, now_ids = searcher.export()
    np.testing.assert_array_equal(now_ids, ids)
    np.testing.assert_array_equal(vectors, db)
    moved_from, moved_to = searcher.remove_rows(np.arange(200))     # everything: nothing moves
    assert len(moved_from) == len(moved_to) == 0 and searcher.size() == 0
    assert np.all(searcher.search(db[:2], 3)[1] == -1)
    searcher.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(["remove", "search", "add", "filtered"]),
                                st.integers(0, 2**32 - 1)), min_size=1, max_size=12),
       metric=st.sampled_from(METRICS))
def test_sequences_of_operations_match_a_model(steps, metric):
    """A dictionary id -> vector is the model: after every remove/add the searcher's rows are exactly its
    rows (through the (moved_from, moved_to) bookkeeping), and every search is the oracle's over it."""
    dim = 6
    rng = np.random.default_rng(len(steps))
    searcher = CpuSearcher(dim, metric, "float32")
    rows_ids: list[int] = []          # what the Index would keep: the id of each row position
    model: dict[int, np.ndarray] = {}
    next_id = 0
    for op, seed in steps:
        step = np.random.default_rng(seed)
        if op == "add" or not model:
            count = int(step.integers(1, 300))
            x = step.integers(-3, 4, size=(count, dim)).astype(np.float32)   # many exact ties
            new_ids = np.arange(next_id, next_id + count, dtype=np.int64)
            next_id += count
            searcher.add(x, new_ids)
            rows_ids.extend(new_ids.tolist())
            model.update(zip(new_ids.tolist(), x))
        elif op == "remove":
            gone = np.unique(step.integers(0, len(rows_ids), size=int(step.integers(1, len(rows_ids) + 1))))
            moved_from, moved_to = searcher.remove_rows(gone)
            for position in gone.tolist():
                del model[rows_ids[position]]
            for source, target in zip(moved_from.tolist(), moved_to.tolist()):
                rows_ids[target] = rows_ids[source]
            del rows_ids[len(rows_ids) - len(gone):]
        ids = np.array(rows_ids, dtype=np.int64)
        db = np.array([model[i] for i in rows_ids], dtype=np.float32).reshape(-1, dim)
        assert searcher.size() == len(model) == len(ids)
        q = step.integers(-3, 4, size=(3, dim)).astype(np.float32)
        k = int(step.integers(1, 20))
        if op == "filtered":
            rows = np.flatnonzero(step.random(len(ids)) < 0.3).astype(np.int64)
            d, i = searcher.search(q, k, rows=rows)
            assert_exact(d, i, db[rows], q, k, metric, id_map=ids[rows])
        else:
            d, i = searcher.search(q, k)
            assert_exact(d, i, db, q, k, metric, id_map=ids)
    vectors, now_ids = searcher.export()
    np.testing.assert_array_equal(now_ids, rows_ids)
    np.testing.assert_array_equal(vectors, np.array([model[i] for i in rows_ids]).reshape(-1, dim))
    searcher.close()
    del rng


def assert_range_exact(got, db, q, radius, metric, dtype, ids):
    want = exact_range(db, q, radius, metric, dtype, ids)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
    assert got[0].dtype == np.int64 and got[1].dtype == np.float32 and got[2].dtype == np.int64


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("metric,radius", [("l2", 30.0), ("ip", 6.0), ("cosine", 0.5)])
def test_range_search_is_exact(metric, radius, dtype, rng):
    searcher, db, ids = build(rng, metric, dtype)
    q = data(rng, 21, 24, dtype)
    for rows in (None, np.arange(0, len(db), 3, dtype=np.int64)):
        got = searcher.range_search(q, radius, rows=rows)
        sub_db, sub_ids = (db, ids) if rows is None else (db[rows], ids[rows])
        assert_range_exact(got, sub_db, q, radius, metric, NUMPY[dtype], sub_ids)
        assert got[0][-1] > 21                               # the radius finds hits
    searcher.close()


@pytest.mark.parametrize("metric", METRICS)
def test_range_search_on_the_radius_itself(metric, rng):
    """Integer data: many rows lie exactly on the radius (never inside: strict), and many hits tie."""
    db = rng.integers(-2, 3, size=(2000, 5)).astype(np.float32)
    searcher, db, ids = build(rng, metric, db=db)
    q = db[:7]
    d = contract_distances(stored(db, np.float32), searched(q), metric)
    for radius in (float(np.median(d)), float(d[0, 10]), -1.0 if metric != "l2" else 0.0):
        assert_range_exact(searcher.range_search(q, radius), db, q, radius, metric, np.float32, ids)
    searcher.close()


def test_range_search_has_no_cap_and_keeps_ties_in_id_order(rng):
    db = np.repeat(rng.standard_normal((1, 8)).astype(np.float32), 5000, axis=0)   # 5,000 identical rows
    searcher = CpuSearcher(8, "l2", "float32")
    searcher.add(db, np.arange(5000)[::-1].copy())
    lims, d, i = searcher.range_search(db[:2], 1e-3)
    np.testing.assert_array_equal(lims, [0, 5000, 10000])
    np.testing.assert_array_equal(i[:5000], np.arange(5000))    # ties by the smaller id
    assert np.all(d == 0.0)
    searcher.close()


def test_range_search_cosine_with_tiny_rows_decides_every_row_in_float64(rng):
    """Rows of norm below ~2^-126 leave cosine's screen without a bound: every row is decided in float64."""
    db = rng.standard_normal((500, 16)).astype(np.float32)
    db[::50] *= np.float32(1e-39)
    searcher, db, ids = build(rng, "cosine", db=db)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    assert_range_exact(searcher.range_search(q, 0.2), db, q, 0.2, "cosine", np.float32, ids)
    searcher.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "uint8"])
@pytest.mark.parametrize("metric", METRICS)
def test_narrow_storage_dtypes_are_exact(metric, dtype, rng):
    searcher, db, ids = build(rng, metric, dtype, n=sketch_rows())
    q = data(rng, 40, 24, dtype)
    for n_queries in (1, 9, 40):                 # rows read directly (<= 8 queries) and through float32 copies
        for k in (1, 10, 100):
            d, i = searcher.search(q[:n_queries], k)
            assert_exact(d, i, db, q[:n_queries], k, metric, NUMPY[dtype], id_map=ids)
    np.testing.assert_array_equal(searcher.get_rows(np.array([7, 3])), db[[7, 3]].astype(NUMPY[dtype]))
    dist = contract_distances(stored(db, NUMPY[dtype]), searched(q[:5]), metric)
    radius = float(np.sort(-dist[0] if LARGER_IS_BETTER[metric] else dist[0])[30])
    radius = -radius if LARGER_IS_BETTER[metric] else radius    # query 0 has 30 hits (fewer where tied)
    got = searcher.range_search(q[:5], radius, rows=np.arange(0, len(db), 2, dtype=np.int64))
    assert_range_exact(got, db[::2], q[:5], radius, metric, NUMPY[dtype], ids[::2])
    vectors, _ = searcher.export()
    assert vectors.dtype == np.dtype(NUMPY[dtype])
    searcher.close()


def test_int8_ties_are_broken_by_id(rng):
    """Small integers: float64 distances tie exactly; the k-th place goes to the smaller id."""
    db = rng.integers(-2, 3, size=(3000, 8)).astype(np.float32)
    for dtype in ("int8", "uint8"):
        x = db + (2 if dtype == "uint8" else 0)
        searcher, x, ids = build(rng, "l2", dtype, db=x)
        d, i = searcher.search(x[:50], 20)
        assert_exact(d, i, x, x[:50], 20, "l2", NUMPY[dtype], id_map=ids)
        searcher.close()


@pytest.mark.gpu
@pytest.mark.parametrize("metric", METRICS)
def test_cpu_and_gpu_index_operations_are_bit_identical(metric, rng):
    from tinyknn.gpu.searcher import GpuSearcher

    db = data(rng, 4000, 20, "float32")
    ids = rng.permutation(40000)[:4000].astype(np.int64)
    cpu, gpu = CpuSearcher(20, metric, "float32"), GpuSearcher(20, metric, "float32")
    for searcher in (cpu, gpu):
        searcher.add(db, ids)
    gone = np.unique(rng.choice(4000, 400, replace=False)).astype(np.int64)
    for a, b in zip(cpu.remove_rows(gone), gpu.remove_rows(gone)):
        np.testing.assert_array_equal(a, b)
    q = data(rng, 50, 20, "float32")
    rows = np.flatnonzero(rng.random(3600) < 0.05).astype(np.int64)
    for k in (1, 10, 3000):
        for a, b in zip(cpu.search(q, k, rows=rows), gpu.search(q, k, rows=rows)):
            np.testing.assert_array_equal(a.view(np.uint32) if a.dtype == np.float32 else a,
                                          b.view(np.uint32) if b.dtype == np.float32 else b)
    radius = {"l2": 20.0, "ip": 5.0, "cosine": 0.4}[metric]
    for a, b in zip(cpu.range_search(q, radius), gpu.range_search(q, radius)):
        np.testing.assert_array_equal(a.view(np.uint32) if a.dtype == np.float32 else a,
                                      b.view(np.uint32) if b.dtype == np.float32 else b)
    np.testing.assert_array_equal(cpu.get_rows(rows), gpu.get_rows(rows))
    cpu.close()
    gpu.close()
