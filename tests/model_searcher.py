"""A pure-NumPy Searcher (the protocol in tinyknn/index/index.py and /work/notes/INDEX_OPS.md), exact by
construction: float64 distances as tests/reference.py computes them, ties by the smaller id. Injected
into an Index (`use_model`) it tests the Index's own logic (ids, labels, filters, grouping, removal,
persistence) on every dtype, with or without the real backends; it records its calls so that tests
can check what the Index asks of a searcher.
"""

from __future__ import annotations

import numpy as np

from reference import exact_range, exact_search
from tinyknn.spec import numpy_dtype


def _check_rows(rows, n: int) -> None:
    """The protocol's `rows`: None or sorted unique int64 positions below n."""
    if rows is None:
        return
    assert isinstance(rows, np.ndarray) and rows.dtype == np.int64 and rows.ndim == 1, rows
    assert np.all(np.diff(rows) > 0) and (not len(rows) or (rows[0] >= 0 and rows[-1] < n)), rows


class ModelSearcher:
    def __init__(self, dim: int, metric: str, dtype: str):
        self.dim, self.metric, self.dtype = dim, metric, dtype
        self.storage = numpy_dtype(dtype)
        self.rows = np.empty((0, dim), dtype=self.storage)
        self.ids = np.empty(0, dtype=np.int64)
        self.calls: list[tuple] = []

    def _db(self, rows):
        chosen = slice(None) if rows is None else rows
        return self.rows[chosen].astype(np.float64), self.ids[chosen]

    def add(self, vectors, ids) -> None:
        assert vectors.dtype == self.storage and vectors.shape == (len(ids), self.dim), (vectors.dtype, vectors.shape)
        self.calls.append(("add", len(ids)))
        self.rows = np.concatenate([self.rows, vectors])
        self.ids = np.concatenate([self.ids, np.asarray(ids, dtype=np.int64)])

    def truncate(self, n_rows: int) -> None:
        self.rows, self.ids = self.rows[:n_rows], self.ids[:n_rows]

    def search(self, queries, k: int, rows=None):
        assert queries.dtype == np.float32 and queries.flags.c_contiguous
        _check_rows(rows, len(self.ids))
        self.calls.append(("search", len(queries), k, rows))
        db, ids = self._db(rows)
        return exact_search(db, queries, k, self.metric, "float64", id_map=ids)

    def range_search(self, queries, radius: float, rows=None):
        assert queries.dtype == np.float32 and isinstance(radius, float)
        _check_rows(rows, len(self.ids))
        self.calls.append(("range_search", len(queries), radius, rows))
        db, ids = self._db(rows)
        return exact_range(db, queries, radius, self.metric, "float64", id_map=ids)

    def remove_rows(self, positions):
        _check_rows(positions, len(self.ids))
        self.calls.append(("remove_rows", positions))
        n, r = len(self.ids), len(positions)
        holes = positions[positions < n - r]
        movers = np.setdiff1d(np.arange(n - r, n, dtype=np.int64), positions)
        self.rows[holes], self.ids[holes] = self.rows[movers], self.ids[movers]
        self.truncate(n - r)
        return movers, holes

    def permute_rows(self, order):
        order = np.asarray(order)
        assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(len(self.ids))), order
        self.calls.append(("permute_rows", order))
        self.rows, self.ids = self.rows[order], self.ids[order]

    def get_rows(self, positions):
        assert positions.dtype == np.int64
        return self.rows[positions].copy()

    def reset(self) -> None:
        self.truncate(0)

    def export(self):
        return self.rows.copy(), self.ids.copy()

    def close(self) -> None:
        pass


def use_model(monkeypatch) -> list[ModelSearcher]:
    """Every Index created from now on (in this test) gets a ModelSearcher; returns the list of them."""
    return _inject(monkeypatch, lambda dim, metric, dtype: ModelSearcher(dim, metric, dtype))


def use_shards(monkeypatch, n_shards: int) -> list:
    """Every Index created from now on (in this test) gets a ShardedSearcher over n_shards CPU searchers
    (tinyknn.index.shards: the multi-GPU index's logic, on the CPU); returns the list of them."""
    from tinyknn.index.shards import ShardedSearcher
    from tinyknn.cpu.searcher import CpuSearcher

    return _inject(monkeypatch, lambda dim, metric, dtype: ShardedSearcher(
        [CpuSearcher(dim, metric, dtype) for _ in range(n_shards)], metric))


def _inject(monkeypatch, build) -> list:
    """Index's searcher factory replaced by build(dim, metric, dtype); the searchers made are listed."""
    import tinyknn.index.index

    made: list = []

    def make(device, dim, metric, dtype):
        made.append(build(dim, metric, dtype))
        return made[-1]

    monkeypatch.setattr(tinyknn.index.index, "_make_searcher", make)
    return made
