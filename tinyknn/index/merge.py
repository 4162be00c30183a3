"""The exact merge of per-shard answers (tinyknn.dask, tinyknn.index.shards): the answer one Index holding every
shard's rows gives.

Each shard answers under the exactness contract for its own rows: nearest first by the float64 distance,
equal float64 distances by the smaller id, distances rounded to float32. Rounding float64 to float32 is
monotone, so sorting the shards' candidates by their float32 distance is right everywhere except among
candidates whose float32 distances are equal: there two candidates of one shard keep that shard's order
(its rank), and candidates of different shards are ordered by their exact float64 distance, asked of the
shards that hold them (`resolve`), then by the smaller id. Only such mixed groups cost a round trip; for
k-NN only those that start within a query's first k.

`exact_distances` is the contract's float64 distance of query/row pairs (kernels/exact.cuh: the same
operations in the same order, so the same bits as the CPU library, the GPU kernels and tests/reference.py).
"""

from __future__ import annotations

import numpy as np

# resolve(query_numbers, ids, shards) -> the float64 contract distance of each (query, id) pair
LARGER_IS_BETTER = {"l2": False, "ip": True, "cosine": True}


def exact_distances(queries: np.ndarray, rows: np.ndarray, metric: str) -> np.ndarray:
    """float64 contract distances of queries[i] (float32) and rows[i] (the stored dtype), pair by pair:
    per coordinate in order, every product and sum rounded on its own (NumPy never fuses them)."""
    q = np.ascontiguousarray(np.asarray(queries, dtype=np.float32).astype(np.float64).T)
    x = np.ascontiguousarray(np.asarray(rows).astype(np.float64).T)     # every storage dtype widens exactly
    total = np.zeros(q.shape[1])
    if metric == "l2":
        for qd, xd in zip(q, x):
            diff = qd - xd
            total = total + diff * diff
        return total + 0.0
    for qd, xd in zip(q, x):
        total = total + qd * xd
    if metric == "ip":
        return total + 0.0
    qq, xx = np.zeros_like(total), np.zeros_like(total)
    for qd, xd in zip(q, x):
        qq = qq + qd * qd
        xx = xx + xd * xd
    zero = (qq == 0.0) | (xx == 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = total / (np.sqrt(qq) * np.sqrt(xx))
    cosine[zero] = 0.0
    return cosine + 0.0


def exact_order(query: np.ndarray, distance: np.ndarray, shard: np.ndarray, rank: np.ndarray, ids: np.ndarray,
                larger: bool, resolve, limit: int | None = None) -> np.ndarray:
    """The permutation that puts the candidates (flat arrays, one entry each) in contract order per query:
    by query, then distance (float32; largest first when `larger`), then within equal float32 distances
    by rank where one shard holds them all, else by the resolved float64 distance and the smaller id.
    `limit`: only groups starting within each query's first `limit` candidates need to be exact."""
    key = -distance if larger else distance
    first = np.lexsort((key, query))
    q_sorted, key_sorted, shard_sorted = query[first], key[first], shard[first]
    n = len(first)
    if n == 0:
        return first
    starts = np.flatnonzero(np.concatenate(([True], (q_sorted[1:] != q_sorted[:-1])
                                            | (key_sorted[1:] != key_sorted[:-1]))))
    mixed = np.minimum.reduceat(shard_sorted, starts) != np.maximum.reduceat(shard_sorted, starts)
    if limit is not None:
        query_starts = np.flatnonzero(np.concatenate(([True], q_sorted[1:] != q_sorted[:-1])))
        query_of_group = np.searchsorted(query_starts, starts, side="right") - 1
        mixed &= starts - query_starts[query_of_group] < limit
    second = rank[first].astype(np.float64)
    if mixed.any():
        sizes = np.diff(np.append(starts, n))
        members = np.repeat(mixed, sizes)
        exact = resolve(q_sorted[members], ids[first][members], shard_sorted[members])
        second[members] = -exact if larger else exact
    return first[np.lexsort((ids[first], second, key_sorted, q_sorted))]


def _flat(parts: list[tuple[np.ndarray, np.ndarray]]):
    """The valid candidates of per-shard (distances, ids) (n_queries, k) as flat arrays."""
    distances = np.concatenate([d for d, _ in parts], axis=1)
    ids = np.concatenate([i for _, i in parts], axis=1)
    n_queries, width = ids.shape
    k = parts[0][0].shape[1]
    shard = np.broadcast_to(np.repeat(np.arange(len(parts)), k), ids.shape)
    rank = np.broadcast_to(np.tile(np.arange(k), len(parts)), ids.shape)
    query = np.broadcast_to(np.arange(n_queries)[:, None], ids.shape)
    valid = ids >= 0
    return query[valid], distances[valid], shard[valid], rank[valid], ids[valid]


def knn(parts: list[tuple[np.ndarray, np.ndarray]], k: int, metric: str, resolve) -> tuple[np.ndarray, np.ndarray]:
    """Merge the shards' (distances, ids) (n_queries, k each) into the k best of all: (distances, ids)."""
    larger = LARGER_IS_BETTER[metric]
    n_queries = parts[0][0].shape[0]
    out_d = np.full((n_queries, k), -np.inf if larger else np.inf, dtype=np.float32)
    out_i = np.full((n_queries, k), -1, dtype=np.int64)
    query, distance, shard, rank, ids = _flat(parts)
    order = exact_order(query, distance, shard, rank, ids, larger, resolve, limit=k)
    query = query[order]
    counts = np.bincount(query, minlength=n_queries)
    position = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = position < k
    out_d[query[keep], position[keep]] = distance[order][keep]
    out_i[query[keep], position[keep]] = ids[order][keep]
    return out_d, out_i


def ranges(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], metric: str,
           resolve) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge the shards' range answers (lims, distances, ids), each query's hits nearest first."""
    n_queries = len(parts[0][0]) - 1
    query = np.concatenate([np.repeat(np.arange(n_queries), np.diff(lims)) for lims, _, _ in parts])
    distance = np.concatenate([d for _, d, _ in parts])
    ids = np.concatenate([i for _, _, i in parts])
    shard = np.concatenate([np.full(len(i), s, dtype=np.int64) for s, (_, _, i) in enumerate(parts)])
    rank = np.concatenate([np.arange(len(i)) for _, _, i in parts])    # each shard's order is its rank
    order = exact_order(query, distance, shard, rank, ids, LARGER_IS_BETTER[metric], resolve)
    lims = np.zeros(n_queries + 1, dtype=np.int64)
    np.cumsum(np.bincount(query, minlength=n_queries), out=lims[1:])
    return lims, distance[order].astype(np.float32), ids[order].astype(np.int64)
