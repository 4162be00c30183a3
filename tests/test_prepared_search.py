"""search(q, k, out=(D, I)) and index.prepare_search(k, n_queries): exact answers (the float64 oracle, bit for
bit) on every metric and dtype, every misuse refused before anything is written, and a prepared search that
follows adds, removals, resets and closes. The backends: the CPU library, the pure-NumPy model searcher and
the sharded searcher (neither takes out=: the Index copies for them), and the GPU (marked gpu). The GPU-only
tests (CUDA arrays in and out, the tensor-core screen, batches beyond one launch, the host-memory tier) are in
tests/test_gpu_prepared_search.py; the GPU searcher's prepared-batch bookkeeping is tested here without a GPU.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict

import numpy as np
import pytest

import tinyknn
from model_searcher import use_model, use_shards
from reference import assert_exact, exact_search
from tinyknn.inputs import validate as _validate

METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8")
DIM = 16
KS = (1, 10, 300)           # 300: beyond the 200 rows the tests hold


@pytest.fixture(params=["cpu", "model", "sharded", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """The device of the Index to build: the CPU library, the model searcher or three sharded CPU searchers
    (device "cpu", injected), or the GPU."""
    if request.param == "model":
        use_model(monkeypatch)
    elif request.param == "sharded":
        use_shards(monkeypatch, 3)
    elif request.param == "cuda":
        from gpu_warm import warm

        warm([(m, t, DIM, k) for m in METRICS for t in DTYPES for k in KS])
    return "cpu" if request.param != "cuda" else "cuda"


def data(rng, n: int, dtype: str, dim: int = DIM) -> np.ndarray:
    """float32 rows a `dtype` index takes: integers in range for the 8-bit ones."""
    if dtype in ("int8", "uint8"):
        low, high = (-128, 128) if dtype == "int8" else (0, 256)
        return rng.integers(low, high, size=(n, dim)).astype(np.float32)
    return rng.standard_normal((n, dim)).astype(np.float32)


def empty_out(n: int, k: int, fill: bool = True):
    """A (distances, ids) pair for out=, filled with values no search returns (to see what was written)."""
    distances, ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
    if fill:
        distances.fill(7.5)
        ids.fill(-7)
    return distances, ids


def untouched(out) -> bool:
    return bool(np.all(out[0] == 7.5) and np.all(out[1] == -7))


# -- exact answers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_out_and_prepared_searches_are_exact(device, metric, dtype, rng):
    db, q = data(rng, 200, dtype), data(rng, 5, dtype)
    with tinyknn.Index(DIM, metric, dtype, device=device) as index:
        index.add(db)
        for k in KS:
            out = empty_out(5, k)
            got = index.search(q, k, out=out)
            assert got[0] is out[0] and got[1] is out[1]
            assert_exact(*out, db, q, k, metric, dtype)
            with index.prepare_search(k=k, n_queries=5) as prepared:
                for _ in range(3):          # the GPU captures a graph on the second call and replays it after
                    assert_exact(*prepared(q), db, q, k, metric, dtype)
                    out = empty_out(5, k)
                    assert prepared(q, out=out)[1] is out[1]
                    assert_exact(*out, db, q, k, metric, dtype)
            single = index.prepare_search(k)                     # n_queries=1
            want = exact_search(db, q, k, metric, dtype)
            for row in range(5):
                distances, ids = single(q[row:row + 1])
                assert np.array_equal(ids, want[1][row:row + 1])
                assert np.array_equal(distances.view(np.uint32), want[0][row:row + 1].view(np.uint32))


def test_results_are_fresh_arrays_per_call_without_out(rng):
    db, q = data(rng, 50, "float32"), data(rng, 1, "float32")
    index = tinyknn.Index(DIM)
    index.add(db)
    prepared = index.prepare_search(4)
    first, second = prepared(q), prepared(q)
    assert first[0] is not second[0] and first[1] is not second[1]
    assert not np.shares_memory(first[1], second[1])
    first[1][:] = -5                        # the caller may keep and change them
    assert_exact(*prepared(q), db, q, 4, "l2")


def test_k_beyond_ntotal_and_beyond_the_kernels_limit_match_search(device, rng):
    db, q = data(rng, 200, "float32"), data(rng, 3, "float32")
    with tinyknn.Index(DIM, "ip", device=device) as index:
        index.add(db)
        for k in (300, 2100):
            want = index.search(q, k)
            assert np.all(want[1][:, 200:] == -1) and np.all(want[0][:, 200:] == -np.inf)
            out = empty_out(3, k)
            index.search(q, k, out=out)
            assert np.array_equal(out[1], want[1]) and np.array_equal(out[0], want[0])
            assert np.array_equal(index.prepare_search(k, 3)(q)[1], want[1])
            assert_exact(*want, db, q, k, "ip")


def test_zero_queries_with_out(rng):
    index = tinyknn.Index(DIM)
    index.add(data(rng, 20, "float32"))
    out = empty_out(0, 5)
    assert index.search(np.empty((0, DIM), np.float32), 5, out=out)[0] is out[0]


def test_out_with_filter_and_labels(device, rng):
    db, q = data(rng, 200, "float32"), data(rng, 6, "float32")
    ids = rng.permutation(5000)[:200].astype(np.int64)
    labels = np.arange(200) % 3
    with tinyknn.Index(DIM, "cosine", device=device) as index:
        index.add(db, ids=ids, labels=labels)
        allowed = ids[::4]
        out = empty_out(6, 10)
        index.search(q, 10, filter=allowed, out=out)
        assert_exact(*out, db[::4], q, 10, "cosine", id_map=ids[::4])
        query_labels = np.array([0, 1, 2, 0, 1, 2])
        out = empty_out(6, 10)
        assert index.search(q, 10, labels=query_labels, out=out)[0] is out[0]   # one searcher call per label
        for label in range(3):
            rows, mine = labels == label, query_labels == label
            assert_exact(out[0][mine], out[1][mine], db[rows], q[mine], 10, "cosine", id_map=ids[rows])
        out = empty_out(6, 10)
        index.search(q, 10, labels=np.zeros(6, np.int64), filter=allowed, out=out)   # one label, and a filter
        rows = (labels == 0) & np.isin(ids, allowed)
        assert_exact(*out, db[rows], q, 10, "cosine", id_map=ids[rows])


def test_out_may_overlap_the_queries(rng):
    """As with a ufunc: queries that share memory with out are read before the results are written."""
    db = data(rng, 100, "float32")
    index = tinyknn.Index(DIM)
    index.add(db)
    buffer = data(rng, 4, "float32")            # (4, 16) float32: the queries, and out[0] for k = 16
    q = buffer.copy()
    ids = np.empty((4, DIM), np.int64)
    index.search(buffer, DIM, out=(buffer, ids))
    assert_exact(buffer, ids, db, q, DIM, "l2")
    buffer[:] = q
    index.prepare_search(DIM, 4)(buffer, out=(buffer, ids))
    assert_exact(buffer, ids, db, q, DIM, "l2")


def test_out_may_be_a_memmap(rng, tmp_path):
    db, q = data(rng, 100, "float32"), data(rng, 3, "float32")
    index = tinyknn.Index(DIM, "ip")
    index.add(db)
    distances = np.lib.format.open_memmap(tmp_path / "d.npy", mode="w+", dtype=np.float32, shape=(3, 5))
    ids = np.lib.format.open_memmap(tmp_path / "i.npy", mode="w+", dtype=np.int64, shape=(3, 5))
    assert index.search(q, 5, out=(distances, ids))[0] is distances
    assert_exact(distances, ids, db, q, 5, "ip")
    distances.flush(), ids.flush()
    assert np.array_equal(np.load(tmp_path / "i.npy"), ids)


# -- misuse: refused before anything is written ----------------------------------------------------------
def _overlapping(n, k):
    raw = np.zeros(n * k * 8, np.uint8)
    return raw[:n * k * 4].view(np.float32).reshape(n, k), raw.view(np.int64).reshape(n, k)


class FakeCudaArray:
    """Looks like a CuPy array to tinyknn (only __cuda_array_interface__ is read)."""

    def __init__(self, shape, typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (1 << 20, False),
                                         "version": 3, "strides": None}


BAD_OUT = [
    (lambda n, k: (np.empty((n, k), np.float64), np.empty((n, k), np.int64)), TypeError,
     r"out\[0\] \(distances\) must have dtype float32 \(native byte order\); got dtype <f8"),
    (lambda n, k: (np.empty((n, k), np.float32), np.empty((n, k), np.int32)), TypeError,
     r"out\[1\] \(ids\) must have dtype int64 .*got dtype <i4"),
    (lambda n, k: (np.empty((n, k), ">f4"), np.empty((n, k), np.int64)), TypeError, r"got dtype >f4"),
    (lambda n, k: (np.empty((n, k + 1), np.float32), np.empty((n, k), np.int64)), ValueError,
     r"out\[0\] \(distances\) must have shape \(3, 4\) \(n_queries, k\); got shape \(3, 5\)"),
    (lambda n, k: (np.empty((n, k), np.float32), np.empty((n + 1, k), np.int64)), ValueError,
     r"out\[1\] \(ids\) must have shape \(3, 4\) .*got shape \(4, 4\)"),
    (lambda n, k: (np.empty((n, k), np.float32), np.empty(n * k, np.int64)), ValueError, r"got shape \(12,\)"),
    (lambda n, k: (np.empty((k, n), np.float32).T, np.empty((n, k), np.int64)), ValueError,
     r"out\[0\] \(distances\) must be C-contiguous; got strides \(4, 12\)"),
    (lambda n, k: (np.empty((n, 2 * k), np.float32)[:, ::2], np.empty((n, k), np.int64)), ValueError, "C-contiguous"),
    (lambda n, k: (np.empty((n, k), np.float32), np.empty((n, k), np.int64).copy().view()), None, None),
    (lambda n, k: (np.empty((n, k), np.float32), _read_only(np.empty((n, k), np.int64))), ValueError,
     r"out\[1\] \(ids\) is read-only; pass a writeable array"),
    (lambda n, k: _overlapping(n, k), ValueError, r"out\[0\] \(distances\) and out\[1\] \(ids\) share memory"),
    (lambda n, k: ([[0.0] * k] * n, np.empty((n, k), np.int64)), TypeError,
     r"out\[0\] \(distances\) must be a NumPy array \(float32, shape \(3, 4\)\); got builtins.list"),
    (lambda n, k: (np.ma.masked_array(np.empty((n, k), np.float32)), np.empty((n, k), np.int64)), TypeError,
     "got numpy.ma.MaskedArray"),
    (lambda n, k: (FakeCudaArray((n, k)), np.empty((n, k), np.int64)), TypeError,
     r"out\[0\] \(distances\) is a CUDA array .* but the queries are host \(NumPy\) arrays"),
    (lambda n, k: (np.empty((n, k), np.float32),), TypeError,
     r"out must be a pair \(distances, ids\) of arrays, as search returns them; got a tuple of length 1"),
    (lambda n, k: np.empty((n, k), np.float32), TypeError, "got numpy.ndarray"),
    (lambda n, k: {"distances": 1, "ids": 2}, TypeError, "got builtins.dict"),
]


def _read_only(array):
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("make, error, text", BAD_OUT)
def test_bad_out_is_refused_before_anything_is_written(make, error, text, rng):
    db, q = data(rng, 50, "float32"), data(rng, 3, "float32")
    index = tinyknn.Index(DIM)
    index.add(db)
    prepared = index.prepare_search(4, 3)
    for search, rows in ((lambda out: index.search(q, 4, out=out), 50), (lambda out: prepared(q, out=out), 50),
                         (lambda out: index.search(q, 4, out=out, filter=np.arange(20)), 20)):
        out = make(3, 4)
        arrays = [a for a in (out if isinstance(out, tuple) else (out,)) if isinstance(a, np.ndarray)]
        for array in arrays:
            if array.flags.writeable:
                array.fill(7)
        before = [a.copy() for a in arrays]
        if error is None:               # a plain view of a fresh array: fine
            assert_exact(*search(out), db[:rows], q, 4, "l2")
            continue
        with pytest.raises(error, match=text):
            search(out)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, before))


@pytest.mark.parametrize("bad, error, text", [
    (np.full((2, DIM), np.nan, np.float32), ValueError, "NaN"),
    (np.full((2, DIM), -np.inf, np.float32), ValueError, "infinity"),
    (np.full((2, DIM), 2.0**51, np.float32), ValueError, r"2\*\*50"),
    (np.zeros((2, DIM + 1), np.float32), ValueError, f"must have {DIM} columns"),
    (np.zeros(DIM, np.float32), ValueError, "2-D"),
])
def test_bad_queries_with_out_write_nothing(device, bad, error, text, rng):
    with tinyknn.Index(DIM, device=device) as index:
        index.add(data(rng, 50, "float32"))
        out = empty_out(2, 3)
        with pytest.raises(error, match=text):
            index.search(bad, 3, out=out)
        prepared = index.prepare_search(3, 2)
        with pytest.raises(error, match=text):
            prepared(bad, out=out)
        with pytest.raises(error, match=text):
            prepared(bad)
        assert untouched(out)


# -- the prepared search: arguments, calls, lifetime ----------------------------------------------------
@pytest.mark.parametrize("kwargs, error, text", [
    ({"k": 0}, ValueError, "k must be between 1 and 2147483647; got 0"),
    ({"k": 2.5}, TypeError, "k must be a positive integer; got 2.5"),
    ({"k": True}, TypeError, "got True"),
    ({"k": 3, "n_queries": 0}, ValueError, "n_queries must be at least 1; got 0"),
    ({"k": 3, "n_queries": -2}, ValueError, "got -2"),
    ({"k": 3, "n_queries": 1.0}, TypeError, r"n_queries must be a positive integer; got 1.0 \(float\)"),
    ({"k": 3, "n_queries": True}, TypeError, "got True"),
    ({"k": 3, "n_queries": None}, TypeError, "got None"),
])
def test_bad_prepare_arguments(kwargs, error, text):
    index = tinyknn.Index(DIM)
    with pytest.raises(error, match=text):
        index.prepare_search(**kwargs)


def test_numpy_integers_are_fine():
    prepared = tinyknn.Index(DIM).prepare_search(np.int32(3), np.int64(2))
    assert (prepared.k, prepared.n_queries) == (3, 2) and type(prepared.k) is int
    assert "k=3, n_queries=2" in repr(prepared)


def test_prepared_calls_check_what_can_differ(rng):
    db = data(rng, 80, "float32")
    index = tinyknn.Index(DIM, "cosine")
    index.add(db)
    prepared = index.prepare_search(5, n_queries=2)
    q = data(rng, 2, "float32")
    with pytest.raises(ValueError, match=r"made for n_queries=2 \(shape \(2, 16\)\); got shape \(3, 16\)"):
        prepared(data(rng, 3, "float32"))
    with pytest.raises(ValueError, match=f"must have {DIM} columns"):
        prepared(np.zeros((2, DIM + 1), np.float32))
    with pytest.raises(TypeError, match="got dtype int32"):
        prepared(np.zeros((2, DIM), np.int32))
    with pytest.raises(TypeError, match="CUDA array"):
        prepared(FakeCudaArray((2, DIM)))
    # what search accepts, the prepared search accepts too (through the general checks)
    for accepted in (q.astype(np.float64), q.astype(np.float16), np.asfortranarray(q), q.tolist(),
                     np.concatenate([q, q], axis=1)[:, :DIM]):
        expected = q if np.asarray(accepted).dtype != np.float16 else q.astype(np.float16)
        assert_exact(*prepared(accepted), db, expected, 5, "cosine")


def test_prepared_on_an_8bit_index_checks_integers(rng):
    db = data(rng, 60, "int8")
    index = tinyknn.Index(DIM, "l2", "int8")
    index.add(db)
    prepared = index.prepare_search(4, 1)
    q = data(rng, 1, "int8")
    assert_exact(*prepared(q), db, q, 4, "l2", "int8")
    with pytest.raises(ValueError, match="int8 index takes integers"):
        prepared(q + np.float32(0.5))
    with pytest.raises(ValueError, match="int8 index takes integers"):
        prepared(np.full((1, DIM), 300.0, np.float32))


def test_closed_index_and_closed_prepared_search(rng):
    index = tinyknn.Index(DIM)
    index.add(data(rng, 30, "float32"))
    q = data(rng, 1, "float32")
    prepared = index.prepare_search(3)
    with index.prepare_search(3) as scoped:
        scoped(q)
    with pytest.raises(ValueError, match="this prepared search was closed"):
        scoped(q)
    assert "closed" in repr(scoped)
    prepared.close()
    prepared.close()                        # twice is harmless
    with pytest.raises(ValueError, match="this prepared search was closed"):
        prepared(q, out=empty_out(1, 3))
    alive = index.prepare_search(3)
    index.close()
    out = empty_out(1, 3)
    with pytest.raises(ValueError, match="Index of this prepared search was closed"):
        alive(q, out=out)
    assert untouched(out)
    with pytest.raises(ValueError, match="this Index was closed"):
        index.prepare_search(3)


def test_prepared_search_follows_add_remove_and_reset(device, rng):
    first, second = data(rng, 120, "float32"), data(rng, 90, "float32")
    q = data(rng, 3, "float32")
    with tinyknn.Index(DIM, "l2", device=device) as index:
        empty = index.prepare_search(5, 3)
        distances, ids = empty(q)                     # prepared on an empty index
        assert np.all(ids == -1) and np.all(distances == np.inf)
        index.add(first)
        assert_exact(*empty(q), first, q, 5, "l2")
        index.add(second, ids=np.arange(1000, 1090))
        both, both_ids = np.concatenate([first, second]), np.concatenate([np.arange(120), np.arange(1000, 1090)])
        out = empty_out(3, 5)
        empty(q, out=out)
        assert_exact(*out, both, q, 5, "l2", id_map=both_ids)
        nearest = np.unique(out[1])
        assert index.remove(nearest) == len(nearest)            # the answers themselves go
        kept = ~np.isin(both_ids, nearest)
        assert_exact(*empty(q), both[kept], q, 5, "l2", id_map=both_ids[kept])
        index.reset()
        assert np.all(empty(q)[1] == -1)
        index.add(second)
        empty(q, out=out)
        assert_exact(*out, second, q, 5, "l2")


def test_two_threads_share_one_prepared_search(device, rng):
    """Two threads call one prepared search (fresh results, and out= arrays of their own) while a third
    adds rows in one add: every answer is the exact one before or after that add."""
    first, second = data(rng, 150, "float32"), data(rng, 150, "float32")
    queries = [data(rng, 2, "float32") for _ in range(4)]
    with tinyknn.Index(DIM, "ip", device=device) as index:
        index.add(first)
        before = [exact_search(first, q, 6, "ip") for q in queries]
        after = [exact_search(np.concatenate([first, second]), q, 6, "ip") for q in queries]
        prepared = index.prepare_search(6, 2)
        failures: list = []
        start = threading.Barrier(3)

        def searching(seed: int) -> None:
            out = empty_out(2, 6)
            start.wait()
            for call in range(60):
                which = (seed + call) % len(queries)
                got = prepared(queries[which]) if call % 2 else prepared(queries[which], out=out)
                if not any(np.array_equal(got[1], want[1]) and np.array_equal(got[0], want[0])
                           for want in (before[which], after[which])):
                    failures.append((seed, call, got[1]))

        def adding() -> None:
            start.wait()
            index.add(second)

        threads = [threading.Thread(target=searching, args=(s,)) for s in (0, 1)] + [threading.Thread(target=adding)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures[:2]
        for q, want in zip(queries, after):
            got = prepared(q)
            assert np.array_equal(got[1], want[1])


# -- the validation fast path ------------------------------------------------------------------------
def test_common_queries_are_used_as_given_and_still_checked():
    q = np.ones((3, DIM), np.float32)
    assert _validate.host_queries(q, DIM) is q
    assert _validate.host_queries(q, DIM, False) is q
    fortran = np.asfortranarray(np.ones((3, DIM), np.float32))
    converted = _validate.host_queries(fortran, DIM)
    assert converted.flags.c_contiguous and converted is not fortran
    with pytest.raises(ValueError, match=f"must have {DIM} columns"):
        _validate.host_queries(np.ones((3, DIM + 1), np.float32), DIM)
    with pytest.raises(ValueError, match="2-D"):
        _validate.host_queries(np.ones((1, 3, DIM), np.float32), DIM)
    with pytest.raises(ValueError, match="int8 index takes integers"):
        _validate.host_queries(np.full((1, DIM), 0.5, np.float32), DIM, True, "int8")
    nan = np.ones((2, DIM), np.float32)
    nan[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        _validate.host_queries(nan, DIM)
    assert _validate.host_queries(nan, DIM, False) is nan       # the GPU checks float32 values itself


@pytest.mark.parametrize("value, ok", [
    (2.0**50, True), (-(2.0**50), True), (float(np.nextafter(np.float32(2.0**50), np.float32(np.inf))), False),
    (1e20, False), (float(np.finfo(np.float32).max), False), (np.inf, False), (-np.inf, False), (np.nan, False),
    (0.0, True), (1e-45, True),
])
def test_finite_float32_keeps_every_bound(value, ok):
    """The one-dot-product check refuses exactly what check_values refuses, without a warning."""
    for size in (1, DIM, 100_000):
        array = np.ones((1, size), np.float32)
        array[0, size // 2] = value
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if ok:
                _validate.finite_float32(array)
                _validate.check_values(array, "queries", "float32")
            else:
                for check in (_validate.finite_float32, lambda a: _validate.check_values(a, "queries", "float32")):
                    with pytest.raises(ValueError, match="NaN|infinity|2\\*\\*50"):
                        check(array)


def test_many_large_values_below_the_limit_pass():
    """A sum of squares that overflows float32 although every value is allowed: the exact check decides."""
    array = np.full((4, 4096), 2.0**49, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _validate.finite_float32(array)
        assert _validate.host_queries(array, 4096) is array


# -- the GPU searcher's prepared batch, without a GPU ------------------------------------------------------
class _FakeBatch:
    """Stands in for plans.HostBatch: the staged queries searched by the oracle over the fake's rows."""

    def __init__(self, owner, n: int, k: int):
        self.owner, self.k, self.live = owner, k, True
        self.stage = np.zeros((n, owner.dim), np.float32)
        self.distances, self.ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
        self.status = np.zeros(n, np.int32)

    def run(self, stream, use_graphs) -> None:
        assert self.live, "a prepared search used a batch that left the plan cache"
        self.distances[:], self.ids[:] = exact_search(self.owner.rows, self.stage, self.k, self.owner.metric)

    def close(self) -> None:
        self.live = False


def _fake_gpu_searcher(rows: np.ndarray):
    """A GpuSearcher with no device: its search, prepare_search, _forget_plans and _search_host_batch are the
    real ones; the host batches are _FakeBatch, made (and counted) by _host_batch."""
    pytest.importorskip("cuda.bindings")
    from tinyknn.gpu.searcher import GpuSearcher
    from tinyknn.gpu.views import EveryRow

    class Fake(GpuSearcher):
        use_screen = False

        def __init__(self):                          # no device, no buffers
            self.dim, self.metric, self.dtype = rows.shape[1], "l2", "float32"
            self.rows, self._n, self._stride = rows, len(rows), rows.shape[1]
            self._lock, self._closed, self._view = threading.Lock(), False, None
            self._every_row = EveryRow(self)
            self._plans, self._buffers, self.lookups = OrderedDict(), {}, 0
            self._stream = type("Stream", (), {"synchronize": lambda self: None})()

        def _host_batch(self, n_queries, k, exact=False):
            self.lookups += 1
            key = (n_queries, k, exact, self._view)
            if key not in self._plans:
                self._plans[key] = _FakeBatch(self, n_queries, k)
            return self._plans[key]

        def evict_everything(self):
            """What _plan's eviction does to a host batch: closed, dropped, the generation moved on."""
            for batch in self._plans.values():
                batch.close()
                self._plan_generation += 1
            self._plans.clear()

    return Fake()


def test_gpu_prepared_batch_is_bound_once_and_rebound_after_every_change(rng):
    import tinyknn.gpu.plan as plans

    first, q = data(rng, 40, "float32"), data(rng, 2, "float32")
    searcher = _fake_gpu_searcher(first)
    token = searcher.prepare_search(2, 3)
    for _ in range(3):
        assert_exact(*searcher.search(q, 3, prepared=token), first, q, 3, "l2")
    assert searcher.lookups == 1                    # bound at the first call, never looked up again
    out = empty_out(2, 3)
    assert searcher.search(q, 3, out=out, prepared=token)[0] is out[0]
    assert_exact(*out, first, q, 3, "l2")
    assert searcher.lookups == 1
    searcher.rows = second = data(rng, 30, "float32")   # what add/remove/reset/truncate/a grown buffer do:
    searcher._n = len(second)
    searcher._forget_plans()                        # ... every plan and batch dropped
    assert_exact(*searcher.search(q, 3, prepared=token), second, q, 3, "l2")
    assert searcher.lookups == 2
    searcher.evict_everything()
    assert_exact(*searcher.search(q, 3, prepared=token), second, q, 3, "l2")
    assert searcher.lookups == 3
    # a call of another shape with this token: the ordinary lookup, the token left alone
    searcher.search(q[:1], 3, prepared=token)
    searcher.search(q, 4, prepared=token)
    assert searcher.lookups == 5 and token.batch.stage.shape == (2, DIM) and token.batch.k == 3
    searcher.search(q, 3, prepared=token)
    assert searcher.lookups == 5
    many = data(rng, plans.MAX_BATCH + 3, "float32")
    out = empty_out(len(many), 3)
    searcher.search(many, 3, out=out)               # beyond one batch: written batch by batch into out
    assert_exact(*out, second, many, 3, "l2")
