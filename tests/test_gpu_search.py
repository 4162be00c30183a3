"""GPU search against the float64 reference: every metric x dtype x dim, k from 1 to 2048 and beyond
ntotal, 1 / 7 / 1000 queries, both selection kernels, odd database sizes, several indexes, threads,
CuPy and torch arrays in and out, adversarial data and bad device inputs.

All marked `gpu`. The kernels the module needs are compiled up front in parallel (a fresh machine has
an empty cache); the float64 reference dominates the run time, so large batches check a sample of
rows that always includes the first and last (partial) query groups.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numpy as np
import pytest

import tinyknn
from tinyknn.jit import render, render_single, search_kernels
from reference import assert_exact

pytestmark = pytest.mark.gpu

METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16")
DIMS = (1, 3, 64, 128, 130, 768, 1536)
SMALL_N, LARGE_N = 1000, 2500
# (index size, k, n_queries): every k (1, 10, 100, 1000, 2048, > ntotal) and every batch size.
SWEEP = (
    (SMALL_N, 1, 1000), (SMALL_N, 10, 7), (SMALL_N, 100, 1000), (SMALL_N, 1200, 7),
    (LARGE_N, 1000, 7), (LARGE_N, 2048, 1), (LARGE_N, 10, 1),
)


def _arch() -> str:
    from tinyknn.gpu.device import current_device

    return current_device().arch


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    """Compile every spec this module launches, in parallel (NVRTC releases the GIL)."""
    from tinyknn.jit.cache import get_cubin

    arch = _arch()
    combos = {(m, t, d, k) for m in METRICS for t in DTYPES for d in DIMS for _, k, _ in SWEEP}
    combos |= {(m, t, d, k) for m in METRICS for t in DTYPES for d in (16, 64) for k in (1, 5, 10, 37, 100, 256)}
    specs = sorted({s for c in combos for s in search_kernels.specs_for_search(*c, arch)})
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(get_cubin, specs))


def _data(rng, n, dim, dtype="float32", scale=1.0, offset=0.0):
    return (rng.standard_normal((n, dim)) * scale + offset).astype(dtype)


def _check(result, db, q, k, metric, dtype, id_map=None, sample=96):
    """The exactness contract (assert_exact: ids and distances bit for bit the float64 oracle's) on all
    rows, or on the first, last and random rows of a large batch; in chunks of rows so that the
    reference's (rows, n) float64 temporaries stay small."""
    distances, ids = (np.asarray(a) for a in result)
    nq = len(q)
    rows = np.arange(nq)
    if nq > sample:
        edge = sample // 3
        rest = np.random.default_rng(nq).choice(np.arange(edge, nq - edge), sample - 2 * edge, replace=False)
        rows = np.unique(np.concatenate([rows[:edge], rows[-edge:], rest]))
    step = max(1, int(2e7 // max(1, db.size)))
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        assert_exact(distances[part], ids[part], db, q[part], k, metric, dtype, id_map)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_matches_reference(metric, dtype, dim, rng):
    large = _data(rng, LARGE_N, dim)
    with tinyknn.Index(dim, metric, dtype, device="cuda") as small_index, \
            tinyknn.Index(dim, metric, dtype, device="cuda") as large_index:
        small_index.add(large[:SMALL_N])
        large_index.add(large)
        for n, k, nq in SWEEP:
            index = small_index if n == SMALL_N else large_index
            q = _data(rng, nq, dim)
            _check(index.search(q, k), large[:n], q, k, metric, dtype)


@pytest.mark.parametrize("variant", ["single", "scan", "tiled"])
@pytest.mark.parametrize("metric,dtype,dim,k", [
    ("l2", "float32", 64, 10), ("ip", "float16", 16, 37), ("cosine", "float32", 64, 256), ("l2", "float16", 64, 100),
    ("cosine", "float16", 16, 1), ("ip", "float32", 64, 5),
])
def test_both_selection_kernels(monkeypatch, variant, metric, dtype, dim, k, rng):
    """The same searches through each selection kernel, at sizes that are no tile multiple (single: one
    query; more go to the scan kernel)."""
    from tinyknn.gpu import plan

    monkeypatch.setattr(plan, "SCAN_MAX_QUERIES", 10**9 if variant != "tiled" else 0)
    monkeypatch.setattr(plan, "USE_SINGLE", variant == "single")
    db = _data(rng, 1237, dim)
    with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
        index.add(db[:1000])
        index.add(db[1000:])
        for nq in (1, 7, 20, 65, 300):      # 1, 7: tiled blocks of 16 queries; 20: of 32 (k < 100)
            q = _data(rng, nq, dim)
            _check(index.search(q, k), db, q, k, metric, dtype)
        if variant == "scan":      # one query: a block of one
            assert index._searcher._main_spec(1, k, False).param("qb") == 1
        if variant == "single":
            expected = "single" if k <= render_single.SINGLE_MAX_K else "scan"
            assert index._searcher._main_spec(1, k, False).variant == expected
        if variant == "tiled":
            block = {nq: index._searcher._main_spec(nq, k, False).param("bq") for nq in (7, 20, 300)}
            default = render.tiled_spec(metric, dtype, dim, k, _arch()).param("bq")
            assert block == {7: min(16, default), 20: min(32, default), 300: default}


@pytest.mark.parametrize("metric", METRICS)
def test_single_query_kernel(metric, rng):
    """One query through single_kernel: slices with fewer rows than a list, more slices than one wave
    (rows per slice capped), k at its limit and one beyond (the scan kernel), 40 tied copies (the band
    search), and repeated searches (graph replays: the arrival counter starts from zero each time)."""
    from tinyknn.gpu import plan

    for n, dim, ks in ((5, 8, (1, 10)), (37, 130, (10, 36)), (600_000, 4, (10, 128, 129)), (3000, 64, (100,))):
        db = _data(rng, n, dim)
        with tinyknn.Index(dim, metric, "float32", device="cuda") as index:
            index.add(db)
            for k in ks:
                for _ in range(4):
                    q = _data(rng, 1, dim)
                    _check(index.search(q, k), db, q, k, metric, "float32")
                expected = "single" if k <= render_single.SINGLE_MAX_K else "scan"
                assert index._searcher._main_spec(1, k, False).variant == expected
            if n == 600_000:
                with index._searcher._lock, index._searcher._reading(None):
                    batch = index._searcher._host_batch(1, 10)
                assert batch.plan.slices >= n / render_single.SINGLE_MAX_ROWS and batch.plan.verify is None
    db = _data(rng, 400, 6)
    db[100:140] = db[3]
    with tinyknn.Index(6, metric, "float32", device="cuda") as index:
        index.add(db)
        before = index._searcher.exact_reruns
        _check(index.search(db[3:4], 10), db, db[3:4], 10, metric, "float32")
        assert metric != "l2" or index._searcher.exact_reruns == before + 1    # the copies tie beyond the margin
    assert plan.choose_variant(1, 10) == "single"


@pytest.mark.parametrize("n", [1, 1000, 100_003])
def test_database_sizes(n, rng):
    db = _data(rng, n, 64)
    ids = rng.permutation(10 * n)[:n].astype(np.int64) + 7
    with tinyknn.Index(64, "l2", "float32", device="cuda") as index:
        index.add(db, ids=ids)
        for nq, k in ((1, 10), (7, 100), (1000, 10)):
            q = _data(rng, nq, 64)
            _check(index.search(q, k), db, q, k, "l2", "float32", id_map=ids, sample=40)


def test_empty_index_pads(rng):
    with tinyknn.Index(16, "ip", "float16", device="cuda") as index:
        distances, ids = index.search(_data(rng, 3, 16), 5)
    assert np.all(ids == -1) and np.all(distances == -np.inf)


def test_several_indexes_alive_at_once(rng):
    configs = [("l2", "float32", 64, 10), ("cosine", "float16", 130, 37), ("ip", "float32", 3, 1)]
    indexes, data = [], []
    for metric, dtype, dim, _ in configs:
        db = _data(rng, 900, dim)
        index = tinyknn.Index(dim, metric, dtype, device="cuda")
        index.add(db)
        indexes.append(index)
        data.append(db)
    try:
        for _ in range(2):
            for index, db, (metric, dtype, dim, k) in zip(indexes, data, configs):
                q = _data(rng, 9, dim)
                _check(index.search(q, k), db, q, k, metric, dtype)
    finally:
        for index in indexes:
            index.close()


def test_eight_threads_share_one_index(rng):
    dim, k = 64, 10
    db = _data(rng, 5000, dim)
    queries = [_data(rng, nq, dim) for nq in (1, 3, 7, 64, 200, 1, 9, 33)]
    failures = []
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        expected = [index.search(q, k) for q in queries]

        def work(i):
            try:
                for _ in range(20):
                    got = index.search(queries[i], k)
                    np.testing.assert_array_equal(got[0], expected[i][0])
                    np.testing.assert_array_equal(got[1], expected[i][1])
            except Exception as exc:  # noqa: BLE001 - reported below with the thread number
                failures.append((i, exc))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, failures
    for q, result in zip(queries, expected):
        _check(result, db, q, k, "l2", "float32")


def test_repeated_searches_compile_nothing(rng):
    from tinyknn.jit.cache import default_cache

    with tinyknn.Index(64, "cosine", "float32", device="cuda") as index:
        index.add(_data(rng, 700, 64))
        index.search(_data(rng, 3, 64), 10)
        before = default_cache().stats["compiles"]
        for nq in (3, 3, 1000, 1000, 3):
            index.search(_data(rng, nq, 64), 10)
        assert default_cache().stats["compiles"] == before


@pytest.mark.parametrize("case", ["ties", "far", "float16_extremes", "zeros"])
def test_adversarial_data(case, rng):
    dim = 32
    if case == "ties":
        db = rng.integers(-2, 3, (3000, dim)).astype(np.float32)
        db[1000:1500] = db[:500]                             # exact duplicates
        q = db[:7] + 0.0
    elif case == "far":
        db = _data(rng, 2000, dim, scale=1e-3, offset=1e4)   # l2 by differences keeps these apart
        q = _data(rng, 7, dim, scale=1e-3, offset=1e4)
    elif case == "float16_extremes":
        db = np.clip(_data(rng, 2000, dim, scale=4e4), -65504, 65504).astype(np.float16)
        q = np.clip(_data(rng, 7, dim, scale=4e4), -65504, 65504)
    else:
        db = np.zeros((300, dim), np.float32)
        db[::2] = _data(rng, 150, dim)
        q = np.zeros((3, dim), np.float32)
    dtype = "float16" if case == "float16_extremes" else "float32"
    for metric in METRICS:
        with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
            index.add(db)
            for k in (1, 10, 100):
                _check(index.search(q, k), db, q, k, metric, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2_filter_is_proven_on_ordinary_data(dtype, rng):
    """Large l2 batches rank by |x|^2 - 2 q.x, then verify: on data near the origin the verify step proves
    every answer (no band search), for list lengths 9 to 108 and an unfiltered k = 121."""
    dim = 48
    db = _data(rng, 4000, dim, dtype)
    with tinyknn.Index(dim, "l2", dtype, device="cuda") as index:
        index.add(db)
        for k in (1, 10, 100, 121):
            q = _data(rng, 300, dim)
            _check(index.search(q, k), db, q, k, "l2", dtype)
        assert index._searcher.exact_reruns == 0


@pytest.mark.parametrize("n", [0, 1, 5, 17])
def test_l2_filter_with_fewer_rows_than_its_lists(n, rng):
    """k + 8 candidates per list but only n rows (n < k + 8, k > n too): verify pads and proves."""
    dim = 12
    db = _data(rng, n, dim)
    q = _data(rng, 20, dim)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        if n:
            index.add(db)
        for k in (3, 10, 24):
            distances, ids = index.search(q, k)
            if n:
                _check((distances, ids), db, q, k, "l2", "float32")
            else:
                assert np.all(ids == -1) and np.all(distances == np.inf)
        assert index._searcher.exact_reruns == 0


def test_l2_filter_proof_counts_underflow(rng):
    """Coordinates near 2^-70 make every square subnormal, where roundings are absolute, not relative:
    the filter cannot rank such rows reliably, so the proof must fail and every query goes to the band
    search (whose answer is the contract's, bit for bit)."""
    dim, k = 16, 1
    center = rng.uniform(-1, 1, dim) * 2.0**-70
    db = (center + rng.uniform(-1, 1, (300, dim)) * 2.0**-75).astype(np.float32)
    q = (center + rng.uniform(-1, 1, (20, dim)) * 2.0**-75).astype(np.float32)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        distances, ids = index.search(q, k)
        assert index._searcher.exact_reruns == len(q)
        _check((distances, ids), db, q, k, "l2", "float32")


def test_zero_queries(rng):
    with tinyknn.Index(8, "l2", "float32", device="cuda") as index:
        index.add(_data(rng, 50, 8))
        distances, ids = index.search(np.zeros((0, 8), np.float32), 4)
        assert distances.shape == (0, 4) and ids.shape == (0, 4)
        assert distances.dtype == np.float32 and ids.dtype == np.int64


@pytest.mark.parametrize("case", ["far", "ties", "one_far_query"])
def test_l2_filter_falls_back_when_unproven(case, rng):
    """Where the filter key's rounding could hide a nearer row (far from the origin, ties at the k-th
    distance), the query goes to the band search: the answer stays the contract's."""
    dim, k = 24, 10
    if case == "far":
        db = _data(rng, 3000, dim, scale=1e-2, offset=1e4)
        q = _data(rng, 64, dim, scale=1e-2, offset=1e4)
    elif case == "ties":
        db = rng.integers(-1, 2, (3000, dim)).astype(np.float32)
        db[1500:] = db[:1500]                                  # every row twice
        q = db[rng.choice(3000, 64)] + 0.0
    else:
        db = _data(rng, 3000, dim)
        q = _data(rng, 64, dim)
        q[5] += 3e5                                            # one query far away: only it is unproven
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        _check(index.search(q, k), db, q, k, "l2", "float32", sample=64)
        reruns = index._searcher.exact_reruns
        if case == "far":
            assert reruns == len(q)
        elif case == "one_far_query":
            assert reruns == 1
        if "cupy" in _frameworks():
            import cupy

            result = index.search(cupy.asarray(q), k)
            _check((result[0].get(), result[1].get()), db, q, k, "l2", "float32", sample=64)
            assert index._searcher.exact_reruns > reruns or reruns == 0


def test_export_round_trips_and_close_is_final(rng, tmp_path):
    db = _data(rng, 333, 130)
    index = tinyknn.Index(130, "l2", "float16", device="cuda")
    index.add(db, ids=np.arange(333) * 2)
    vectors, ids = index._searcher.export()
    np.testing.assert_array_equal(vectors, db.astype(np.float16))
    np.testing.assert_array_equal(ids, np.arange(333) * 2)
    index.save(tmp_path / "gpu.tkn")
    loaded = tinyknn.Index.load(tmp_path / "gpu.tkn", device="cuda")
    q = _data(rng, 5, 130)
    np.testing.assert_array_equal(loaded.search(q, 7)[1], index.search(q, 7)[1])
    index.close()
    index.close()
    with pytest.raises(ValueError, match="closed"):
        index.search(q, 7)
    loaded.close()


# -- CUDA arrays of other frameworks -------------------------------------------------------------
def _frameworks():
    found = []
    for name in ("cupy", "torch"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        if name == "torch" and not module.cuda.is_available():
            continue
        found.append(name)
    return found


def _to_device(framework, array):
    if framework == "cupy":
        import cupy

        return cupy.asarray(array)
    import torch

    return torch.as_tensor(array).cuda()


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_device_arrays_in_and_out(framework, rng):
    if framework not in _frameworks():
        pytest.skip(f"{framework} with CUDA is not installed")
    dim, k = 40, 10
    db = _data(rng, 3000, dim, dtype="float64")
    q = _data(rng, 20, dim)
    for metric, dtype in (("l2", "float16"), ("cosine", "float32")):
        with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
            index.add(_to_device(framework, db[:2000]))          # float64 converted on the device
            index.add(db[2000:])                                 # host rows too
            distances, ids = index.search(_to_device(framework, q), k)
            assert type(distances).__module__.split(".")[0] == framework
            host = (distances.get(), ids.get()) if framework == "cupy" else (distances.cpu().numpy(), ids.cpu().numpy())
            _check(host, db, q, k, metric, dtype)
            np.testing.assert_array_equal(host[1], index.search(q, k)[1])
            strided = _to_device(framework, np.concatenate([q, q], axis=1))[:, :dim]   # rows not contiguous
            np.testing.assert_array_equal(_host(framework, index.search(strided, k)[1]), host[1])
            half = _to_device(framework, q.astype(np.float16))
            _check(tuple(_host(framework, a) for a in index.search(half, k)), db, q.astype(np.float16), k, metric, dtype)


def _host(framework, array):
    return array.get() if framework == "cupy" else array.cpu().numpy()


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_large_device_batches_are_screened(framework, rng, monkeypatch):
    """A batch of 64 or more CUDA-array queries on a screened index goes through the tensor-core screen, as a
    NumPy batch does: the same answers bit for bit (the oracle's), the screen's query count rising, rows
    handed back answered by the other kernels (forced with a survivor room of 64), a NaN refused."""
    if framework not in _frameworks():
        pytest.skip(f"{framework} with CUDA is not installed")
    from tinyknn.jit import render_screen

    dim, k = 72, 10
    db = _data(rng, 30000, dim)
    q = _data(rng, 300, dim)
    for metric, dtype in (("l2", "float16"), ("cosine", "float32"), ("ip", "bfloat16")):
        with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
            index.add(db)
            screen = index._searcher._screen
            expected = index.search(q, k)
            before = screen.queries
            found = tuple(_host(framework, a) for a in index.search(_to_device(framework, q), k))
            assert screen.queries == before + len(q)
            np.testing.assert_array_equal(found[1], expected[1])
            np.testing.assert_array_equal(found[0].view(np.int32), expected[0].view(np.int32))
            _check(found, db, q, k, metric, dtype)
            strided = _to_device(framework, np.concatenate([q, q], axis=1))[:, :dim]
            np.testing.assert_array_equal(_host(framework, index.search(strided, k)[1]), expected[1])
            bad = q.copy()
            bad[100, 3] = np.nan
            with pytest.raises(ValueError, match="NaN"):
                index.search(_to_device(framework, bad), k)
    monkeypatch.setattr(render_screen, "SURVIVOR_CAPACITY", 64)     # survivors past 64 a query: handed back
    with tinyknn.Index(dim, "l2", "float16", device="cuda") as index:
        index.add(db)
        screen = index._searcher._screen
        expected = index.search(q, 100)
        handed_back = screen.fallbacks
        found = tuple(_host(framework, a) for a in index.search(_to_device(framework, q), 100))
        assert screen.fallbacks > handed_back
        np.testing.assert_array_equal(found[1], expected[1])
        _check(found, db, q, 100, "l2", "float16")


def test_cupy_stream_ordering(rng):
    if "cupy" not in _frameworks():
        pytest.skip("cupy is not installed")
    import cupy

    dim = 64
    db = _data(rng, 20000, dim)
    with tinyknn.Index(dim, "ip", "float32", device="cuda") as index:
        index.add(db)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            q = cupy.asarray(_data(rng, 50, dim))
            q *= 2.0                                   # pending work on the caller's stream
            distances, ids = index.search(q, 10)
            checksum = ids.sum()                       # consumer on the same stream
        stream.synchronize()
        expected = index.search(cupy.asnumpy(q), 10)
        np.testing.assert_array_equal(ids.get(), expected[1])
        assert int(checksum.get()) == int(expected[1].sum())


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_bad_device_inputs(framework, rng):
    if framework not in _frameworks():
        pytest.skip(f"{framework} with CUDA is not installed")
    dim = 16
    with tinyknn.Index(dim, "l2", "float16", device="cuda") as index:
        index.add(_data(rng, 100, dim))
        with pytest.raises(TypeError, match="float16, float32, float64 or bfloat16"):
            index.search(_to_device(framework, np.ones((2, dim), np.int32)), 3)
        with pytest.raises(ValueError, match="16 columns"):
            index.search(_to_device(framework, np.ones((2, dim + 1), np.float32)), 3)
        with pytest.raises(ValueError, match="2-D"):
            index.search(_to_device(framework, np.ones(dim, np.float32)), 3)
        bad = np.ones((5, dim), np.float32)
        bad[3, 7] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            index.search(_to_device(framework, bad), 3)
        with pytest.raises(ValueError, match="NaN"):
            index.add(_to_device(framework, bad))
        too_big = np.full((2, dim), 1e5, np.float32)           # beyond float16
        with pytest.raises(ValueError, match="float16"):
            index.add(_to_device(framework, too_big))
        assert index.ntotal == 100
        q = _data(rng, 4, dim)
        _check(index.search(q, 3), index._searcher.export()[0], q, 3, "l2", "float16")


@pytest.mark.parametrize("bad,message", [(np.nan, "NaN"), (np.inf, "infinity"), (2.0**51, "2\\*\\*50")])
@pytest.mark.parametrize("nq", [1, 300])
def test_bad_host_query_values_raise_after_the_device_is_done(bad, message, nq, rng):
    """Host float32 values are checked while the device searches: a bad value still raises, and the
    index keeps answering correctly afterwards (float64 input is checked before its conversion)."""
    dim = 16
    db = _data(rng, 500, dim)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        q = _data(rng, nq, dim)
        bad_q = q.copy()
        bad_q[nq // 2, 3] = bad
        for _ in range(3):                    # the third search replays a graph
            with pytest.raises(ValueError, match=message):
                index.search(bad_q, 5)
        with pytest.raises(ValueError, match="1e\\+300"):
            index.search(np.full((nq, dim), 1e300), 5)
        _check(index.search(q, 5), db, q, 5, "l2", "float32")
