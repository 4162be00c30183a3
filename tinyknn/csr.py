"""Range-search answers in CSR form (FAISS's layout: lims, distances, ids, each query's hits at
lims[q]:lims[q + 1]): offsets of per-query counts, and answers to disjoint sets of queries put together in
query order (a filtered search's label groups, the GPU's screened queries and the ones it handed back)."""

from __future__ import annotations

import numpy as np


def offsets(counts) -> np.ndarray:
    """[0, counts[0], counts[0] + counts[1], ...] as int64: CSR offsets of consecutive counts."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def combine(n_queries: int, answers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lims, distances, ids) of n_queries queries from answers (queries, lims, distances, ids), each answering
    its `queries` (query numbers, distinct across answers) in their order; a query no answer names has no hits."""
    counts = np.zeros(n_queries, dtype=np.int64)
    for queries, lims, _, _ in answers:
        counts[queries] = np.diff(lims)
    all_lims = offsets(counts)
    distances = np.empty(int(all_lims[-1]), dtype=np.float32)
    ids = np.empty(int(all_lims[-1]), dtype=np.int64)
    for queries, lims, part_distances, part_ids in answers:
        sizes = np.diff(lims)
        # hit j of the answer's i-th query goes to all_lims[queries[i]] + (j - lims[i])
        where = np.repeat(all_lims[queries] - lims[:-1], sizes) + np.arange(int(lims[-1]), dtype=np.int64)
        distances[where], ids[where] = part_distances, part_ids
    return all_lims, distances, ids
