"""The index classes of tinyknn.faiss (IndexFlat, IndexFlatL2, IndexFlatIP, IndexIDMap, IndexIDMap2)
over tinyknn.Index; conventions in tinyknn/faiss/__init__.py's docstring.

Length: FAISS's flat classes and their id maps, one method per FAISS call they answer.
"""

from __future__ import annotations

import numpy as np

from ..errors import TinyKnnError
from ..index import Index
from ..inputs import validate_ops as _ops
from .selectors import IDSelector, SearchParameters, as_selector

METRIC_INNER_PRODUCT = 0
METRIC_L2 = 1
FLT_MAX = float(np.finfo(np.float32).max)
_METRICS = {METRIC_L2: "l2", METRIC_INNER_PRODUCT: "ip"}


class FaissError(TinyKnnError):
    """What FAISS raises as RuntimeError: a missing key, an operation this kind of index does not have."""


def _metric_name(metric_type) -> str:
    if isinstance(metric_type, (int, np.integer)) and int(metric_type) in _METRICS:
        return _METRICS[int(metric_type)]
    raise ValueError(f"tinyknn.faiss supports METRIC_L2 ({METRIC_L2}) and METRIC_INNER_PRODUCT "
                     f"({METRIC_INNER_PRODUCT}); got metric_type {metric_type!r}")


def _fill_missing(distances: np.ndarray, ids: np.ndarray, metric_type: int) -> np.ndarray:
    """tinyknn pads with +-inf; FAISS with +-FLT_MAX."""
    distances = np.array(distances, dtype=np.float32, copy=True)
    distances[ids < 0] = FLT_MAX if metric_type == METRIC_L2 else -FLT_MAX
    return distances


def _selector(params) -> IDSelector | None:
    if params is None:
        return None
    if not isinstance(params, SearchParameters):
        raise TypeError(f"params must be a tinyknn.faiss.SearchParameters; got {type(params).__name__}")
    return params.sel


class _IdColumn:
    """An int64 column that grows by doubling (n single-row adds cost O(n)), with masked deletion."""

    def __init__(self, values=None):
        self._buffer = np.array([] if values is None else values, dtype=np.int64)
        self.view = self._buffer

    def append(self, ids: np.ndarray) -> None:
        size = len(self.view)
        if size + len(ids) > len(self._buffer):
            grown = np.empty(max(2 * len(self._buffer), size + len(ids), 16), dtype=np.int64)
            grown[:size] = self.view
            self._buffer = grown
        self._buffer[size:size + len(ids)] = ids
        self.view = self._buffer[:size + len(ids)]

    def delete(self, mask: np.ndarray) -> None:
        self._buffer = self.view[~mask].copy()
        self.view = self._buffer

    def clear(self) -> None:
        """Empty, in place (an IndexIDMap and the flat index it wraps share one column)."""
        self._buffer = np.empty(0, dtype=np.int64)
        self.view = self._buffer


def _positions(view: np.ndarray, internal: np.ndarray, ordered: bool) -> np.ndarray:
    """Where each Index id of `internal` (each one in `view`) is in `view`: a binary search when `view`
    increases, else through its argsort."""
    if ordered:
        return np.searchsorted(view, internal)
    by_id = np.argsort(view, kind="stable")
    return by_id[np.searchsorted(view, internal, sorter=by_id)]


class IndexFlat:
    """Exact search over float32 vectors; its ids are storage positions 0..ntotal-1, which remove_ids
    renumbers as FAISS does (the tinyknn.Index below keeps fixed ids; `_rows` maps positions to them).
    Wrapped by an IndexIDMap, it shares the map's Index and `_rows` (the map's ids, in storage order): it
    still answers in positions, as FAISS's wrapped index does, and changes go through the map."""

    def __init__(self, d: int, metric: int = METRIC_L2, *, device: str = "cpu"):
        self._setup(Index(dim=d, metric=_metric_name(metric), dtype="float32", device=device), int(metric))

    def _setup(self, index: Index, metric_type: int, rows=None, next_id: int = 0) -> None:
        self.metric_type, self.is_trained, self.verbose = metric_type, True, False
        self._index = index
        self._rows = _IdColumn(rows)   # the Index id of each position, increasing
        self._next_id = next_id
        self._wrapped_by: str | None = None   # the IndexIDMap class that holds this index's vectors, if any

    # -- what FAISS exposes -----------------------------------------------------------------
    @property
    def d(self) -> int:
        return self._index.dim

    @property
    def ntotal(self) -> int:
        return self._index.ntotal

    @property
    def device(self) -> str:
        return self._index.device

    def __repr__(self) -> str:
        return f"tinyknn.faiss.{type(self).__name__}(d={self.d}, metric_type={self.metric_type}, " \
               f"ntotal={self.ntotal}, device={self.device!r})"

    # -- the ids FAISS users see (public) and the ids the Index holds (internal) -------------
    def _universe(self) -> np.ndarray:
        """Every public id, in storage order: what a selector picks from."""
        return np.arange(self.ntotal, dtype=np.int64)

    def _to_internal(self, public: np.ndarray) -> np.ndarray:
        return self._rows.view[public]

    def _to_public(self, internal: np.ndarray) -> np.ndarray:
        found = internal >= 0
        public = np.full(internal.shape, -1, dtype=np.int64)
        public[found] = _positions(self._rows.view, internal[found], self._wrapped_by is None)
        return public

    def _storage_order(self, internal: np.ndarray) -> np.ndarray:
        return _positions(self._rows.view, internal, self._wrapped_by is None)

    def _unwrapped(self, what: str) -> None:
        """Changes to a wrapped index go through its IndexIDMap, which holds the ids of the vectors."""
        if self._wrapped_by is not None:
            raise FaissError(f"this {type(self).__name__} is wrapped by an {self._wrapped_by}, which holds its "
                             f"vectors: change them through the {self._wrapped_by} ({what} is not possible here)")

    def _known(self, keys: np.ndarray) -> np.ndarray:
        return (keys >= 0) & (keys < self.ntotal)

    def _allowed(self, params) -> np.ndarray | None:
        """The Index ids a search with these SearchParameters may return (None: all)."""
        sel = _selector(params)
        if sel is None:
            return None
        universe = self._universe()
        return self._to_internal(universe[sel.members(universe)])

    # -- operations ---------------------------------------------------------------------------
    def train(self, x) -> None:
        """Flat indexes need no training (FAISS's is a no-op too); the shape is still checked."""
        _checked_rows(x, self.d, "training vectors")

    def add(self, x) -> None:
        self._unwrapped("add")
        x = _checked_rows(x, self.d, "vectors to add")
        ids = np.arange(self._next_id, self._next_id + len(x), dtype=np.int64)
        self._index.add(x, ids=ids)
        self._rows.append(ids)
        self._next_id += len(x)

    def add_with_ids(self, x, ids) -> None:
        raise FaissError("add_with_ids not implemented for this type of index: wrap it, "
                         "IndexIDMap(IndexFlat(d)) or index_factory(d, 'IDMap,Flat')")

    def search(self, x, k: int, *, params=None, D=None, I=None) -> tuple[np.ndarray, np.ndarray]:
        """(D float32 (n, k), I int64 (n, k)), nearest first; missing results are id -1, distance +-FLT_MAX."""
        x = _checked_rows(x, self.d, "queries")
        allowed = self._allowed(params)
        if allowed is None:
            distances, ids = self._index.search(x, k)
        else:
            distances, ids = self._index.search(x, k, filter=allowed)
        ids = np.asarray(ids, dtype=np.int64)
        return _into(D, _fill_missing(distances, ids, self.metric_type)), _into(I, self._to_public(ids))

    def range_search(self, x, thresh: float, *, params=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lims uint64 (n + 1,), D float32, I int64): l2 distance < thresh, inner product > thresh; each
        query's hits in storage (insertion) order, as FAISS's flat indexes give them and its tests expect."""
        x = _checked_rows(x, self.d, "queries")
        allowed = self._allowed(params)
        kwargs = {} if allowed is None else {"filter": allowed}
        lims, distances, ids = self._index.range_search(x, float(thresh), **kwargs)
        lims, distances, ids = (np.asarray(lims, dtype=np.int64), np.asarray(distances, dtype=np.float32),
                                np.asarray(ids, dtype=np.int64))
        order = np.lexsort((self._storage_order(ids), np.repeat(np.arange(len(lims) - 1), np.diff(lims))))
        return lims.astype(np.uint64), distances[order], self._to_public(ids[order])

    def remove_ids(self, sel) -> int:
        """Remove the ids `sel` selects (an IDSelector or an array of ids); for IndexFlat later ids shift
        down, as in FAISS. Returns how many were removed."""
        self._unwrapped("remove_ids")
        universe = self._universe()
        removed = as_selector(sel).members(universe)
        if not removed.any():
            return 0
        count = int(self._index.remove(self._to_internal(universe[removed])))
        self._rows.delete(removed)
        return count

    def reconstruct(self, key: int, x=None) -> np.ndarray:
        return _into(x, self._get(np.array([_ops.one_id(key, "key")], dtype=np.int64))[0])

    def reconstruct_n(self, n0: int = 0, ni: int = -1, x=None) -> np.ndarray:
        n0, ni = _ops.one_id(n0, "n0"), _ops.one_id(ni, "ni")
        ni = self.ntotal - n0 if ni < 0 else ni
        return _into(x, self._get(np.arange(n0, n0 + ni, dtype=np.int64)))

    def reconstruct_batch(self, keys, x=None) -> np.ndarray:
        keys = np.ravel(keys) if isinstance(keys, np.ndarray) else keys
        return _into(x, self._get(_ops.id_list(keys, "keys")))

    def _get(self, keys: np.ndarray) -> np.ndarray:
        missing = keys[~self._known(keys)]
        if missing.size:
            raise FaissError(f"key {int(missing[0])} not found (the index holds {self.ntotal} vectors"
                             + (f"; {missing.size} keys are missing)" if missing.size > 1 else ")"))
        return np.asarray(self._index.get(self._to_internal(keys)), dtype=np.float32)

    def reset(self) -> None:
        self._unwrapped("reset")
        self._index.reset()
        self._rows.clear()


class IndexFlatL2(IndexFlat):
    def __init__(self, d: int, *, device: str = "cpu"):
        super().__init__(d, METRIC_L2, device=device)


class IndexFlatIP(IndexFlat):
    def __init__(self, d: int, *, device: str = "cpu"):
        super().__init__(d, METRIC_INNER_PRODUCT, device=device)


class IndexIDMap(IndexFlat):
    """A flat index with the caller's int64 ids (add_with_ids); `id_map` holds them in storage order.
    reconstruct is not available, as in FAISS (use IndexIDMap2). The wrapped index must be empty; this
    index takes over its storage: the wrapped index still searches and reconstructs, answering in its
    own positions 0..ntotal-1 as FAISS's does, and refuses changes (add, remove_ids, reset: use the map)."""

    _reconstructs = False

    def __init__(self, index: IndexFlat):
        if not isinstance(index, IndexFlat) or isinstance(index, IndexIDMap):
            raise TypeError(f"{type(self).__name__} wraps a tinyknn.faiss IndexFlat; got {type(index).__name__}")
        if index.ntotal:
            raise ValueError(f"{type(self).__name__} needs an empty index to wrap; it holds {index.ntotal} vectors")
        self.index = index
        self._setup(index._index, index.metric_type)
        self._wrap(index)

    def _wrap(self, index: IndexFlat) -> None:
        """`index` (holding this map's Index) answers in positions of this map's ids, and takes no changes."""
        index._rows, index._wrapped_by = self._rows, type(self).__name__

    @property
    def id_map(self) -> np.ndarray:
        return self._rows.view

    # Public ids are the Index's ids; storage order is insertion order.
    def _universe(self) -> np.ndarray:
        return self._rows.view

    def _to_internal(self, public: np.ndarray) -> np.ndarray:
        return public

    def _to_public(self, internal: np.ndarray) -> np.ndarray:
        return internal

    def _storage_order(self, internal: np.ndarray) -> np.ndarray:
        by_id = np.argsort(self._rows.view, kind="stable")
        return by_id[np.searchsorted(self._rows.view, internal, sorter=by_id)]

    def _known(self, keys: np.ndarray) -> np.ndarray:
        return np.asarray(self._index.contains(keys), dtype=bool)

    def add(self, x) -> None:
        raise FaissError("add does not make sense with IndexIDMap, use add_with_ids")

    def add_with_ids(self, x, ids) -> None:
        x = _checked_rows(x, self.d, "vectors to add")
        ids = np.asarray(ids)
        if ids.shape != (len(x),):
            raise ValueError(f"add_with_ids needs one id per vector: {len(x)} vectors, ids of shape {ids.shape}")
        self._index.add(x, ids=ids)   # validates the ids (integers, unique, not yet present)
        self._rows.append(ids.astype(np.int64))

    def _get(self, keys: np.ndarray) -> np.ndarray:
        if not self._reconstructs:
            raise FaissError("reconstruct not implemented for this type of index (IndexIDMap); use IndexIDMap2")
        return super()._get(keys)


class IndexIDMap2(IndexIDMap):
    """IndexIDMap that can also reconstruct vectors by id."""

    _reconstructs = True


def _checked_rows(x, d: int, what: str) -> np.ndarray:
    """FAISS's Python layer takes (n, d) NumPy arrays of any float type and converts them to float32."""
    on_device = hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray) and x.__dlpack_device__()[0] != 1)   # 1: CPU
    if on_device:
        raise TypeError(f"tinyknn.faiss takes host arrays for {what}, as FAISS's Python API does; got a "
                        f"{type(x).__module__}.{type(x).__name__} on a device: use tinyknn.Index(device='cuda') for those")
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] != d:
        raise ValueError(f"{what} must be a 2-D array of shape (n, {d}); got shape {shape}")
    return x


def _into(out, result: np.ndarray) -> np.ndarray:
    """FAISS lets the caller pass the output array (D=, I=, x=); fill it when given."""
    if out is None:
        return result
    if out.shape != result.shape:
        raise ValueError(f"output array has shape {out.shape}; the result has shape {result.shape}")
    out[...] = result
    return out
