"""Index operations: labels, remove, filtered and labelled search, range search, get, contains,
k beyond 2,048, against the float64 oracle (reference.py) bit for bit.

Every test runs on `backend`: "model" (tests/model_searcher.py injected: the Index's own logic on every
dtype), "cpu" and "cuda" (the real searchers, once they implement the protocol's new methods).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import tinyknn
from model_searcher import ModelSearcher, use_model, use_shards
from reference import LARGER_IS_BETTER, assert_exact, contract_distances, exact_search
from tinyknn.spec import numpy_dtype

METRICS = ("l2", "ip", "cosine")


def _has_protocol(device: str) -> bool:
    if device == "cpu":
        from tinyknn.cpu.searcher import CpuSearcher as searcher
    else:
        from tinyknn.gpu.searcher import GpuSearcher as searcher
    return all(hasattr(searcher, name) for name in ("remove_rows", "get_rows", "range_search"))


@pytest.fixture(params=["model", "cpu", "sharded", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request, monkeypatch):
    """(device, searchers made): the model searcher, three CPU searchers behind a ShardedSearcher (the
    multi-GPU index's logic, tinyknn.index.shards), or a real device whose searcher has the new methods."""
    if request.param == "model":
        return "cpu", use_model(monkeypatch)
    if request.param == "sharded":
        use_shards(monkeypatch, 3)
        return "cpu", None
    if not _has_protocol(request.param):
        pytest.skip(f"the {request.param} searcher does not implement remove_rows/get_rows/range_search yet")
    return request.param, None


class Oracle:
    """What the index must hold: id -> (vector as stored, in float64; label or None)."""

    def __init__(self, dtype: str):
        self.dtype, self.vectors, self.labels = dtype, {}, {}

    def add(self, x, ids, labels=None):
        stored = np.asarray(x, dtype=np.float64).astype(np.float32).astype(numpy_dtype(self.dtype))
        for row, user_id in enumerate(np.asarray(ids).tolist()):
            self.vectors[user_id] = stored[row].astype(np.float64)
            self.labels[user_id] = None if labels is None else int(labels[row])

    def remove(self, ids):
        gone = [int(i) for i in set(np.asarray(ids).tolist()) if int(i) in self.vectors]
        for user_id in gone:
            del self.vectors[user_id], self.labels[user_id]
        return len(gone)

    def allowed(self, dim, filter=None, label=None):
        keep = [i for i in self.vectors if (filter is None or i in filter) and (label is None or self.labels[i] == label)]
        ids = np.array(sorted(keep), dtype=np.int64)
        return np.array([self.vectors[i] for i in ids]).reshape(len(ids), dim), ids

    def search(self, q, k, metric, filter=None, labels=None):
        """The oracle's answer, query by query (each with its own allowed set)."""
        filter = None if filter is None else set(np.asarray(filter).tolist())
        rows = []
        for i in range(len(q)):
            db, ids = self.allowed(q.shape[1], filter, None if labels is None else int(labels[i]))
            rows.append(exact_search(db, q[i:i + 1], k, metric, "float64", id_map=ids))
        return np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])

    def assert_search(self, index, q, k, **kwargs):
        got_d, got_i = index.search(q, k, **kwargs)
        want_d, want_i = self.search(q, k, index.metric, **kwargs)
        assert np.array_equal(got_i, want_i), (got_i, want_i)
        assert np.array_equal(got_d.view(np.uint32), want_d.view(np.uint32)), (got_d, want_d)


def build(device, metric="l2", dtype="float32", n=60, dim=5, seed=0, labels=True, ids=None):
    rng = np.random.default_rng(seed)
    index = tinyknn.Index(dim, metric=metric, dtype=dtype, device=device)
    oracle = Oracle(dtype)
    x = rng.integers(-4, 5, size=(n, dim)).astype(np.float64) if dtype in ("int8", "uint8") else rng.standard_normal((n, dim))
    if dtype == "uint8":
        x = np.abs(x)
    ids = np.arange(n) * 3 + 1 if ids is None else ids
    row_labels = rng.integers(0, 4, n) if labels else None
    index.add(x, ids=ids, labels=row_labels)
    oracle.add(x, ids, row_labels)
    return index, oracle, rng


# -- add with labels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("labels, error, text", [
    ([1, 2], ValueError, r"labels \(one per added vector\) must have shape \(3,\), one int64 label each; got shape \(2,\)"),
    (np.array([1.0, 2.0, 3.0]), TypeError, "must be integers .*got dtype float64"),
    (np.array([1.0, np.nan, 3.0]), TypeError, "got dtype float64"),
    ([True, False, True], TypeError, "must be integers; got True"),
    (np.array([True, False, True]), TypeError, "got dtype bool"),
    (["a", "b", "c"], TypeError, "must be integers; got 'a'"),
    ([1, 2, 2**63], ValueError, "int64's range; got 9223372036854775808"),
    (np.array([1, 2, 2**64 - 1], np.uint64), ValueError, "int64's range"),
    (np.ones((3, 1), np.int64), ValueError, r"got shape \(3, 1\)"),
])
def test_bad_labels_are_refused_and_change_nothing(backend, labels, error, text):
    index, oracle, rng = build(backend[0])
    before = index.search(np.ones((2, 5)), 5)
    with pytest.raises(error, match=text):
        index.add(rng.standard_normal((3, 5)), labels=labels)
    assert index.ntotal == 60
    after = index.search(np.ones((2, 5)), 5)
    assert np.array_equal(before[1], after[1])


def test_labels_accept_any_integer_array_like(backend):
    index = tinyknn.Index(2, device=backend[0])
    index.add(np.eye(2), labels=[7, -2**63])
    index.add(np.eye(2), labels=np.array([3, 3], np.uint8))
    index.add(np.eye(2), labels=np.array([-1, 5], np.int16))
    _, ids = index.search(np.ones((1, 2)), 2, labels=[-2**63])
    assert ids.tolist() == [[1, -1]]
    _, ids = index.search(np.ones((2, 2)), 3, labels=np.array([3, 5], np.int32))
    assert ids.tolist() == [[2, 3, -1], [5, -1, -1]]


# -- labelled and filtered search ----------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_labelled_search_groups_queries_and_keeps_their_order(backend, metric):
    index, oracle, rng = build(backend[0], metric)
    q = rng.standard_normal((9, 5))
    labels = np.array([3, 0, 0, 9, 1, 3, 2, 0, 1])            # label 9 has no vectors: all padding
    oracle.assert_search(index, q, 7, labels=labels)
    oracle.assert_search(index, q, 30, labels=labels)            # k beyond each label's rows: padded
    if backend[1] is not None:                                   # one searcher call per distinct label
        calls = [c for c in backend[1][0].calls if c[0] == "search"]
        assert [c[1] for c in calls[-5:]] == [3, 2, 1, 2, 1]


@pytest.mark.parametrize("metric", METRICS)
def test_filtered_search_sees_only_the_allowed_ids(backend, metric):
    index, oracle, rng = build(backend[0], metric)
    q = rng.standard_normal((4, 5))
    allowed = np.array([1, 4, 101, 7, 58, 10**15, -5, 4])       # unknown, negative and repeated ids are ignored
    oracle.assert_search(index, q, 3, filter=allowed)
    oracle.assert_search(index, q, 10, filter=allowed)           # 4 allowed < k: padded
    oracle.assert_search(index, q, 10, filter=np.array([], np.int64))
    oracle.assert_search(index, q, 10, filter=[])
    oracle.assert_search(index, q, 5, filter=np.arange(0, 200, 2, dtype=np.uint16), labels=[1, 2, 1, 0])
    if backend[1] is not None:
        rows = [c[3] for c in backend[1][0].calls if c[0] == "search"][0]
        assert rows.tolist() == [0, 1, 2, 19]                    # positions of ids 1, 4, 7, 58, sorted


def test_a_filter_repeated_across_changes_sees_the_index_as_it_is_then(backend):
    """One filter array searched again and again (IdMap.rows_allowed remembers its rows) while ids are added,
    removed, reordered by a labelled search's layout and the array itself is changed in place: every answer
    is the oracle's for the index and the filter as they are at that search."""
    index, oracle, rng = build(backend[0], "l2")            # ids 1, 4, ..., 178
    q = rng.standard_normal((3, 5))
    allowed = np.arange(0, 260, 2, dtype=np.int64)         # even ids: some held now, some added below
    oracle.assert_search(index, q, 8, filter=allowed)
    oracle.assert_search(index, q, 8, filter=allowed.copy())        # equal values, another array
    more = np.arange(200, 240, dtype=np.int64)
    x, more_labels = rng.standard_normal((len(more), 5)), rng.integers(0, 4, len(more))
    index.add(x, ids=more, labels=more_labels)
    oracle.add(x, more, more_labels)
    oracle.assert_search(index, q, 8, filter=allowed)
    gone = allowed[(allowed % 3 == 1) & (allowed < 120)]    # held ids among the allowed
    assert index.remove(gone) == oracle.remove(gone) > 0
    oracle.assert_search(index, q, 8, filter=allowed)
    allowed[:40] += 1                                       # the caller's array changed in place
    oracle.assert_search(index, q, 8, filter=allowed)
    for label in range(4):                                  # labelled searches may reorder the rows
        index.search(q, 3, labels=np.full(len(q), label))
    oracle.assert_search(index, q, 8, filter=allowed)
    index.reset()
    oracle.remove(list(oracle.vectors))
    oracle.assert_search(index, q, 8, filter=allowed)
    index.close()


def test_unfiltered_search_passes_nothing_else(monkeypatch):
    made = use_model(monkeypatch)
    index = tinyknn.Index(3)
    index.add(np.eye(3))
    index.search(np.eye(3), 2)
    assert made[0].calls[-1] == ("search", 3, 2, None)


@pytest.mark.parametrize("kwargs, error, text", [
    ({"filter": np.array([1.0, 2.0])}, TypeError, "filter must be integers .*got dtype float64"),
    ({"filter": np.array([[1, 2]])}, ValueError, r"filter must be a 1-D array of ids; got shape \(1, 2\)"),
    ({"filter": "abc"}, TypeError, "filter must be integers"),
    ({"filter": [1, 2.5]}, TypeError, "filter must be integers; got 2.5"),
    ({"labels": [1]}, ValueError, r"labels \(one per query\) must have shape \(2,\)"),
    ({"labels": np.array([0.5, 1.0])}, TypeError, "got dtype float64"),
])
def test_bad_filters_and_query_labels(backend, kwargs, error, text):
    index, _, _ = build(backend[0])
    with pytest.raises(error, match=text):
        index.search(np.ones((2, 5)), 3, **kwargs)
    with pytest.raises(error, match=text):
        index.range_search(np.ones((2, 5)), 1.0, **kwargs)


# -- remove --------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_remove_then_search_add_again(backend, metric):
    index, oracle, rng = build(backend[0], metric)
    q = rng.standard_normal((5, 5))
    gone = np.array([1, 10, 10, 58, 175, 5, 10**12, -3])        # 1, 10, 58, 175 held; 5, 10**12, -3 not
    assert index.remove(gone) == oracle.remove(gone) == 4
    assert index.ntotal == 56 and 10 not in index and 4 in index
    oracle.assert_search(index, q, 60)
    oracle.assert_search(index, q, 6, labels=[0, 1, 2, 3, 0])
    oracle.assert_search(index, q, 6, filter=[1, 4, 7, 13, 58])
    assert index.remove([1, 10]) == 0 and index.remove([]) == 0
    again = rng.standard_normal((2, 5))
    index.add(again, ids=[10, 1], labels=[2, 2])                 # removed ids may come back
    oracle.add(again, [10, 1], [2, 2])
    oracle.assert_search(index, q, 10, labels=[2] * 5)
    oracle.assert_search(index, q, 70)


def test_remove_hands_sorted_unique_positions_and_follows_the_moves(monkeypatch):
    made = use_model(monkeypatch)
    index = tinyknn.Index(2)
    index.add(np.arange(20, dtype=np.float64).reshape(10, 2), labels=np.arange(10) % 2)
    assert index.remove([8, 2, 2, 5]) == 3
    assert made[0].calls[-1][0] == "remove_rows" and made[0].calls[-1][1].tolist() == [2, 5, 8]
    assert made[0].ids.tolist() == [0, 1, 7, 3, 4, 9, 6]          # rows 7 and 9 moved into the holes
    assert index.get([9, 7]).tolist() == [[18, 19], [14, 15]]
    _, ids = index.search(np.zeros((1, 2)), 5, labels=[1])
    assert ids.tolist() == [[1, 3, 7, 9, -1]]


@pytest.mark.parametrize("bad, error, text", [
    (np.array([1.5]), TypeError, "ids to remove must be integers"),
    ([[1, 2]], ValueError, "ids to remove must be a 1-D array"),
    (3, ValueError, r"1-D array of ids; got shape \(\)"),
])
def test_bad_removals_change_nothing(backend, bad, error, text):
    index, _, _ = build(backend[0])
    with pytest.raises(error, match=text):
        index.remove(bad)
    assert index.ntotal == 60


def test_removing_everything_and_reset(backend):
    index, oracle, rng = build(backend[0])
    ids = np.array(sorted(oracle.vectors))
    assert index.remove(ids[::-1]) == 60 and index.ntotal == 0
    d, i = index.search(np.ones((1, 5)), 3, labels=[1])
    assert i.tolist() == [[-1, -1, -1]] and np.all(np.isinf(d))
    index.add(np.ones((2, 5)), labels=[1, 1])
    assert index.search(np.ones((1, 5)), 3, labels=[1])[1].tolist() == [[179, 180, -1]]  # auto ids go on
    index.reset()
    assert index.ntotal == 0 and index.search(np.ones((1, 5)), 1, labels=[1])[1].tolist() == [[-1]]


def test_remove_of_one_percent_of_a_million_rows_is_fast(monkeypatch):
    """The Index's own work (ids -> rows, bookkeeping for the moved rows) well under 20 ms; the
    searcher's part (here the model's) is timed separately and left out."""
    made = use_model(monkeypatch)
    index = tinyknn.Index(1)
    n = 10**6
    index.add(np.zeros((n, 1), np.float32), labels=np.arange(n) % 100)
    searcher = made[0]
    spent = []
    real = ModelSearcher.remove_rows

    def timed(self, positions):
        start = time.perf_counter()
        answer = real(self, positions)
        spent.append(time.perf_counter() - start)
        return answer

    monkeypatch.setattr(ModelSearcher, "remove_rows", timed)
    rng = np.random.default_rng(0)
    best = np.inf
    for _ in range(3):
        gone = rng.choice(np.fromiter(iter(searcher.ids), np.int64), 10_000, replace=False)
        start = time.perf_counter()
        assert index.remove(gone) == 10_000
        best = min(best, time.perf_counter() - start - spent[-1])
    print(f"Index-level remove: {best * 1e3:.2f} ms")
    assert best < 0.020, f"Index.remove's own work took {best * 1e3:.1f} ms"
    assert index.ntotal == n - 30_000
    _, ids = index.search(np.zeros((1, 1)), 3, labels=[7])
    assert all(searcher.ids[index._ids.rows_of(ids[0])] == ids[0]) and np.all(ids % 100 == 7)


# -- get and contains ----------------------------------------------------------------------------
def test_get_and_contains(backend):
    index, oracle, _ = build(backend[0], dtype="float16")
    index.remove([4])
    got = index.get([7, 1, 7])
    assert got.dtype == np.float16 and got.shape == (3, 5)
    assert np.array_equal(got.astype(np.float64), np.array([oracle.vectors[7], oracle.vectors[1], oracle.vectors[7]]))
    assert index.get(np.int64(7)).shape == (5,)
    assert index.contains([1, 4, 7, -1, 10**18]).tolist() == [True, False, True, False, False]
    assert 1 in index and 4 not in index and np.uint8(7) in index
    with pytest.raises(ValueError, match=r"get: 2 of the ids asked for are not in the index: \[2, 4\]"):
        index.get([1, 4, 2, 4])
    with pytest.raises(TypeError, match="must be an integer id; got 1.0"):
        1.0 in index
    with pytest.raises(TypeError, match="ids to get must be integers"):
        index.get(np.array([1.0]))
    assert index.get([]).shape == (0, 5)


@pytest.mark.parametrize("odd, error, text", [
    (2**64, ValueError, "the id in .id in index. must lie in int64's range; got 18446744073709551616"),
    (2**63, ValueError, "int64's range; got 9223372036854775808"),
    (-2**63 - 1, ValueError, "int64's range; got -9223372036854775809"),
    (np.uint64(2**64 - 1), ValueError, "int64's range; got 18446744073709551615"),
    (True, TypeError, "must be an integer id; got True"),
    (np.bool_(False), TypeError, "must be an integer id; got (np.)?False"),
])
def test_odd_python_and_numpy_integers_in_contains_and_get(backend, odd, error, text):
    """`2**64 in index` was an OverflowError (from building an int64 array); now the ValueError (or the
    TypeError of a bool) that get and contains give, and nothing changes."""
    index, _, _ = build(backend[0])
    with pytest.raises(error, match=text):
        odd in index
    with pytest.raises(error):
        index.get(odd)
    with pytest.raises(error):
        index.contains([odd])
    assert index.ntotal == 60 and -2**63 not in index and 2**63 - 1 not in index and np.int64(-1) not in index


# -- range search --------------------------------------------------------------------------------
def oracle_ranges(oracle, q, radius, metric, filter=None, labels=None):
    lims, distances, ids = [0], [], []
    for i in range(len(q)):
        db, allowed = oracle.allowed(q.shape[1], None if filter is None else set(np.asarray(filter).tolist()),
                                     None if labels is None else int(labels[i]))
        d = contract_distances(db, q[i:i + 1].astype(np.float32).astype(np.float64), metric)[0] if len(allowed) else np.zeros(0)
        larger = LARGER_IS_BETTER[metric]
        hits = np.flatnonzero(d > radius if larger else d < radius)
        order = hits[np.lexsort((allowed[hits], -d[hits] if larger else d[hits]))]
        distances.append(d[order].astype(np.float32))
        ids.append(allowed[order])
        lims.append(lims[-1] + len(order))
    return np.array(lims), np.concatenate(distances), np.concatenate(ids)


@pytest.mark.parametrize("metric, radius", [("l2", 4.0), ("l2", 0.0), ("ip", 0.5), ("cosine", 0.3), ("ip", -1e9)])
def test_range_search_matches_the_oracle(backend, metric, radius):
    index, oracle, rng = build(backend[0], metric)
    assert index.remove([4, 7, 100]) == oracle.remove([4, 7, 100]) == 3
    q = rng.standard_normal((6, 5))
    for kwargs in ({}, {"filter": np.arange(0, 120, 2)}, {"labels": [0, 1, 1, 3, 0, 2]},
                   {"filter": [1, 13, 19], "labels": [0, 0, 1, 2, 3, 3]}):
        lims, distances, ids = index.range_search(q, radius, **kwargs)
        want = oracle_ranges(oracle, q, radius, metric, **kwargs)
        assert lims.dtype == np.int64 and lims.shape == (7,) and distances.dtype == np.float32 and ids.dtype == np.int64
        assert np.array_equal(lims, want[0]) and np.array_equal(ids, want[2]), (kwargs, lims, want[0])
        assert np.array_equal(distances.view(np.uint32), want[1].view(np.uint32))


@pytest.mark.parametrize("metric, radius, error, text", [
    ("l2", -0.5, ValueError, "radius for metric 'l2' .* must be >= 0; got -0.5"),
    ("l2", float("nan"), ValueError, "radius must be finite; got nan"),
    ("ip", float("inf"), ValueError, "radius must be finite; got inf"),
    ("cosine", "0.5", TypeError, "radius must be a real number; got '0.5'"),
    ("ip", True, TypeError, "radius must be a real number; got True"),
    ("ip", None, TypeError, "got None"),
])
def test_bad_radius(backend, metric, radius, error, text):
    index, _, _ = build(backend[0], metric)
    with pytest.raises(error, match=text):
        index.range_search(np.ones((1, 5)), radius)


# -- k beyond 2,048 ------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_k_beyond_the_kernels_limit(backend, metric):
    index, oracle, rng = build(backend[0], metric, n=2500, dim=3)
    q = rng.standard_normal((3, 3))
    oracle.assert_search(index, q, 2049)
    oracle.assert_search(index, q, 2600)                          # beyond ntotal: padded
    oracle.assert_search(index, q, 2100, labels=[0, 1, 2])


# -- threads -------------------------------------------------------------------------------------
def test_searches_never_see_half_a_removal(backend):
    """Filtered and labelled searches run while another thread removes and re-adds batches: every
    answer holds only ids that were in the index, with their own vectors' distances."""
    device = backend[0]
    index = tinyknn.Index(2, device=device)
    base = np.arange(400, dtype=np.float64)[:, None] * np.array([[1.0, 0.0]])
    index.add(base, labels=np.arange(400) % 3)
    stop, failures = threading.Event(), []

    def search():
        while not stop.is_set():
            d, ids = index.search(np.zeros((2, 2)), 8, filter=np.arange(0, 400, 2), labels=[0, 1])
            for row, label in zip(range(2), (0, 1)):
                real = ids[row][ids[row] >= 0]
                if not (np.all(real % 2 == 0) and np.all(real % 3 == label)
                        and np.array_equal(d[row][:len(real)], (real.astype(np.float64) ** 2).astype(np.float32))):
                    failures.append((ids[row], d[row]))

    threads = [threading.Thread(target=search) for _ in range(3)]
    for thread in threads:
        thread.start()
    rng = np.random.default_rng(0)
    for _ in range(30):
        chosen = rng.choice(400, 40, replace=False)
        index.remove(chosen)
        index.add(base[chosen], ids=chosen, labels=chosen % 3)
    stop.set()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    assert index.ntotal == 400


# -- every storage dtype -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "uint8"])
@pytest.mark.parametrize("metric", METRICS)
def test_every_storage_dtype(backend, metric, dtype):
    device, _ = backend
    if device == "cpu" and backend[1] is None:
        from tinyknn.cpu.library import DTYPE_CODES

        if dtype not in DTYPE_CODES:
            pytest.skip(f"the CPU library does not store {dtype} yet")
    index, oracle, rng = build(device, metric, dtype)
    q = rng.integers(-3, 4, size=(5, 5)).astype(np.float64) if dtype in ("int8", "uint8") else rng.standard_normal((5, 5))
    q = np.abs(q) if dtype == "uint8" else q
    oracle.assert_search(index, q, 12)
    assert index.remove([1, 31, 61]) == oracle.remove([1, 31, 61]) == 3
    oracle.assert_search(index, q, 12, labels=[0, 1, 2, 3, 0])
    oracle.assert_search(index, q.astype(np.int8) if dtype == "int8" else q, 4, filter=np.arange(0, 90))
    assert index.get([4]).dtype == numpy_dtype(dtype)
    assert np.array_equal(index.get([4])[0].astype(np.float64), oracle.vectors[4])


# -- sequences against the model dictionary (hypothesis) ------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_seeds = st.integers(0, 2**31 - 1)
_steps = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 20), st.sampled_from(["auto", "fresh", "reuse"]), st.booleans(), _seeds),
    st.tuples(st.just("remove"), st.integers(0, 30), _seeds),
    st.tuples(st.just("search"), st.integers(1, 4), st.integers(1, 30), st.sampled_from(["none", "filter", "labels",
                                                                                          "both"]), _seeds),
    st.tuples(st.just("range"), st.integers(1, 3), st.sampled_from(["none", "filter", "labels"]), _seeds),
    st.tuples(st.just("get"), st.integers(0, 5), _seeds),
    st.tuples(st.just("round_trip"),),
    st.tuples(st.just("reorder"),),
)


def _run_steps(device, metric, dtype, steps):
    index, oracle = tinyknn.Index(3, metric=metric, dtype=dtype, device=device), Oracle(dtype)
    removed: list[int] = []
    next_auto = 0                 # 1 + the largest id held since creation or the last load (class doc)
    for step in steps:
        rng = np.random.default_rng(step[-1] if isinstance(step[-1], int) else 0)
        held = np.array(sorted(oracle.vectors), dtype=np.int64)
        if step[0] == "add":
            _, n, how, labelled, _ = step
            if how == "reuse" and removed:
                ids = np.array(sorted(set(removed)), dtype=np.int64)[:n]
            elif how == "fresh":
                ids = rng.choice(10**6, n, replace=False).astype(np.int64) + 10**9
            else:
                ids = None
            n = n if ids is None else len(ids)
            x = rng.integers(-3, 4, size=(n, 3)).astype(np.float64)
            labels = rng.integers(0, 3, n) if labelled else None
            if ids is not None and set(ids.tolist()) & set(oracle.vectors):
                continue                                          # collisions: test_ids' business
            index.add(x, ids=ids, labels=labels)
            ids = np.arange(next_auto, next_auto + n) if ids is None else ids
            next_auto = max([next_auto] + [int(i) + 1 for i in ids])
            oracle.add(x, ids, labels)
            removed = [i for i in removed if i not in set(ids.tolist())]
        elif step[0] == "remove":
            chosen = np.concatenate([rng.choice(held, min(step[1], len(held)), replace=False) if len(held) else [],
                                     [10**15 + 3]]).astype(np.int64)
            assert index.remove(chosen) == oracle.remove(chosen)
            removed += [int(i) for i in chosen if i < 10**15]
            assert not index.contains(chosen).any()
            assert index.contains(held).sum() == len(oracle.vectors)
        elif step[0] == "search":
            _, nq, k, how, _ = step
            q = rng.standard_normal((nq, 3))
            kwargs = {}
            if how in ("filter", "both"):
                kwargs["filter"] = np.concatenate([rng.choice(held, len(held) // 2) if len(held) else [], [-1]]).astype(np.int64)
            if how in ("labels", "both"):
                kwargs["labels"] = rng.integers(0, 4, nq)
            oracle.assert_search(index, q, k, **kwargs)
        elif step[0] == "range":
            _, nq, how, _ = step
            q = rng.standard_normal((nq, 3))
            radius = {"l2": 6.0, "ip": 0.5, "cosine": 0.2}[metric]
            kwargs = {"filter": held[::2]} if how == "filter" else {"labels": rng.integers(0, 3, nq)} if how == "labels" else {}
            got, want = index.range_search(q, radius, **kwargs), oracle_ranges(oracle, q, radius, metric, **kwargs)
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
        elif step[0] == "get" and len(held):
            chosen = rng.choice(held, step[1])
            assert np.array_equal(index.get(chosen).astype(np.float64).reshape(len(chosen), 3),
                                  np.array([oracle.vectors[int(i)] for i in chosen]).reshape(len(chosen), 3))
            assert index.contains(np.concatenate([chosen, removed[:3]]).astype(np.int64)).tolist() == \
                [True] * len(chosen) + [False] * len(removed[:3])
        elif step[0] == "reorder" and hasattr(index._searcher, "permute_rows"):
            with index._add_lock, index._view:                  # what a labelled search does once it is due
                index._layout.reorder(index._searcher, index._ids, index._labels)
        elif step[0] == "round_trip":
            index = pickle_round_trip(index)
            next_auto = max(oracle.vectors, default=-1) + 1
        assert index.ntotal == len(oracle.vectors)


def pickle_round_trip(index):
    import pickle

    again = pickle.loads(pickle.dumps(index))
    index.close()
    return again


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@settings(deadline=None, max_examples=int(os.environ.get("TINYKNN_FUZZ_EXAMPLES", "100")), database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metric=st.sampled_from(METRICS), steps=st.lists(_steps, min_size=1, max_size=25))
def test_sequences_match_the_model_dictionary(backend, dtype, metric, steps):
    _run_steps(backend[0], metric, dtype, steps)


def test_label_logs_are_folded_when_long(monkeypatch):
    """A label no search asks for still holds O(its rows): its log of adds and removals is folded once it
    holds LOG_LIMIT changes, and the folded rows are the label's."""
    from tinyknn.index import labels as _labels

    use_model(monkeypatch)
    index = tinyknn.Index(1)
    for step in range(3 * _labels.LOG_LIMIT):
        index.add(np.full((2, 1), float(step)), labels=[5, 6])
        if step % 3 == 2:
            index.remove([2 * step - 4])
    logs = index._labels._rows
    assert all(len(log) <= _labels.LOG_LIMIT for log in logs.values())
    searcher = index._searcher
    assert index._labels.rows_of(5).tolist() == [row for row in range(len(searcher.ids)) if searcher.ids[row] % 2 == 0]


def test_range_search_refuses_cuda_queries():
    index = tinyknn.Index(3)
    index.device = "cuda"                       # the check comes before any device work

    class FakeCuda:
        __cuda_array_interface__ = {"shape": (1, 3), "typestr": "<f4", "data": (1 << 20, False), "version": 3,
                                    "strides": None}

    with pytest.raises(TypeError, match="range_search takes host \\(NumPy\\) queries"):
        index.range_search(FakeCuda(), 1.0)
