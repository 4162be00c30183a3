"""The host-memory tier's database: rows in their storage dtype and their ids, in host memory that grows.

Pinned (page-locked) by default, so that every chunk goes to the GPU as one DMA at full PCIe speed;
`allocate` may be replaced (tests on machines without a GPU pass plain NumPy memory). Rows are dense
(n, dim), the layout the GPU ingest reads; growth doubles (or takes exactly what is asked when that is
larger), and every new allocation happens before anything old is released, so a failed growth leaves
the rows as they were.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import CudaError

# allocate(nbytes) -> (a uint8 array of nbytes, a function that frees it)
Allocate = Callable[[int], tuple[np.ndarray, Callable[[], None]]]
MIN_CAPACITY = 1024


def pinned_memory(nbytes: int) -> tuple[np.ndarray, Callable[[], None]]:
    """`nbytes` of page-locked host memory (cuMemHostAlloc), as a uint8 array and its free function."""
    from .memory import PinnedBuffer

    try:
        buffer = PinnedBuffer(nbytes)
    except CudaError as exc:
        if exc.error_name != "CUDA_ERROR_OUT_OF_MEMORY":
            raise
        raise MemoryError(f"storage='host' needs {nbytes:,} more bytes of pinned host memory; the driver "
                          "could not page-lock that much") from None
    return buffer.array(np.uint8, nbytes), buffer.close


def plain_memory(nbytes: int) -> tuple[np.ndarray, Callable[[], None]]:
    """Ordinary NumPy memory (tests without a GPU)."""
    return np.empty(nbytes, dtype=np.uint8), lambda: None


class HostRows:
    """Rows 0 .. n-1 (`rows[:n]`, `ids[:n]`) of the tier's database."""

    def __init__(self, dim: int, dtype: np.dtype, allocate: Allocate = pinned_memory):
        self.dim, self.dtype, self._allocate = dim, np.dtype(dtype), allocate
        self.n = 0
        self.rows = np.empty((0, dim), dtype=self.dtype)
        self.ids = np.empty(0, dtype=np.int64)
        self._frees: list[Callable[[], None]] = []

    @property
    def capacity(self) -> int:
        return len(self.ids)

    def reserve(self, n_rows: int, exact: bool = False) -> None:
        """Room for n_rows rows (exact: no more than that, e.g. a benchmark that knows its size)."""
        if n_rows <= self.capacity:
            return
        capacity = n_rows if exact else max(n_rows, 2 * self.capacity, MIN_CAPACITY)
        row_bytes = self.dim * self.dtype.itemsize
        rows_memory, free_rows = self._allocate(capacity * row_bytes)
        try:
            ids_memory, free_ids = self._allocate(capacity * 8)
        except BaseException:
            free_rows()
            raise
        rows = rows_memory[:capacity * row_bytes].view(self.dtype).reshape(capacity, self.dim)
        ids = ids_memory[:capacity * 8].view(np.int64)
        rows[:self.n] = self.rows[:self.n]
        ids[:self.n] = self.ids[:self.n]
        old, self._frees = self._frees, [free_rows, free_ids]
        self.rows, self.ids = rows, ids
        for free in old:
            free()

    def append(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        count = len(ids)
        self.reserve(self.n + count)
        self.rows[self.n:self.n + count] = vectors
        self.ids[self.n:self.n + count] = ids
        self.n += count

    def append_with(self, count: int, write: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Append `count` rows that write(rows_view, ids_view) fills in place (no staging copy)."""
        self.reserve(self.n + count)
        write(self.rows[self.n:self.n + count], self.ids[self.n:self.n + count])
        self.n += count

    def truncate(self, n_rows: int) -> None:
        if not 0 <= n_rows <= self.n:
            raise ValueError(f"truncate: n_rows must be between 0 and {self.n}; got {n_rows}")
        self.n = n_rows

    def remove(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Swap-remove the sorted unique `positions`: the last live rows fill the holes. (moved_from, moved_to)."""
        if len(positions) and (positions[0] < 0 or positions[-1] >= self.n):
            raise ValueError(f"remove_rows: positions must be in [0, {self.n}); got {positions[0]}..{positions[-1]}")
        n_new = self.n - len(positions)
        holes = positions[positions < n_new]
        movers = np.setdiff1d(np.arange(n_new, self.n, dtype=np.int64), positions, assume_unique=True)
        self.rows[holes] = self.rows[movers]
        self.ids[holes] = self.ids[movers]
        self.n = n_new
        return movers, holes

    def get(self, positions: np.ndarray) -> np.ndarray:
        if len(positions) and (positions.min() < 0 or positions.max() >= self.n):
            raise ValueError(f"get_rows: positions must be in [0, {self.n})")
        return self.rows[positions]       # fancy indexing: a fresh copy

    def close(self) -> None:
        frees, self._frees = self._frees, []
        self.rows, self.ids, self.n = np.empty((0, self.dim), dtype=self.dtype), np.empty(0, dtype=np.int64), 0
        for free in frees:
            free()


__all__ = ["HostRows", "pinned_memory", "plain_memory"]
