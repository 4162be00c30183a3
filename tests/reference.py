"""The float64 oracle and the tie-aware comparison every search test uses.

A search result is correct when (1) each row's distances are sorted nearest first, (2) they equal the
reference's k best distances within float32 rounding (so ties may be broken any way), (3) every
returned id is a real, distinct database id whose exact distance is the distance returned beside it,
and (4) rows are padded with (-1, +inf / -inf) exactly where k exceeds the database size.
"""

from __future__ import annotations

import numpy as np

LARGER_IS_BETTER = {"l2": False, "ip": True, "cosine": True}


def stored(db: np.ndarray, dtype: str) -> np.ndarray:
    """The database as the index stores it (rounded to its dtype), in float64."""
    return np.asarray(db).astype(dtype).astype(np.float64)


def searched(q: np.ndarray) -> np.ndarray:
    """Queries as the index searches them (float32), in float64."""
    return np.asarray(q).astype(np.float32).astype(np.float64)


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
