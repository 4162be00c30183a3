"""The host-memory tier's chunk workers (gpu/host_tier.py): GpuSearchers that share one device-memory
budget and take turns on the bus.

Budget: TINYKNN_DEVICE_MEMORY_LIMIT caps the tier's workers together (each GpuSearcher alone would check
only its own buffers). Bus: a chunk's host-to-device copy waits on the device for the previous chunk's, and
nothing small is copied per chunk (local ids once, a search's queries once), because a small copy queues
behind the other worker's chunk and would keep the two workers in lockstep (copy, copy, search, search).
"""

from __future__ import annotations

import threading

import numpy as np

from ..config import get_config
from .memory import DeviceBuffer, Event
from .searcher import GpuSearcher


class Budget:
    """The device memory of the tier's workers together, checked against the configured cap."""

    def __init__(self):
        self.lock = threading.Lock()
        self.members: list[GpuSearcher] = []

    def in_use(self) -> int:
        return sum(b.nbytes for m in self.members for b in list(getattr(m, "_buffers", {}).values())
                   if isinstance(b, DeviceBuffer))


class Bus:
    """The order of the workers' chunk copies: each copy waits (on the device) for the previous one."""

    def __init__(self):
        self.lock = threading.Lock()
        self.last: Event | None = None


class ChunkWorker(GpuSearcher):
    """A GpuSearcher whose device allocations count against the tier's shared budget, and whose host rows
    cross the bus as one copy per chunk, queued on the device behind the other worker's copy (so the copies
    run back to back and never wait for an ingest or a search). Its plans live for one chunk (an add
    forgets them), so capturing CUDA graphs would only cost."""

    use_graphs = False
    single_shadow = False   # a chunk is searched once per load: making its float16 shadow would cost more than it saves
    keeps_queries = True    # the screen uploads a search's queries once for all chunks (forget_queries)

    def __init__(self, dim: int, metric: str, dtype: str, budget: Budget, bus: Bus):
        self._budget, self._bus = budget, bus
        budget.members.append(self)
        super().__init__(dim, metric, dtype)
        self._copied = Event(timing=False)
        self._ids_held = (0, 0)     # (rows, ids buffer address): the device holds local ids 0 .. rows-1 there
        self.kept_queries = None    # (queries, screen_q32 address) the screen uploaded (screen.Screen._upload)

    def forget_queries(self) -> None:
        """A new search: its queries must be uploaded again."""
        self.kept_queries = None

    def _copy_ids(self, ids: np.ndarray, n: int) -> None:
        """Every chunk's ids are the local 0 .. n-1, copied once: a per-chunk copy would queue on the bus
        behind the other worker's chunk and hold this worker's add until that chunk is across."""
        buffer = self._buffers["ids"]
        held, at = self._ids_held
        if self._n == 0 and n <= held and at == buffer.ptr:
            return
        super()._copy_ids(ids, n)
        if self._n == 0 and n and ids[0] == 0 and ids[-1] == n - 1:
            self._ids_held = (n, buffer.ptr)

    def _add_host(self, vectors: np.ndarray, data_ptr: int, norms_ptr: int) -> None:
        """GpuSearcher._add_host in one piece: the chunk -> 'add_source' (one DMA after the previous
        chunk's), then the ingest kernel into the rows."""
        source = self._device("add_source", vectors.nbytes)
        with self._bus.lock:
            if self._bus.last is not None:
                self._stream.wait(self._bus.last)
            source.copy_from_host(vectors, vectors.nbytes, self._stream)
            self._copied.record(self._stream)
            self._bus.last = self._copied
        self._ingest(source.ptr, vectors.dtype, self.dim, len(vectors), self.dtype, data_ptr, norms_ptr, True)

    def close(self) -> None:
        with self._bus.lock:
            if self._bus.last is self._copied:
                self._bus.last = None
        super().close()
        self._copied.close()

    def _allocate(self, kind, size: int, what: str, pending: int = 0):
        if kind is not DeviceBuffer:
            return super()._allocate(kind, size, what)
        with self._budget.lock:
            limit = get_config().device_memory_limit
            in_use = self._budget.in_use() + pending
            if limit is not None and in_use + size > limit:
                raise MemoryError(
                    f"this host-storage GPU index needs {size:,} more bytes of device memory for {what} ({in_use:,} "
                    f"in use by its {len(self._budget.members)} chunk workers); TINYKNN_DEVICE_MEMORY_LIMIT allows "
                    f"{limit:,} bytes")
            return super()._allocate(kind, size, what)     # (its own check counts this worker's buffers only)


__all__ = ["Budget", "Bus", "ChunkWorker"]
