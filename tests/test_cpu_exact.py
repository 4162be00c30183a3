"""The exactness contract on the CPU: on the data sets that break float32 search, every answer is
the float64 oracle's bit for bit (reference.assert_exact), and the exact-fallback counter says how often the
screen's candidates could not be proven (0 on random data, > 0 where ties outnumber the margin)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyknn
from tinyknn.cpu import library
from reference import assert_exact, near_tied_queries

METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16")


def searched(db, q, k, metric="l2", dtype="float32", chunks=1):
    """(distances, ids, the index's fallback count) of one search, checked against the oracle."""
    index = tinyknn.Index(db.shape[1], metric=metric, dtype=dtype)
    for part in np.array_split(db, chunks):
        index.add(part)
    distances, ids = index.search(q, k)
    assert_exact(distances, ids, db, q, k, metric, dtype)
    fallbacks = index._searcher.exact_fallbacks()
    index.close()
    return distances, ids, fallbacks


def first_pass_rows() -> int:
    panels = max(library.build_param("sketch_min_panels"), library.build_param("winograd_min_panels"))
    return (panels + 40) * library.build_param("panel_rows")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("n_queries", [1, 8, 9, 100])
def test_random_normal_is_proven_without_fallbacks(rng, metric, dtype, n_queries):
    """Random data: the screen's float32 order separates the k-th neighbour from the rows it left out, so no
    query needs the exhaustive pass, on every path (sketch for <= 8 queries, Winograd for >= 16, full scan)."""
    db = rng.standard_normal((first_pass_rows(), 48)).astype(np.float32)
    q = rng.standard_normal((n_queries, 48)).astype(np.float32)
    for k in (1, 10):
        assert searched(db, q, k, metric, dtype)[2] == 0


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_faiss_near_tie_case(rng, metric):
    """FAISS's TestIndexFlat.test_with_blas_reservoir shape (1,000 x 32 standard normal, 200 queries, k = 150):
    pairs whose float64 distances differ in the 7th digit round to one float32; the order is float64's."""
    db = rng.standard_normal((1000, 32)).astype(np.float32)
    q = rng.standard_normal((200, 32)).astype(np.float32)
    _, _, fallbacks = searched(db, q, 150, metric)
    print(f"{metric}: {fallbacks} of 200 queries searched exhaustively")
    assert fallbacks <= 20


def load_integer_data():
    """scikit-learn's digits (1,797 x 64, values 0..16) where installed, else integers of the same kind."""
    try:
        from sklearn.datasets import load_digits

        return load_digits().data.astype(np.float32)
    except ImportError:
        return np.random.default_rng(7).integers(0, 17, size=(1797, 64)).astype(np.float32)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("k", [10, 50])
def test_integer_data_with_exact_ties(metric, k):
    """Every row of an integer data set searched: many float64 distances are exactly equal, and those at the
    k-th place are broken by the smaller id (more ties at the k-th place than the margin: exhaustive)."""
    db = load_integer_data()
    _, _, fallbacks = searched(db, db, k, metric)
    print(f"{metric} k={k}: {fallbacks} of {len(db)} queries searched exhaustively")
    assert fallbacks < len(db) // 2


@pytest.mark.parametrize("metric", METRICS)
def test_forty_copies_of_one_row(rng, metric):
    """40 copies of one row among random rows, k = 10: the copies tie exactly, more than the margin holds, so
    their query is searched exhaustively (counted) and answered with the 10 smallest ids of the copies."""
    db = rng.standard_normal((3000, 16)).astype(np.float32)
    copies = np.sort(rng.choice(len(db), 40, replace=False))
    # the copied row is 5x longer than a typical row, so its copies are the first query's 10 best under every
    # metric (under ip a longer random row would otherwise beat them, and then no tie reaches the k-th place)
    row = db[copies[0]]
    db[copies] = row * (20.0 / np.linalg.norm(row))
    q = np.concatenate([db[copies[:1]] + 0.01, rng.standard_normal((4, 16)).astype(np.float32)])
    _, ids, fallbacks = searched(db, q, 10, metric)
    assert np.array_equal(ids[0], copies[:10])
    assert fallbacks >= 1


@pytest.mark.parametrize("n_queries", [1, 20])
@pytest.mark.parametrize("metric", METRICS)
def test_far_from_the_origin(rng, metric, n_queries):
    """1e6 + noise: float32 l2 sees the noise only through direct differences; every metric is exact."""
    db = (1e6 + rng.standard_normal((first_pass_rows(), 32))).astype(np.float32)
    q = (1e6 + rng.standard_normal((n_queries, 32))).astype(np.float32)
    _, _, fallbacks = searched(db, q, 10, metric)
    print(f"{metric}: {fallbacks} of {n_queries} exhaustive")
    if metric == "l2":
        assert fallbacks == 0
    else:   # float32 inner products of such rows are off by more than their differences: only float64 orders them
        assert fallbacks == n_queries


@pytest.mark.parametrize("metric", METRICS)
def test_float16_pixels(rng, metric):
    """Fashion-MNIST-like float16 storage (values 0..255, 784 dims): squared distances far above 2^24, so float32
    sums round; the float64 order is kept. Half the pixels background (exact zeros)."""
    def images(count):
        ink = rng.random((count, 784)) < 0.5
        return (ink * rng.integers(215, 256, size=(count, 784))).astype(np.float32)

    db, q = images(1200), images(9)
    distances, _, fallbacks = searched(db, q, 10, metric, "float16")
    if metric == "l2":
        assert np.median(distances) > 2**24
        assert fallbacks == 0


@pytest.mark.parametrize("n_queries", [1, 100])
@pytest.mark.parametrize("metric", ["ip", "cosine"])
def test_unit_norm_embeddings(rng, metric, n_queries):
    """Normalised clustered embeddings (the usual ip/cosine use): exact, and proven for every query but those
    whose k-th neighbour ties with the rows past the margin within float32's error (a cluster can hold them)."""
    centres = rng.standard_normal((20, 96))
    db = centres[rng.integers(20, size=first_pass_rows())] + 0.3 * rng.standard_normal((first_pass_rows(), 96))
    db = (db / np.linalg.norm(db, axis=1, keepdims=True)).astype(np.float32)
    q = db[rng.integers(len(db), size=n_queries)] + 0.01 * rng.standard_normal((n_queries, 96)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
    width = 8 * 2 * (96 + 2) * 2.0**-24     # 8x the float32 sum's relative bound, on keys of magnitude <= 1
    for dtype in DTYPES:
        _, _, fallbacks = searched(db, q, 10, metric, dtype)
        near_tied = near_tied_queries(db, q, 10, metric, dtype, width)
        print(f"{metric} {dtype}: {fallbacks} exhaustive, {near_tied} of {n_queries} queries near-tied")
        assert fallbacks <= near_tied


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("k", [1, 10, 150, 2048])
def test_every_k(rng, metric, k):
    """k from 1 to 2,048, including k above the database size (padding) and k + margin above it."""
    db = rng.standard_normal((2500, 24)).astype(np.float32)
    q = rng.standard_normal((9, 24)).astype(np.float32)
    _, _, fallbacks = searched(db, q, k, metric, chunks=3)
    assert fallbacks == 0


@pytest.mark.parametrize("metric", METRICS)
def test_five_thousand_queries_on_a_small_database(rng, metric):
    db = rng.standard_normal((300, 16)).astype(np.float32)
    q = rng.standard_normal((5000, 16)).astype(np.float32)
    assert searched(db, q, 10, metric)[2] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_cosine_of_tiny_vectors(dtype):
    """Values near 1e-25 were treated as zero vectors, values near 1e-20 were 8 % off;
    the screen's query is scaled by a power of two and the norms come from float64 sums."""
    db = np.array([[-1, -2, -3, -4], [1, 2, 3, 4]], np.float32) * np.float32(1e-25)
    q = np.array([[1, 2, 3, 4]], np.float32) * np.float32(1e-25)
    if dtype == "float32":
        distances, ids, _ = searched(db, q, 2, "cosine", dtype)
        assert ids[0].tolist() == [1, 0] and distances[0, 0] == np.float32(1.0)
    distances, ids, _ = searched(np.array([[7e-23], [-3e-23]], np.float32), np.array([[5e-20]], np.float32), 2,
                                 "cosine", "float32")
    assert distances[0].tolist() == [1.0, -1.0] and ids[0].tolist() == [0, 1]


def test_cosine_rows_below_float32_norms_are_answered_exhaustively(rng):
    """Rows whose norm is below ~2^-126 have no float32 inverse norm: the index answers cosine exhaustively."""
    db = rng.standard_normal((500, 8)).astype(np.float32)
    db[7] = np.float32(1e-42)          # subnormal elements
    q = rng.standard_normal((3, 8)).astype(np.float32)
    _, _, fallbacks = searched(db, q, 5, "cosine")
    assert fallbacks == 3


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 300), dim=st.integers(1, 40), n_queries=st.integers(1, 20), k=st.integers(1, 60),
    metric=st.sampled_from(METRICS), dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([1e-30, 1e-20, 1e-3, 1.0, 1e6, 1e12]), offset=st.sampled_from([0.0, 1.0, 1e6]),
    integers=st.booleans(), duplicates=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_hypothesis_ids_equal_the_oracle(n, dim, n_queries, k, metric, dtype, scale, offset, integers, duplicates, seed):
    """Random shapes and values (tiny, huge, offset, integer-valued, duplicated rows): ids and distances exactly
    the oracle's."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-3, 4, size=(n + n_queries, dim)) if integers else rng.standard_normal((n + n_queries, dim))
    data = (values * scale + offset).astype(np.float32)
    if dtype == "float16":
        data = np.clip(data, -60000, 60000)
    db, q = data[:n], data[n:]
    if duplicates and n > 1:
        db[n // 2:] = db[: n - n // 2]
    searched(db, q, k, metric, dtype)
