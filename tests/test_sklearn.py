"""tinyknn.sklearn.NearestNeighbors against scikit-learn's brute-force estimator, and scikit-learn's own
estimator checks.

Operations that need the index-operations issue's Index API (get for X=None, range_search for the radius
methods) run on two backends (adapter_index_model.backend_fixture): the real tinyknn.Index, skipped
naming what it lacks, and the model of those operations.
"""

from __future__ import annotations

import copy
import pickle
import re

import numpy as np
import pytest

sklearn = pytest.importorskip("sklearn", reason="scikit-learn (the test extra) is not installed")
from adapter_index_model import backend_fixture  # noqa: E402
from sklearn.neighbors import NearestNeighbors as SkNearestNeighbors  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from tinyknn.sklearn import NearestNeighbors  # noqa: E402

backend = backend_fixture("tinyknn.sklearn")
METRICS = ["euclidean", "l2", "sqeuclidean", "cosine"]


def data(rng, n=200, nq=9, d=10):
    # float32 values, so scikit-learn (float64) and tinyknn (float32 storage) see the same points
    return (rng.standard_normal((n, d)).astype(np.float32).astype(np.float64),
            rng.standard_normal((nq, d)).astype(np.float32).astype(np.float64))


def ties_by_id(D, I):
    """Each row reordered by (distance to 5 decimals, id): scikit-learn orders exact ties arbitrarily."""
    order = np.lexsort((I, np.round(D, 5)), axis=-1)
    return np.take_along_axis(D, order, -1), np.take_along_axis(I, order, -1)


def assert_same_neighbours(got, want):
    (D, I), (D_ref, I_ref) = ties_by_id(*got), ties_by_id(*want)
    assert np.array_equal(I, I_ref) and I.dtype == np.int64
    np.testing.assert_allclose(D, D_ref, rtol=2e-5, atol=2e-6)


def reference(metric, **params):
    return SkNearestNeighbors(algorithm="brute", metric=metric, **params)


@pytest.mark.parametrize("metric", METRICS)
def test_kneighbors_equals_scikit_learn(rng, metric):
    X, Q = data(rng)
    ours, theirs = NearestNeighbors(n_neighbors=6, metric=metric).fit(X), reference(metric, n_neighbors=6).fit(X)
    assert_same_neighbours(ours.kneighbors(Q), theirs.kneighbors(Q))
    assert np.array_equal(ours.kneighbors(Q, n_neighbors=3, return_distance=False),
                          theirs.kneighbors(Q, n_neighbors=3, return_distance=False))
    for mode in ("connectivity", "distance"):
        graph, graph_ref = ours.kneighbors_graph(Q, mode=mode), theirs.kneighbors_graph(Q, mode=mode)
        assert graph.shape == graph_ref.shape == (9, 200)
        np.testing.assert_allclose(graph.toarray(), graph_ref.toarray(), rtol=2e-5, atol=2e-6)
    assert ours.n_features_in_ == 10 and ours.n_samples_fit_ == 200


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_kneighbors_of_the_training_points_excludes_each_itself(rng, backend, metric):
    backend("get")
    X, _ = data(rng, n=60)
    ours, theirs = NearestNeighbors(n_neighbors=4, metric=metric).fit(X), reference(metric, n_neighbors=4).fit(X)
    assert_same_neighbours(ours.kneighbors(), theirs.kneighbors())
    np.testing.assert_allclose(ours.kneighbors_graph(mode="distance").toarray(),
                               theirs.kneighbors_graph(mode="distance").toarray(), rtol=2e-5, atol=1e-6)
    X[7] = X[3]   # a duplicate: each copy is the other's nearest neighbour, at distance 0
    D, I = NearestNeighbors(n_neighbors=4, metric=metric).fit(X).kneighbors()
    assert I[3, 0] == 7 and I[7, 0] == 3 and 0 <= D[3, 0] < 1e-6 and 0 <= D[7, 0] < 1e-6
    assert not np.any(I == np.arange(60)[:, None])


@pytest.mark.parametrize("metric", METRICS)
def test_radius_neighbors_equals_scikit_learn(rng, backend, metric):
    backend("range_search")
    X, Q = data(rng)
    radius = {"euclidean": 3.5, "l2": 3.5, "sqeuclidean": 12.0, "cosine": 0.6}[metric]
    ours, theirs = NearestNeighbors(radius=radius, metric=metric).fit(X), reference(metric, radius=radius).fit(X)
    D, I = ours.radius_neighbors(Q)
    D_ref, I_ref = theirs.radius_neighbors(Q, sort_results=True)
    assert len(I) == len(I_ref) == 9 and sum(len(i) for i in I) > 20
    for got_d, got_i, want_d, want_i in zip(D, I, D_ref, I_ref):
        assert np.array_equal(got_i, want_i)
        np.testing.assert_allclose(got_d, want_d, rtol=2e-5, atol=2e-6)
    for mode in ("connectivity", "distance"):
        np.testing.assert_allclose(ours.radius_neighbors_graph(Q, mode=mode).toarray(),
                                   theirs.radius_neighbors_graph(Q, mode=mode).toarray(), rtol=2e-5, atol=2e-6)
    smaller = ours.radius_neighbors(Q, radius=radius / 2, return_distance=False)
    assert all(set(s) <= set(i) for s, i in zip(smaller, I))


def test_radius_includes_points_at_exactly_the_radius(backend):
    backend("range_search")
    X = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])
    I = NearestNeighbors(radius=5.0).fit(X).radius_neighbors([[0.0, 0.0]], return_distance=False)
    assert sorted(I[0].tolist()) == [0, 1]   # |(3, 4)| = 5 exactly, as scikit-learn's distance <= radius


def test_radius_neighbors_of_the_training_points(rng, backend):
    backend("range_search", "get")
    X, _ = data(rng, n=80)
    ours, theirs = NearestNeighbors(radius=3.0).fit(X), reference("euclidean", radius=3.0).fit(X)
    I = ours.radius_neighbors(return_distance=False)
    I_ref = theirs.radius_neighbors(return_distance=False)
    assert all(set(a) == set(b) and q not in set(a) for q, (a, b) in enumerate(zip(I, I_ref)))


def test_bad_parameters_and_inputs_are_refused(rng):
    X, Q = data(rng, n=20)
    with pytest.raises(ValueError, match="metric must be one of"):
        NearestNeighbors(metric="manhattan").fit(X)
    fitted = NearestNeighbors(n_neighbors=3).fit(X)
    with pytest.raises(ValueError, match="n_neighbors <= n_samples_fit"):
        fitted.kneighbors(Q, n_neighbors=21)
    with pytest.raises(ValueError, match="n_neighbors must be a positive integer"):
        fitted.kneighbors(Q, n_neighbors=0)
    with pytest.raises(ValueError, match="features"):
        fitted.kneighbors(Q[:, :4])
    with pytest.raises(ValueError, match="Unsupported mode"):
        fitted.kneighbors_graph(Q, mode="weights")
    with pytest.raises(ValueError, match="sort_results"):
        fitted.radius_neighbors(Q, return_distance=False, sort_results=True)
    with pytest.raises(ValueError, match="radius must be a finite number"):
        fitted.radius_neighbors(Q, radius=-1.0)
    with pytest.raises(sklearn.exceptions.NotFittedError):
        NearestNeighbors().kneighbors(Q)


@pytest.mark.parametrize("value", [1e39, -3.5e38])
def test_finite_float64_beyond_float32_is_refused_as_such(rng, value):
    """fit and kneighbors used to cast to float32 first, so a finite 1e39 was refused as "infinity"."""
    with pytest.raises(ValueError, match=re.escape(f"holds {value!r} at row 0, column 0, beyond float32's range")):
        NearestNeighbors().fit(np.full((3, 2), value))
    fitted = NearestNeighbors(n_neighbors=2).fit(rng.standard_normal((5, 2)))
    queries = np.zeros((2, 2))
    queries[1, 1] = value
    with pytest.raises(ValueError, match=re.escape(f"holds {value!r} at row 1, column 1, beyond float32's range")):
        fitted.kneighbors(queries)
    with pytest.raises(ValueError, match="beyond float32's range"):
        fitted.radius_neighbors(queries, radius=1.0)


def test_pickle_and_deepcopy_keep_the_fitted_index(rng):
    X, Q = data(rng)
    fitted = NearestNeighbors(n_neighbors=4, metric="cosine").fit(X)
    expected = fitted.kneighbors(Q)
    for restored in (pickle.loads(pickle.dumps(fitted)), copy.deepcopy(fitted)):
        assert restored.get_params() == fitted.get_params() and restored._index is not fitted._index
        got = restored.kneighbors(Q)
        assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])


@pytest.mark.gpu
def test_cuda_answers_as_the_cpu(rng):
    X, Q = data(rng)
    cpu = NearestNeighbors(n_neighbors=5).fit(X).kneighbors(Q)
    gpu = NearestNeighbors(n_neighbors=5, device="cuda").fit(X).kneighbors(Q)
    assert np.array_equal(cpu[1], gpu[1]) and np.array_equal(cpu[0], gpu[0])


@parametrize_with_checks([NearestNeighbors(), NearestNeighbors(metric="cosine", n_neighbors=2)])
def test_scikit_learn_estimator_checks(estimator, check):
    check(estimator)
