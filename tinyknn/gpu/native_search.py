"""A prepared one-query search issued from native code (kernels/cpu/gpu_call.cpp, `tk_gpu_search_one`).

A one-query search on the GPU is a graph replay and a wait: from Python, the launch and the wait through
cuda.bindings and the layers around them cost several microseconds that C++ issuing the same calls does not pay
(bench/launch_overhead.py). Here one ctypes call (the GIL released) launches the batch's captured graph, checks the
staged query's values while the device works (the contract's check: finite, |x| <= MAX_ABS_VALUE), waits, and copies
the answer. The driver's functions come as pointers from cuGetProcAddress, so tinyknn's native library (the CPU
library, which gains this one function) never links CUDA; where that library is not built yet, or the driver
gives no pointer, searches keep the Python path: nothing here ever waits for a compile.

Used by GpuSearcher._search_host_batch for a one-query host batch whose graph is captured and whose kernel writes
the answer into pinned staging (a prepared search's, or Index.search's of a shape seen before) when USE_NATIVE
is set.
"""

from __future__ import annotations

import ctypes
import functools
import logging

from cuda.bindings import driver

from ..inputs.validate import MAX_ABS_VALUE

USE_NATIVE = False      # measured against the Python path before it becomes the default (bench/launch_overhead.py)
REFUSED, UNPROVEN, INCOMPLETE = -1, -2, -3    # tk_gpu_search_one's own codes (tinyknn_cpu.h); > 0: a CUresult
_DRIVER_VERSION = 12000         # the ABI of cuGraphLaunch / cuStreamSynchronize asked of cuGetProcAddress

_log = logging.getLogger("tinyknn.gpu")
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_SYNCHRONIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class TkGpuSearch(ctypes.Structure):
    """tk_gpu_search (kernels/cpu/tinyknn_cpu.h)."""

    _fields_ = [("graph_launch", _LAUNCH), ("stream_synchronize", _SYNCHRONIZE), ("graph", ctypes.c_void_p),
                ("stream", ctypes.c_void_p), ("stage", ctypes.c_void_p), ("distances", ctypes.c_void_p),
                ("ids", ctypes.c_void_p), ("status", ctypes.c_void_p), ("dim", ctypes.c_int64),
                ("k", ctypes.c_int64), ("max_abs", ctypes.c_float)]


def _entry(name: str) -> int:
    """The driver's function `name` as an address (0 where the driver gives none)."""
    try:
        found = driver.cuGetProcAddress(name.encode(), _DRIVER_VERSION,
                                        driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
    except Exception as exc:  # noqa: BLE001 - bindings or a driver without it: the Python path, said in the log
        _log.debug("cuGetProcAddress(%s) failed: %s: %s", name, type(exc).__name__, exc)
        return 0
    if int(found[0]) or len(found) < 2 or not int(found[1]):
        _log.debug("cuGetProcAddress(%s) gave no function: %r", name, found)
        return 0
    return int(found[1])


@functools.lru_cache(maxsize=1)
def driver_entries() -> tuple[int, int] | None:
    """(cuGraphLaunch, cuStreamSynchronize) as function addresses, or None where either is missing."""
    launch, synchronize = _entry("cuGraphLaunch"), _entry("cuStreamSynchronize")
    return (launch, synchronize) if launch and synchronize else None


_not_ready = False      # the library was looked for and not found: not looked for again until it is loaded


def native_library():
    """tinyknn's native library when it is loaded, prebuilt or cached (never built here), else None. A miss
    (a few milliseconds: the cache and the compiler looked at) is remembered until something loads the library."""
    global _not_ready
    from ..cpu.library import get_library, ready_library

    if _not_ready and not get_library.cache_info().currsize:
        return None
    found = ready_library()
    _not_ready = found is None
    return found


class NativeSearch:
    """One host batch's search as one native call: `run(out_distances_address, out_ids_address)` (0: not copied
    there) after the query was staged; returns 0, UNPROVEN, REFUSED or a CUresult. Kept on its batch
    (HostBatch.native), whose graph and pinned staging it uses: it goes with the batch."""

    def __init__(self, library, batch, stream, dim: int, k: int, entries: tuple[int, int]):
        self.record = TkGpuSearch(_LAUNCH(entries[0]), _SYNCHRONIZE(entries[1]), int(batch.graph.handle),
                                  int(stream.handle), batch.stage.ctypes.data, batch.distances.ctypes.data,
                                  batch.ids.ctypes.data, batch.status.ctypes.data, dim, k, MAX_ABS_VALUE)
        self._call, self._pointer = library.tk_gpu_search_one, ctypes.byref(self.record)

    def run(self, out_distances: int = 0, out_ids: int = 0) -> int:
        return self._call(self._pointer, out_distances or None, out_ids or None)


def for_batch(batch, stream, dim: int, k: int) -> NativeSearch | None:
    """The native search of a one-query host batch whose graph is captured and whose kernel writes the answer
    into the pinned staging, or None (the Python path) where it cannot be had."""
    if not USE_NATIVE or batch.graph is None or not batch.direct or batch.plan.n_queries != 1:
        return None
    entries, library = driver_entries(), native_library()
    if entries is None or library is None:
        return None
    return NativeSearch(library, batch, stream, dim, k, entries)


__all__ = ["INCOMPLETE", "NativeSearch", "REFUSED", "TkGpuSearch", "UNPROVEN", "USE_NATIVE", "driver_entries",
           "for_batch"]
