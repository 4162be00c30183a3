"""CpuSearcher: the Searcher of device="cpu", a thin owner of one index handle in the C++ library.

Inputs arrive validated by tinyknn.inputs.validate (C-contiguous, the storage dtype for the database, float32
queries), so this module only passes pointers. A search allocates nothing but its two result arrays (none
when the caller gives out= arrays); the library's threads (get_config().cpu_threads of them) do the work while
the GIL is released. Answers keep the exactness contract (kernels/exact.cuh): the ids of an exhaustive float64
search, equal float64 distances by the smaller id, the float64 distances rounded to float32 (kernels/cpu/verify.h).

Index operations work on row positions (the Index maps ids and labels onto them), with GpuSearcher's meaning:
search(rows=) over the allowed rows only (gathered into a temporary index of the library's, or for a few queries
read from its row-major copy once filtered searches have paid for one: row_copy), remove_rows
(swap-remove: the last rows move into the holes), get_rows, range_search (kernels/cpu/range.h),
permute_rows (the Index's label-partitioned order, tinyknn.index.layout).
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np

from ..config import get_config
from ..spec import numpy_dtype
from .library import DTYPE_CODES, METRIC_CODES, check, get_library


class CpuSearcher:
    """Exact k-NN over a database held by the C++ library (see kernels/cpu/)."""
    # (an add that fails leaves the library's index exactly as it was: it allocates before it writes)

    def __init__(self, dim: int, metric: str, dtype: str):
        self.dim, self.metric, self.dtype = dim, metric, dtype
        self._library = get_library()
        handle = ctypes.c_void_p()
        check(self._library, self._library.tk_index_new(dim, METRIC_CODES[metric], DTYPE_CODES[dtype],
                                                        ctypes.byref(handle)), "creating a CPU index")
        self._handle = handle.value
        # close() must not free the handle under a running call: calls count themselves in and out.
        self._state = threading.Condition()
        self._calls = 0

    @property
    def _threads(self) -> int:
        """Read at every call, so that a change (tinyknn.faiss.omp_set_num_threads) reaches existing indexes."""
        return get_config().cpu_threads

    def _enter(self) -> int:
        with self._state:
            if self._handle is None:
                raise ValueError("this CPU index was closed")
            self._calls += 1
            return self._handle

    def _leave(self) -> None:
        with self._state:
            self._calls -= 1
            if self._calls == 0:
                self._state.notify_all()

    def _call(self, what: str, function, *args) -> None:
        handle = self._enter()
        try:
            check(self._library, function(handle, *args), what)
        finally:
            self._leave()

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        self._call("adding vectors", self._library.tk_index_add, vectors.ctypes.data, vectors.shape[0],
                    ids.ctypes.data)

    takes_out = True    # search(..., out=(distances, ids)) writes into the caller's arrays (tinyknn.index.prepared)

    def search(self, queries: np.ndarray, k: int, rows=None, *, out=None) -> tuple[np.ndarray, np.ndarray]:
        """(distances, ids) (n_queries, k), nearest first, padded with (+-inf, -1). rows: None (every row) or the
        sorted, unique int64 positions the queries may return; they are gathered into a temporary index first
        (a search over 1 % of the rows reads the panels that hold them), or, for up to
        build_param("direct_max_queries") queries, read from the row copy where it reads less (row_copy).
        out: (float32, int64) C-contiguous writeable (n_queries, k) arrays, checked by the Index
        (tinyknn.inputs.outputs): the library writes the results there, and they are returned."""
        n_queries = queries.shape[0]
        if out is None:
            distances = np.empty((n_queries, k), dtype=np.float32)
            ids = np.empty((n_queries, k), dtype=np.int64)
        else:
            distances, ids = out
        if rows is None:
            self._call("searching", self._library.tk_index_search, queries.ctypes.data, n_queries, k,
                       self._threads, distances.ctypes.data, ids.ctypes.data)
        else:
            rows = _positions(rows, "rows")
            self._call("searching the allowed rows", self._library.tk_index_search_rows, queries.ctypes.data,
                       n_queries, k, self._threads, rows.ctypes.data, len(rows), distances.ctypes.data,
                       ids.ctypes.data)
        return distances, ids

    def remove_rows(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """Remove rows at once: the last live rows move into the holes (O(removed x dim), in the library's panels,
        ids, norms and sketch alike). Returns (moved_from, moved_to): the rows >= the new size that were kept,
        ascending, and the removed positions below it, ascending. Bad positions change nothing (ValueError)."""
        positions = np.unique(_positions(positions, "positions"))
        moved_from = np.empty(len(positions), dtype=np.int64)
        moved_to = np.empty(len(positions), dtype=np.int64)
        moved = ctypes.c_int64()
        self._call("removing rows", self._library.tk_index_remove_rows, positions.ctypes.data, len(positions),
                   moved_from.ctypes.data, moved_to.ctypes.data, ctypes.byref(moved))
        return moved_from[:moved.value].copy(), moved_to[:moved.value].copy()

    def permute_rows(self, order) -> None:
        """Reorder the rows: new row i is old row order[i] (every row once). The library copies them in the new
        order first, then swaps the copy in (a concurrent search sees one order or the other; a failed
        allocation changes nothing): the Index's label-partitioned order (tinyknn.index.layout)."""
        order = _positions(order, "order")
        self._call("reordering the rows", self._library.tk_index_permute_rows, order.ctypes.data, len(order),
                   self._threads)

    def get_rows(self, positions) -> np.ndarray:
        """Copies of the stored rows at `positions` (any order), (len, dim) in the storage dtype."""
        positions = _positions(positions, "positions")
        out = np.empty((len(positions), self.dim), dtype=numpy_dtype(self.dtype))
        self._call("reading rows", self._library.tk_index_get_rows, positions.ctypes.data, len(positions),
                   out.ctypes.data)
        return out

    def range_search(self, queries: np.ndarray, radius: float, rows=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lims (nq + 1,) int64, distances float32, ids int64): every allowed row whose contract float64 distance
        is strictly inside `radius` (l2: below it; ip, cosine: above it), each query's hits nearest first, equal
        distances by the smaller id (kernels/cpu/range.h). No cap on the hits."""
        radius = float(radius)
        if not math.isfinite(radius):
            raise ValueError(f"radius must be a finite number; got {radius!r}")
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        n_queries = queries.shape[0]
        if rows is not None:
            rows = _positions(rows, "rows")
        result = ctypes.c_void_p()
        self._call("range searching", self._library.tk_index_range_search, queries.ctypes.data, n_queries, radius,
                   None if rows is None else rows.ctypes.data, 0 if rows is None else len(rows), self._threads,
                   ctypes.byref(result))
        try:
            total = ctypes.c_int64()
            check(self._library, self._library.tk_range_total(result, ctypes.byref(total)), "reading a range result")
            counts = np.empty(n_queries, dtype=np.int64)
            distances = np.empty(total.value, dtype=np.float32)
            ids = np.empty(total.value, dtype=np.int64)
            check(self._library, self._library.tk_range_copy(result, counts.ctypes.data, distances.ctypes.data,
                                                             ids.ctypes.data), "reading a range result")
        finally:
            self._library.tk_range_free(result)
        lims = np.zeros(n_queries + 1, dtype=np.int64)
        np.cumsum(counts, out=lims[1:])
        return lims, distances, ids

    @property
    def ntotal(self) -> int:
        return self.size()

    def size(self) -> int:
        n = ctypes.c_int64()
        self._call("reading the index size", self._library.tk_index_size, ctypes.byref(n))
        return n.value

    def _pass_counts(self, what: str, function) -> tuple[int, int]:
        answered, declined = ctypes.c_int64(), ctypes.c_int64()
        self._call(f"reading the {what} counters", function, ctypes.byref(answered), ctypes.byref(declined))
        return answered.value, declined.value

    def sketch_counts(self) -> tuple[int, int]:
        """(searches the float16 sketch answered, searches it handed to the exact scan): diagnostics."""
        return self._pass_counts("sketch", self._library.tk_index_sketch_counts)

    def winograd_counts(self) -> tuple[int, int]:
        """(searches the Winograd pass answered, searches it handed to the exact scan): diagnostics."""
        return self._pass_counts("Winograd", self._library.tk_index_winograd_counts)

    def exact_fallbacks(self) -> int:
        """Queries whose screened candidates could not be proven to hold the float64 answer (ties or near-ties
        beyond the margin, data whose float32 error bound is too loose) and were searched exhaustively."""
        count = ctypes.c_int64()
        self._call("reading the exact-fallback counter", self._library.tk_index_exact_fallbacks, ctypes.byref(count))
        return count.value

    def row_copy(self, mode: str, threads: int | None = None) -> None:
        """The row-major copy that filtered searches of a few queries read scattered rows from
        (kernels/cpu/row_copy.h, direct.h): "auto" (the default) builds it once the filtered searches it would
        have sped up have lost about its cost; "always" builds it now (MemoryError when it cannot) and answers
        every filtered search of up to build_param("direct_max_queries") queries from it; "off" drops it."""
        codes = {"off": 0, "auto": 1, "always": 2}
        if mode not in codes:
            raise ValueError(f"row copy mode must be one of {sorted(codes)}; got {mode!r}")
        self._call("setting the row copy", self._library.tk_index_row_copy, codes[mode],
                   self._threads if threads is None else int(threads))

    def row_copy_counts(self) -> tuple[int, int, int]:
        """(rows the row copy holds, -1 for none; filtered searches answered from it; times it was built)."""
        rows, searches, builds = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        self._call("reading the row copy counters", self._library.tk_index_row_copy_counts, ctypes.byref(rows),
                   ctypes.byref(searches), ctypes.byref(builds))
        return rows.value, searches.value, builds.value

    def truncate(self, n_rows: int) -> None:
        """Drop rows n_rows and later (0 <= n_rows <= size): Index.add undoes a chunked add that failed part way."""
        self._call("truncating the index", self._library.tk_index_truncate, int(n_rows))

    def use_first_passes(self, on: bool) -> None:
        """False: every later search screens with the full scan, the reference that the float16 sketch and the
        Winograd pass are tested and measured against (all give the same answer bit for bit). True: the default."""
        self._call("switching the first passes", self._library.tk_index_use_first_passes, int(bool(on)))

    def reset(self) -> None:
        self._call("resetting the index", self._library.tk_index_reset)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(vectors (n, dim) in the storage dtype, ids (n,) int64): copies of what the index holds."""
        handle = self._enter()
        try:
            n = ctypes.c_int64()
            check(self._library, self._library.tk_index_size(handle, ctypes.byref(n)), "reading the index size")
            vectors = np.empty((n.value, self.dim), dtype=numpy_dtype(self.dtype))
            ids = np.empty(n.value, dtype=np.int64)
            check(self._library, self._library.tk_index_export(handle, n.value, vectors.ctypes.data,
                                                                ids.ctypes.data),
                  "exporting the index")
        finally:
            self._leave()
        return vectors, ids

    def close(self) -> None:
        """Free the library's index once no call is running; later calls raise ValueError."""
        with self._state:
            self._state.wait_for(lambda: self._calls == 0)
            handle, self._handle = self._handle, None
        if handle is not None:
            check(self._library, self._library.tk_index_free(handle), "freeing the index")

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self.close()


def _positions(values, what: str) -> np.ndarray:
    """Row positions as a C-contiguous int64 array (the library checks their range and order)."""
    array = np.asarray(values)
    if array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
        raise TypeError(f"{what} must be a 1-D array of integer row positions; got dtype {array.dtype}, "
                        f"shape {array.shape}")
    return np.ascontiguousarray(array, dtype=np.int64)
