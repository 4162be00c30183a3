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

import sys

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


def sort_keys(distances: np.ndarray, larger: bool) -> np.ndarray:
    """uint32 keys in the order of the float32 distances (nearest first: larger ones first when `larger`),
    equal exactly where the floats are equal (-0.0 is +0.0); below PADDING_KEY, which padding gets."""
    value = (-distances if larger else distances) + np.float32(0.0)     # the sum turns -0.0 into +0.0
    bits = np.ascontiguousarray(value, dtype=np.float32).view(np.uint32)
    flip = (bits.view(np.int32) >> 31).view(np.uint32) | np.uint32(0x80000000)  # negatives: every bit
    return bits ^ flip


PADDING_KEY = np.uint32(0xFFFFFFFF)
_HIGH, _LOW = (1, 0) if sys.byteorder == "little" else (0, 1)     # where a uint64's halves lie in memory
MERGE_BLOCK = 1 << 18      # candidates merged at a time: a block's arrays stay in cache (10,000 x 200: 2x faster)


def knn(parts: list[tuple[np.ndarray, np.ndarray]], k: int, metric: str, resolve,
        exact_below: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Merge the shards' (distances, ids) (n_queries, width each) into the k best of all: (distances, ids).

    Vectorised per query, MERGE_BLOCK candidates at a time: the parts side by side, each candidate one
    uint64, its distance's sort key above its column, sorted along each row (NumPy's vectorised sort:
    equal distances keep column order, part order then rank, as a stable sort would, at a fraction of an
    argsort's cost); padding (id -1) last. That is right wherever one part holds a whole group of equal
    float32 distances. Only groups of equal float32 distances that mix parts and start within the first k
    are resolved in float64 (then the smaller id), each within its own positions; `exact_order` gives the
    same order (the tests hold them to it) at the cost of one lexsort of everything.

    exact_below: float32 distances smaller than this in magnitude are known to be their float64 distances
    (integer inputs whose float64 distances are integers: 2**24), so a tie among them is an exact tie,
    settled by the smaller id without asking `resolve`; where every candidate of a block is such, the
    key's lower half is the id and the sort alone gives the contract's order.
    """
    larger = LARGER_IS_BETTER[metric]
    parts = [(np.ascontiguousarray(d, dtype=np.float32), np.ascontiguousarray(i, dtype=np.int64)) for d, i in parts]
    n_queries, width = parts[0][1].shape[0], sum(i.shape[1] for _, i in parts)
    out_d = np.full((n_queries, k), -np.inf if larger else np.inf, dtype=np.float32)
    out_i = np.full((n_queries, k), -1, dtype=np.int64)
    step = max(1, MERGE_BLOCK // max(1, width))
    for a in range(0, n_queries, step):
        block, out = [(d[a:a + step], i[a:a + step]) for d, i in parts], (out_d[a:a + step], out_i[a:a + step])
        if exact_below > 0 and _ties_are_exact(block, exact_below):
            _by_distance_and_id(block, k, larger, *out)
        else:
            asked = resolve if a == 0 else (lambda numbers, ids, shards, a=a: resolve(numbers + a, ids, shards))
            _by_distance_then_float64(block, k, larger, asked, exact_below, *out)
    return out_d, out_i


def _ties_are_exact(parts, exact_below: float) -> bool:
    """Whether every candidate's float32 distance is below `exact_below` in magnitude (so it is its float64
    distance, and equal float32 distances are equal float64 ones) and every id fits in 32 bits."""
    for d, i in parts:
        valid = i >= 0
        if not (np.max(d, where=valid, initial=-np.inf) < exact_below
                and np.min(d, where=valid, initial=np.inf) > -exact_below and int(i.max(initial=0)) < 0xFFFFFFFF):
            return False
    return True


def _packed(parts, larger: bool, low) -> tuple[np.ndarray, np.ndarray]:
    """Each candidate as one uint64, its distance's sort key (padding: PADDING_KEY) above `low(column,
    ids)`, written as two uint32 halves (no temporaries); and the halves' view, (rows, width, 2)."""
    n_queries, width = parts[0][1].shape[0], sum(i.shape[1] for _, i in parts)
    packed = np.empty((n_queries, width), dtype=np.uint64)
    halves = packed.view(np.uint32).reshape(n_queries, width, 2)
    column = 0
    for d, i in parts:
        key = sort_keys(d, larger)
        key[i < 0] = PADDING_KEY
        halves[:, column:column + i.shape[1], _HIGH] = key
        halves[:, column:column + i.shape[1], _LOW] = low(column, i)
        column += i.shape[1]
    return packed, halves


def _by_distance_and_id(parts, k: int, larger: bool, out_d, out_i) -> None:
    """knn of a block where every tie is exact: the contract's order is (float32 distance, id), so the
    lower half is the id's 32 bits (padding's -1: 0xFFFFFFFF, after every id) and the sort is the merge;
    the distances come back from their keys, which are one to one."""
    packed, halves = _packed(parts, larger, lambda _, i: i.view(np.uint32).reshape(*i.shape, 2)[..., _LOW])
    packed.sort(axis=1)
    taken = min(out_i.shape[1], packed.shape[1])
    key = halves[:, :taken, _HIGH]
    bits = key ^ ((key >> np.uint32(31)) - np.uint32(1) | np.uint32(0x80000000))   # sort_keys undone
    value = bits.view(np.float32)
    out_d[:, :taken] = (-value if larger else value) + np.float32(0.0)      # +0.0, as the contract's are
    out_i[:, :taken] = halves[:, :taken, _LOW]
    padded = key == PADDING_KEY
    out_d[:, :taken][padded] = -np.inf if larger else np.inf
    out_i[:, :taken][padded] = -1


def _by_distance_then_float64(parts, k: int, larger: bool, resolve, exact_below: float, out_d, out_i) -> None:
    """knn of a block: sorted by (distance, column), then the mixed groups within k put in float64 order."""
    distances = np.concatenate([d for d, _ in parts], axis=1)
    ids = np.concatenate([i for _, i in parts], axis=1)
    part = np.repeat(np.arange(len(parts)), [i.shape[1] for _, i in parts])
    n_queries, width = ids.shape
    packed, halves = _packed(parts, larger, lambda column, i: np.arange(column, column + i.shape[1], dtype=np.uint32))
    packed.sort(axis=1)
    key = halves[..., _HIGH]
    reach = width
    if k < width:          # what can matter: the first k, and the rest of any group of equal distances at k - 1
        same = (key[:, k:] == key[:, k - 1:k]) & (key[:, k - 1:k] != PADDING_KEY)
        reach = k + int(same.sum(axis=1).max(initial=0))
    order = halves[:, :reach, _LOW].astype(np.intp)
    key = key[:, :reach]
    tied = (key[:, 1:] == key[:, :-1]) & (key[:, 1:] != PADDING_KEY)     # padding never ties
    cross = tied & (part[order[:, 1:]] != part[order[:, :-1]])
    rows = np.flatnonzero(cross.any(axis=1))
    if len(rows):
        order[rows] = _resolved(order[rows], tied[rows], cross[rows], ids[rows], distances[rows], part, rows, k,
                                larger, resolve, exact_below)
    taken = min(k, reach)
    flat = (order[:, :taken] + (np.arange(n_queries) * width)[:, None]).ravel()
    out_i[:, :taken] = ids.reshape(-1)[flat].reshape(n_queries, taken)
    out_d[:, :taken] = distances.reshape(-1)[flat].reshape(n_queries, taken)
    padded = out_i < 0
    out_i[padded] = -1
    out_d[padded] = -np.inf if larger else np.inf


def _resolved(order, tied, cross, ids, distances, part, rows, k: int, larger: bool, resolve,
              exact_below: float) -> np.ndarray:
    """`order` (sorted by float32, stable) of the queries `rows` with each mixed group that starts within
    the first k put in float64 order, then by the smaller id (float64 asked of `resolve` only for groups
    at or beyond `exact_below`)."""
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
    exact = distances[row, member].astype(np.float64)
    asked = ~(np.abs(exact) < exact_below)
    if asked.any():
        exact[asked] = resolve(rows[row[asked]], member_ids[asked], part[member[asked]])
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
