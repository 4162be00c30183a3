"""Prepared searches (Index.prepare_search) and searches that write into the caller's arrays (out=).

`s = index.prepare_search(k=10, n_queries=1)` binds once what does not change between calls: k (checked
once), the query count and width, the searcher's search method, and on the GPU the searcher's host batch
(staging, plan, CUDA graph; tinyknn.gpu.host_search) through a token the searcher keeps valid. A call
`s(q)` / `s(q, out=(D, I))` then checks only what can differ per call: for the common case, a C-contiguous
float32 ndarray of exactly (n_queries, dim), that in a few attribute reads, and its values (NaN, infinity,
|x| > 2**50) as every search does. Anything else a search accepts (other dtypes and layouts, CUDA arrays
on a GPU index) goes through the Index's general checks, and must still hold n_queries rows.

What it binds is never a snapshot of the data: every call searches the index as it is at that moment
(add, remove and reset are seen at once, exactly as by index.search; the GPU re-binds its batch after any
change that invalidates it). A closed index or a closed prepared search is a ValueError. Results are fresh
arrays per call (the caller may keep them) unless out= is given. Any number of threads may call one
prepared search at once (it holds no per-call state; the GPU searcher serialises its own calls).

Searcher capabilities used here, both optional (tinyknn.index.backends.Searcher): `takes_out = True` means
search(queries, k, rows, out=(distances, ids)) writes into those validated arrays (NumPy arrays, or the
DeviceArray descriptions of CUDA ones); `prepare_search(n_queries, k)` returns a token that search(...,
prepared=token) may use to skip per-call work. A searcher without them is served by copying its results.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import numpy as np

from ..inputs import outputs as _outputs, validate as _validate, validate_ops as _ops

_FLOAT32 = np.dtype(np.float32)


def search_into(searcher, queries, k: int, rows, targets, prepared=None) -> None:
    """searcher.search(queries, k, rows) with its results left in `targets` (checked by tinyknn.inputs.outputs):
    written there by a searcher that takes out=, else copied there. prepared: the searcher's token."""
    if getattr(searcher, "takes_out", False):
        if prepared is None:
            searcher.search(queries, k, rows, out=targets)
        else:
            searcher.search(queries, k, rows, out=targets, prepared=prepared)
        return
    if isinstance(targets[0], _validate.DeviceArray):
        raise TypeError(f"this index's searcher ({type(searcher).__name__}) cannot write into CUDA arrays; "
                        "call search without out=")
    distances, ids = searcher.search(queries, k, rows)
    np.copyto(targets[0], distances)
    np.copyto(targets[1], ids)


class _Bound(NamedTuple):
    searcher: Any
    search: Any           # searcher.search, with the searcher's prepared token where it has one
    token: Any            # that token, or None


class PreparedSearch:
    """A search with k and the query count bound once: `D, I = s(q)` or `s(q, out=(D, I))`.

    Made by Index.prepare_search(k, n_queries); see this module's docstring. Attributes: `k`, `n_queries`,
    `index`. close() (or leaving a `with` block) releases what it holds; later calls raise ValueError.
    """

    def __init__(self, index, k: int, n_queries: int):
        self.k = _ops.search_k(k)
        self.n_queries = _ops.query_count(n_queries)
        searcher = index._open_searcher()
        self.index = index
        self._shape = (self.n_queries, index.dim)
        # float32 values: checked here on the CPU; the GPU searcher checks them on the host while the device works
        self._check = index.device == "cpu"
        # an 8-bit index checks its queries by its own rule (integers in range): the general path does that
        self._fast = index.dtype not in _validate.EIGHT_BIT
        self._results = (self.n_queries, self.k)
        prepare = getattr(searcher, "prepare_search", None)
        token = None if prepare is None else prepare(self.n_queries, self.k)
        self._bound: _Bound | None = _Bound(
            searcher, searcher.search if token is None else partial(searcher.search, prepared=token), token)

    def __call__(self, q, out=None):
        """(distances float32 (n_queries, k), ids int64 (n_queries, k)) of the queries q, as
        index.search(q, k) returns them; with out=(distances, ids), written into those and returned."""
        bound = self._bound
        if bound is None:
            raise ValueError("this prepared search was closed; make another with index.prepare_search(k, n_queries)")
        index = self.index
        if index._searcher is not bound.searcher:
            raise ValueError("the Index of this prepared search was closed; create a new index")
        if q.__class__ is np.ndarray and q.dtype is _FLOAT32 and q.shape == self._shape and q.flags.c_contiguous \
                and self._fast:
            if self._check:
                _validate.finite_float32(q)
            if out is None:
                return index._handover.whole_adds_only(bound.search, q, self.k)
            targets, queries = _outputs.host(out, q, self._results)
            given = targets
        else:
            queries = self._general(q)
            if out is None:
                return index._handover.whole_adds_only(bound.search, queries, self.k)
            given, targets, queries = _outputs.checked(out, queries, self.k)
        index._handover.whole_adds_only(search_into, bound.searcher, queries, self.k, None, targets, bound.token)
        return given

    def _general(self, q):
        """What index.search accepts, checked and converted by the Index, with the bound query count."""
        queries = self.index._queries(q)
        if tuple(queries.shape) != self._shape:
            raise ValueError(f"this prepared search was made for n_queries={self.n_queries} (shape {self._shape}); "
                             f"got shape {tuple(queries.shape)}: prepare another with index.prepare_search(k, "
                             "n_queries), or call index.search")
        return queries

    def close(self) -> None:
        """Drop what the prepared search holds (its searcher's token; the searcher owns the buffers)."""
        self._bound = None

    def __enter__(self) -> "PreparedSearch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._bound is None else f"index={self.index!r}"
        return f"tinyknn PreparedSearch(k={self.k}, n_queries={self.n_queries}, {state})"


__all__ = ["PreparedSearch", "search_into"]
