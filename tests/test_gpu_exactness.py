"""The exactness contract on the GPU, and CPU = GPU bit for bit.

Each data set is searched on the GPU and compared with `reference.assert_exact` (ids and float32 distances
bit for bit those of the float64 oracle, ties by the smaller id); the same index on the CPU must return the
identical arrays. How many queries the band search answered (the verify step could not prove them) is
printed per data set, so a run's log shows how often the margin overflowed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyknn
from reference import assert_exact

pytestmark = pytest.mark.gpu


def near_tie_case(rng):
    """FAISS's test_with_blas_reservoir shape: near-ties that round to one float32 value."""
    return rng.standard_normal((1000, 32)).astype(np.float32), rng.standard_normal((200, 32)).astype(np.float32)


def digits_case(rng):
    """Integer pixel data with many exact ties (sklearn's load_digits where installed)."""
    try:
        from sklearn.datasets import load_digits

        db = load_digits().data.astype(np.float32)
    except ImportError:
        db = rng.integers(0, 17, (1797, 64)).astype(np.float32)
    return db, db.copy()


def copies_case(rng):
    """40 copies of one row among random rows, the query at that row: 40 rows tie at distance 0."""
    db = rng.standard_normal((500, 16)).astype(np.float32)
    db[100:140] = db[7]
    return db, np.repeat(db[7:8], 9, axis=0)


def far_case(rng):
    db = (1e6 + rng.standard_normal((2000, 24))).astype(np.float32)
    return db, (1e6 + rng.standard_normal((100, 24))).astype(np.float32)


def pixels_case(rng):
    """Fashion-MNIST-like float16 pixel values: squared distances above 2^24."""
    db = rng.integers(0, 256, (1500, 784)).astype(np.float16)
    return db, rng.integers(0, 256, (9, 784)).astype(np.float32)


def embeddings_case(rng):
    x = rng.standard_normal((3000, 96))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.choice(3000, 100)] + rng.standard_normal((100, 96)) * 0.05
    return x.astype(np.float32), (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


CASES = {
    "normal": (lambda rng: (rng.standard_normal((3000, 40)).astype(np.float32),
                            rng.standard_normal((100, 40)).astype(np.float32)), ("l2", "ip", "cosine"), "float32"),
    "near_ties": (near_tie_case, ("l2",), "float32"),
    "digits": (digits_case, ("l2", "ip", "cosine"), "float32"),
    "copies": (copies_case, ("l2", "ip", "cosine"), "float32"),
    "far": (far_case, ("l2",), "float32"),
    "pixels": (pixels_case, ("l2",), "float16"),
    "embeddings": (embeddings_case, ("ip", "cosine"), "float32"),
}


def search_both(db, q, k, metric, dtype):
    """(GPU answer, CPU answer, band-searched queries on the GPU)."""
    with tinyknn.Index(db.shape[1], metric, dtype, device="cuda") as gpu, \
            tinyknn.Index(db.shape[1], metric, dtype, device="cpu") as cpu:
        gpu.add(db)
        cpu.add(db)
        return gpu.search(q, k), cpu.search(q, k), gpu._searcher.exact_reruns


@pytest.mark.parametrize("case", sorted(CASES))
def test_data_sets_are_exact_and_identical_on_both_devices(case, rng):
    make, metrics, dtype = CASES[case]
    db, q = make(rng)
    for metric in metrics:
        for k in (1, 10, 150):
            (gd, gi), (cd, ci), band = search_both(db, q, k, metric, dtype)
            print(f"{case} {metric} k={k}: {band} of {len(q)} queries answered by the band search")
            assert_exact(gd, gi, db, q, k, metric, dtype)
            np.testing.assert_array_equal(gi, ci)
            np.testing.assert_array_equal(gd.view(np.uint32), cd.view(np.uint32))


def test_copies_go_through_the_band_search(rng):
    """Ties beyond the margin cannot be proven by the verify step: counted, and still exact."""
    db, q = copies_case(rng)
    (gd, gi), _, band = search_both(db, q, 10, "l2", "float32")
    assert band == len(q)
    assert_exact(gd, gi, db, q, 10, "l2")
    np.testing.assert_array_equal(gi[0], np.r_[7, np.arange(100, 109)])   # the smallest ids of the 41 tied rows


@pytest.mark.parametrize("n_queries", [1, 8, 9, 100, 5000])
@pytest.mark.parametrize("k", [1, 10, 150, 2048])
def test_every_batch_size_and_k(n_queries, k, rng):
    n = 2500 if k == 2048 else 1200
    db = rng.standard_normal((n, 20)).astype(np.float32)
    q = rng.standard_normal((n_queries, 20)).astype(np.float32)
    if n_queries == 5000:
        q = q[:5000:1] if k <= 10 else q[:600]      # the oracle's cost grows with nq x n x k
    for metric in ("l2", "cosine"):
        with tinyknn.Index(20, metric, "float32", device="cuda") as index:
            index.add(db)
            d, i = index.search(q, k)
        assert_exact(d, i, db, q, k, metric)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 400), dim=st.integers(1, 40), nq=st.integers(1, 40),
       k=st.integers(1, 60), metric=st.sampled_from(["l2", "ip", "cosine"]),
       dtype=st.sampled_from(["float32", "float16"]), levels=st.sampled_from([0, 3, 1000]))
def test_property_exact_on_both_devices(seed, n, dim, nq, k, metric, dtype, levels):
    """Random shapes; levels > 0 draws integer coordinates from a few values, so exact ties abound."""
    rng = np.random.default_rng(seed)
    if levels:
        db = rng.integers(-levels, levels + 1, (n, dim)).astype(np.float32)
        q = rng.integers(-levels, levels + 1, (nq, dim)).astype(np.float32)
    else:
        db = rng.standard_normal((n, dim)).astype(np.float32)
        q = rng.standard_normal((nq, dim)).astype(np.float32)
    (gd, gi), (cd, ci), _ = search_both(db, q, k, metric, dtype)
    assert_exact(gd, gi, db, q, k, metric, dtype)
    np.testing.assert_array_equal(gi, ci)
    np.testing.assert_array_equal(gd.view(np.uint32), cd.view(np.uint32))


def test_tiny_cosine_vectors(rng):
    """Values ~1e-25 and ~1e-20 are not zero vectors (float64: similarity 1)."""
    db = np.array([[-1, -2, -3, -4], [1, 2, 3, 4]], np.float32) * np.float32(1e-25)
    q = np.array([[1, 2, 3, 4]], np.float32) * np.float32(1e-25)
    with tinyknn.Index(4, "cosine", device="cuda") as index:
        index.add(db)
        d, i = index.search(q, 2)
    assert_exact(d, i, db, q, 2, "cosine")
    assert i[0, 0] == 1 and d[0, 0] == np.float32(1.0)
    db1, q1 = np.array([[7e-23]], np.float32), np.array([[5e-20]], np.float32)
    with tinyknn.Index(1, "cosine", device="cuda") as index:
        index.add(db1)
        d, i = index.search(q1, 1)
    assert d[0, 0] == np.float32(1.0)
