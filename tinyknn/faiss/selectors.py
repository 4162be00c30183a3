"""FAISS's id selectors and SearchParameters, for tinyknn.faiss.

A selector answers "may this id be returned?" for a whole array of ids at once (`members`), so the
adapter turns it into the allow-list that `tinyknn.Index.search(filter=...)` takes: the index's ids
for which the selector says yes. `is_member(id)` answers for one id, as FAISS's does.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IDSelector", "IDSelectorAll", "IDSelectorBatch", "IDSelectorArray", "IDSelectorRange",
           "IDSelectorBitmap", "IDSelectorNot", "IDSelectorAnd", "IDSelectorOr", "IDSelectorXOr",
           "SearchParameters", "as_selector"]


def _id_array(ids, what: str) -> np.ndarray:
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of integer ids; got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{what} must hold integer ids; got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _n_and_array(args, what: str):
    """FAISS's C++ constructors take (n, pointer); its Python ones one array. Accept both."""
    if len(args) == 1:
        return args[0]
    if len(args) == 2:
        n, array = args
        array = np.asarray(array)
        if int(n) > array.size:
            raise ValueError(f"{what}: n = {n} but the array holds only {array.size} elements")
        return array[: int(n)]
    raise TypeError(f"{what} takes an array, or (n, array); got {len(args)} arguments")


class IDSelector:
    """Base class: `members(ids) -> bool array`; `is_member(id) -> bool`."""

    def members(self, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def is_member(self, id_) -> bool:
        return bool(self.members(np.asarray([id_], dtype=np.int64))[0])


class IDSelectorAll(IDSelector):
    """Every id."""

    def members(self, ids):
        return np.ones(len(ids), dtype=bool)


class IDSelectorBatch(IDSelector):
    """The ids in a set: IDSelectorBatch(ids) or IDSelectorBatch(n, ids)."""

    def __init__(self, *args):
        self.ids = np.unique(_id_array(_n_and_array(args, "IDSelectorBatch"), "IDSelectorBatch ids"))

    def members(self, ids):
        return np.isin(ids, self.ids)


class IDSelectorArray(IDSelectorBatch):
    """The ids in an array (FAISS scans it; here it is the same set as IDSelectorBatch)."""


class IDSelectorRange(IDSelector):
    """imin <= id < imax. `assume_sorted` is accepted (a FAISS speed hint for sorted storage) and unused."""

    def __init__(self, imin, imax, assume_sorted: bool = False):
        self.imin, self.imax, self.assume_sorted = int(imin), int(imax), bool(assume_sorted)

    def members(self, ids):
        return (ids >= self.imin) & (ids < self.imax)


class IDSelectorBitmap(IDSelector):
    """Bit `id & 7` of byte `id >> 3` (little bit order, as np.packbits(..., bitorder='little') writes it)."""

    def __init__(self, *args):
        bitmap = np.asarray(_n_and_array(args, "IDSelectorBitmap"))
        if bitmap.ndim != 1 or bitmap.dtype != np.uint8:
            raise TypeError(f"IDSelectorBitmap needs a 1-D uint8 array; got {bitmap.dtype} of shape {bitmap.shape}")
        self.bitmap = bitmap.copy()

    def members(self, ids):
        byte = ids >> 3
        inside = (ids >= 0) & (byte < len(self.bitmap))
        result = np.zeros(len(ids), dtype=bool)
        result[inside] = (self.bitmap[byte[inside]] >> (ids[inside] & 7).astype(np.uint8)) & 1 == 1
        return result


class IDSelectorNot(IDSelector):
    def __init__(self, sel: IDSelector):
        self.sel = as_selector(sel)

    def members(self, ids):
        return ~self.sel.members(ids)


class _Pair(IDSelector):
    _combine = None

    def __init__(self, lhs: IDSelector, rhs: IDSelector):
        self.lhs, self.rhs = as_selector(lhs), as_selector(rhs)

    def members(self, ids):
        return type(self)._combine(self.lhs.members(ids), self.rhs.members(ids))


class IDSelectorAnd(_Pair):
    _combine = np.logical_and


class IDSelectorOr(_Pair):
    _combine = np.logical_or


class IDSelectorXOr(_Pair):
    _combine = np.logical_xor


def as_selector(sel) -> IDSelector:
    """An IDSelector as is; an array of ids as an IDSelectorBatch (what FAISS's remove_ids accepts)."""
    if isinstance(sel, IDSelector):
        return sel
    if isinstance(sel, (np.ndarray, list, tuple)):
        return IDSelectorBatch(sel)
    raise TypeError(f"expected a tinyknn.faiss IDSelector or an array of ids; got {type(sel).__name__}")


class SearchParameters:
    """SearchParameters(sel=IDSelector): which ids a search may return. Other FAISS search parameters
    (nprobe, efSearch, ...) belong to approximate indexes and are refused by name."""

    def __init__(self, sel: IDSelector | None = None, **others):
        if others:
            raise TypeError(f"tinyknn.faiss.SearchParameters takes only sel= (flat indexes have no other "
                            f"search parameters); got {sorted(others)}")
        self.sel = None if sel is None else as_selector(sel)
