"""Filtered searches: which rows each group of queries may see, and the results put back in query order.

A search with `filter` (allowed ids) and/or `labels` (one per query) becomes one searcher call per
distinct query label, each with the sorted unique row positions that group may return: the label's
rows, intersected with the filter's rows. Range-search results of the groups are assembled into
FAISS's CSR layout (lims, distances, ids) in query order.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..csr import combine

_EMPTY = np.empty(0, dtype=np.int64)


class Group(NamedTuple):
    queries: np.ndarray | None     # the query numbers of the group (None: every query, in order)
    rows: np.ndarray               # sorted unique int64 row positions the group may return


def groups(n_queries: int, allowed: np.ndarray | None, query_labels: np.ndarray | None, rows_of_label) -> list[Group]:
    """The searcher calls of one filtered search: `allowed` the filter's rows (IdMap.rows_present) or None,
    `query_labels` one label per query or None, rows_of_label(label) a label's sorted rows."""
    if query_labels is None:
        return [Group(None, allowed)]
    if len(query_labels) and bool((query_labels == query_labels[0]).all()):     # one label: no np.unique
        return [Group(None, _allowed(rows_of_label(int(query_labels[0])), allowed))]
    distinct, which = np.unique(query_labels, return_inverse=True)
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(1, len(distinct)))
    return [Group(members, _allowed(rows_of_label(label), allowed))
            for label, members in zip(distinct.tolist(), np.split(order, bounds))]


def _allowed(label_rows: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """A label's rows that the filter allows: both sorted and unique, so the smaller one is looked up
    in the larger (O(small log large), no sort)."""
    if allowed is None:
        return label_rows
    small, large = (label_rows, allowed) if len(label_rows) <= len(allowed) else (allowed, label_rows)
    if not len(small) or not len(large):
        return _EMPTY
    where = np.minimum(np.searchsorted(large, small), len(large) - 1)
    return small[large[where] == small]


def knn(search, queries, n_queries: int, k: int, parts: list[Group]):
    """(distances, ids) of every query: one search(queries_of_group, k, rows) per group, scattered back."""
    if len(parts) == 1 and parts[0].queries is None:
        return search(queries, k, parts[0].rows)
    distances = np.empty((n_queries, k), dtype=np.float32)
    ids = np.empty((n_queries, k), dtype=np.int64)
    for part in parts:
        distances[part.queries], ids[part.queries] = search(queries[part.queries], k, part.rows)
    return distances, ids


def ranges(range_search, queries, n_queries: int, radius: float, parts: list[Group]):
    """(lims, distances, ids) in query order from one range_search(queries_of_group, radius, rows) per group."""
    if len(parts) == 1 and parts[0].queries is None:
        return range_search(queries, radius, parts[0].rows)
    answers = [(part.queries, *range_search(queries[part.queries], radius, part.rows)) for part in parts]
    return combine(n_queries, answers)
