"""The caller's result arrays: `search(q, k, out=(distances, ids))` and a prepared search's `out=`.

As NumPy's ufuncs take `out=`: the results are written into the caller's arrays and those same arrays are
returned. Every check is made before anything is written; a wrong array is a TypeError (not an array of the
right kind, or the wrong dtype) or ValueError (shape, layout, read-only, overlap) naming what was given and
what is expected.

- Host (NumPy) queries: two NumPy arrays (subclasses such as np.memmap too; masked arrays no), float32 and
  int64 (native byte order), shape exactly (n_queries, k), C-contiguous, writeable, not sharing memory with
  each other. Out arrays that may share memory with the queries are allowed: the queries are copied first,
  as a ufunc does.
- CUDA queries (a GPU index): two CUDA arrays of the framework the results would come back in (torch in,
  torch out; CuPy and every other CUDA array, CuPy out), float32 and int64, (n_queries, k), C-contiguous,
  writeable, not requiring grad, sharing no memory with each other or with the queries. They must be on
  the index's GPU (the GPU searcher checks that, it needs the driver).
"""

from __future__ import annotations

import numpy as np

from .arrays import DeviceArray, describe_device_array, is_device_array, name_of

_FLOAT32 = np.dtype(np.float32)
_INT64 = np.dtype(np.int64)
_WHAT = ("out[0] (distances)", "out[1] (ids)")
_DTYPES = (_FLOAT32, _INT64)


def checked(out, queries, k: int):
    """(the caller's pair, what the searcher writes into, the queries to search) for `out`: the caller's
    arrays as a tuple, the same NumPy arrays (host queries) or their DeviceArray descriptions (CUDA
    queries), and the queries (copied when host out arrays may overlap them). Raises before any write."""
    if isinstance(queries, DeviceArray):
        _pair_or_raise(out)
        return tuple(out), _device_pair(out, (queries.shape[0], k), queries), queries
    pair, queries = host(out, queries, (queries.shape[0], k))
    return pair, pair, queries


def host(out, queries: np.ndarray, shape: tuple[int, int]):
    """((distances, ids), queries) for host queries and the caller's `out` of `shape` (n_queries, k): the
    checks of the module docstring, the common case (two fresh C-contiguous arrays) in a few attribute
    reads; the queries are copied when they may share memory with out."""
    if out.__class__ is not tuple or len(out) != 2:
        _pair_or_raise(out)
    distances, ids = out
    if distances.__class__ is np.ndarray and ids.__class__ is np.ndarray and distances.dtype is _FLOAT32 and \
            ids.dtype is _INT64 and distances.shape == shape and ids.shape == shape:
        d_flags, i_flags = distances.flags, ids.flags
        if not (d_flags.c_contiguous and i_flags.c_contiguous and d_flags.writeable and i_flags.writeable):
            _host_pair(out, shape)                         # raises, naming the array and what is wrong
        owned = d_flags.owndata and i_flags.owndata       # two allocations of their own: they cannot overlap
    else:
        _host_pair(out, shape)
        owned = False
    if not owned and np.may_share_memory(distances, ids):
        raise ValueError("out[0] (distances) and out[1] (ids) share memory; pass two separate arrays")
    if not (owned and queries.flags.owndata and queries is not distances) and (
            np.may_share_memory(distances, queries) or np.may_share_memory(ids, queries)):
        queries = queries.copy()        # the results must not overwrite queries still to be read
    return (distances, ids), queries


def _pair_or_raise(out) -> None:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        shown = f"a {type(out).__name__} of length {len(out)}" if isinstance(out, (tuple, list)) else name_of(out)
        raise TypeError(f"out must be a pair (distances, ids) of arrays, as search returns them; got {shown}")


def _host_pair(out, shape: tuple[int, int]) -> None:
    """Raise for the first of the two host arrays that is not what `checked` expects."""
    for array, dtype, what in zip(out, _DTYPES, _WHAT):
        if array.__class__ is not np.ndarray:
            if is_device_array(array):
                raise TypeError(f"{what} is a CUDA array ({name_of(array)}) but the queries are host (NumPy) "
                                "arrays, whose results are NumPy arrays: pass NumPy arrays, or CUDA queries")
            if not isinstance(array, np.ndarray) or isinstance(array, np.ma.MaskedArray):
                raise TypeError(f"{what} must be a NumPy array ({dtype}, shape {shape}); got {name_of(array)}")
        if array.dtype != dtype:          # a byte-swapped float32 or int64 is not equal to them either
            raise TypeError(f"{what} must have dtype {dtype} (native byte order); got dtype {array.dtype.str}")
        if array.shape != shape:
            raise ValueError(f"{what} must have shape {shape} (n_queries, k); got shape {array.shape}")
        if not array.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous; got strides {array.strides} for shape {array.shape} "
                             "(pass np.empty(shape, dtype) or np.ascontiguousarray of it)")
        if not array.flags.writeable:
            raise ValueError(f"{what} is read-only; pass a writeable array")


def _device_pair(out, shape: tuple[int, int], queries: DeviceArray) -> tuple[DeviceArray, DeviceArray]:
    expected = "torch" if queries.framework == "torch" else "cupy"
    kind = "torch CUDA tensors" if expected == "torch" else "CuPy arrays"
    described = []
    for array, dtype, what in zip(out, _DTYPES, _WHAT):
        if not is_device_array(array):
            raise TypeError(f"{what} must be one of two {kind} ({queries.framework} CUDA queries give results of "
                            f"that kind); got {name_of(array)}")
        if getattr(array, "requires_grad", False):
            raise ValueError(f"{what} requires grad; tinyknn's results are not differentiable: pass a tensor "
                             "created without requires_grad")
        found = describe_device_array(array)
        if found.framework != expected:
            raise TypeError(f"{what} must be one of two {kind} ({queries.framework} CUDA queries give results of "
                            f"that kind); got {name_of(array)}")
        if found.dtype != dtype:
            raise TypeError(f"{what} must have dtype {dtype}; got dtype {getattr(array, 'dtype', found.dtype)}")
        if found.shape != shape:
            raise ValueError(f"{what} must have shape {shape} (n_queries, k); got shape {found.shape}")
        if not found.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous; got strides {found.strides} (bytes) for shape "
                             f"{found.shape}")
        if found.readonly:
            raise ValueError(f"{what} is read-only; pass a writeable array")
        described.append(found)
    distances, ids = described
    if _overlap(distances, ids):
        raise ValueError("out[0] (distances) and out[1] (ids) share memory; pass two separate arrays")
    if _overlap(distances, queries) or _overlap(ids, queries):
        raise ValueError("out shares memory with the CUDA queries, which are read while results are written; "
                         "pass result arrays of their own")
    return distances, ids


def _extent(array: DeviceArray) -> tuple[int, int]:
    """The bytes [start, stop) that an array's elements occupy (any strides); empty for an empty array."""
    if 0 in array.shape:
        return array.ptr, array.ptr
    item = array.dtype.itemsize
    if array.strides is None:
        return array.ptr, array.ptr + int(np.prod(array.shape)) * item
    reach = [(extent - 1) * step for extent, step in zip(array.shape, array.strides)]
    return array.ptr + sum(r for r in reach if r < 0), array.ptr + sum(r for r in reach if r > 0) + item


def _overlap(a: DeviceArray, b: DeviceArray) -> bool:
    a_start, a_stop = _extent(a)
    b_start, b_stop = _extent(b)
    return a_start < a_stop and b_start < b_stop and a_start < b_stop and b_start < a_stop


__all__ = ["checked", "host"]
