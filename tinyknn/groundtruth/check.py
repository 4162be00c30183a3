"""Compare a k-NN result or a published ground truth with an exact one, entry by entry, and say why they differ.

Each position j < k where the candidate's id c differs from the exact ground truth's id r is one of:
- **tie**: c and r have the same float64 distance to the query: the same answer, another order among
  equal distances (tinyknn breaks ties by the smaller id; others by whatever their sort did);
- **float32 misordering**: their float64 distances differ, but by no more than a float32 computation of
  the two distances can err (the bound below): what a float32 brute force (FAISS, cuVS, NumPy float32)
  produces near ties; `float32_equal` counts those whose exact distances even round to the same float32;
- **error**: a difference no float32 arithmetic explains, a repeated id, -1 or an id outside the base.

The bound: a float32 distance summed over d dimensions in any order (directly or by the norm expansion
|q|^2 + |x|^2 - 2 q.x) errs by at most gamma = (d + 2) * 2**-24 (first order) times the sum of the absolute
terms: (|q| + |x|)^2 for l2, |q| |x| for ip, 2 for cosine. A pair counts as misordered when the distances
differ by no more than twice the two pairs' bounds added. The bound is a worst case: a misordering is
what a float32 computation *may* produce, so in an approximate index's result an id a little farther than
the true one (by less than the bound) is counted as one too. The candidate's own distances, when it has
them, are compared with the exact ones in its format's convention (float32 of the float64 value).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import conventions
from .exact import Exact, storage_dtype
from .inputs import open_pair
from .recall import convention_of, exact_counts, load_groundtruth, pair_distances, recall

EXAMPLES = 5


@dataclasses.dataclass
class Comparison:
    queries: int
    k: int
    entries: int
    differ: int = 0
    queries_differing: int = 0
    ties: int = 0
    float32_misorderings: int = 0
    float32_equal: int = 0
    errors: int = 0
    duplicates: int = 0
    invalid_ids: int = 0
    distances_checked: int = 0
    distances_differing: int = 0
    max_distance_relative_error: float = 0.0
    recall: dict = dataclasses.field(default_factory=dict)
    examples: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def report(self) -> str:
        lines = [f"{self.queries:,} queries x k = {self.k}: {self.entries:,} entries compared",
                 f"differ from the exact ground truth: {self.differ:,} entries in {self.queries_differing:,} queries"]
        if self.differ:
            lines += [f"  ties (equal float64 distance, another id order): {self.ties:,}",
                      f"  float32 misorderings (distinct in float64, within float32 rounding): "
                      f"{self.float32_misorderings:,} (of which {self.float32_equal:,} round to the same "
                      "float32)",
                      f"  real errors: {self.errors:,} (repeated ids {self.duplicates:,}, -1 or unknown ids "
                      f"{self.invalid_ids:,})"]
        if self.distances_checked:
            lines.append(f"distances: {self.distances_differing:,} of {self.distances_checked:,} differ from the "
                         f"float64 value rounded to float32 (largest relative difference "
                         f"{self.max_distance_relative_error:.3g})")
        if self.recall:
            shown = ", ".join(f"{rule} {value:.6f}" for rule, value in self.recall.items())
            lines.append(f"recall@k of the candidate: {shown}")
        for example in self.examples:
            lines.append(f"  e.g. query {example['query']}, position {example['position']}: {example['kind']}: "
                         f"id {example['candidate_id']} (float64 {example['candidate_distance']!r}) where the exact "
                         f"answer has id {example['exact_id']} (float64 {example['exact_distance']!r})")
        return "\n".join(lines)


def _bounds(run: Exact, query_rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The float32 error bound of each (query, id) pair's distance (see the module docstring)."""
    q = run.queries[query_rows].astype(np.float64)
    x = run.stored_rows(ids).astype(np.float64)
    gamma = (q.shape[1] + 2) * 2.0 ** -24
    qn, xn = np.linalg.norm(q, axis=1), np.linalg.norm(x, axis=1)
    if run.metric == "l2":
        return gamma * (qn + xn) ** 2
    if run.metric == "ip":
        return gamma * qn * xn
    return np.full(len(ids), gamma * 2.0)


def compare(candidate, exact, base, queries, k: int | None = None, metric: str | None = None, *,
            candidate_convention: str | None = None, dtype=None) -> Comparison:
    """Classify how `candidate` (a result or a ground truth: KnnGroundTruth, path, (ids, distances) or ids)
    differs from `exact` (tinyknn's ground truth of the same queries, in any of those forms) on base/queries
    (arrays or vector files). metric: default from an HDF5 file's `distance` attribute."""
    cand, truth = load_groundtruth(candidate), load_groundtruth(exact)
    metric = metric or (conventions.metric_of_hdf5(truth.distance) if truth.distance else None) or \
        (conventions.metric_of_hdf5(cand.distance) if cand.distance else None)
    if metric is None:
        raise ValueError("compare needs the metric (l2, ip or cosine): neither file says it")
    k = min(cand.ids.shape[1], truth.ids.shape[1]) if k is None else int(k)
    nq = cand.ids.shape[0]
    if truth.ids.shape[0] != nq or cand.ids.shape[1] < k or truth.ids.shape[1] < k:
        raise ValueError(f"the candidate holds {cand.ids.shape} ids and the exact ground truth {truth.ids.shape}; "
                         f"both need {nq:,} queries and at least k = {k} columns")
    c_ids, r_ids = cand.ids[:, :k].astype(np.int64), truth.ids[:, :k].astype(np.int64)
    base_source, query_source = open_pair(base, queries)
    try:
        n = base_source.shape[0]
        run = Exact(base_source, query_source.rows(0, nq), n, metric, storage_dtype(base_source, dtype))
        result = Comparison(queries=nq, k=k, entries=nq * k)
        differ = c_ids != r_ids
        result.differ = int(differ.sum())
        result.queries_differing = int(differ.any(axis=1).sum())
        sorted_ids = np.sort(c_ids, axis=1)
        repeated = np.zeros_like(differ)
        for q in np.flatnonzero((sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(axis=1)):
            _, first = np.unique(c_ids[q], return_index=True)
            repeated[q] = True
            repeated[q, first] = False
        invalid = (c_ids < 0) | (c_ids >= n)
        query_of, position = np.nonzero(differ)
        bad = invalid[query_of, position] | repeated[query_of, position]
        result.invalid_ids = int(invalid[query_of, position].sum())
        result.duplicates = int((repeated[query_of, position] & ~invalid[query_of, position]).sum())
        ok = ~bad & (r_ids[query_of, position] >= 0)
        q_ok, p_ok = query_of[ok], position[ok]
        d_c = run.exact(run.queries[q_ok], c_ids[q_ok, p_ok])
        d_r = run.exact(run.queries[q_ok], r_ids[q_ok, p_ok])
        tie = d_c == d_r
        bound = 2.0 * (_bounds(run, q_ok, c_ids[q_ok, p_ok]) + _bounds(run, q_ok, r_ids[q_ok, p_ok]))
        misordered = ~tie & (np.abs(d_c - d_r) <= bound)
        result.ties = int(tie.sum())
        result.float32_misorderings = int(misordered.sum())
        result.float32_equal = int((misordered & (d_c.astype(np.float32) == d_r.astype(np.float32))).sum())
        result.errors = result.differ - result.ties - result.float32_misorderings
        kinds = np.where(tie, "tie", np.where(misordered, "float32 misordering", "error"))
        for kind in ("error", "float32 misordering", "tie"):
            for i in np.flatnonzero(kinds == kind)[:EXAMPLES - len(result.examples)]:
                result.examples.append({"kind": kind, "query": int(q_ok[i]), "position": int(p_ok[i]),
                                        "candidate_id": int(c_ids[q_ok[i], p_ok[i]]),
                                        "exact_id": int(r_ids[q_ok[i], p_ok[i]]),
                                        "candidate_distance": float(d_c[i]), "exact_distance": float(d_r[i])})
        if cand.distances is not None:
            name = convention_of(cand, metric, candidate_convention)
            valid = (c_ids >= 0) & (c_ids < n)
            rows = np.broadcast_to(np.arange(nq)[:, None], c_ids.shape)[valid]
            d64 = run.exact(run.queries[rows], c_ids[valid])
            want = conventions.to_float32(d64, metric, name)
            got = cand.distances[:, :k][valid].astype(np.float32)
            result.distances_checked = int(valid.sum())
            result.distances_differing = int((want.view(np.uint32) != got.view(np.uint32)).sum())
            scale = np.maximum(np.abs(want.astype(np.float64)), np.finfo(np.float32).tiny)
            with np.errstate(invalid="ignore"):
                relative = np.abs(got.astype(np.float64) - want) / scale
            result.max_distance_relative_error = float(np.nanmax(relative)) if len(relative) else 0.0
        result.recall["ids"] = recall(c_ids, (r_ids, None), k, "ids")
        exact_share = exact_counts(c_ids, r_ids, k, metric, lambda ids: pair_distances(run, ids)) / \
            np.maximum(1, np.count_nonzero(r_ids >= 0, axis=1))
        result.recall["exact"] = float(exact_share.mean())
        if truth.distances is not None:
            result.recall["bigann"] = recall(c_ids, truth, k, "bigann")
        return result
    finally:
        base_source.close()
        query_source.close()
