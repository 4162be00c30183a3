"""The GPU searcher's buffers: named device and pinned buffers grown on demand (a failed allocation leaves the
old one in place), the database rows' capacity, and the device-memory cap (TINYKNN_DEVICE_MEMORY_LIMIT) with
MemoryErrors that say what was asked for, what is in use and what is free."""

from __future__ import annotations

import numpy as np

from ..config import get_config
from ..errors import CudaError
from . import plan as plans
from .launcher import ReplayedIssue
from .memory import DeviceBuffer, PinnedBuffer

SCRATCH_ALIGN = 256             # bytes between a call's scratch slices (cuMemAlloc's own alignment)


class DeviceSlice(DeviceBuffer):
    """`nbytes` of a DeviceBuffer from `offset`, with its copies and fills; close() closes the whole buffer
    (every slice of it), so a call closes its slices in any order, any number of times."""

    def __init__(self, whole: DeviceBuffer, offset: int, nbytes: int):
        self.whole, self.nbytes, self.ptr = whole, nbytes, whole.ptr + offset
        self.handle = type(whole.handle)(self.ptr)

    @property
    def _open(self) -> bool:
        return self.whole._open

    def close(self) -> None:
        self.whole.close()

    def __repr__(self) -> str:
        return f"DeviceSlice(nbytes={self.nbytes}, ptr={self.ptr:#x}{', closed' if self.closed else ''})"


class Buffers:
    """Mixin of GpuSearcher: its `_buffers` by name, the rows' capacity and the plan cache they invalidate."""

    def _device(self, name: str, nbytes: int) -> DeviceBuffer:
        return self._buffer(name, nbytes, DeviceBuffer)

    def _pinned(self, name: str, nbytes: int) -> PinnedBuffer:
        return self._buffer(name, nbytes, PinnedBuffer)

    def _allocate(self, kind, size: int, what: str, pending: int = 0):
        """A new buffer of `size` bytes; device memory beyond the configured cap
        (TINYKNN_DEVICE_MEMORY_LIMIT) or beyond what the GPU has free is a MemoryError that says how much
        was asked for, what is in use and what is free (nothing is changed). `pending`: bytes of this
        call's other scratch buffers, counted as in use."""
        if kind is DeviceBuffer:
            limit = get_config().device_memory_limit
            in_use = pending + sum(b.nbytes for b in self._buffers.values() if isinstance(b, DeviceBuffer))
            if limit is not None and in_use + size > limit:
                raise MemoryError(
                    f"this GPU index needs {size:,} more bytes of device memory for {what} ({in_use:,} in use); "
                    f"TINYKNN_DEVICE_MEMORY_LIMIT allows {limit:,} bytes")
        try:
            return kind(size)
        except CudaError as exc:
            if exc.error_name != "CUDA_ERROR_OUT_OF_MEMORY":
                raise
            from cuda.bindings import driver

            _, free, total = driver.cuMemGetInfo()
            place = "device" if kind is DeviceBuffer else "pinned host"
            raise MemoryError(f"this GPU index needs {size:,} more bytes of {place} memory for {what}; the GPU has "
                              f"{int(free):,} of {int(total):,} bytes free") from None

    def _scratch(self, what: str, *sizes: int) -> list[DeviceBuffer]:
        """Device buffers of one call (the caller closes them), allocated as the index's own are: the
        configured cap counts them with what the index holds, and a GPU out of memory is a MemoryError;
        all of them or none."""
        made: list[DeviceBuffer] = []
        try:
            for size in sizes:
                made.append(self._allocate(DeviceBuffer, size, what, pending=sum(b.nbytes for b in made)))
        except BaseException:
            for buffer in made:
                buffer.close()
            raise
        return made

    def _scratch_slices(self, what: str, *sizes: int) -> list[DeviceBuffer]:
        """As _scratch, in one allocation carved into slices (SCRATCH_ALIGN apart; closing one closes all):
        cuMemAlloc and cuMemFree cost ~20 us each on the H200's host, and a range search asked for six
        twice a batch."""
        starts, total = [], 0
        for size in sizes:
            starts.append(total)
            total += -(-size // SCRATCH_ALIGN) * SCRATCH_ALIGN
        whole = self._allocate(DeviceBuffer, total, what)
        return [DeviceSlice(whole, start, size) for start, size in zip(starts, sizes)]

    def _buffer(self, name, nbytes, kind):
        """The named buffer, grown (doubling, or exactly when doubling does not fit) when too small;
        growth invalidates the plans. A failed allocation leaves the old buffer in place."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            size = max(nbytes, 2 * buffer.nbytes if buffer is not None else 0, 64)
            try:
                grown = self._allocate(kind, size, f"{name!r} ({size:,} bytes)")
            except MemoryError:
                if size == max(nbytes, 64):
                    raise
                grown = self._allocate(kind, max(nbytes, 64), f"{name!r} ({nbytes:,} bytes)")
            size = grown.nbytes
            if buffer is not None:
                self._stream.synchronize()     # nothing enqueued may still use the old one
                buffer.close()
            buffer = grown
            if kind is PinnedBuffer:
                buffer.array(np.uint8, size)[:] = 0   # the query padding columns stay zero forever
            else:
                buffer.fill_bytes(0, size, self._stream)   # e.g. the bounds start at "none yet"
            self._buffers[name] = buffer
            self._forget_plans()
        return buffer

    def _reserve(self, rows: int) -> None:
        """Room for `rows` database rows; existing rows move to the new buffers on the stream. Every new
        buffer is allocated before any old one is released, so a MemoryError leaves the index as it was."""
        if rows <= self._capacity:
            return
        sizes = {"data": self._row_bytes, "ids": 8, "norms": 4 if self.metric in ("cosine", "l2") else 0}
        try:
            capacity = max(rows, 2 * self._capacity, 1024)
            new = self._allocate_rows(sizes, capacity)
        except MemoryError:
            capacity = rows                     # doubling does not fit: exactly what is needed
            new = self._allocate_rows(sizes, capacity)
        for name, buffer in new.items():
            old = self._buffers.get(name)
            if old is not None and self._n:
                buffer.copy_from_device(old.ptr, self._n * sizes[name], self._stream)
        self._stream.synchronize()
        for name, buffer in new.items():
            old = self._buffers.get(name)
            self._buffers[name] = buffer
            if old is not None:
                old.close()
        self._capacity = capacity
        self._forget_plans()

    def _allocate_rows(self, sizes: dict[str, int], capacity: int) -> dict[str, DeviceBuffer]:
        new: dict[str, DeviceBuffer] = {}
        try:
            for name, per_row in sizes.items():
                if per_row:
                    new[name] = self._allocate(DeviceBuffer, capacity * per_row,
                                               f"{capacity:,} rows of {name} ({capacity * per_row:,} bytes)")
        except MemoryError:
            for buffer in new.values():
                buffer.close()
            raise
        return new

    def _evict_plans(self, keep: int) -> None:
        """The plan cache cut to its `keep` most recent entries, each one dropped closed (a host batch's or a
        screen's steps' CUDA graphs); a host batch's drop moves _plan_generation (a prepared search may hold it)."""
        while len(self._plans) > keep:
            _, dropped = self._plans.popitem(last=False)
            if isinstance(dropped, ReplayedIssue):
                dropped.close()
            if isinstance(dropped, plans.HostBatch):
                self._plan_generation += 1

    def _forget_plans(self) -> None:
        for batch in self._plans.values():
            if isinstance(batch, ReplayedIssue):   # a host batch or a screen's steps (their CUDA graphs)
                batch.close()
        self._plans.clear()

    def _pointer(self, name: str) -> int:
        buffer = self._buffers.get(name)
        return 0 if buffer is None else buffer.ptr
