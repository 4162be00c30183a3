"""Recall of a k-NN result against ground truth, under the rules the benchmarks use and tinyknn's exact one.

| rule | a returned id counts when | needs |
| --- | --- | --- |
| `ids` | it is among the ground truth's first k ids | ids |
| `bigann` | it is among the ids of the ground truth's first k *groups* of distances, a group being a run of distances each within 1e-6 of the run's first (big-ann-benchmarks `get_recall_values`, count_ties=True) | GT distances |
| `ann-benchmarks` | its distance is <= the k-th GT distance + 1e-3 (ann-benchmarks' "k-nn" recall, `knn_threshold`, additive epsilon; ann-benchmarks recomputes the distance of each returned id) | distances of the returned ids |
| `ann-benchmarks-epsilon` | its distance is <= (1 + 0.01) x the k-th GT distance (ann-benchmarks' "epsilon" recall) | same |
| `exact` | its float64 contract distance is no worse than the float64 distance of the GT's k-th id (ties count) | base, queries, metric |

Each query's recall is what counts divided by k (by the number of real GT ids when the GT holds fewer,
e.g. k > n), and the mean over queries is returned (per_query=True: the array). The first k returned ids
are scored; -1 (no neighbour) never counts. `ids`, `bigann` and `exact` count a repeated id once;
`ann-benchmarks` counts each returned distance, repeats included, as its code does.

Two faithful quirks: big-ann's groups are counted in distances, not in positions, so with ties inside the
first k its window reaches past the k-th GT neighbour (GT distances 1, 1, 2 and k = 2: ids at distance 2
count too); ann-benchmarks' epsilon is absolute, so on data of tiny distances every id can count.
For similarity conventions (inner product, cosine similarity) the ann-benchmarks thresholds are mirrored
(>= the k-th similarity - epsilon).
"""

from __future__ import annotations

import os

import numpy as np

from .. import io as tio
from . import conventions

RULES = ("exact", "ids", "bigann", "ann-benchmarks", "ann-benchmarks-epsilon")
BIGANN_TIE = 1e-6
ANN_BENCHMARKS_EPSILON = {"ann-benchmarks": 1e-3, "ann-benchmarks-epsilon": 0.01}


def load_groundtruth(gt, k: int | None = None) -> tio.KnnGroundTruth:
    """A KnnGroundTruth from one, a path (format guessed by name), an (ids, distances) pair (or (distances,
    ids), as groundtruth() returns: the integer array is the ids) or ids alone."""
    if isinstance(gt, tio.KnnGroundTruth):
        return gt
    if isinstance(gt, (str, os.PathLike)):
        return tio.read_knn_groundtruth(gt)
    if isinstance(gt, tuple) and len(gt) == 2:
        ids, distances = (np.asarray(a) if a is not None else None for a in gt)
        if distances is not None and ids.dtype.kind == "f" and distances.dtype.kind in "iu":
            ids, distances = distances, ids              # (distances, ids), as groundtruth() and search() return
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ground-truth ids must be integers; got dtype {ids.dtype} (pass (ids, distances) "
                            "or (distances, ids))")
        return tio.KnnGroundTruth(ids.astype(np.int64), None if distances is None else
                                  distances.astype(np.float32), "arrays")
    return tio.KnnGroundTruth(np.asarray(gt, dtype=np.int64), None, "arrays")


def _as_rows(values, what: str) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim != 2:
        raise ValueError(f"{what} must be 2-D (n_queries, k); got shape {values.shape}")
    return values


def _metric_of(truth: tio.KnnGroundTruth, metric: str | None) -> str | None:
    if metric is not None:
        return metric
    if truth.distance is not None:
        return conventions.metric_of_hdf5(truth.distance, truth.paths[0] if truth.paths else "")
    return None


def convention_of(truth: tio.KnnGroundTruth, metric: str | None, convention: str | None = None) -> str | None:
    """The convention of the GT's distances: given, else its format's for the metric."""
    if convention is not None:
        if convention not in conventions.CONVENTIONS:
            raise ValueError(f"convention must be one of {', '.join(conventions.CONVENTIONS)}; got {convention!r}")
        return convention
    if metric is None:
        return None
    return conventions.convention(truth.format, metric)


def _unique_valid(row: np.ndarray) -> np.ndarray:
    row = row[row >= 0]
    return np.unique(row)


def _bigann_sets(gt_ids: np.ndarray, gt_d: np.ndarray, k: int) -> list[np.ndarray]:
    """Per query, the GT ids of the first k groups of distances (big-ann's chaining rule)."""
    nq, width = gt_d.shape
    group = np.zeros((nq, width), dtype=np.int64)
    anchor = gt_d[:, 0].astype(np.float64) if width else np.zeros(nq)
    for j in range(1, width):
        d = gt_d[:, j].astype(np.float64)
        merged = np.abs(d - anchor) < BIGANN_TIE
        group[:, j] = group[:, j - 1] + (~merged)
        anchor = np.where(merged, anchor, d)
    return [gt_ids[q][(group[q] < k) & (gt_ids[q] >= 0)] for q in range(nq)]


def recall(result_ids, gt, k: int = 10, rule: str = "exact", *, base=None, queries=None, metric: str | None = None,
           result_distances=None, epsilon: float | None = None, convention: str | None = None,
           per_query: bool = False, dtype=None):
    """Recall@k of `result_ids` (n_queries, >= k) against `gt` under `rule` (see the module's table).

    gt: a KnnGroundTruth, a path to a ground-truth file, an (ids, distances) or (distances, ids) pair (what
    groundtruth() returns; the integer array is the ids) or ids alone.
    base, queries (arrays or vector files) and metric: needed by `exact`, and by the ann-benchmarks rules to
    compute the returned ids' distances when `result_distances` (in the GT's convention) is not given.
    convention: of the GT's distances (default: its format's for `metric`; tinyknn's own for arrays).
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer; got {k!r}")
    truth = load_groundtruth(gt)
    result = _as_rows(result_ids, "result ids").astype(np.int64)
    gt_ids = _as_rows(truth.ids, "ground-truth ids")
    if result.shape[0] != gt_ids.shape[0]:
        raise ValueError(f"{result.shape[0]:,} result rows but the ground truth holds {gt_ids.shape[0]:,} queries")
    if result.shape[1] < k or gt_ids.shape[1] < k:
        raise ValueError(f"recall@{k} needs k columns; the result has {result.shape[1]} and the ground truth "
                         f"{gt_ids.shape[1]}")
    result, metric = result[:, :k], _metric_of(truth, metric)
    denominators = np.maximum(1, np.count_nonzero(gt_ids[:, :k] >= 0, axis=1))
    if rule == "ids":
        counts = np.array([len(np.intersect1d(_unique_valid(r), g[g >= 0])) for r, g in zip(result, gt_ids[:, :k])])
    elif rule == "bigann":
        if truth.distances is None:
            raise ValueError("the bigann rule needs the ground truth's distances; this ground truth has none")
        sets = _bigann_sets(gt_ids, truth.distances, k)
        counts = np.array([len(np.intersect1d(_unique_valid(r), s)) for r, s in zip(result, sets)])
    elif rule == "exact":
        if metric is None:
            raise ValueError("the exact rule needs the metric (l2, ip or cosine)")
        counts = exact_counts(result, gt_ids, k, metric, lambda ids: _distances_of(ids, base, queries, metric, dtype))
    else:
        counts = _ann_benchmarks_counts(result, truth, k, rule, base, queries, metric, result_distances, epsilon,
                                        convention, dtype)
    values = counts / denominators
    return values if per_query else float(values.mean()) if len(values) else float("nan")


def pair_distances(run, ids: np.ndarray) -> np.ndarray:
    """float64 contract distances of every (query i, ids[i, j]) on an open exact.Exact; NaN where the id is
    -1 or outside the base."""
    valid = (ids >= 0) & (ids < run.n)
    out = np.full(ids.shape, np.nan)
    rows = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)[valid]
    out[valid] = run.exact(run.queries[rows], ids[valid])
    return out


def _distances_of(ids: np.ndarray, base, queries, metric: str, dtype=None) -> np.ndarray:
    """pair_distances of ids on base and queries given as arrays or files."""
    from .exact import Exact, storage_dtype
    from .inputs import open_pair

    if base is None or queries is None or metric is None:
        raise ValueError("this rule needs base, queries and metric to compute float64 distances of the ids")
    base_source, query_source = open_pair(base, queries)
    try:
        if query_source.shape[0] < ids.shape[0]:
            raise ValueError(f"{ids.shape[0]:,} result rows but only {query_source.shape[0]:,} queries")
        run = Exact(base_source, query_source.rows(0, ids.shape[0]), base_source.shape[0], metric,
                   storage_dtype(base_source, dtype))
        return pair_distances(run, ids)
    finally:
        base_source.close()
        query_source.close()


def exact_counts(result: np.ndarray, gt_ids: np.ndarray, k: int, metric: str, distances_of) -> np.ndarray:
    """Per query, how many distinct returned ids are no worse in float64 than the GT's k-th id (ties count);
    distances_of(ids (nq, w)) gives their float64 distances (NaN: no such row)."""
    larger = conventions.LARGER_IS_BETTER[metric]
    gt_valid = gt_ids[:, :k] >= 0
    last = np.where(gt_valid.any(axis=1), gt_valid.sum(axis=1) - 1, 0)
    kth_ids = gt_ids[np.arange(len(gt_ids)), last][:, None]
    both = distances_of(np.concatenate([kth_ids, result], axis=1))
    threshold, got = both[:, :1], both[:, 1:]
    first = np.zeros(result.shape, dtype=bool)              # count each id once per query
    order = np.argsort(result, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(result, order, axis=1)
    new = np.concatenate([np.ones((len(result), 1), dtype=bool), sorted_ids[:, 1:] != sorted_ids[:, :-1]], axis=1)
    np.put_along_axis(first, order, new, axis=1)
    with np.errstate(invalid="ignore"):
        good = (got >= threshold) if larger else (got <= threshold)
    good &= first & (result >= 0) & ~np.isnan(got)
    counts = good.sum(axis=1)
    counts[~gt_valid.any(axis=1)] = 0
    return counts


def _ann_benchmarks_counts(result, truth, k, rule, base, queries, metric, result_distances, epsilon, convention,
                           dtype) -> np.ndarray:
    if truth.distances is None:
        raise ValueError(f"the {rule} rule needs the ground truth's distances; this ground truth has none")
    name = convention_of(truth, metric, convention) or "squared_l2"
    if result_distances is None:
        d64 = _distances_of(result, base, queries, metric, dtype)
        got = np.where(np.isnan(d64), np.nan, conventions.from_contract(np.nan_to_num(d64), metric, name))
    else:
        got = _as_rows(result_distances, "result distances")[:, :k].astype(np.float64)
        got = np.where(result >= 0, got, np.nan)
    eps = ANN_BENCHMARKS_EPSILON[rule] if epsilon is None else float(epsilon)
    gt_d = truth.distances.astype(np.float64)
    gt_valid = truth.ids[:, :k] >= 0
    last = np.where(gt_valid.any(axis=1), gt_valid.sum(axis=1) - 1, 0)
    kth = gt_d[np.arange(len(gt_d)), last][:, None]
    larger = conventions.larger_is_better(name)
    if rule == "ann-benchmarks":
        threshold = kth - eps if larger else kth + eps
    else:
        threshold = kth * (1 - eps) if larger else kth * (1 + eps)
    with np.errstate(invalid="ignore"):
        good = (got >= threshold) if larger else (got <= threshold)
    return (good & ~np.isnan(got)).sum(axis=1)
