"""The base and the queries of a ground-truth run: arrays or files (memory-mapped through tinyknn.io), read a
block of rows at a time, and their fingerprint (sizes and a hash of sampled rows)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from .. import io as tio

FINGERPRINT_ROWS = 64


def is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike))


class Source:
    """A (n, d) array-like: a NumPy array (or anything with shape and row slicing), or a file path
    (`FILE.hdf5` means its `default_dataset`; `FILE.hdf5:test` names one)."""

    def __init__(self, value, what: str, default_dataset: str = "train"):
        self.what = what
        self.path = os.fspath(value) if is_path(value) else None
        if self.path is not None:
            file, name = tio.split_dataset(self.path)
            hdf5 = tio.extension_of(self.path) in (".hdf5", ".h5")
            self.array = tio.open_vectors(file if hdf5 else self.path, (name or default_dataset) if hdf5 else None)
        elif hasattr(value, "shape") and hasattr(value, "__getitem__") and hasattr(value, "dtype"):
            self.array = value
        else:
            self.array = np.asarray(value)
        shape = tuple(int(s) for s in self.array.shape)
        if len(shape) != 2 or shape[1] < 1:
            raise ValueError(f"{what} must be a 2-D array of rows (n, dim); got shape {shape}"
                             + (f" from {self.path}" if self.path else ""))
        self.shape = shape
        self.dtype = np.dtype(self.array.dtype)

    @property
    def name(self) -> str:
        return self.path if self.path is not None else f"<{type(self.array).__name__} {self.shape}>"

    def rows(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.array[start:stop])

    def read(self, start: int, stop: int, into: np.ndarray | None = None) -> np.ndarray:
        """Rows start..stop in memory of their own: a memory-mapped file's by one pread (the kernel's
        sequential read-ahead, no page faults in the caller), anything else copied. into: a (>= stop - start,
        dim) array of the source's dtype to read them into (its first stop - start rows are returned)."""
        array = self.array
        out = None if into is None else into[:stop - start]
        if isinstance(array, np.memmap) and array.flags.c_contiguous and getattr(array, "filename", None):
            if out is None:
                out = np.empty((stop - start, self.shape[1]), dtype=self.dtype)
            view, offset = memoryview(out).cast("B"), array.offset + start * self.shape[1] * self.dtype.itemsize
            with open(array.filename, "rb", buffering=0) as handle:
                while len(view):
                    got = os.preadv(handle.fileno(), [view], offset)
                    if got <= 0:
                        raise ValueError(f"{self.name} ended early: rows {start:,}..{stop:,} could not be read")
                    view, offset = view[got:], offset + got
            return out
        if out is None:
            return np.array(self.rows(start, stop))
        np.copyto(out, self.rows(start, stop))
        return out

    def take(self, positions: np.ndarray) -> np.ndarray:
        """Rows at any positions (any order, repeats allowed), read in ascending order."""
        positions = np.asarray(positions, dtype=np.int64)
        unique, inverse = np.unique(positions, return_inverse=True)
        if not len(unique):
            return np.empty((0, self.shape[1]), dtype=self.dtype)
        return np.asarray(self.array[unique])[inverse.reshape(-1)]

    def fingerprint(self, n: int) -> dict:
        """Sizes and a BLAKE2b hash of FINGERPRINT_ROWS evenly spaced rows (the first and the last among them)
        of the first n rows: enough to tell two inputs apart without reading either whole."""
        positions = np.unique(np.linspace(0, n - 1, num=min(n, FINGERPRINT_ROWS)).astype(np.int64)) if n else []
        digest = hashlib.blake2b(digest_size=16)
        digest.update(json.dumps([n, self.shape[1], self.dtype.str]).encode())
        if len(positions):
            rows = np.ascontiguousarray(self.take(positions), dtype=self.dtype.newbyteorder("<"))
            digest.update(np.asarray(positions, dtype="<i8").tobytes())
            digest.update(rows.tobytes())
        result = {"rows": int(n), "dim": self.shape[1], "dtype": self.dtype.name, "sampled_rows": len(positions),
                  "sample_blake2b": digest.hexdigest()}
        if self.path is not None:
            file = tio.split_dataset(self.path)[0]
            result.update(file=self.path, file_bytes=os.path.getsize(file))
        return result

    def close(self) -> None:
        close = getattr(self.array, "close", None)
        if callable(close) and not isinstance(self.array, np.ndarray):
            close()


def open_pair(base, queries) -> tuple[Source, Source]:
    """Sources of the base and the queries; one HDF5 file named for both gives its `train` and its `test`."""
    same = is_path(base) and is_path(queries) and os.fspath(base) == os.fspath(queries)
    base_source = Source(base, "the base")
    try:
        query_source = Source(queries, "the queries", default_dataset="test" if same else "train")
    except BaseException:
        base_source.close()
        raise
    if query_source.shape[1] != base_source.shape[1]:
        base_source.close()
        query_source.close()
        raise ValueError(f"the queries ({query_source.name}) have dimension {query_source.shape[1]} but the base "
                         f"({base_source.name}) {base_source.shape[1]}")
    return base_source, query_source


class FirstRows:
    """The first n rows of a Source as an array-like that reads only what is sliced (for writers that copy
    a base into an output file chunk by chunk)."""

    def __init__(self, source: Source, n: int):
        self.source, self.shape, self.dtype = source, (n, source.shape[1]), source.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        start, stop, step = key.indices(self.shape[0])
        return self.source.rows(start, stop)[::step]
