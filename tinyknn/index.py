"""Index: owns the database and its ids, validates every input, and hands the work to a searcher.

No CUDA and no ctypes here: the CPU searcher (tinyknn.cpu) and the GPU searcher (tinyknn.gpu) are
imported lazily, so `import tinyknn` works on a machine with no GPU, driver or compiler.
"""

from __future__ import annotations

import io
import threading
from typing import Protocol

import numpy as np

from . import _persist, _validate
from ._ids import IdMap
from ._persist import FILE_FORMAT, FILE_VERSION  # noqa: F401 - re-exported for callers and tests
from .spec import numpy_dtype, parse_dim, parse_dtype, parse_metric

DEVICES = ("cpu", "cuda")


class Searcher(Protocol):
    """What a backend provides. Inputs arrive validated (host ndarrays or _validate.DeviceArray).

    Rows are numbered in the order they were added. `add` copies its rows before it returns (the
    caller reuses the array), and either takes all of them or raises with the searcher unchanged;
    `truncate(n_rows)` drops every row from n_rows on (the newest), so that an add handed over in
    several pieces can be undone when a later piece fails."""

    def add(self, vectors, ids: np.ndarray) -> None: ...
    def truncate(self, n_rows: int) -> None: ...
    def search(self, queries, k: int): ...
    def reset(self) -> None: ...
    def export(self) -> tuple[np.ndarray, np.ndarray]: ...
    def close(self) -> None: ...


def parse_device(device) -> str:
    text = str(device).lower() if isinstance(device, str) else device
    if text in DEVICES:
        return text
    if isinstance(text, str) and text.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (tinyknn uses the current CUDA device); got {device!r}")
    raise ValueError(f"device must be one of 'cpu', 'cuda'; got {device!r}")


def _make_searcher(device: str, dim: int, metric: str, dtype: str) -> Searcher:
    if device == "cpu":
        from .cpu.library import DTYPE_CODES
        from .cpu.searcher import CpuSearcher

        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype!r} is not available on device='cpu' (it stores "
                             f"{', '.join(map(repr, DTYPE_CODES))}); use one of those or device='cuda'")
        return CpuSearcher(dim=dim, metric=metric, dtype=dtype)
    from .gpu.searcher import GpuSearcher

    return GpuSearcher(dim=dim, metric=metric, dtype=dtype)


class Index:
    """Exact k-nearest-neighbour index.

    Index(dim, metric="l2" | "ip" | "cosine", dtype="float32" | "float16", device="cpu" | "cuda")

    - `l2` reports squared Euclidean distances (smallest first), `ip` inner products (largest first),
      `cosine` the cosine similarity (largest first); a zero vector has similarity 0 with everything.
    - The database is stored in `dtype`; distances are accumulated in float32. Queries are searched
      in float32 whatever the index's dtype.
    - Input conversion: see `tinyknn._validate` (float16/32/64 NumPy arrays and DLPack/CUDA arrays
      accepted, copied only when the dtype or layout differs; NaN, infinity, |x| > 2**50, masked
      arrays and non-float arrays refused).
    - Ids: int64 in 0 .. 2**63 - 1, unique in the index. Without ids, an add numbers its rows on from
      the largest id the index has held since it was created, loaded or reset (0, 1, 2, ... for an
      index of automatic ids), so automatic ids never collide with given ones.
    - An Index pickles and deep-copies (through the save format, in memory) onto the same device kind.
    """

    def __init__(self, dim: int, metric: str = "l2", dtype: str = "float32", device: str = "cpu"):
        self.dim = parse_dim(dim)
        self.metric = parse_metric(metric)
        self.dtype = parse_dtype(dtype)
        self._storage = numpy_dtype(self.dtype)
        self.device = parse_device(device)
        self._ids = IdMap()
        self._add_lock = threading.Lock()
        self._searcher: Searcher | None = _make_searcher(self.device, self.dim, self.metric, self.dtype)

    # -- the database -------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        """How many vectors the index holds."""
        return self._ids.count

    def __len__(self) -> int:
        return self.ntotal

    def __repr__(self) -> str:
        return (f"tinyknn.Index(dim={self.dim}, metric={self.metric!r}, dtype={self.dtype!r}, "
                f"device={self.device!r}, ntotal={self.ntotal})")

    def add(self, x, ids=None) -> None:
        """Add vectors x of shape (n, dim); `ids` are optional int64 ids (default: see the class doc).

        Host input is checked whole, then converted to the index's dtype and handed over in pieces
        of _validate.CHUNK_BYTES (no second full copy); CUDA input (device='cuda' only) is copied
        device to device without visiting the host. A failed add leaves the index as it was.
        """
        searcher = self._open_searcher()
        if self.device == "cuda" and _validate.is_device_array(x):
            vectors = _validate.device_matrix(x, self.dim, "vectors to add")
        else:
            vectors = _validate.host_rows(x, self.dim, self.dtype)
        n = vectors.shape[0]
        given = None if ids is None else _validate.user_ids(ids, n)
        with self._add_lock:
            new = self._ids.auto_ids(n) if given is None else given
            self._ids.check_new(new, given=given is not None)
            if n == 0:
                return
            self._hand_over(searcher, vectors, new)
            self._ids.commit(new)

    def _hand_over(self, searcher: Searcher, vectors, ids: np.ndarray) -> None:
        """Give the rows to the searcher; undo what it took if that fails part way.

        Host input in another dtype or layout is converted CHUNK_BYTES at a time into one reused
        buffer (never a full copy; a fresh allocation per piece would page-fault its memory in again
        every time), each piece handed over as it is ready. Input already in the storage dtype and
        C-contiguous, CUDA input, and any input to a searcher without truncate (an older backend) go
        over in one piece: the searcher copies them straight from where they are."""
        n_before, n = self._ids.count, len(ids)
        truncate = getattr(searcher, "truncate", None)
        convert = not isinstance(vectors, _validate.DeviceArray) and (
            vectors.dtype != self._storage or not vectors.flags.c_contiguous)
        step = max(1, _validate.CHUNK_BYTES // (self.dim * self._storage.itemsize))
        try:
            if not convert or truncate is None or n <= step:
                searcher.add(np.ascontiguousarray(vectors, dtype=self._storage) if convert else vectors, ids)
                return
            buffer = np.empty((step, self.dim), dtype=self._storage)
            for start in range(0, n, step):
                piece = buffer[:min(step, n - start)]
                np.copyto(piece, vectors[start:start + step], casting="unsafe")   # as ascontiguousarray does
                searcher.add(piece, ids[start:start + step])
        except BaseException:
            if truncate is not None:
                truncate(n_before)
            raise

    def search(self, q, k: int):
        """The k nearest database vectors of each query: (distances float32 (nq, k), ids int64 (nq, k)).

        Nearest first. Where k exceeds ntotal the rows are padded with id -1 and distance +inf
        (-inf for 'ip' and 'cosine'). Host input gives NumPy output; CuPy or torch CUDA input gives
        results of the same framework on the GPU, ordered after the caller's current stream.
        """
        searcher = self._open_searcher()
        k = _validate.check_k(k)
        if self.device == "cuda" and _validate.is_device_array(q):
            queries = _validate.device_matrix(q, self.dim, "queries")
        else:
            # The GPU searcher checks host float32 values itself, on the host while the device works.
            queries = _validate.host_queries(q, self.dim, self.device == "cpu")
        return searcher.search(queries, k)

    def reset(self) -> None:
        """Remove every vector (the index keeps its dim, metric, dtype and device)."""
        with self._add_lock:
            self._open_searcher().reset()
            self._ids.reset()

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the index's native or GPU memory now; the index cannot be used afterwards."""
        searcher, self._searcher = self._searcher, None
        if searcher is not None:
            searcher.close()

    def __enter__(self) -> "Index":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_searcher(self) -> Searcher:
        if self._searcher is None:
            raise ValueError("this Index was closed; create a new one")
        return self._searcher

    # -- persistence --------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the index to `path` (format: README 'File format'; an uncompressed NumPy .npz, version 1),
        or onto a binary file object (e.g. io.BytesIO) as it is.

        A path is written to a temporary file beside it and renamed over it: a failed save leaves no
        temporary file behind and any previous file at `path` intact."""
        if hasattr(path, "write"):
            self._write(path)
        else:
            _persist.save(path, self._write)

    def _write(self, handle) -> None:
        with self._add_lock:
            vectors, ids = self._open_searcher().export()
        _persist.write(handle, self.dim, self.metric, self.dtype, vectors, ids)

    @classmethod
    def load(cls, path, device: str = "cpu") -> "Index":
        """Read an index written by save() from a path or a binary file object.

        A damaged file, a file of another format version or one whose sizes disagree with its
        header is a ValueError (nothing larger than the file is allocated to find out)."""
        device = parse_device(device)
        return _persist.load(path, lambda dim, metric, dtype: cls(dim, metric=metric, dtype=dtype, device=device))

    def __reduce__(self):
        """Pickling and copy.deepcopy go through the save format in memory, onto the same device kind."""
        if self._searcher is None:
            raise ValueError("cannot pickle or copy a closed tinyknn Index")
        buffer = io.BytesIO()
        self._write(buffer)
        return _restore, (buffer.getvalue(), self.device)


def _restore(data: bytes, device: str) -> Index:
    return Index.load(io.BytesIO(data), device=device)
