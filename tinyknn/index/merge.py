"""The exact merge of per-shard answers (tinyknn.dask, tinyknn.index.shards): the answer one Index holding every
shard's rows gives.

Each shard answers under the exactness contract for its own rows: nearest first by the float64 distance,
equal float64 distances by the smaller id, distances rounded to float32. Rounding float64 to float32 is
monotone, so sorting the shards' candidates by their float32 distance is right everywhere except among
candidates whose float32 distances are equal: there two candidates of one shard keep that shard's order
(its rank), and candidates of different shards are ordered by their exact float64 distance, asked of the
shards that hold them (`resolve`), then by the smaller id. Only such mixed groups cost a round trip; for
k-NN only those that start within a query's first k. `knn` sorts each query's row of candidates and
settles only the mixed groups; `exact_order` (ranges, and the reference the tests hold `knn` to) sorts
every candidate of every query at once.

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


def knn(parts: list[tuple[np.ndarray, np.ndarray]], k: int, metric: str, resolve) -> tuple[np.ndarray, np.ndarray]:
    """Merge the shards' (distances, ids) (n_queries, width each) into the k best of all: (distances, ids).

    Vectorised per query: the parts side by side, one stable sort by float32 distance along each row
    (padding, id -1, sorted last), so equal float32 distances keep part order, then rank order: right
    wherever one part holds the whole group. Only groups of equal float32 distances that mix parts and
    start within the first k are resolved in float64 (then the smaller id), each within its own positions;
    `exact_order` gives the same order (the tests hold them to it) at the cost of one lexsort of everything.
    """
    larger = LARGER_IS_BETTER[metric]
    distances = np.concatenate([np.asarray(d) for d, _ in parts], axis=1)
    ids = np.concatenate([np.asarray(i, dtype=np.int64) for _, i in parts], axis=1)
    part = np.repeat(np.arange(len(parts)), [np.shape(i)[1] for _, i in parts])
    n_queries, width = ids.shape
    key = -distances if larger else distances.copy()
    key[ids < 0] = np.nan                                   # NumPy sorts NaN last: padding after every candidate
    order = np.argsort(key, axis=1, kind="stable")
    key = np.take_along_axis(key, order, axis=1)
    if k < width:          # what can matter: the first k, and the rest of any group of equal distances at k - 1
        reach = k + int((key[:, k:] == key[:, k - 1:k]).sum(axis=1).max(initial=0))
        order, key = order[:, :reach], key[:, :reach]
    tied = key[:, 1:] == key[:, :-1]                        # NaN never equals: padding never ties
    cross = tied & (part[order[:, 1:]] != part[order[:, :-1]])
    rows = np.flatnonzero(cross.any(axis=1))
    if len(rows):
        order[rows] = _resolved(order[rows], tied[rows], cross[rows], ids[rows], part, rows, k, larger, resolve)
    taken = min(k, order.shape[1])
    out_i = np.full((n_queries, k), -1, dtype=np.int64)
    out_d = np.full((n_queries, k), -np.inf if larger else np.inf, dtype=np.float32)
    out_i[:, :taken] = np.take_along_axis(ids, order[:, :taken], axis=1)
    out_d[:, :taken] = np.take_along_axis(distances, order[:, :taken], axis=1)
    padded = out_i < 0
    out_i[padded] = -1
    out_d[padded] = -np.inf if larger else np.inf
    return out_d, out_i


def _resolved(order, tied, cross, ids, part, rows, k: int, larger: bool, resolve) -> np.ndarray:
    """`order` (sorted by float32, stable) of the queries `rows` with each mixed group that starts within
    the first k put in float64 order, then by the smaller id."""
    order = np.ascontiguousarray(order)                     # its flat view below is the array itself
    n, width = order.shape
    starts = np.ones((n, width), dtype=bool)
    starts[:, 1:] = ~tied
    starts = np.flatnonzero(starts)                         # flat positions where a group begins
    ends = np.append(starts[1:], n * width)
    right = np.flatnonzero(cross)                           # (row, j) of cross is flat row * (width - 1) + j
    mixed = np.searchsorted(starts, right + right // (width - 1) + 1, side="right") - 1
    mixed = mixed[np.append(True, mixed[1:] != mixed[:-1])]     # ascending already: keep each group once
    mixed = mixed[starts[mixed] % width < k]
    if not len(mixed):
        return order
    sizes = ends[mixed] - starts[mixed]
    flat = np.repeat(starts[mixed] - np.cumsum(sizes) + sizes, sizes) + np.arange(int(sizes.sum()))
    group = np.repeat(np.arange(len(mixed)), sizes)
    row = flat // width
    member = order.reshape(-1)[flat]
    member_ids = ids[row, member]
    exact = resolve(rows[row], member_ids, part[member])
    within = np.lexsort((member_ids, -exact if larger else exact, group))
    order.reshape(-1)[flat] = member[within]
    return order


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
