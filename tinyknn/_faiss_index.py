"""The index classes of tinyknn.faiss (IndexFlat, IndexFlatL2, IndexFlatIP, IndexIDMap, IndexIDMap2)
over tinyknn.Index; conventions in tinyknn/faiss.py's docstring."""

from __future__ import annotations

import numpy as np

from ._faiss_selectors import IDSelector, SearchParameters, as_selector
from ._index_ops import require
from .errors import TinyKnnError
from .index import Index

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


class IndexFlat:
    """Exact search over float32 vectors; ids are positions 0..ntotal-1, renumbered by remove_ids as in FAISS."""

    def __init__(self, d: int, metric: int = METRIC_L2, *, device: str = "cpu"):
        self.metric_type = int(metric) if isinstance(metric, (int, np.integer)) else metric
        self._index = Index(dim=d, metric=_metric_name(metric), dtype="float32", device=device)
        self.is_trained = True
        self.verbose = False

    @classmethod
    def _over(cls, index: Index, metric_type: int) -> "IndexFlat":
        """An IndexFlat around an existing tinyknn.Index (the device copies)."""
        flat = cls.__new__(cls)
        flat.metric_type, flat.is_trained, flat.verbose, flat._index = metric_type, True, False, index
        return flat

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

    def _stored_ids(self) -> np.ndarray:
        """Every id the index holds (the universe a selector picks from)."""
        return np.arange(self.ntotal, dtype=np.int64)

    def _allowed(self, params) -> np.ndarray | None:
        sel = _selector(params)
        if sel is None:
            return None
        universe = self._stored_ids()
        return universe[sel.members(universe)]

    def train(self, x) -> None:
        """Flat indexes need no training (FAISS's is a no-op too); the shape is still checked."""
        _checked_rows(x, self.d, "training vectors")

    def add(self, x) -> None:
        x = _checked_rows(x, self.d, "vectors to add")
        start = self.ntotal
        self._index.add(x, ids=np.arange(start, start + len(x), dtype=np.int64))

    def add_with_ids(self, x, ids) -> None:
        raise FaissError("add_with_ids not implemented for this type of index: wrap it, "
                         "IndexIDMap(IndexFlat(d)) or index_factory(d, 'IDMap,Flat')")

    def search(self, x, k, *, params=None, D=None, I=None):
        """(D float32 (n, k), I int64 (n, k)), nearest first; missing results are id -1, distance +-FLT_MAX."""
        x = _checked_rows(x, self.d, "queries")
        allowed = self._allowed(params)
        if allowed is None:
            distances, ids = self._index.search(x, k)
        else:
            distances, ids = require(self._index, "search", "filter")(x, k, filter=allowed)
        distances = _fill_missing(distances, ids, self.metric_type)
        return _into(D, distances), _into(I, np.asarray(ids, dtype=np.int64))

    def range_search(self, x, thresh, *, params=None):
        """(lims uint64 (n + 1,), D float32, I int64): l2 distance < thresh, inner product > thresh; each
        query's hits in storage (insertion) order, as FAISS's flat indexes give them and its tests expect."""
        x = _checked_rows(x, self.d, "queries")
        allowed = self._allowed(params)
        range_search = require(self._index, "range_search")
        kwargs = {} if allowed is None else {"filter": allowed}
        lims, distances, ids = range_search(x, float(thresh), **kwargs)
        lims, distances, ids = (np.asarray(lims, dtype=np.int64), np.asarray(distances, dtype=np.float32),
                                np.asarray(ids, dtype=np.int64))
        query = np.repeat(np.arange(len(lims) - 1), np.diff(lims))
        order = np.lexsort((self._positions(ids), query))
        return lims.astype(np.uint64), distances[order], ids[order]

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        """Where each id sits in storage order (for IndexFlat the id is its position)."""
        return ids

    def remove_ids(self, sel) -> int:
        """Remove the ids `sel` selects (an IDSelector or an array of ids); later ids shift down, as in FAISS."""
        universe = self._stored_ids()
        removed = as_selector(sel).members(universe)
        count = int(removed.sum())
        if count:
            kept = require(self._index, "get")(universe[~removed])
            self._index.reset()
            self._index.add(kept, ids=np.arange(len(kept), dtype=np.int64))
        return count

    def reconstruct(self, key, x=None) -> np.ndarray:
        return _into(x, self._get(np.asarray([key], dtype=np.int64))[0])

    def reconstruct_n(self, n0: int = 0, ni: int = -1, x=None) -> np.ndarray:
        ni = self.ntotal - n0 if ni < 0 else ni
        return _into(x, self._get(np.arange(n0, n0 + ni, dtype=np.int64)))

    def reconstruct_batch(self, keys, x=None) -> np.ndarray:
        return _into(x, self._get(np.asarray(keys, dtype=np.int64).ravel()))

    def _get(self, keys: np.ndarray) -> np.ndarray:
        contains = require(self._index, "contains")
        missing = keys[~np.asarray(contains(keys), dtype=bool)]
        if missing.size:
            raise FaissError(f"key {int(missing[0])} not found (the index holds {self.ntotal} vectors"
                             + (f"; {missing.size} keys are missing)" if missing.size > 1 else ")"))
        return np.asarray(require(self._index, "get")(keys), dtype=np.float32)

    def reset(self) -> None:
        self._index.reset()


class IndexFlatL2(IndexFlat):
    def __init__(self, d: int, *, device: str = "cpu"):
        super().__init__(d, METRIC_L2, device=device)


class IndexFlatIP(IndexFlat):
    def __init__(self, d: int, *, device: str = "cpu"):
        super().__init__(d, METRIC_INNER_PRODUCT, device=device)


class IndexIDMap(IndexFlat):
    """A flat index with the caller's int64 ids (add_with_ids). reconstruct is not available, as in
    FAISS (use IndexIDMap2). The wrapped index must be empty; it shares its storage with this one."""

    _reconstructs = False

    def __init__(self, index: IndexFlat):
        if not isinstance(index, IndexFlat) or isinstance(index, IndexIDMap):
            raise TypeError(f"{type(self).__name__} wraps a tinyknn.faiss IndexFlat; got {type(index).__name__}")
        if index.ntotal:
            raise ValueError(f"{type(self).__name__} needs an empty index to wrap; it holds {index.ntotal} vectors")
        self._wrap(index)

    def _wrap(self, index: IndexFlat) -> None:
        self.index = index
        self.metric_type, self.is_trained, self.verbose = index.metric_type, True, False
        self._index = index._index
        self.id_map = np.empty(0, dtype=np.int64)
        self._id_buffer = np.empty(0, dtype=np.int64)

    def _stored_ids(self) -> np.ndarray:
        return self.id_map

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        by_id = np.argsort(self.id_map, kind="stable")
        return by_id[np.searchsorted(self.id_map, ids, sorter=by_id)]

    def add(self, x) -> None:
        raise FaissError("add does not make sense with IndexIDMap, use add_with_ids")

    def add_with_ids(self, x, ids) -> None:
        x = _checked_rows(x, self.d, "vectors to add")
        ids = np.asarray(ids)
        if ids.shape != (len(x),):
            raise ValueError(f"add_with_ids needs one id per vector: {len(x)} vectors, ids of shape {ids.shape}")
        self._index.add(x, ids=ids)   # validates the ids (integers, unique, not yet present)
        self._append_ids(ids.astype(np.int64))

    def _append_ids(self, ids: np.ndarray) -> None:
        """id_map grows by doubling, so n single-row adds cost O(n), not O(n^2)."""
        size = len(self.id_map)
        if size + len(ids) > len(self._id_buffer):
            grown = np.empty(max(2 * len(self._id_buffer), size + len(ids), 16), dtype=np.int64)
            grown[:size] = self.id_map
            self._id_buffer = grown
        self._id_buffer[size:size + len(ids)] = ids
        self.id_map = self._id_buffer[:size + len(ids)]

    def remove_ids(self, sel) -> int:
        removed = as_selector(sel).members(self.id_map)
        if not removed.any():
            return 0
        count = int(require(self._index, "remove")(self.id_map[removed]))
        self.id_map = self.id_map[~removed].copy()
        self._id_buffer = self.id_map
        return count

    def reconstruct(self, key, x=None):
        if not self._reconstructs:
            raise FaissError("reconstruct not implemented for this type of index (IndexIDMap); use IndexIDMap2")
        return super().reconstruct(key, x)

    def reconstruct_n(self, n0: int = 0, ni: int = -1, x=None):
        if not self._reconstructs:
            raise FaissError("reconstruct not implemented for this type of index (IndexIDMap); use IndexIDMap2")
        return super().reconstruct_n(n0, ni, x)

    def reconstruct_batch(self, keys, x=None):
        if not self._reconstructs:
            raise FaissError("reconstruct not implemented for this type of index (IndexIDMap); use IndexIDMap2")
        return super().reconstruct_batch(keys, x)

    def reset(self) -> None:
        self._index.reset()
        self.id_map = np.empty(0, dtype=np.int64)
        self._id_buffer = self.id_map


class IndexIDMap2(IndexIDMap):
    """IndexIDMap that can also reconstruct vectors by id."""

    _reconstructs = True


def _checked_rows(x, d: int, what: str) -> np.ndarray:
    """FAISS's Python layer takes (n, d) arrays of any float type and converts them to float32."""
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
