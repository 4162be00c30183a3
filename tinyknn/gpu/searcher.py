"""GpuSearcher: the database on the GPU, its stream and staging buffers, and the search plans.

Layout: rows stored in the index's dtype, padded with zeros to a 16-byte multiple (render.row_layout),
inverse norms for cosine, squared norms and their maximum for l2 (the filter key of large batches),
the user's int64 ids. Queries are float32, padded the same way.

Every search ends in the verify step (kernels/verify.cuh; one query alone: single.cuh, whose last block
verifies, so one launch): the selection kernel's k + margin best
candidates of each query get their float64 distances (kernels/exact.cuh), are sorted by (distance, id)
and the k first returned; a query whose answer the selection kernel's rounding bound cannot prove (ties
or near-ties beyond the margin, data far from the origin for l2's filter key, tiny vectors for cosine)
goes to the band search: every row whose float64 distance is within its k-th candidate's, sorted on the
host by (distance, id). So every answer is the exactness contract's, bit for bit the CPU's;
`exact_reruns` counts the queries the band search answered.

Host queries (NumPy): copied into pinned staging allocated once and grown (never per call), one async
copy in, the selection kernel and the merge, one async copy of the (n_queries, k) results out (one query:
the kernel writes them into the mapped pinned staging itself), one stream synchronisation with the GIL
released, then into the two result arrays (the only per-call allocations). Their values (NaN, infinity,
magnitude) are checked on the host while the device searches; bad values raise once the device is done,
and their results are never returned. A batch shape seen twice is captured as a CUDA graph and replayed
(one driver call).

CUDA queries (CuPy, torch): read in place by the ingest kernel (dtype conversion, padding and the
NaN check on the device), results written straight into arrays of the caller's framework; our
stream waits for the caller's current stream and the caller's stream waits for the results
(events). The NaN flag is read back, so the call returns once the results are ready.

Threads: an index's calls take turns, one at a time (they share the staging, the plans and the stream;
the GPU work of one search already fills the device); a change (add, remove, truncate, reset) that waits
goes ahead of the searches still waiting (tinyknn.gpu.turns).

Length: the searcher's own state and the protocol's entry points; each plan kind's work lives in buffers.py,
host_search.py, device_search.py and row_ops.py.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..inputs.validate import DeviceArray, check_values
from ..config import get_config
from ..jit import render
from ..spec import MAX_K, numpy_dtype
from . import interop, plan as plans
from .device import current_device, ensure_context
from .buffers import Buffers
from .device_search import DeviceQueries
from .host_search import HostQueries
from .memory import DeviceBuffer, Event, PinnedBuffer, Stream
from .row_ops import RowOperations
from .turns import Turns
from .views import EveryRow, Rows

MAX_ROWS = 2**31 - 1            # positions are int32 in the kernels
ADD_CHUNK_BYTES = 64 << 20      # host vectors are copied to the device in chunks of this size
SOURCE_KINDS = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3, "int8": 4, "uint8": 5}   # ingest.cuh


@dataclass
class PreparedBatch:
    """A prepared search's hold on its host batch (GpuSearcher.prepare_search). `batch` is the HostBatch of
    (n_queries, k) over every row, valid while `generation` equals the searcher's _plan_generation: that
    changes whenever a host batch leaves the plan cache (_forget_plans: add, remove, reset, truncate, a
    grown buffer, close; or an eviction), so a bound batch is always one still in the cache, whose buffers
    and graph are live. Read and written only under the searcher's lock."""

    n_queries: int
    k: int
    batch: "plans.HostBatch | None" = None
    generation: int = -1


def _copy_into(out, found):
    """Results computed into fresh arrays, copied into the caller's (host) arrays."""
    np.copyto(out[0], found[0])
    np.copyto(out[1], found[1])
    return out


class GpuSearcher(Buffers, HostQueries, DeviceQueries, RowOperations):
    """The Searcher protocol (tinyknn.index) on the current CUDA device."""

    use_graphs = True
    use_screen = True       # benchmarks and tests may switch the tensor-core path off
    single_shadow = True    # one query on a float32 l2 index streams the screen's float16 shadow (single.cuh)

    def __init__(self, dim: int, metric: str, dtype: str):
        self.dim, self.metric, self.dtype = dim, metric, dtype
        ensure_context()
        info = current_device()
        self._ordinal, self._sm_count = info.ordinal, info.sm_count
        self._arch = get_config().arch or info.arch
        self._stride = render.row_layout(dim, dtype)[1]
        self._itemsize = render.ITEMSIZE[dtype]
        self._row_bytes = self._stride * self._itemsize
        self._lock = Turns()
        self._stream = Stream()
        self._events = (Event(timing=False), Event(timing=False))
        self._buffers: dict[str, DeviceBuffer | PinnedBuffer] = {}
        self._kernels: dict = {}
        self._launches: dict = {}          # spec -> (LoadedKernel, PreparedLaunch), see _packed
        self._plans: OrderedDict = OrderedDict()
        self._n = 0
        self._view: Rows | None = None     # set by _reading() for the duration of a search
        self._every_row = EveryRow(self)
        self._capacity = 0
        self._status_host = PinnedBuffer(4)
        self._device("status", 4)
        self._device("row_stats", 16)   # verify.cuh's database facts, kept by the ingest kernel
        self.exact_reruns = 0
        self._closed = False
        from .screen import Screen

        self._screen = Screen(self)

    # -- kernels ------------------------------------------------------------------------------------
    def _kernel(self, spec) -> plans.LoadedKernel:
        loaded = self._kernels.get(spec)
        if loaded is None:
            loaded = self._kernels[spec] = plans.load_kernel(spec)
        return loaded

    def _packed(self, spec, *values):
        """(the kernel of `spec`, its launch holding `values`): packed once per searcher and rewritten in place
        after, since a searcher's calls take turns and a launch takes its parameters' values when enqueued (on
        the H200's host a fresh packing cost about as much as a screened step's own host work)."""
        kept = self._launches.get(spec)
        if kept is None:
            loaded = self._kernel(spec)
            kept = self._launches[spec] = (loaded, loaded.prepare())
        kept[1].set_all(*values)
        return kept

    def _ingest(self, source_ptr: int, source_dtype, row_step: int, rows: int, storage: str,
                dest_ptr: int, norms_ptr: int, database: bool) -> None:
        """Enqueue the ingest kernel: rows of any float dtype -> padded `storage` rows, NaN flag set;
        with norms_ptr, the rows' inverse norms (cosine) or squared norms (l2); for the database, the
        facts the verify step's bounds need (row_stats)."""
        squared = int(bool(norms_ptr) and self.metric == "l2")
        row_stats = self._pointer("row_stats") if database else 0
        kind = SOURCE_KINDS.get(np.dtype(source_dtype).name)
        if kind is None:
            raise TypeError(f"tinyknn's GPU ingest reads {', '.join(SOURCE_KINDS)} elements; "
                            f"got {np.dtype(source_dtype)}")
        loaded, launch = self._packed(render.norms_spec(storage, self.dim, self._arch), source_ptr, kind, row_step,
                                      rows, self.dim, dest_ptr, self._stride, norms_ptr, squared, row_stats,
                                      self._pointer("status"))
        blocks = max(1, min(math.ceil(rows / (loaded.threads // 32)), self._sm_count * 8))
        launch.launch(blocks, loaded.threads, 0, self._stream)

    def _raise_if_bad(self, what: str) -> None:
        """Read the device's bad-value flag (synchronising the stream) and raise if it is set."""
        self._buffers["status"].copy_to_host(self._status_host, 4, self._stream)
        self._stream.synchronize()
        if self._status_host.array(np.int32, 1)[0]:
            raise ValueError(f"{what} contains NaN, infinity or a value beyond what dtype {self.dtype!r} "
                             "holds; tinyknn accepts finite values only")

    # -- the Searcher protocol ------------------------------------------------------------------------
    def add(self, vectors, ids: np.ndarray) -> None:
        """Append rows (a validated host array in the storage dtype, or a CUDA array) with their ids."""
        with self._lock.change:
            self._check_open()
            n = len(ids)
            if self._n + n > MAX_ROWS:
                raise ValueError(f"a GPU index holds at most {MAX_ROWS} vectors; it has {self._n}, adding {n}")
            self._reserve(self._n + n)
            self._buffers["status"].fill_bytes(0, 4, self._stream)
            data_ptr = self._pointer("data") + self._n * self._row_bytes
            norms_ptr = self._pointer("norms") + self._n * 4 if self.metric in ("cosine", "l2") else 0
            if isinstance(vectors, DeviceArray):
                self._add_device(vectors, data_ptr, norms_ptr)
            else:
                self._add_host(vectors, data_ptr, norms_ptr)
            self._copy_ids(ids, n)
            self._raise_if_bad("vectors to add")
            self._n += n
            self._forget_plans()

    def _copy_ids(self, ids: np.ndarray, n: int) -> None:
        """The new rows' ids after the existing ones (the host tier's chunk workers skip what is there)."""
        self._buffers["ids"].copy_from_host(np.ascontiguousarray(ids, dtype=np.int64), n * 8, self._stream,
                                            offset=self._n * 8)

    def _add_host(self, vectors: np.ndarray, data_ptr: int, norms_ptr: int) -> None:
        row_bytes = self.dim * self._itemsize
        chunk = max(1, min(len(vectors), ADD_CHUNK_BYTES // row_bytes))
        source = self._device("add_source", chunk * row_bytes)
        for start in range(0, len(vectors), chunk):
            part = vectors[start:start + chunk]
            source.copy_from_host(part, part.nbytes, self._stream)
            self._ingest(source.ptr, vectors.dtype, self.dim, len(part), self.dtype,
                         data_ptr + start * self._row_bytes, norms_ptr + start * 4 if norms_ptr else 0, True)

    def _add_device(self, vectors: DeviceArray, data_ptr: int, norms_ptr: int) -> None:
        interop.check_device(vectors, self._ordinal, "vectors to add")
        step = interop.row_step(vectors, "vectors to add")
        self._wait_for_caller(interop.caller_stream(vectors))
        self._ingest(vectors.ptr, vectors.dtype, step, vectors.shape[0], self.dtype, data_ptr, norms_ptr, True)

    takes_out = True    # search(..., out=(distances, ids)) writes into the caller's arrays (tinyknn.index.prepared)

    def search(self, queries, k: int, rows=None, *, out=None, prepared: "PreparedBatch | None" = None):
        """(distances, ids) of the k nearest: NumPy for host queries, the caller's framework for CUDA ones.
        rows: None (every row) or the sorted unique positions the queries may return, read in place (one run
        of rows as a view, scattered rows through a position list), so a 1 % filter reads about 1 % of the
        database and copies none of it; k beyond the kernels gathers them first. out: the caller's arrays,
        checked by the Index (tinyknn.inputs.outputs): NumPy arrays for host queries, DeviceArray descriptions
        for CUDA ones; the results are written there and they are returned. prepared: prepare_search's token."""
        if isinstance(queries, DeviceArray):
            if k > MAX_K:
                raise ValueError(f"k = {k} is beyond the GPU kernels' {MAX_K} for CUDA-array queries; pass the "
                                 "queries as a NumPy array (k up to ntotal is served through the host)")
            with self._lock, self._reading(rows):
                return self._search_device(queries, k, out)
        n_queries = queries.shape[0]
        with self._lock, self._reading(rows, gather=k > MAX_K):
            if k > MAX_K:
                found = self._large_k(queries, k)
                return found if out is None else _copy_into(out, found)
            if 0 < n_queries <= plans.MAX_BATCH:      # one batch: its results are the arrays returned
                return self._search_host_batch(queries, k, out=out, prepared=None if rows is not None else prepared)
            if out is None:
                out = np.empty((n_queries, k), dtype=np.float32), np.empty((n_queries, k), dtype=np.int64)
            else:   # every batch's values before the first batch's results reach the caller's arrays
                check_values(queries, "queries", "float32")
            distances, ids = out
            for start in range(0, n_queries, plans.MAX_BATCH):
                stop = min(n_queries, start + plans.MAX_BATCH)
                self._search_host_batch(queries[start:stop], k, out=(distances[start:stop], ids[start:stop]))
        return distances, ids

    def prepare_search(self, n_queries: int, k: int) -> "PreparedBatch":
        """A token for search(..., prepared=token): it keeps the host batch of (n_queries, k) over every row
        once it is made, so that later calls skip the plan-cache lookup (tinyknn.index.prepared)."""
        return PreparedBatch(n_queries, k)

    _plan_generation = 0    # counts _forget_plans and evictions of host batches: a PreparedBatch's validity

    def _forget_plans(self) -> None:
        """Every plan and host batch dropped (tinyknn.gpu.buffers); the prepared searches' bound batches too."""
        self._plan_generation += 1
        super()._forget_plans()

    def _large_k(self, queries: np.ndarray, k: int):
        from . import ranges

        return ranges.large_k_search(self, np.ascontiguousarray(queries, dtype=np.float32), k)

    read_in_place = True    # benchmarks and tests may switch it off: every filter gathers its rows first

    def _reading(self, rows, gather: bool = False):
        """For the call in progress (the lock held): read every row, or `rows` (sorted, unique) in place or,
        with `gather` (range search, k beyond the kernels), from a gathered copy."""
        if rows is None:        # the common case, without a generator per call (~1 us on the host)
            return self._every_row
        return self._reading_rows(rows, gather or not self.read_in_place)

    @contextlib.contextmanager
    def _reading_rows(self, rows, gather: bool):
        self._check_open()
        positions = np.asarray(rows)
        m = len(positions)
        if gather or not m:
            positions = np.ascontiguousarray(positions, dtype=np.int64)
            self._view = Rows("sub_", m)
            if m:
                self._copy_rows(positions, None, "sub_")
        elif int(positions[-1]) - int(positions[0]) == m - 1:     # one run (sorted and unique): a view, no copy
            self._view = Rows("run", m, int(positions[0]))
        else:
            self._list_rows(positions)
            self._view = Rows("list", m)
        try:
            yield
        finally:
            self._view = None
            self._listed = None

    _listed = None      # the positions of the "list" view in use (its band search gathers them)

    def _list_rows(self, positions: np.ndarray) -> None:
        """The positions as int32 into the "row_list" buffer, through pinned staging, on the stream: the listed
        kernels that follow read them there (no synchronisation; the staging is free again once the search
        that follows has synchronised). The same positions again (the very array, read-only and owning its
        values: the Index's kept rows of a repeated filter, IdMap.rows_allowed) are already there."""
        m = len(positions)
        listed = self._device("row_list", m * 4)      # grown before any plan is looked up
        if not (positions is self._row_list_of and listed is self._row_list_in):
            stage = self._pinned("row_list_stage", m * 4)
            np.copyto(stage.array(np.int32, m), positions, casting="unsafe")
            listed.copy_from_host(stage, m * 4, self._stream)
            self.row_lists_copied += 1
            unchanging = not positions.flags.writeable and positions.base is None
            self._row_list_of, self._row_list_in = (positions, listed) if unchanging else (None, None)
        self._listed = positions

    # the positions "row_list" holds (kept only if they cannot change), and that buffer: the object, not its
    # address, which a later buffer can be given once this one is freed
    _row_list_of, _row_list_in = None, None
    row_lists_copied = 0                    # filters' row lists copied to the device (tests)

    slices_override: int | None = None   # benchmarks only: force the number of database slices
    single_overrides: tuple = ()         # benchmarks only: (name, value) pairs for render_single.single_params

    # -- index operations (row positions; ids and labels are the Index's) ------------------------------
    def range_search(self, queries, radius: float, rows=None):
        """(lims, distances, ids): every allowed row whose contract distance is strictly inside `radius`
        (l2 below it; ip and cosine above it), each query's hits nearest first, ties by the smaller id."""
        from . import ranges

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        with self._lock, self._reading(rows, gather=True):
            return ranges.range_search(self, queries, float(radius))

    # -- the rest of the protocol ---------------------------------------------------------------------
    def truncate(self, n_rows: int) -> None:
        """Drop every row from n_rows on (Index.add undoes a failed piece of a chunked add with it). The
        row statistics stay as they were: a larger maximum or smaller minimum only loosens the bounds."""
        with self._lock.change:
            self._check_open()
            if not 0 <= n_rows <= self._n:
                raise ValueError(f"truncate: n_rows must be between 0 and {self._n}; got {n_rows}")
            self._n = n_rows
            self._screen.forget_rows()
            self._forget_plans()

    def reset(self) -> None:
        with self._lock.change:
            self._check_open()
            self._n = 0
            self._screen = type(self._screen)(self)
            self._buffers["row_stats"].fill_bytes(0, 16, self._stream)
            self._forget_plans()

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the stored vectors (n, dim) in the storage dtype and of the ids, for save()."""
        with self._lock:
            self._check_open()
            rows = np.empty((self._n, self._stride), dtype=numpy_dtype(self.dtype))
            ids = np.empty(self._n, dtype=np.int64)
            if self._n:
                self._buffers["data"].copy_to_host(rows, rows.nbytes, self._stream)
                self._buffers["ids"].copy_to_host(ids, ids.nbytes, self._stream)
                self._stream.synchronize()
            return np.ascontiguousarray(rows[:, :self.dim]), ids

    def close(self) -> None:
        """Free every device and pinned buffer, the graphs, events and the stream (once)."""
        with self._lock.change:
            if self._closed:
                return
            self._closed = True
            try:
                self._stream.synchronize()
            finally:
                self._forget_plans()
                for buffer in self._buffers.values():
                    buffer.close()
                self._buffers.clear()
                self._status_host.close()
                for event in self._events:
                    event.close()
                self._stream.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this GPU index was closed")

    @property
    def ntotal(self) -> int:
        return self._n


__all__ = ["GpuSearcher"]
