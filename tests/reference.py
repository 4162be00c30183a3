"""The float64 oracle of the exactness contract, and the older tie-aware comparison.

`exact_search` / `assert_exact` are the contract (docs/exactness.md, kernels/exact.cuh): float64 distances
computed operation by operation as the kernels compute them (sequential over dimensions, every product and
sum rounded, no fused multiply-add), nearest first, equal float64 distances broken by the smaller id,
distances returned as those float64 values rounded to float32; `assert_exact` compares bit for bit.

`check_search` (below them) is the first version's tolerant check, kept for paths not yet under the contract:

A search result is correct when (1) each row's distances are sorted nearest first, (2) they equal the
reference's k best distances within float32 rounding (so ties may be broken any way), (3) every
returned id is a real, distinct database id whose exact distance is the distance returned beside it,
and (4) rows are padded with (-1, +inf / -inf) exactly where k exceeds the database size.
"""

from __future__ import annotations

import numpy as np

LARGER_IS_BETTER = {"l2": False, "ip": True, "cosine": True}


def stored(db: np.ndarray, dtype: str) -> np.ndarray:
    """The database as the index stores it (rounded to its dtype: bfloat16 through float32, as tinyknn
    converts), in float64."""
    from tinyknn.spec import numpy_dtype

    db = np.asarray(db)
    if dtype == "bfloat16" and db.dtype != numpy_dtype("bfloat16"):
        db = db.astype(np.float32)
    return db.astype(numpy_dtype(dtype)).astype(np.float64)


def searched(q: np.ndarray) -> np.ndarray:
    """Queries as the index searches them (float32), in float64."""
    return np.asarray(q).astype(np.float32).astype(np.float64)


BLOCK_ELEMENTS = 1 << 16   # (queries x rows) the oracle sums at a time: two such float64 blocks stay in L2


def _sequential_sums(q64: np.ndarray, db64: np.ndarray, squared_difference: bool) -> np.ndarray:
    """(nq, n): sum over d, in order d = 0, 1, ..., of (q_d - x_d)^2 or q_d * x_d, each pair's sum rounded
    after every term as kernels/exact.cuh does. Summed a block of queries x rows at a time (the same operations
    in the same order as one whole-array pass, ~7x faster: the block stays in cache)."""
    nq, n = q64.shape[0], db64.shape[0]
    columns = np.ascontiguousarray(db64.T)
    out = np.empty((nq, n))
    block_queries = max(1, min(nq, 16))
    block_rows = max(1, BLOCK_ELEMENTS // block_queries)
    for first in range(0, nq, block_queries):
        queries = q64[first:first + block_queries]
        for start in range(0, n, block_rows):
            rows = columns[:, start:start + block_rows]
            total = np.zeros((len(queries), rows.shape[1]))
            term = np.empty_like(total)
            for d in range(rows.shape[0]):
                if squared_difference:
                    np.subtract(queries[:, d, None], rows[d][None, :], out=term)
                    np.multiply(term, term, out=term)
                else:
                    np.multiply(queries[:, d, None], rows[d][None, :], out=term)
                np.add(total, term, out=total)
            out[first:first + block_queries, start:start + block_rows] = total
    return out


def contract_distances(db64: np.ndarray, q64: np.ndarray, metric: str) -> np.ndarray:
    """(nq, n) float64 distances exactly as kernels/exact.cuh defines them (same operations, same order)."""
    nq, n = q64.shape[0], db64.shape[0]
    if metric == "l2":
        return _sequential_sums(q64, db64, True) + 0.0
    dot = _sequential_sums(q64, db64, False)
    if metric == "ip":
        return dot + 0.0
    qq, xx = np.zeros(nq), np.zeros(n)
    for d in range(db64.shape[1]):
        qq = qq + q64[:, d] * q64[:, d]
        xx = xx + db64[:, d] * db64[:, d]
    denominator = np.sqrt(qq)[:, None] * np.sqrt(xx)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = dot / denominator
    cosine[(qq == 0)[:, None] | (xx == 0)[None, :]] = 0.0
    return cosine + 0.0


def smallest(key: np.ndarray, ids: np.ndarray, take: int) -> np.ndarray:
    """Positions of the `take` smallest keys, by key then by the smaller id (NaN keys last). Every key equal
    to the take-th smallest is a candidate before the (key, id) sort, so a partition loses no tie."""
    if take < len(key):
        kth = np.partition(key, take - 1)[take - 1]
        if not np.isnan(kth):
            candidates = np.flatnonzero(key <= kth)
            return candidates[np.lexsort((ids[candidates], key[candidates]))][:take]
    return np.lexsort((ids, key))[:take]


def exact_search(db, q, k: int, metric: str, dtype: str = "float32", id_map=None) -> tuple[np.ndarray, np.ndarray]:
    """The contract's answer: (float32 distances, int64 ids), (nq, k), padded with (+-inf, -1) beyond n."""
    db64, q64 = stored(db, dtype), searched(q)
    nq, n = q64.shape[0], db64.shape[0]
    ids = np.arange(n, dtype=np.int64) if id_map is None else np.asarray(id_map, dtype=np.int64)
    larger = LARGER_IS_BETTER[metric]
    out_d = np.full((nq, k), -np.inf if larger else np.inf, dtype=np.float32)
    out_i = np.full((nq, k), -1, dtype=np.int64)
    if n == 0 or nq == 0:
        return out_d, out_i
    dist = contract_distances(db64, q64, metric)
    take = min(k, n)
    for row in range(nq):
        order = smallest(-dist[row] if larger else dist[row], ids, take)     # by key, then by the smaller id
        out_d[row, :take] = dist[row, order].astype(np.float32)
        out_i[row, :take] = ids[order]
    return out_d, out_i


def exact_range(db, q, radius: float, metric: str, dtype: str = "float32", id_map=None):
    """The contract's range search: (lims, float32 distances, int64 ids) in CSR order, every row strictly inside
    the radius (l2 below it; ip and cosine above it), each query's hits by (float64 distance, id)."""
    dist = contract_distances(stored(db, dtype), searched(q), metric)
    ids = np.arange(len(db), dtype=np.int64) if id_map is None else np.asarray(id_map, dtype=np.int64)
    larger = LARGER_IS_BETTER[metric]
    lims, out_d, out_i = [0], [np.empty(0, np.float32)], [np.empty(0, np.int64)]
    for row in dist:
        hit = np.flatnonzero(row > radius if larger else row < radius)
        order = hit[np.lexsort((ids[hit], -row[hit] if larger else row[hit]))]
        out_d.append(row[order].astype(np.float32))
        out_i.append(ids[order])
        lims.append(lims[-1] + len(order))
    return np.array(lims, dtype=np.int64), np.concatenate(out_d), np.concatenate(out_i)


def near_tied_queries(db, q, k: int, metric: str, dtype: str, width: float) -> int:
    """How many queries have their k-th and (k + margin)-th float64 keys within `width` of each other (the CPU
    screen's margin, library.build_param): rows a float32 screen cannot order, so the exhaustive pass may answer
    them. Tests that expect no fallbacks on random data allow this many: such near ties come by chance."""
    from tinyknn.cpu import library

    dist = contract_distances(stored(db, dtype), searched(q), metric)
    keys = np.sort(-dist if LARGER_IS_BETTER[metric] else dist, axis=1)
    last = min(k + library.build_param(f"margin:{k}"), keys.shape[1]) - 1
    if last < k:
        return 0
    return int(np.count_nonzero(keys[:, last] - keys[:, k - 1] <= width))


def assert_exact(distances, ids, db, q, k: int, metric: str, dtype: str = "float32", id_map=None) -> None:
    """The exactness contract: ids equal the float64 oracle's, distances its float32 roundings, bit for bit."""
    want_d, want_i = exact_search(db, q, k, metric, dtype, id_map)
    got_d, got_i = np.asarray(distances), np.asarray(ids)
    assert got_d.shape == want_d.shape and got_i.shape == want_i.shape, (got_d.shape, got_i.shape, want_d.shape)
    assert got_d.dtype == np.float32 and got_i.dtype == np.int64, (got_d.dtype, got_i.dtype)
    bad_rows = np.flatnonzero(np.any(got_i != want_i, axis=1) |
                              np.any(got_d.view(np.uint32) != want_d.view(np.uint32), axis=1))
    if len(bad_rows):
        row = bad_rows[0]
        wrong = np.flatnonzero((got_i[row] != want_i[row]) | (got_d[row].view(np.uint32) != want_d[row].view(np.uint32)))
        raise AssertionError(
            f"{len(bad_rows)} of {len(got_i)} queries differ from the float64 oracle; query {row}, positions "
            f"{wrong[:8].tolist()}: got ids {got_i[row, wrong[:8]].tolist()} distances "
            f"{got_d[row, wrong[:8]].tolist()}, expected ids {want_i[row, wrong[:8]].tolist()} distances "
            f"{want_d[row, wrong[:8]].tolist()}")


def all_distances(db64: np.ndarray, q64: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(nq, n) exact distances and a per-pair bound on float32 rounding error."""
    dim = db64.shape[1]
    gamma = 1e-6 * max(dim, 8)  # >= 16x the worst-case float32 summation bound dim * 2**-24
    if metric == "l2":
        diff = q64[:, None, :] - db64[None, :, :]
        dist = np.einsum("qnd,qnd->qn", diff, diff)
        return dist, gamma * dist + 1e-30
    ip = q64 @ db64.T
    magnitude = np.abs(q64) @ np.abs(db64).T
    if metric == "ip":
        return ip, gamma * magnitude + 1e-30
    qn = np.linalg.norm(q64, axis=1)
    dn = np.linalg.norm(db64, axis=1)
    scale = np.outer(np.where(qn > 0, 1 / np.where(qn > 0, qn, 1), 0), np.where(dn > 0, 1 / np.where(dn > 0, dn, 1), 0))
    return ip * scale, gamma * (magnitude * scale + 1.0) + 1e-30


def exact_knn(db64: np.ndarray, q64: np.ndarray, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Reference (distances float64, ids) with FAISS-style padding; ties broken by lowest position."""
    dist, _ = all_distances(db64, q64, metric)
    nq, n = dist.shape
    key = -dist if LARGER_IS_BETTER[metric] else dist
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    out_d = np.full((nq, k), -np.inf if LARGER_IS_BETTER[metric] else np.inf)
    out_i = np.full((nq, k), -1, dtype=np.int64)
    take = min(k, n)
    out_i[:, :take] = order[:, :take]
    out_d[:, :take] = np.take_along_axis(dist, order[:, :take], axis=1)
    return out_d, out_i


def check_search(distances, ids, db, q, k: int, metric: str, dtype: str = "float32", id_map=None) -> None:
    """Assert that (distances, ids) is a correct k-NN answer for db, q (see the module docstring).

    `id_map[i]` is the user id of database row i (default: i).
    """
    distances = np.asarray(distances)
    ids = np.asarray(ids)
    db64, q64 = stored(db, dtype), searched(q)
    nq, n = q64.shape[0], db64.shape[0]
    assert distances.shape == (nq, k), f"distances shape {distances.shape}, expected {(nq, k)}"
    assert ids.shape == (nq, k), f"ids shape {ids.shape}, expected {(nq, k)}"
    assert distances.dtype == np.float32, f"distances dtype {distances.dtype}"
    assert ids.dtype == np.int64, f"ids dtype {ids.dtype}"
    id_map = np.arange(n, dtype=np.int64) if id_map is None else np.asarray(id_map, dtype=np.int64)
    position_of = {int(user_id): row for row, user_id in enumerate(id_map)}
    larger = LARGER_IS_BETTER[metric]
    pad = -np.inf if larger else np.inf
    take = min(k, n)
    if n:
        all_d, all_tol = all_distances(db64, q64, metric)
        ref_d, _ = exact_knn(db64, q64, k, metric)
    for row in range(nq):
        got_d = distances[row].astype(np.float64)
        got_i = ids[row]
        assert np.all(got_i[take:] == -1), f"row {row}: padding ids {got_i[take:]}"
        assert np.all(got_d[take:] == pad), f"row {row}: padding distances {got_d[take:]}"
        if take == 0:
            continue
        real_d, real_i = got_d[:take], got_i[:take]
        assert np.all(np.isfinite(real_d)), f"row {row}: non-finite distances {real_d}"
        steps = np.diff(real_d)
        assert np.all(steps <= 1e-30 if larger else steps >= -1e-30) or _sorted_within(real_d, larger), \
            f"row {row}: distances not nearest-first: {real_d}"
        assert len(set(real_i.tolist())) == take, f"row {row}: repeated ids {real_i}"
        positions = np.array([position_of.get(int(i), -1) for i in real_i])
        assert np.all(positions >= 0), f"row {row}: unknown ids {real_i[positions < 0]}"
        exact = all_d[row, positions]
        tol = np.max(all_tol[row]) * 4
        assert np.all(np.abs(exact - real_d) <= tol), (
            f"row {row}: returned distances {real_d} differ from the ids' exact distances {exact} (tol {tol:g})")
        expected = ref_d[row, :take]
        assert np.all(np.abs(np.sort(expected) - np.sort(real_d)) <= tol), (
            f"row {row}: k best distances {np.sort(real_d)} but the reference has {np.sort(expected)} (tol {tol:g})")


def _sorted_within(values: np.ndarray, larger: bool) -> bool:
    """Sorted up to float32 rounding between near-equal neighbours."""
    steps = np.diff(values) * (-1 if larger else 1)
    return bool(np.all(steps >= -1e-6 * (np.abs(values[1:]) + 1e-30)))
