"""Exact merging, on the host, of answers computed chunk by chunk (the host-memory tier, gpu/host_tier.py).

Each chunk's answer is exact over the chunk's rows: float32 distances rounded from the contract's float64
ones. Rounding to float32 is monotone, so candidates in float32 order are in float64 order except inside
groups of EQUAL float32 values: only those groups get their float64 distances computed here (the contract's
definition, kernels/exact.cuh: dimension by dimension, every product and sum rounded on its own), and
equal float64 distances go to the smaller id. Keys: the distance for l2, minus the similarity for ip and
cosine, so smaller is nearer everywhere; a missing candidate has key +inf, position -1 and id -1.
No CUDA here: the tier's workers hand over NumPy arrays.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

LARGER_IS_BETTER = {"l2": False, "ip": True, "cosine": True}

# exact(query_numbers, row_positions) -> the float64 keys of those (query, row) pairs
ExactKeys = Callable[[np.ndarray, np.ndarray], np.ndarray]


def contract_keys(queries: np.ndarray, rows: np.ndarray, metric: str) -> np.ndarray:
    """Float64 keys of the pairs (queries[i], rows[i]): float32 queries, rows in their storage dtype."""
    q = np.ascontiguousarray(queries.astype(np.float64).T)     # (dim, m): one dimension at a time, in order
    x = np.ascontiguousarray(rows.astype(np.float64).T)
    total = np.zeros(q.shape[1])
    if metric == "l2":
        for d in range(q.shape[0]):
            diff = q[d] - x[d]
            total = total + diff * diff
        return total + 0.0
    for d in range(q.shape[0]):
        total = total + q[d] * x[d]
    if metric == "ip":
        return -(total + 0.0)
    qq, xx = np.zeros(q.shape[1]), np.zeros(q.shape[1])
    for d in range(q.shape[0]):
        qq = qq + q[d] * q[d]
        xx = xx + x[d] * x[d]
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = total / (np.sqrt(qq) * np.sqrt(xx))
    return -(np.where((qq == 0) | (xx == 0), 0.0, cosine) + 0.0)


def _tied(sorted_keys: np.ndarray, axis_equal: np.ndarray) -> np.ndarray:
    """Mask of the entries that share their (sorted, finite) key with a neighbour: `axis_equal` says where
    entry j + 1 equals entry j along the last axis."""
    member = np.zeros(sorted_keys.shape, dtype=bool)
    member[..., 1:] |= axis_equal
    member[..., :-1] |= axis_equal
    return member


class Best:
    """The k best candidates of every query seen so far; merge() folds in a chunk's, exact at every step.

    Folding a chunk in needs, from that chunk, its exact k best by (float64 key, id) or a superset of them
    (host_tier makes sure every row tied in float32 with the chunk's k-th is there). Threads may merge at
    once (a lock keeps one at a time); float64 keys computed once are kept with their candidates."""

    def __init__(self, n_queries: int, k: int, exact: ExactKeys):
        self.k, self._exact = k, exact
        self._lock = threading.Lock()
        self.key32 = np.empty((n_queries, 0), dtype=np.float32)
        self.key64 = np.empty((n_queries, 0))
        self.pos = np.empty((n_queries, 0), dtype=np.int64)
        self.ids = np.empty((n_queries, 0), dtype=np.int64)

    def merge(self, key32: np.ndarray, pos: np.ndarray, ids: np.ndarray) -> None:
        with self._lock:
            k32 = np.concatenate((self.key32, key32), axis=1)
            k64 = np.concatenate((self.key64, np.full(key32.shape, np.nan)), axis=1)
            p = np.concatenate((self.pos, pos), axis=1)
            i = np.concatenate((self.ids, ids), axis=1)
            n, wide = k32.shape
            width = min(self.k, wide)
            # flat indices of each row's candidates in float32 order (one gather per array, not take_along_axis)
            flat = np.argsort(k32, axis=1, kind="stable") + (np.arange(n) * wide)[:, None]
            s32 = k32.ravel()[flat]
            tied = np.empty(0, dtype=np.int64)
            if width:
                equal = (s32[:, 1:] == s32[:, :-1]) & np.isfinite(s32[:, 1:])
                member = _tied(s32, equal) & (s32 <= s32[:, width - 1:width])
                tied = np.flatnonzero(member.any(axis=1))
            if len(tied):     # rows with equal float32 keys in reach: order those by (float64 key, id)
                rows_flat = flat[tied]
                s64 = k64.ravel()[rows_flat]
                unknown = member[tied] & np.isnan(s64)
                if unknown.any():
                    r, c = np.nonzero(unknown)
                    s64[r, c] = self._exact(tied[r], p.ravel()[rows_flat[r, c]])
                    k64.ravel()[rows_flat[r, c]] = s64[r, c]          # kept with the candidates
                sub = np.lexsort((i.ravel()[rows_flat], s64, s32[tied]), axis=-1)
                flat[tied] = np.take_along_axis(rows_flat, sub, axis=1)
            keep = flat[:, :width]
            self.key32, self.key64, self.pos, self.ids = (a.ravel()[keep] for a in (k32, k64, p, i))

    def result(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """(distances float32, ids int64), (n_queries, k), padded with (+inf / -inf, -1)."""
        n_queries, width = self.key32.shape
        distances = np.full((n_queries, self.k), np.inf, dtype=np.float32)
        ids = np.full((n_queries, self.k), -1, dtype=np.int64)
        distances[:, :width], ids[:, :width] = self.key32, self.ids
        return (-distances if LARGER_IS_BETTER[metric] else distances), ids


def hit_order(query: np.ndarray, key32: np.ndarray, pos: np.ndarray, ids: np.ndarray, exact: ExactKeys) -> np.ndarray:
    """The permutation putting range-search hits (flat arrays) in query order, each query's nearest first
    by (float64 key, id); float64 keys only for hits whose float32 key another hit of the query shares."""
    order = np.lexsort((key32, query))
    q, k32 = query[order], key32[order]
    equal = (q[1:] == q[:-1]) & (k32[1:] == k32[:-1])
    if not equal.any():
        return order
    member = _tied(k32, equal)
    k64 = np.zeros(len(order))
    k64[member] = exact(q[member], pos[order][member])
    return order[np.lexsort((ids[order], k64, k32, q))]


__all__ = ["Best", "contract_keys", "hit_order", "LARGER_IS_BETTER"]
