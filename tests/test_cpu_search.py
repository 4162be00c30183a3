"""The CPU search against the exactness contract's float64 oracle (reference.assert_exact: ids and distance
bits): every metric x dtype, dims, k, ties, ids, extremes, and every path (full scan, float16 sketch, Winograd
pass). Database sizes follow the build's panel width (AVX2 16 rows, AVX-512 32, portable 8: tk_build_param),
never one machine's."""

from __future__ import annotations

import platform
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyknn
from tinyknn.config import reset_config
from tinyknn.cpu import build as cpu_build
from tinyknn.cpu import library
from reference import assert_exact

METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16")
DIMS = (1, 2, 3, 7, 64, 96, 128, 130, 1000)


def build(db, metric, dtype, ids=None):
    index = tinyknn.Index(db.shape[1], metric=metric, dtype=dtype, device="cpu")
    index.add(db, ids=ids)
    return index


@pytest.fixture
def threads(monkeypatch):
    """Set TINYKNN_CPU_THREADS for indexes created inside the test."""
    def set_threads(count: int):
        monkeypatch.setenv("TINYKNN_CPU_THREADS", str(count))
        reset_config()
    yield set_threads
    monkeypatch.delenv("TINYKNN_CPU_THREADS", raising=False)
    reset_config()


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_matches_reference(rng, metric, dtype, dim):
    n = 150 if dim == 1000 else 301          # not a multiple of any panel width
    db = rng.standard_normal((n, dim)).astype(np.float32)
    q = rng.standard_normal((13, dim)).astype(np.float32)   # two tiles and a remainder
    index = build(db, metric, dtype)
    for k in (1, 10, n + 7):
        distances, ids = index.search(q, k)
        assert_exact(distances, ids, db, q, k, metric, dtype)


@pytest.mark.parametrize("metric", METRICS)
def test_k_from_one_to_beyond_ntotal(rng, metric):
    n = 40
    db = rng.standard_normal((n, 5)).astype(np.float32)
    q = rng.standard_normal((3, 5)).astype(np.float32)
    index = build(db, metric, "float32")
    for k in (1, 2, 3, n - 1, n, n + 1, 3 * n, 2048):
        distances, ids = index.search(q, k)
        assert_exact(distances, ids, db, q, k, metric)


@pytest.mark.parametrize("n_queries", [1, 2, 7, 200])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_threads_and_database_slices(rng, threads, n_queries, n_threads):
    """Few queries split the database across threads (slices merged); many split the queries."""
    threads(n_threads)
    db = rng.standard_normal((3000, 24)).astype(np.float32)
    q = rng.standard_normal((n_queries, 24)).astype(np.float32)
    for metric in METRICS:
        distances, ids = build(db, metric, "float32").search(q, 17)
        assert_exact(distances, ids, db, q, 17, metric)


def first_pass_rows(extra_panels: int = 20) -> int:
    """Rows enough for both first passes in the loaded build (their minimum panels, plus some), whatever its
    panel width."""
    panels = max(library.build_param("sketch_min_panels"), library.build_param("winograd_min_panels"))
    return (panels + extra_panels) * library.build_param("panel_rows")


def sketch_data(rng, kind, n=None, dim=24):
    """Databases for the float16 sketch (float32 l2, few queries): easy, shifted, tiny, huge, tied."""
    n = n or first_pass_rows()
    if kind == "normal":
        return rng.standard_normal((n, dim)).astype(np.float32)
    if kind == "far":
        return (1e6 + rng.standard_normal((n, dim))).astype(np.float32)
    if kind == "tiny":
        return (rng.standard_normal((n, dim)) * 1e-30).astype(np.float32)
    if kind == "subnormal":     # squared differences ~1e-42: the exact scan's sums round in absolute terms
        return (rng.standard_normal((n, dim)) * 1e-21).astype(np.float32)
    if kind == "huge":
        return (rng.standard_normal((n, dim)) * 1e14).astype(np.float32)
    if kind == "ties":
        db = rng.integers(-2, 3, size=(n, dim)).astype(np.float32)
        db[n // 2:] = db[: n - n // 2]
        return db
    if kind == "near-duplicates":
        base = rng.standard_normal(dim).astype(np.float32)
        return (base + rng.standard_normal((n, dim)) * 1e-5).astype(np.float32)
    # a tight cluster inside a wide spread: the sketch's float16 scale follows the spread, so it cannot
    # tell the cluster's rows apart; only the exact rescoring of every row inside the bound does
    db = rng.standard_normal((n, dim)) * 1e4
    db[:30] = rng.standard_normal(dim) + rng.standard_normal((30, dim)) * 1e-3
    return db.astype(np.float32)


def first_pass_case(rng, kind, n_queries, dim=24):
    """(database, float32 l2 index of it added in two batches, queries near its rows) for one data kind."""
    db = sketch_data(rng, kind, dim=dim)
    index = tinyknn.Index(db.shape[1])
    index.add(db[:1000])
    index.add(db[1000:])
    rows = rng.choice(30 if kind == "cluster-in-spread" else len(db), n_queries)
    noise = rng.standard_normal((n_queries, db.shape[1])) * db[:30].std() * 0.1
    return db, index, db[rows] + noise.astype(np.float32)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("kind", ["normal", "far", "tiny", "subnormal", "huge", "ties", "near-duplicates",
                                  "cluster-in-spread"])
def test_few_queries_through_the_sketch_match_the_full_scan(rng, threads, kind, n_threads):
    """Float32 l2 searches of <= 8 queries go through the float16 sketch: exact, bit for bit the full scan."""
    threads(n_threads)
    db, index, q = first_pass_case(rng, kind, 8)
    for k in (1, 10):
        for batch in (q[:1], q[1:3], q):
            distances, ids = search_matching_full_scan(index, batch, k)
            assert_exact(distances, ids, db, batch, k, "l2")
    answered, declined = index._searcher.sketch_counts()
    assert answered + declined == 6
    if kind in ("normal", "far", "huge", "subnormal"):
        assert answered == 6, (answered, declined)
    assert_fallbacks(index, kind, searched=2 * 2 * (1 + 2 + 8))
    if kind == "tiny":      # every exact distance underflows: the bound's absolute terms hand over to the scan
        assert declined == 6, (answered, declined)


def assert_fallbacks(index, kind, searched):
    """The exact-fallback counter on a first-pass data set: none where float32 separates the neighbours, every
    query where every float32 distance underflows (all keys 0: nothing can be proven)."""
    fallbacks = index._searcher.exact_fallbacks()
    print(f"{kind}: {fallbacks} of {searched} queries searched exhaustively")
    if kind in ("normal", "far", "huge", "cluster-in-spread"):
        assert fallbacks == 0
    if kind == "tiny":
        assert fallbacks == searched


def full_scan(index, queries, k):
    """The exact scan's answer, with the first passes (sketch, Winograd) switched off for this one search."""
    index._searcher.use_first_passes(False)
    try:
        return index.search(queries, k)
    finally:
        index._searcher.use_first_passes(True)


def search_matching_full_scan(index, queries, k):
    """index.search(queries, k), asserted bit for bit equal (distances and ids) to the full scan's answer."""
    distances, ids = index.search(queries, k)
    full_d, full_i = full_scan(index, queries, k)
    assert np.array_equal(distances, full_d) and np.array_equal(ids, full_i)
    return distances, ids


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("kind", ["normal", "far", "tiny", "subnormal", "huge", "ties", "near-duplicates",
                                  "cluster-in-spread"])
def test_many_queries_through_the_winograd_pass_match_the_full_scan(rng, threads, kind, n_threads):
    """Float32 l2 searches of >= 16 queries (here of 32 dims) go through the Winograd pass: exact, bit for
    bit the full scan, for batches that fill whole tiles of queries and batches that do not, in one chunk
    or several."""
    threads(n_threads)
    db, index, q = first_pass_case(rng, kind, 300, dim=32)
    for k in (1, 10):
        for batch in (q[:16], q[:21], q):
            distances, ids = search_matching_full_scan(index, batch, k)
            assert_exact(distances, ids, db, batch, k, "l2")
    answered, declined = index._searcher.winograd_counts()
    assert answered + declined == 6
    assert_fallbacks(index, kind, searched=2 * 2 * (16 + 21 + 300))
    # (near-duplicates seen from afar: the exact scan's own rounding is wider than their spread, so
    # more rows stay candidates than the pass rescores; ties: as many candidates as tied rows)
    if kind in ("normal", "far", "huge", "subnormal", "cluster-in-spread"):
        assert answered == 6, (answered, declined)
    if kind == "tiny":      # every exact distance underflows: the bound's absolute terms hand over to the scan
        assert declined == 6, (answered, declined)


@pytest.mark.parametrize("dim", [1, 2, 7, 16, 31, 32, 33, 34, 128, 192, 193, 386, 1000])
def test_winograd_pass_for_every_grouping_of_dims(rng, dim):
    """The pass pairs coordinates in groups of three, and scores many dims in blocks of 192; dims with
    none, one or two left over, in one block or several (the last one as short as one dim), give the
    full scan's answer bit for bit (a database of one panel more than the pass's minimum, whose last
    panel is padding). Below 32 dims the full scan answers."""
    n = library.build_param("winograd_min_panels") * library.build_param("panel_rows") + 1
    db = (rng.standard_normal((n, dim)) * 3 + 5).astype(np.float32)
    q = (rng.standard_normal((21, dim)) * 3 + 5).astype(np.float32)
    index = build(db, "l2", "float32")
    for k in (1, 5, 11):   # the pass takes k + margin <= panels / 16
        distances, ids = search_matching_full_scan(index, q, k)
        assert_exact(distances, ids, db, q, k, "l2")
    assert index._searcher.winograd_counts() == ((3, 0) if dim >= library.build_param("winograd_min_dim") else (0, 0))


@pytest.mark.parametrize("n_queries, counts", [(3, "sketch_counts"), (24, "winograd_counts")])
def test_first_passes_break_ties_as_the_full_scan_does(rng, n_queries, counts):
    """Rows at exactly the same distance, scattered over the database: of those tied at the k-th
    distance, every path returns the smallest ids (the contract), not just equal distances: 40 ties are
    more than the screen's margin, so query 0 is searched exhaustively (counted) after each screen."""
    db = (rng.standard_normal((first_pass_rows(300), 32)) * 10).astype(np.float32)
    q = rng.integers(-5, 6, size=(n_queries, 32)).astype(np.float32)
    tied = np.sort(rng.choice(len(db), 40, replace=False))
    for row in tied:     # one coordinate of query 0 moved by 1: distance exactly 1
        db[row] = q[0]
        db[row, rng.integers(32)] += rng.choice([-1.0, 1.0])
    index = build(db, "l2", "float32")
    for k in (1, 2, 5):
        distances, ids = search_matching_full_scan(index, q, k)
        assert np.array_equal(ids[0], tied[:k]) and np.all(distances[0] == 1.0)
        assert_exact(distances, ids, db, q, k, "l2")
    assert getattr(index._searcher, counts)() == (3, 0)
    assert index._searcher.exact_fallbacks() >= 2 * 3   # query 0, first pass and full scan, each k


def test_winograd_pass_over_several_blocks_of_queries(rng):
    """More queries than one block of the pass (4,096): every block's answer lands in its own rows."""
    db = rng.standard_normal((first_pass_rows(), 32)).astype(np.float32)
    q = rng.standard_normal((4096 + 21, 32)).astype(np.float32)
    index = build(db, "l2", "float32")
    distances, ids = search_matching_full_scan(index, q, 3)
    assert_exact(distances[-50:], ids[-50:], db, q[-50:], 3, "l2")
    assert index._searcher.winograd_counts() == (1, 0)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the build flags are x86-64's")
@pytest.mark.parametrize("flags, lanes", [(("-march=x86-64",), 4), ((cpu_build._NATIVE, "-DTINYKNN_FORCE_LANES=16"), 16)],
                         ids=["portable", "forced-16-lanes"])
def test_other_builds_first_passes_match_their_full_scan(rng, cache_dir, monkeypatch, flags, lanes):
    """The library built for a baseline x86-64 CPU (128-bit vectors: 4 lanes, no FMA, no F16C), as a CPU
    without AVX gets it, and one forced to an AVX-512 build's 16 lanes (32-row panels; runs on any x86-64
    CPU, the compiler splits the vectors): the sketch and the Winograd pass still give the contract's
    answer, bit for bit their own full scan's, on a database sized from the build's panel width; so do
    filtered searches from the row-major copy (kernels/cpu/direct.h) for every metric and dtype."""
    monkeypatch.setattr(cpu_build, "FLAGS", tuple(f for f in cpu_build.FLAGS if f != cpu_build._NATIVE) + flags)
    library.reset_library()
    try:
        assert f"{lanes} lanes" in library.get_library().tk_build_info().decode()
        assert library.build_param("lanes") == lanes and library.build_param("panel_rows") == 2 * lanes
        db = (rng.standard_normal((first_pass_rows(), 40)) * 2 + 3).astype(np.float32)
        q = (rng.standard_normal((37, 40)) * 2 + 3).astype(np.float32)
        index = build(db, "l2", "float32")
        for batch in (q[:3], q):
            distances, ids = search_matching_full_scan(index, batch, 10)
            assert_exact(distances, ids, db, batch, 10, "l2")
        assert index._searcher.sketch_counts() == (1, 0) and index._searcher.winograd_counts() == (1, 0)
        assert index._searcher.exact_fallbacks() == 0
        index.close()
        tied = db[:3000].copy()
        tied[::75] = tied[0]        # 40 copies: more ties than the margin, so the exhaustive pass answers
        for metric in METRICS:
            for dtype in DTYPES:
                index = build(tied, metric, dtype)
                distances, ids = index.search(tied[:2] + 0.01, 10)
                assert_exact(distances, ids, tied, tied[:2] + 0.01, 10, metric, dtype)
                if metric != "ip":   # (ip: longer rows may outrank the copies, leaving no tie to break)
                    assert index._searcher.exact_fallbacks() >= 1
                index._searcher.row_copy("always")
                allowed = np.sort(rng.choice(len(tied), 300, replace=False))
                distances, ids = index.search(tied[:3] + 0.01, 10, filter=allowed)
                assert_exact(distances, ids, tied[allowed], tied[:3] + 0.01, 10, metric, dtype, id_map=allowed)
                assert index._searcher.row_copy_counts()[1] == 1
                index.close()
    finally:
        library.reset_library()


@pytest.mark.parametrize("n_queries, counts", [(2, "sketch_counts"), (20, "winograd_counts")])
def test_first_passes_decline_data_they_describe_poorly(rng, n_queries, counts):
    """Far outliers in the first batch set a coarse float16 scale for the sketch, and make the Winograd
    keys' error bound (which grows with the largest row) useless: both hand over to the full scan."""
    db = rng.standard_normal((first_pass_rows(), 32)).astype(np.float32)
    db[::97] *= 1e5
    index = build(db, "l2", "float32")
    q = rng.standard_normal((n_queries, 32)).astype(np.float32)
    distances, ids = index.search(q, 5)
    assert_exact(distances, ids, db, q, 5, "l2")
    assert getattr(index._searcher, counts)() == (0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_empty_index_answers_with_padding(metric, dtype):
    index = tinyknn.Index(4, metric=metric, dtype=dtype)
    distances, ids = index.search(np.ones((3, 4), np.float32), 5)
    assert ids.shape == (3, 5) and np.all(ids == -1)
    assert np.all(distances == (np.inf if metric == "l2" else -np.inf))


@pytest.mark.parametrize("metric", METRICS)
def test_ties_and_exact_duplicates(rng, metric):
    """Integer-valued data: many exactly equal distances, and rows repeated several times."""
    base = rng.integers(-3, 4, size=(60, 6)).astype(np.float32)
    db = np.concatenate([base, base[:20], base[:5]])
    q = np.concatenate([base[:4], rng.integers(-3, 4, size=(4, 6)).astype(np.float32)])
    index = build(db, metric, "float32")
    for k in (1, 3, 8, 30, len(db)):
        distances, ids = index.search(q, k)
        assert_exact(distances, ids, db, q, k, metric)
    if metric == "l2":  # a query equal to a row with two copies: both copies at distance 0 come first
        distances, ids = index.search(base[:1], 3)
        assert distances[0, 0] == 0.0 and distances[0, 1] == 0.0
        assert set(ids[0, :2].tolist()) <= {0, 60, 80}


def test_custom_ids_over_several_adds(rng):
    db = rng.standard_normal((90, 8)).astype(np.float32)
    q = rng.standard_normal((5, 8)).astype(np.float32)
    user_ids = rng.choice(10**12, size=90, replace=False).astype(np.int64)
    index = tinyknn.Index(8)
    for start, stop in ((0, 10), (10, 11), (11, 57), (57, 90)):
        index.add(db[start:stop], ids=user_ids[start:stop])
    distances, ids = index.search(q, 12)
    assert_exact(distances, ids, db, q, 12, "l2", id_map=user_ids)
    _, exported_ids = index._searcher.export()
    assert np.array_equal(exported_ids, user_ids)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_ids_continue_after_each_add(rng, dtype):
    db = rng.standard_normal((50, 3)).astype(dtype).astype(np.float32)  # exact in either dtype
    index = tinyknn.Index(3, dtype=dtype)
    index.add(db[:20])
    index.add(db[20:])
    distances, ids = index.search(db[35:36], 1)
    assert ids[0, 0] == 35 and distances[0, 0] == 0.0


@pytest.mark.parametrize("metric", METRICS)
def test_far_from_origin_is_exact(rng, metric):
    """1e6 + small noise: l2 must see the noise (a norm expansion would lose it to cancellation)."""
    db = (1e6 + rng.standard_normal((400, 32))).astype(np.float32)
    q = (1e6 + rng.standard_normal((6, 32))).astype(np.float32)
    distances, ids = build(db, metric, "float32").search(q, 10)
    assert_exact(distances, ids, db, q, 10, metric)
    if metric == "l2":
        # float32 near 1e6 is a multiple of 1/16, so each squared difference and these small sums are
        # exact in float32: direct differences must reproduce the float64 distances bit for bit.
        exact = ((q[:, None, :].astype(np.float64) - db[None].astype(np.float64)) ** 2).sum(-1)
        assert np.array_equal(distances, np.sort(exact, axis=1)[:, :10].astype(np.float32))


@pytest.mark.parametrize("metric", METRICS)
def test_float16_extremes(rng, metric):
    """Values near float16's largest (65504): squared distances far beyond float16's range."""
    db = (rng.choice([-1.0, 1.0], size=(120, 16)) * rng.uniform(60000, 65504, size=(120, 16))).astype(np.float16)
    q = (rng.choice([-1.0, 1.0], size=(5, 16)) * 65504.0).astype(np.float32)
    distances, ids = build(db, metric, "float16").search(q, 7)
    assert np.all(np.isfinite(distances))
    assert_exact(distances, ids, db, q, 7, metric, "float16")


def test_cosine_zero_vector_has_similarity_zero():
    db = np.array([[0.0, 0.0], [1.0, 0.0], [-1.0, 0.0]], np.float32)
    index = build(db, "cosine", "float32")
    distances, ids = index.search(np.array([[2.0, 0.0], [0.0, 0.0]], np.float32), 3)
    assert ids[0].tolist() == [1, 0, 2] and distances[0].tolist() == [1.0, 0.0, -1.0]
    assert np.all(distances[1] == 0.0)


def test_reset_then_add_again(rng):
    db = rng.standard_normal((30, 4)).astype(np.float32)
    index = build(db, "l2", "float32")
    index.reset()
    assert index.ntotal == 0 and np.all(index.search(db[:1], 2)[1] == -1)
    index.add(db[:10])
    distances, ids = index.search(db[:2], 3)
    assert_exact(distances, ids, db[:10], db[:2], 3, "l2")


def test_eight_python_threads_search_one_index(rng, threads):
    threads(2)
    db = rng.standard_normal((6000, 32)).astype(np.float32)
    queries = [rng.standard_normal((n, 32)).astype(np.float32) for n in (1, 3, 8, 50, 1, 2, 13, 100)]
    index = build(db, "l2", "float32")
    results, errors = [None] * 8, []

    def work(slot):
        try:
            for _ in range(3):
                results[slot] = index.search(queries[slot], 9)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(slot,)) for slot in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors
    for slot, (distances, ids) in enumerate(results):
        assert_exact(distances, ids, db, queries[slot], 9, "l2")


class _CallTimer:
    """Stands in for the loaded library and times the native search call itself (the worker's side)."""

    def __init__(self, library):
        self.library, self.window = library, None

    def __getattr__(self, name):
        return getattr(self.library, name)

    def tk_index_search(self, *args):
        start = time.perf_counter()
        status = self.library.tk_index_search(*args)
        self.window = (start, time.perf_counter())
        return status


def test_search_releases_the_gil(rng, threads):
    """Python threads run while the library searches: ctypes.CDLL drops the GIL for the call (with a
    PyDLL the main thread only runs around the call's ends, at GIL switches; checked by hand)."""
    threads(1)
    db = rng.standard_normal((20000, 64)).astype(np.float32)
    index = build(db, "l2", "float32")
    timer = _CallTimer(index._searcher._library)
    index._searcher._library = timer

    def search_while_counting(q):
        done, stamps = threading.Event(), []
        worker = threading.Thread(target=lambda: (index.search(q, 5), done.set()))
        worker.start()
        while not done.is_set():
            stamps.append(time.perf_counter())
        worker.join()
        return timer.window, stamps

    # 1,500 queries are ~30-70 ms of work on one core; twice as many until a call is long enough that its
    # middle third lasts two GIL switch intervals (a fast, idle machine needs more)
    for n_queries in (1500, 3000, 6000, 12000, 24000):
        (start, end), stamps = search_while_counting(rng.standard_normal((n_queries, 64)).astype(np.float32))
        third = (end - start) / 3   # near the ends the main thread may run at a GIL switch even with a PyDLL
        if third > 2 * sys.getswitchinterval():
            break
    assert third > 2 * sys.getswitchinterval(), f"the search took only {end - start:.4f} s; the test needs more"
    assert any(start + third < t < end - third for t in stamps), \
        "the main thread never ran during the middle third of the native search call"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 70), dim=st.integers(1, 40), n_queries=st.integers(1, 8), k=st.integers(1, 80),
    metric=st.sampled_from(METRICS), dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1e-3, 1.0, 300.0]),
    repeat=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_hypothesis_shapes_and_values(n, dim, n_queries, k, metric, dtype, scale, repeat, seed):
    rng = np.random.default_rng(seed)
    db = (rng.standard_normal((n, dim)) * scale).astype(np.float32)
    if repeat and n > 1:
        db[n // 2:] = db[: n - n // 2]           # exact duplicates
    q = (rng.standard_normal((n_queries, dim)) * scale).astype(np.float32)
    distances, ids = build(db, metric, dtype).search(q, k)
    assert_exact(distances, ids, db, q, k, metric, dtype)
