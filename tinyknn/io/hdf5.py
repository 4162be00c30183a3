"""ann-benchmarks' HDF5 files (ann_benchmarks/datasets.py): datasets `train` (the base, n x d), `test` (the
queries), `neighbors` (int32, nq x k, nearest first) and `distances` (float32, nq x k), and the file
attribute `distance` ('euclidean', 'angular', 'hamming', 'jaccard'; some derived sets write 'ip' or 'dot')
and `point_type` ('float'). h5py is an optional extra: it is imported only here, when a file is used.

h5py reads a slice of a dataset without reading the rest, so `open_vectors` gives an array-like over the
file and `read_vectors` reads only the rows asked for.
"""

from __future__ import annotations

import numpy as np

from ._files import atomic_path, check_slice, file_size, shown

DATASETS = ("train", "test", "neighbors", "distances")
CHUNK_ROWS_BYTES = 64 << 20


def h5py():
    try:
        import h5py as module
    except ImportError:
        raise ImportError("reading or writing ann-benchmarks HDF5 files needs h5py: pip install tinyknn[hdf5] "
                          "(or pip install h5py)") from None
    return module


def _open(path):
    module = h5py()
    size = file_size(path)
    if size == 0:
        raise ValueError(f"{shown(path)} is empty (0 bytes); expected an ann-benchmarks HDF5 file")
    try:
        return module.File(path, "r")
    except OSError as exc:
        raise ValueError(f"{shown(path)} is not a readable HDF5 file ({exc})") from None


def _dataset(handle, path, name: str, ndim: int = 2):
    if name not in handle:
        raise ValueError(f"{shown(path)} has no dataset {name!r}; it holds {sorted(handle.keys())} "
                         f"(an ann-benchmarks file holds {', '.join(DATASETS)})")
    dataset = handle[name]
    if not hasattr(dataset, "shape") or len(dataset.shape) != ndim or dataset.dtype.kind not in "fiub":
        raise ValueError(f"{shown(path)}: dataset {name!r} should be a {ndim}-D numeric array; got "
                         f"{getattr(dataset, 'shape', None)} of {getattr(dataset, 'dtype', type(dataset).__name__)}")
    return dataset


def distance_of(handle) -> str | None:
    value = handle.attrs.get("distance")
    if isinstance(value, bytes):
        value = value.decode()
    return None if value is None else str(value)


class HDF5Vectors:
    """A read-only (n, d) array-like over one dataset of an HDF5 file: shape, dtype, len() and slicing
    (which reads only the rows asked for). The file stays open until close() or garbage collection."""

    def __init__(self, path, name: str):
        self.path, self.name = path, name
        self._file = _open(path)
        try:
            self._dataset = _dataset(self._file, path, name)
        except BaseException:
            self._file.close()
            raise
        self.shape = tuple(int(s) for s in self._dataset.shape)
        self.dtype = np.dtype(self._dataset.dtype)
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, np.ndarray) and key.dtype.kind in "iu":      # h5py wants sorted unique points
            unique, inverse = np.unique(key, return_inverse=True)
            return self._dataset[unique.tolist()][inverse] if len(unique) else \
                np.empty((0,) + self.shape[1:], dtype=self.dtype)
        return self._dataset[key]

    def __array__(self, dtype=None, copy=None):
        values = self._dataset[()]
        return values if dtype is None else values.astype(dtype)

    def close(self) -> None:
        self._file.close()

    def __repr__(self) -> str:
        return f"HDF5Vectors({shown(self.path)!r}, {self.name!r}, shape={self.shape}, dtype={self.dtype})"


def open_vectors(path, name: str = "train") -> HDF5Vectors:
    return HDF5Vectors(path, name)


def read_vectors(path, name: str = "train", start: int = 0, stop: int | None = None) -> np.ndarray:
    with _open(path) as handle:
        dataset = _dataset(handle, path, name)
        start, stop = check_slice(path, dataset.shape[0], start, stop)
        return np.asarray(dataset[start:stop])


def read_knn(path, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(ids int64, distances float32, the `distance` attribute) of queries start .. stop - 1."""
    with _open(path) as handle:
        neighbors = _dataset(handle, path, "neighbors")
        distances = _dataset(handle, path, "distances")
        if neighbors.shape != distances.shape:
            raise ValueError(f"{shown(path)}: 'neighbors' has shape {neighbors.shape} but 'distances' "
                             f"{distances.shape}")
        start, stop = check_slice(path, neighbors.shape[0], start, stop, "queries")
        return (np.asarray(neighbors[start:stop]).astype(np.int64),
                np.asarray(distances[start:stop]).astype(np.float32), distance_of(handle))


def attributes(path) -> dict:
    with _open(path) as handle:
        return {key: (value.decode() if isinstance(value, bytes) else value) for key, value in handle.attrs.items()}


def _copy_rows(handle, name: str, source) -> None:
    shape = tuple(int(s) for s in source.shape)
    dtype = np.dtype(source.dtype)
    target = handle.create_dataset(name, shape, dtype=dtype)
    step = max(1, CHUNK_ROWS_BYTES // max(1, int(np.prod(shape[1:])) * dtype.itemsize))
    for start in range(0, shape[0], step):
        target[start:start + step] = np.asarray(source[start:start + step])


def write(path, neighbors, distances, distance: str, train=None, test=None, point_type: str = "float",
          extra_attributes: dict | None = None) -> None:
    """Write an ann-benchmarks file atomically: `neighbors` as int32, `distances` as float32, and, when
    given, `train` and `test` (copied in chunks from any array-like, e.g. a memory map)."""
    module = h5py()
    neighbors = np.asarray(neighbors)
    if neighbors.ndim != 2 or np.shape(distances) != neighbors.shape:
        raise ValueError(f"cannot write {shown(path)}: neighbors and distances must be 2-D of one shape; got "
                         f"{neighbors.shape} and {np.shape(distances)}")
    if neighbors.size and (int(neighbors.max()) > (1 << 31) - 1 or int(neighbors.min()) < -1):
        raise ValueError(f"cannot write {shown(path)}: ann-benchmarks stores neighbours as int32; got ids "
                         f"{int(neighbors.min()):,} .. {int(neighbors.max()):,}")
    distances = np.asarray(distances)
    if not np.can_cast(distances.dtype, np.float32, "safe"):
        raise ValueError(f"cannot write {shown(path)}: distances must be float32; got {distances.dtype}")
    with atomic_path(path) as temporary:
        with module.File(temporary, "w") as handle:
            handle.attrs["distance"] = distance
            handle.attrs["point_type"] = point_type
            for key, value in (extra_attributes or {}).items():
                handle.attrs[key] = value
            if train is not None:
                _copy_rows(handle, "train", train)
            if test is not None:
                _copy_rows(handle, "test", test)
            handle.create_dataset("neighbors", data=neighbors.astype(np.int32))
            handle.create_dataset("distances", data=distances.astype(np.float32))


def write_vectors(path, array, name: str = "train") -> None:
    """Write a new HDF5 file holding `array` as dataset `name` (atomically; copied in chunks)."""
    module = h5py()
    if len(getattr(array, "shape", np.shape(array))) != 2:
        raise ValueError(f"cannot write {shown(path)}: vectors must be a 2-D array; got shape {np.shape(array)}")
    if not hasattr(array, "dtype"):
        array = np.asarray(array)
    with atomic_path(path) as temporary:
        with module.File(temporary, "w") as handle:
            _copy_rows(handle, name, array)
