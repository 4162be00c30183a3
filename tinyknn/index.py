"""Index: owns the database and its ids, validates every input, and hands the work to a searcher.

No CUDA and no ctypes here: the CPU searcher (tinyknn.cpu) and the GPU searcher (tinyknn.gpu) are
imported lazily, so `import tinyknn` works on a machine with no GPU, driver or compiler.
"""

from __future__ import annotations

import json
import os
import threading
import zipfile
from pathlib import Path
from typing import Protocol

import numpy as np

from . import _validate
from .spec import parse_dim, parse_dtype, parse_metric

FILE_FORMAT = "tinyknn.index"
FILE_VERSION = 1
DEVICES = ("cpu", "cuda")


class Searcher(Protocol):
    """What a backend provides. Inputs arrive validated (host ndarrays or _validate.DeviceArray)."""

    def add(self, vectors, ids: np.ndarray) -> None: ...
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
        from .cpu.searcher import CpuSearcher

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
    - Input conversion: see `tinyknn._validate` (float16/32/64 accepted, copied only when the dtype or
      layout differs; NaN, infinity, |x| > 2**50 and non-float arrays refused).
    """

    def __init__(self, dim: int, metric: str = "l2", dtype: str = "float32", device: str = "cpu"):
        self.dim = parse_dim(dim)
        self.metric = parse_metric(metric)
        self.dtype = parse_dtype(dtype)
        self.device = parse_device(device)
        self._ids = np.empty(0, dtype=np.int64)
        self._add_lock = threading.Lock()
        self._searcher: Searcher | None = _make_searcher(self.device, self.dim, self.metric, self.dtype)

    # -- the database -------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        """How many vectors the index holds."""
        return len(self._ids)

    def __len__(self) -> int:
        return self.ntotal

    def __repr__(self) -> str:
        return (f"tinyknn.Index(dim={self.dim}, metric={self.metric!r}, dtype={self.dtype!r}, "
                f"device={self.device!r}, ntotal={self.ntotal})")

    def add(self, x, ids=None) -> None:
        """Add vectors x of shape (n, dim); `ids` are optional int64 ids (default: 0, 1, ... in order).

        Host input is copied into the index in its dtype; CUDA input (device='cuda' only) is copied
        device to device without visiting the host.
        """
        searcher = self._open_searcher()
        vectors = self._checked(x, "vectors to add", lambda a: _validate.host_database(a, self.dim, self.dtype))
        n = vectors.shape[0]
        with self._add_lock:
            new = _validate.new_ids(ids, n, self._ids)
            if n == 0:
                return
            searcher.add(vectors, new)
            self._ids = np.concatenate([self._ids, new])

    def search(self, q, k: int):
        """The k nearest database vectors of each query: (distances float32 (nq, k), ids int64 (nq, k)).

        Nearest first. Where k exceeds ntotal the rows are padded with id -1 and distance +inf
        (-inf for 'ip' and 'cosine'). Host input gives NumPy output; CuPy or torch CUDA input gives
        results of the same framework on the GPU, ordered after the caller's current stream.
        """
        searcher = self._open_searcher()
        k = _validate.check_k(k)
        # The GPU searcher checks host float32 values itself, on the host while the device works.
        queries = self._checked(q, "queries", lambda a: _validate.host_queries(a, self.dim, self.device == "cpu"))
        return searcher.search(queries, k)

    def _checked(self, x, what: str, check_host):
        """CUDA input on a CUDA index is described in place; everything else goes through `check_host`,
        whose to_host_array refuses CUDA arrays on a CPU index with a TypeError that says how to move them."""
        if self.device == "cuda" and _validate.is_device_array(x):
            return _validate.device_matrix(x, self.dim, what)
        return check_host(x)

    def reset(self) -> None:
        """Remove every vector (the index keeps its dim, metric, dtype and device)."""
        with self._add_lock:
            self._open_searcher().reset()
            self._ids = np.empty(0, dtype=np.int64)

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
        """Write the index to `path` (format: README 'File format'; a NumPy .npz, version 1)."""
        vectors, ids = self._open_searcher().export()
        header = {
            "format": FILE_FORMAT, "version": FILE_VERSION, "dim": self.dim, "metric": self.metric,
            "dtype": self.dtype, "ntotal": int(len(ids)),
        }
        header_bytes = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        path = Path(path)
        temporary = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(temporary, "wb") as handle:
            np.savez(handle, header=header_bytes, vectors=vectors, ids=ids)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path, device: str = "cpu") -> "Index":
        """Read an index written by save(); a damaged file or another format version is a ValueError."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as archive:
                header = json.loads(bytes(archive["header"]).decode())
                vectors, ids = archive["vectors"], archive["ids"]
        except FileNotFoundError:
            raise
        except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a readable tinyknn index file ({type(exc).__name__}: {exc})") from None
        if not isinstance(header, dict) or header.get("format") != FILE_FORMAT:
            raise ValueError(f"{path} is not a tinyknn index file (format {header.get('format')!r})")
        if header.get("version") != FILE_VERSION:
            raise ValueError(
                f"{path} is tinyknn index format version {header.get('version')!r}; "
                f"this tinyknn reads version {FILE_VERSION}"
            )
        index = cls(header["dim"], metric=header["metric"], dtype=header["dtype"], device=device)
        expected = (header["ntotal"], header["dim"])
        if vectors.shape != expected or ids.shape != (header["ntotal"],) or vectors.dtype != np.dtype(header["dtype"]):
            raise ValueError(
                f"{path} is damaged: header says {expected} {header['dtype']} vectors, "
                f"file holds {vectors.shape} {vectors.dtype} vectors and {ids.shape} ids"
            )
        index.add(vectors, ids=ids)
        return index
