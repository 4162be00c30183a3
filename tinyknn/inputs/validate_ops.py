"""Checks of the index operations' arguments: labels, id lists (filter, remove, get,
contains), the search k, a prepared search's query count and the range-search radius. Vectors and
queries: tinyknn.inputs.validate; the caller's result arrays (out=): tinyknn.inputs.outputs.

Every check returns a fresh, C-contiguous array the caller may keep, or raises a TypeError (wrong
kind of value) or ValueError (wrong shape or range) naming what was given and what is expected.
"""

from __future__ import annotations

import math

import numpy as np

from .arrays import dlpack_device_kind, from_dlpack, is_device_array

INT64_MAX = int(np.iinfo(np.int64).max)
# Index.search takes any k >= 1 (the searchers serve k beyond the kernels' spec.MAX_K by selecting over
# distance blocks, and pad past the rows allowed); the bound only keeps result sizes addressable.
MAX_SEARCH_K = 2**31 - 1


def search_k(k) -> int:
    """k as a Python int >= 1 (not bool, not float)."""
    if k.__class__ is int and 1 <= k <= MAX_SEARCH_K:   # the common case in one comparison
        return k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be a positive integer; got {k!r} ({type(k).__name__})")
    if not 1 <= int(k) <= MAX_SEARCH_K:
        raise ValueError(f"k must be between 1 and {MAX_SEARCH_K}; got {int(k)}")
    return int(k)


def query_count(n) -> int:
    """A prepared search's number of queries per call: a Python or NumPy integer >= 1 (not bool)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n_queries must be a positive integer; got {n!r} ({type(n).__name__})")
    if not 1 <= int(n) <= INT64_MAX:
        raise ValueError(f"n_queries must be at least 1; got {int(n)}")
    return int(n)


def _host_integers(values, what: str) -> np.ndarray:
    """A host array-like of integers as an ndarray (no copy yet); lists of Python ints beyond int64,
    floats, bools, strings and CUDA arrays are refused."""
    if is_device_array(values) or dlpack_device_kind(values) == "cuda":
        raise TypeError(f"{what} must be a host (NumPy) array of integers; got a CUDA array")
    if isinstance(values, np.ma.MaskedArray):
        raise TypeError(f"{what} must not be a masked array (masks are not supported)")
    if isinstance(values, (list, tuple)):
        for value in values:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                if isinstance(value, (list, tuple, np.ndarray)):
                    break                                   # nested: the shape check explains it
                raise TypeError(f"{what} must be integers; got {value!r} ({type(value).__name__})")
            if not -INT64_MAX - 1 <= int(value) <= INT64_MAX:
                raise ValueError(f"{what} must lie in int64's range; got {int(value)}")
        array = np.asarray(values) if len(values) else np.empty(0, dtype=np.int64)
    else:
        array = from_dlpack(values, what) if dlpack_device_kind(values) == "cpu" else None
        array = np.asarray(values) if array is None else array
    if array.size == 0 and array.dtype.kind == "f":
        array = array.astype(np.int64)                      # [] or np.array([]) with no values
    if array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers (int64 or smaller); got dtype {array.dtype}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) > INT64_MAX:
        raise ValueError(f"{what} must lie in int64's range; got {int(array.max())}")
    return array


def labels(values, n: int, what: str) -> np.ndarray:
    """One int64 label per vector (or per query): any integer array-like of shape (n,)."""
    array = _host_integers(values, what)
    if array.shape != (n,):
        raise ValueError(f"{what} must have shape ({n},), one int64 label each; got shape {array.shape}")
    return np.array(array, dtype=np.int64, copy=True)


def id_list(values, what: str) -> np.ndarray:
    """A 1-D integer array of ids (filter, remove, get, contains) as int64; negative ids are allowed
    here (no vector has one, so they are simply not in the index)."""
    array = _host_integers(values, what)
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of ids; got shape {array.shape}")
    return np.array(array, dtype=np.int64, copy=True)


def one_id(value, what: str) -> int:
    """A single id (for `id in index`): a Python or NumPy integer in int64's range, not a bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer id; got {value!r} ({type(value).__name__})")
    number = int(value)
    if not -INT64_MAX - 1 <= number <= INT64_MAX:
        raise ValueError(f"{what} must lie in int64's range; got {number}")
    return number


def radius(value, metric: str) -> float:
    """A finite real radius as float64; l2 (squared distances) also needs radius >= 0."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"radius must be a real number; got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"radius must be finite; got {number!r}")
    if metric == "l2" and number < 0:
        raise ValueError(f"radius for metric 'l2' (a squared distance) must be >= 0; got {number!r}")
    return number


__all__ = ["MAX_SEARCH_K", "id_list", "labels", "one_id", "query_count", "radius", "search_k"]
