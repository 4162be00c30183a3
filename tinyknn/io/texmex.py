"""TEXMEX vectors (corpus-texmex.irisa.fr; FAISS's contrib/vecs_io.py reads them): `.fvecs` (float32),
`.bvecs` (uint8), `.ivecs` (int32). Every row is a little-endian int32 dimension d followed by d values,
so a file of n rows of dimension d is exactly n * (4 + d * itemsize) bytes. `.ivecs` also holds the
TEXMEX ground truth (the neighbour ids of each query, nearest first).

Before a file is mapped its size must be a whole number of rows of the first row's dimension, and the
dimension prefixes of the first row, the last row and an evenly spaced sample of rows must all agree
(a read of a slice also checks the prefixes of every row it returns): a ragged, truncated or mislabelled
file is a ValueError naming the file, what was found and what was expected.
"""

from __future__ import annotations

import numpy as np

from ._files import (atomic_write, check_slice, element_of, file_size, read_head, sample_positions, shown, unpack,
                     write_rows)

ELEMENTS = {".fvecs": np.dtype("<f4"), ".bvecs": np.dtype("u1"), ".ivecs": np.dtype("<i4")}
MAX_DIM = 1 << 24            # far beyond any real vector; a larger first prefix means this is not such a file


def _element(path, extension: str) -> np.dtype:
    return element_of(path, extension, ELEMENTS, "TEXMEX")


def _hint(size: int, dim: int, extension: str) -> str:
    """Which other TEXMEX element type the file's size fits, if any (a file with the wrong extension)."""
    for other, element in ELEMENTS.items():
        if other != extension and element.itemsize != ELEMENTS[extension].itemsize and \
                size % (4 + dim * element.itemsize) == 0:
            return f"; its size fits rows of {dim} {element.name} values: is it a {other} file?"
    return ""


def layout(path, extension: str) -> tuple[int, int]:
    """(rows, dim) of a TEXMEX file after the size and sampled-prefix checks."""
    element = _element(path, extension)
    size = file_size(path)
    if size == 0:
        raise ValueError(f"{shown(path)} is empty (0 bytes); a {extension} file holds rows of an int32 "
                         f"dimension followed by that many {element.name} values")
    if size < 4:
        raise ValueError(f"{shown(path)} is {size} bytes: too short for the 4-byte dimension of its first row")
    dim, = unpack("<i", read_head(path, 4))
    if not 0 < dim <= MAX_DIM:
        raise ValueError(f"{shown(path)}: the first row's dimension prefix is {dim}; expected an int32 in "
                         f"1 .. {MAX_DIM} (is this a {extension} file?)")
    row = 4 + dim * element.itemsize
    if size % row:
        raise ValueError(
            f"{shown(path)} is {size:,} bytes, not a whole number of {extension} rows of dimension {dim} "
            f"({row:,} bytes each): {size // row:,} rows and {size % row:,} bytes left over; the file is "
            f"truncated or ragged{_hint(size, dim, extension)}")
    n = size // row
    prefixes = np.memmap(path, dtype=np.uint8, mode="r", shape=(n, row))
    _check_prefixes(path, prefixes, sample_positions(n), dim)
    return n, dim


def _check_prefixes(path, prefixes: np.ndarray, positions: np.ndarray, dim: int, first: int = 0) -> None:
    """The int32 dimension of each row at `positions` of the (n, row bytes) uint8 map must be `dim`
    (`first`: the file row of prefixes[0], for the message)."""
    found = np.ascontiguousarray(prefixes[positions, :4]).view("<i4").reshape(-1)
    bad = np.flatnonzero(found != dim)
    if len(bad):
        row = first + int(positions[bad[0]])
        raise ValueError(f"{shown(path)} is ragged: row {row:,} has dimension prefix {int(found[bad[0]])}, "
                         f"the first row has {dim} ({len(bad)} of the {len(positions):,} rows checked differ)")


def open_vectors(path, extension: str) -> np.ndarray:
    """The file's (n, dim) rows as a read-only memory-mapped view (no row is read until used)."""
    element = _element(path, extension)
    n, dim = layout(path, extension)
    if element.itemsize == 4:
        whole = np.memmap(path, dtype=element, mode="r", shape=(n, dim + 1))
        return whole[:, 1:]
    whole = np.memmap(path, dtype=element, mode="r", shape=(n, dim + 4))
    return whole[:, 4:]


def read_vectors(path, extension: str, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start .. stop - 1 as an in-memory (stop - start, dim) array; their prefixes are checked too."""
    element = _element(path, extension)
    n, dim = layout(path, extension)
    start, stop = check_slice(path, n, start, stop)
    row = 4 + dim * element.itemsize
    raw = np.memmap(path, dtype=np.uint8, mode="r", shape=(n, row))[start:stop]
    if stop > start:
        _check_prefixes(path, raw, np.arange(stop - start), dim, first=start)
    values = np.ascontiguousarray(raw[:, 4:]).view(element).reshape(stop - start, dim)
    return values.astype(element.newbyteorder("="), copy=False)


def write_vectors(path, array, extension: str) -> None:
    """Write (n, dim) rows atomically; the array's dtype must convert to the extension's without loss."""
    element = _element(path, extension)
    shape = getattr(array, "shape", None)
    if shape is None:
        array = np.asarray(array)
        shape = array.shape
    if len(shape) != 2:
        raise ValueError(f"cannot write {shown(path)}: a {extension} file holds a 2-D array of rows; got shape "
                         f"{tuple(shape)}")
    dtype = np.dtype(array.dtype)
    if not np.can_cast(dtype, element, "safe"):
        raise ValueError(f"cannot write {shown(path)}: a {extension} file holds {element.name} values and "
                         f"{dtype.name} does not convert to it without loss; convert the array first "
                         "(or use the extension of its dtype)")
    n, dim = int(shape[0]), int(shape[1])
    if n == 0 or not 0 < dim <= MAX_DIM:
        raise ValueError(f"cannot write {shown(path)}: a {extension} file needs at least one row and a "
                         f"dimension in 1 .. {MAX_DIM}; got shape {tuple(shape)}")
    row = np.dtype([("dim", "<i4"), ("values", element, (dim,))])
    step = max(1, (64 << 20) // row.itemsize)
    with atomic_write(path) as handle:
        for begin in range(0, n, step):
            part = np.asarray(array[begin:begin + step])
            records = np.empty(len(part), dtype=row)
            records["dim"] = dim
            records["values"] = part
            write_rows(handle, records, row)
