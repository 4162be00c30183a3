"""`tinyknn.sklearn.NearestNeighbors`: scikit-learn's unsupervised neighbours estimator over tinyknn.Index.

It answers as `sklearn.neighbors.NearestNeighbors(algorithm="brute")` does: `euclidean` (alias `l2`)
distances are Euclidean, not squared; `sqeuclidean` squared; `cosine` is 1 - cosine similarity; radius
queries include points at exactly `radius`; without X, each training point's neighbours exclude itself.
The search itself is tinyknn's exact search in float32 (the data are stored as float32), on
`device="cpu"` or `"cuda"`. Needs scikit-learn (`pip install "tinyknn[sklearn]"`).
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted, validate_data

from .index import Index

__all__ = ["NearestNeighbors"]

_INDEX_METRIC = {"euclidean": "l2", "l2": "l2", "sqeuclidean": "l2", "cosine": "cosine"}


class NearestNeighbors(BaseEstimator):
    """Exact nearest neighbours; metric in 'euclidean' | 'l2' | 'sqeuclidean' | 'cosine'."""

    def __init__(self, n_neighbors: int = 5, radius: float = 1.0, metric: str = "euclidean", device: str = "cpu"):
        self.n_neighbors = n_neighbors
        self.radius = radius
        self.metric = metric
        self.device = device

    # -- fitting -------------------------------------------------------------------------------
    def fit(self, X, y=None) -> "NearestNeighbors":
        """Store X (n_samples, n_features) in a tinyknn.Index; y is ignored."""
        if self.metric not in _INDEX_METRIC:
            raise ValueError(f"metric must be one of {sorted(_INDEX_METRIC)}; got {self.metric!r}")
        X = validate_data(self, X, dtype=[np.float64, np.float32])
        index = Index(dim=X.shape[1], metric=_INDEX_METRIC[self.metric], dtype="float32", device=self.device)
        index.add(X)   # float64 as it is: the Index converts it, and refuses what float32 cannot hold by name
        self._index = index
        self.n_samples_fit_ = X.shape[0]
        self.effective_metric_ = "euclidean" if self.metric == "l2" else self.metric
        return self

    def _queries(self, X):
        """(the queries (float32 or float64), whether they are the training points themselves)."""
        check_is_fitted(self)
        if X is None:
            return None, True
        X = validate_data(self, X, dtype=[np.float64, np.float32], reset=False)
        return X, False

    def _to_sklearn_distance(self, values: np.ndarray, dtype) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if self.effective_metric_ == "euclidean":
            values = np.sqrt(np.maximum(values, 0.0))
        elif self.effective_metric_ == "cosine":
            values = np.clip(1.0 - values, 0.0, 2.0)   # as scikit-learn's cosine_distances: never below 0
        return values.astype(dtype, copy=False)

    # -- k nearest -----------------------------------------------------------------------------
    def kneighbors(self, X=None, n_neighbors=None, return_distance: bool = True):
        """(distances, indices), each (n_queries, n_neighbors), nearest first; indices are rows of the fitted X."""
        X, itself = self._queries(X)
        k = self.n_neighbors if n_neighbors is None else n_neighbors
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
            raise ValueError(f"n_neighbors must be a positive integer; got {k!r}")
        limit = self.n_samples_fit_ - 1 if itself else self.n_samples_fit_
        if k > limit:
            raise ValueError(f"Expected n_neighbors <= n_samples_fit{' - 1 (X=None: a point is not its own neighbour)' if itself else ''}, "
                             f"but n_neighbors = {k}, n_samples_fit = {self.n_samples_fit_}")
        queries = self._training_points() if itself else X
        distances, ids = self._index.search(queries, int(k) + int(itself))
        ids = np.asarray(ids, dtype=np.int64)
        distances = np.asarray(distances)
        if itself:
            distances, ids = _drop_self(distances, ids)
        if not return_distance:
            return ids
        return self._to_sklearn_distance(distances, _result_dtype(X)), ids

    def kneighbors_graph(self, X=None, n_neighbors=None, mode: str = "connectivity"):
        """Sparse (n_queries, n_samples_fit) graph: 1 per neighbour ('connectivity') or its distance ('distance')."""
        _check_mode(mode)
        distances, ids = self.kneighbors(X, n_neighbors, return_distance=True)
        n_queries, k = ids.shape
        values = np.ones(ids.size) if mode == "connectivity" else distances.ravel()
        return csr_matrix((values, ids.ravel(), np.arange(0, n_queries * k + 1, k)),
                          shape=(n_queries, self.n_samples_fit_))

    # -- within a radius -----------------------------------------------------------------------
    def radius_neighbors(self, X=None, radius=None, return_distance: bool = True, sort_results: bool = False):
        """Per query, the rows within `radius` (inclusive), as object arrays of arrays (scikit-learn's layout);
        nearest first always, so sort_results only adds scikit-learn's check."""
        if sort_results and not return_distance:
            raise ValueError("return_distance must be True if sort_results is True.")
        X, itself = self._queries(X)
        radius = float(self.radius if radius is None else radius)
        if not np.isfinite(radius) or radius < 0:
            raise ValueError(f"radius must be a finite number >= 0; got {radius!r}")
        queries = self._training_points() if itself else X
        lims, distances, ids = self._index.range_search(queries, self._index_radius(radius))
        lims = np.asarray(lims, dtype=np.int64)
        all_d = self._to_sklearn_distance(distances, _result_dtype(X))
        all_i = np.asarray(ids, dtype=np.int64)
        out_d = np.empty(len(lims) - 1, dtype=object)
        out_i = np.empty(len(lims) - 1, dtype=object)
        for q in range(len(lims) - 1):
            d, i = all_d[lims[q]:lims[q + 1]], all_i[lims[q]:lims[q + 1]]
            keep = i != q if itself else slice(None)
            out_d[q], out_i[q] = d[keep], i[keep]
        return (out_d, out_i) if return_distance else out_i

    def radius_neighbors_graph(self, X=None, radius=None, mode: str = "connectivity", sort_results: bool = False):
        """Sparse (n_queries, n_samples_fit) graph of the rows within `radius`."""
        _check_mode(mode)
        distances, ids = self.radius_neighbors(X, radius, return_distance=True, sort_results=sort_results)
        counts = np.array([len(i) for i in ids], dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(counts)])
        flat_i = np.concatenate(list(ids)) if len(ids) else np.empty(0, np.int64)
        values = np.ones(len(flat_i)) if mode == "connectivity" else \
            (np.concatenate(list(distances)) if len(distances) else np.empty(0))
        return csr_matrix((values, flat_i, indptr), shape=(len(ids), self.n_samples_fit_))

    def _index_radius(self, radius: float) -> float:
        """scikit-learn's `distance <= radius` as the Index's strict comparison (l2: <, cosine: similarity >)."""
        if self.effective_metric_ == "euclidean":
            return float(np.nextafter(radius * radius, np.inf))
        if self.effective_metric_ == "sqeuclidean":
            return float(np.nextafter(radius, np.inf))
        return float(np.nextafter(1.0 - radius, -np.inf))

    def _training_points(self) -> np.ndarray:
        return np.asarray(self._index.get(np.arange(self.n_samples_fit_, dtype=np.int64)))


def _drop_self(distances: np.ndarray, ids: np.ndarray):
    """Remove each training point from its own k + 1 neighbours (scikit-learn: where a duplicate hides it,
    the first column goes instead)."""
    n, width = ids.shape
    keep = ids != np.arange(n)[:, None]
    missing_self = keep.all(axis=1)
    keep[missing_self, 0] = False
    return distances[keep].reshape(n, width - 1), ids[keep].reshape(n, width - 1)


def _result_dtype(X):
    return np.float32 if X is not None and X.dtype == np.float32 else np.float64


def _check_mode(mode: str) -> None:
    if mode not in ("connectivity", "distance"):
        raise ValueError(f'Unsupported mode, must be one of "connectivity", "distance" but got "{mode}" instead')
