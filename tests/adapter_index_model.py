"""A stand-in for the index-operations issue's Index API, so the adapters' own logic is tested before
tinyknn.Index has remove/get/contains/range_search/search(filter=).

`IndexWithOperations` is a real tinyknn.Index (add, unfiltered search, reset and save go to it) plus those
operations answered by the float64 oracle of tests/reference.py over a copy of the stored vectors. It is
only a test double: the adapter tests run against the real Index too, and skip what it lacks
(`missing_operations`).
"""

from __future__ import annotations

import inspect

import numpy as np
from reference import LARGER_IS_BETTER, contract_distances, exact_search, searched, stored

import tinyknn


def missing_operations(index_class=tinyknn.Index) -> list[str]:
    """Which of the index-operations issue's methods `index_class` lacks."""
    missing = [name for name in ("remove", "get", "contains", "range_search") if not hasattr(index_class, name)]
    if "filter" not in inspect.signature(index_class.search).parameters:
        missing.append("search(filter=)")
    return missing


class IndexWithOperations(tinyknn.Index):
    """tinyknn.Index plus remove/get/contains/range_search/search(filter=) from the float64 oracle."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._model_ids = np.empty(0, dtype=np.int64)
        self._model_vectors = np.empty((0, self.dim), dtype=self.dtype)

    def add(self, x, ids=None):
        before = self.ntotal
        super().add(x, ids=ids)
        added = np.arange(before, self.ntotal) if ids is None else np.asarray(ids, dtype=np.int64)
        self._model_ids = np.concatenate([self._model_ids, added])
        self._model_vectors = np.concatenate([self._model_vectors, np.asarray(x).astype(self.dtype)])

    def reset(self):
        super().reset()
        self._model_ids = np.empty(0, dtype=np.int64)
        self._model_vectors = np.empty((0, self.dim), dtype=self.dtype)

    def remove(self, ids) -> int:
        gone = np.isin(self._model_ids, np.asarray(ids, dtype=np.int64))
        kept_ids, kept_vectors = self._model_ids[~gone], self._model_vectors[~gone]
        self.reset()
        if len(kept_ids):
            self.add(kept_vectors, ids=kept_ids)
        return int(gone.sum())

    def contains(self, ids) -> np.ndarray:
        return np.isin(np.asarray(ids, dtype=np.int64), self._model_ids)

    def get(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        missing = ids[~self.contains(ids)]
        if missing.size:
            raise ValueError(f"ids not in the index: {missing[:10].tolist()}")
        row_of = {int(i): row for row, i in enumerate(self._model_ids)}
        return self._model_vectors[[row_of[int(i)] for i in ids]].copy()

    def search(self, q, k, *, filter=None, labels=None):
        if filter is None:
            return super().search(q, k)
        allowed = np.isin(self._model_ids, np.asarray(filter, dtype=np.int64))
        return exact_search(self._model_vectors[allowed], np.asarray(q), k, self.metric, self.dtype,
                            id_map=self._model_ids[allowed])

    def range_search(self, q, radius, *, filter=None, labels=None):
        allowed = np.ones(len(self._model_ids), dtype=bool) if filter is None else \
            np.isin(self._model_ids, np.asarray(filter, dtype=np.int64))
        ids = self._model_ids[allowed]
        q64 = searched(q)
        dist = contract_distances(stored(self._model_vectors[allowed], self.dtype), q64, self.metric)
        larger = LARGER_IS_BETTER[self.metric]
        lims, out_d, out_i = [0], [], []
        for row in range(len(q64)):
            hit = dist[row] > radius if larger else dist[row] < radius
            order = np.lexsort((ids[hit], -dist[row][hit] if larger else dist[row][hit]))
            out_d.append(dist[row][hit][order].astype(np.float32))
            out_i.append(ids[hit][order])
            lims.append(lims[-1] + int(hit.sum()))
        return (np.asarray(lims, dtype=np.int64), np.concatenate(out_d or [np.empty(0, np.float32)]),
                np.concatenate(out_i or [np.empty(0, np.int64)]))


def backend_fixture(*module_names: str):
    """A fixture over two backends of an adapter: the real tinyknn.Index, and IndexWithOperations put in
    place of `Index` in each of `module_names`. It yields `needs(*operations)`, which skips the test on
    the real Index while it lacks one of them (the skip names what is missing)."""
    import importlib

    import pytest

    @pytest.fixture(params=["Index", "model"], ids=["tinyknn.Index", "model-of-operations"])
    def backend(request, monkeypatch):
        if request.param == "model":
            for name in module_names:
                monkeypatch.setattr(importlib.import_module(name), "Index", IndexWithOperations)

        def needs(*operations: str) -> None:
            lacking = [op for op in operations if op in missing_operations()] if request.param == "Index" else []
            if lacking:
                pytest.skip(f"tinyknn.Index lacks {', '.join(lacking)} (the index-operations issue)")

        return needs

    return backend
