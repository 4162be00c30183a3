"""NumPy `.npy` files: mapped with np.load(mmap_mode="r") (the header is NumPy's own; pickles are refused),
written atomically with np.save onto a temporary file beside the target."""

from __future__ import annotations

import numpy as np

from ._files import atomic_write, check_slice, file_size, shown


def open_array(path, ndim: int | None = 2) -> np.ndarray:
    size = file_size(path)
    if size == 0:
        raise ValueError(f"{shown(path)} is empty (0 bytes); expected a NumPy .npy file")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:            # a bad header, object arrays, or data shorter than the header says
        raise ValueError(f"{shown(path)} is not a readable .npy file of numbers ({exc})") from None
    except OSError as exc:
        raise ValueError(f"{shown(path)} is not a readable .npy file ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{shown(path)} holds a {type(array).__name__}, not one array (an .npz archive?)")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{shown(path)} holds an array of shape {array.shape}; expected {ndim}-D")
    if array.dtype.kind not in "fiub":
        raise ValueError(f"{shown(path)} holds dtype {array.dtype}; expected numbers")
    return array


def read_rows(path, start: int = 0, stop: int | None = None, ndim: int | None = 2) -> np.ndarray:
    array = open_array(path, ndim)
    start, stop = check_slice(path, array.shape[0], start, stop)
    return np.array(array[start:stop])


def write_array(path, array) -> None:
    if not hasattr(array, "dtype"):
        array = np.asarray(array)
    with atomic_write(path) as handle:
        np.save(handle, np.asarray(array), allow_pickle=False)
