"""Range-search answers in CSR form (FAISS's layout: lims, distances, ids, each query's hits at
lims[q]:lims[q + 1]): offsets of per-query counts, and answers to disjoint sets of queries put together in
query order (a filtered search's label groups, the GPU's screened queries and the ones it handed back)."""

from __future__ import annotations

import numpy as np

RUN_HITS = 64   # an answer whose runs of hits that stay together (consecutive queries in both orders) average
                # this many or more is copied run by run: slices, not a scatter of every hit


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
        lims = np.asarray(lims, dtype=np.int64)
        # hit j of the answer's i-th query goes to all_lims[queries[i]] + (j - lims[i])
        shift = all_lims[queries] - lims[:-1]
        some = np.flatnonzero(np.diff(lims))    # queries with hits: between two, the hits follow on
        if not len(some):
            continue
        moved = shift[some]
        runs = some[np.flatnonzero(np.concatenate(([True], moved[1:] != moved[:-1])))]
        if len(runs) * RUN_HITS <= lims[-1]:    # runs of hits that stay together, and few: copied as slices
            ends = np.append(lims[runs[1:]], lims[-1])
            for first, end, by in zip(lims[runs].tolist(), ends.tolist(), shift[runs].tolist()):
                distances[first + by:end + by] = part_distances[first:end]
                ids[first + by:end + by] = part_ids[first:end]
        else:
            where = np.repeat(shift, np.diff(lims)) + np.arange(int(lims[-1]), dtype=np.int64)
            distances[where], ids[where] = part_distances, part_ids
    return all_lims, distances, ids
