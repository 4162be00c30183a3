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
copy in, the selection kernel and the merge, one async copy of the (n_queries, k) results out, one
stream synchronisation with the GIL released, then into the two result arrays (the only per-call
allocations). Their values (NaN, infinity, magnitude) are checked on the host while the device
searches; bad values raise once the device is done, and their results are never returned. A batch
shape seen twice is captured as a CUDA graph and replayed (one driver call).

CUDA queries (CuPy, torch): read in place by the ingest kernel (dtype conversion, padding and the
NaN check on the device), results written straight into arrays of the caller's framework; our
stream waits for the caller's current stream and the caller's stream waits for the results
(events). The NaN flag is read back, so the call returns once the results are ready.

Threads: one lock per index serialises its searches and adds (they share the staging, the plans and
the stream); the GPU work of one search already fills the device.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .._validate import DeviceArray, check_values
from ..config import get_config
from ..errors import CudaError
from ..jit import render
from ..spec import MAX_K, numpy_dtype
from . import interop, plan as plans
from .device import current_device, ensure_context
from .memory import DeviceBuffer, Event, PinnedBuffer, Stream, copy_host_to_address

MAX_ROWS = 2**31 - 1            # positions are int32 in the kernels
ADD_CHUNK_BYTES = 64 << 20      # host vectors are copied to the device in chunks of this size
PLAN_CACHE = 32
SOURCE_KINDS = {"float64": 0, "float32": 1, "float16": 2, "bfloat16": 3, "int8": 4, "uint8": 5}   # ingest.cuh
BAND_MIN_CAPACITY = 256         # band entries per query at first (grown to the largest count when exceeded)


@dataclass(frozen=True)
class Rows:
    """The rows a search reads: the index's own buffers (prefix ""), or the copy of a filter's allowed rows
    gathered into the "sub_" buffers (ids and norms beside them)."""

    prefix: str
    n: int


class GpuSearcher:
    """The Searcher protocol (tinyknn.index) on the current CUDA device."""

    use_graphs = True
    use_screen = True       # benchmarks and tests may switch the tensor-core path off

    def __init__(self, dim: int, metric: str, dtype: str):
        self.dim, self.metric, self.dtype = dim, metric, dtype
        ensure_context()
        info = current_device()
        self._ordinal, self._sm_count = info.ordinal, info.sm_count
        self._arch = get_config().arch or info.arch
        self._stride = render.row_layout(dim, dtype)[1]
        self._itemsize = render.ITEMSIZE[dtype]
        self._row_bytes = self._stride * self._itemsize
        self._lock = threading.Lock()
        self._stream = Stream()
        self._events = (Event(timing=False), Event(timing=False))
        self._buffers: dict[str, DeviceBuffer | PinnedBuffer] = {}
        self._kernels: dict = {}
        self._ingest_launches: dict = {}
        self._plans: OrderedDict = OrderedDict()
        self._n = 0
        self._view: Rows | None = None     # set by _reading() for the duration of a search
        self._capacity = 0
        self._status_host = PinnedBuffer(4)
        self._device("status", 4)
        self._device("row_stats", 16)   # verify.cuh's database facts, kept by the ingest kernel
        self.exact_reruns = 0
        self._closed = False
        from .screen import Screen

        self._screen = Screen(self)

    # -- buffers ----------------------------------------------------------------------------------
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

    def _forget_plans(self) -> None:
        for batch in self._plans.values():
            if isinstance(batch, plans.HostBatch):
                batch.close()
        self._plans.clear()

    def _pointer(self, name: str) -> int:
        buffer = self._buffers.get(name)
        return 0 if buffer is None else buffer.ptr

    # -- kernels ------------------------------------------------------------------------------------
    def _kernel(self, spec) -> plans.LoadedKernel:
        loaded = self._kernels.get(spec)
        if loaded is None:
            loaded = self._kernels[spec] = plans.load_kernel(spec)
        return loaded

    def _ingest(self, source_ptr: int, source_dtype, row_step: int, rows: int, storage: str,
                dest_ptr: int, norms_ptr: int, database: bool) -> None:
        """Enqueue the ingest kernel: rows of any float dtype -> padded `storage` rows, NaN flag set;
        with norms_ptr, the rows' inverse norms (cosine) or squared norms (l2); for the database, the
        facts the verify step's bounds need (row_stats)."""
        squared = int(bool(norms_ptr) and self.metric == "l2")
        row_stats = self._pointer("row_stats") if database else 0
        loaded = self._kernel(render.norms_spec(storage, self.dim, self._arch))
        launch = self._ingest_launches.get(storage)
        if launch is None:     # packed once per index; the slots are rewritten in place
            launch = self._ingest_launches[storage] = loaded.prepare(*[0] * len(plans.ARGUMENTS["norms"]))
        kind = SOURCE_KINDS.get(np.dtype(source_dtype).name)
        if kind is None:
            raise TypeError(f"tinyknn's GPU ingest reads {', '.join(SOURCE_KINDS)} elements; got {np.dtype(source_dtype)}")
        launch.set_all(source_ptr, kind, row_step, rows, self.dim, dest_ptr, self._stride, norms_ptr, squared,
                       row_stats, self._pointer("status"))
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
        with self._lock:
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

    def search(self, queries, k: int, rows=None):
        """(distances, ids) of the k nearest: NumPy for host queries, the caller's framework for CUDA ones.
        rows: None (every row) or the sorted positions the queries may return, gathered first (so a 1 %
        filter reads about 1 % of the database)."""
        if isinstance(queries, DeviceArray):
            with self._lock, self._reading(rows):
                if k > MAX_K:
                    raise ValueError(f"k = {k} is beyond the GPU kernels' {MAX_K} for CUDA-array queries; pass the "
                                     "queries as a NumPy array (k up to ntotal is served through the host)")
                return self._search_device(queries, k)
        n_queries = queries.shape[0]
        with self._lock, self._reading(rows):
            if k > MAX_K:
                return self._large_k(queries, k)
            if 0 < n_queries <= plans.MAX_BATCH:      # one batch: its results are the arrays returned
                return self._search_host_batch(queries, k)
            distances = np.empty((n_queries, k), dtype=np.float32)
            ids = np.empty((n_queries, k), dtype=np.int64)
            for start in range(0, n_queries, plans.MAX_BATCH):
                stop = min(n_queries, start + plans.MAX_BATCH)
                distances[start:stop], ids[start:stop] = self._search_host_batch(queries[start:stop], k)
        return distances, ids

    def _large_k(self, queries: np.ndarray, k: int):
        from . import ranges

        return ranges.large_k_search(self, np.ascontiguousarray(queries, dtype=np.float32), k)

    @contextlib.contextmanager
    def _reading(self, rows):
        """For the call in progress (the lock held): read every row, or the gathered copy of `rows`."""
        self._check_open()
        if rows is None:
            self._view = Rows("", self._n)
        else:
            positions = np.ascontiguousarray(rows, dtype=np.int64)
            self._view = Rows("sub_", len(positions))
            if len(positions):
                self._copy_rows(positions, None, "sub_")
        try:
            yield
        finally:
            self._view = None

    def _copy_rows(self, source_rows: np.ndarray, target_rows: np.ndarray | None, target: str) -> None:
        """Rows source_rows of the index go to rows target_rows (in place when target == "") or, with
        target_rows None, to rows 0, 1, ... of the `target` buffers ("sub_" or "get_"): data, ids, norms."""
        count = len(source_rows)
        has_norms = self.metric in ("cosine", "l2")
        if target:
            for name, per_row in (("data", self._row_bytes), ("ids", 8), ("norms", 4 if has_norms else 0)):
                if per_row:
                    self._device(target + name, count * per_row)
        loaded = self._kernel(render.rows_spec(self._arch))
        sources, targets = self._scratch("gathering rows", count * 8, count * 8 if target_rows is not None else 0)
        with sources, targets:
            sources.copy_from_host(source_rows, count * 8, self._stream)
            if target_rows is not None:
                targets.copy_from_host(np.ascontiguousarray(target_rows, dtype=np.int64), count * 8, self._stream)
            launch = loaded.prepare(self._pointer("data"), self._pointer(target + "data"), self._row_bytes // 16,
                                    sources.ptr, targets.ptr if target_rows is not None else 0, count,
                                    self._pointer("ids"), self._pointer(target + "ids"),
                                    self._pointer("norms") if has_norms else 0,
                                    self._pointer(target + "norms") if has_norms else 0)
            blocks = max(1, min(math.ceil(count / 8), self._sm_count * 8))
            launch.launch(blocks, 256, 0, self._stream)
            self._stream.synchronize()        # before the index buffers behind the pointers can move

    def _search_host_batch(self, queries: np.ndarray, k: int, exact: bool = False,
                           screen: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """One batch of host queries; fresh result arrays (the only allocations of the call). Large batches
        on a screened index go through the tensor cores (gpu/screen.py); what it cannot settle comes here."""
        if screen and not exact and self.use_screen and self._screen.applies(len(queries), k):
            screened = self._screen.search(queries, k)
            if screened is not None:
                distances, ids, unproven = screened
                if len(unproven):
                    distances[unproven], ids[unproven] = self._search_host_batch(queries[unproven], k, screen=False)
                return distances, ids
        batch = self._host_batch(len(queries), k, exact)
        if self._stride == self.dim:
            np.copyto(batch.stage, queries)
        else:
            batch.stage[:, :self.dim] = queries
        batch.run(self._stream, self.use_graphs)
        try:    # NaN, infinity and magnitude: checked here, on the host, while the device searches
            check_values(queries, "queries", "float32")
        finally:
            self._stream.synchronize()
        distances, ids = batch.distances.copy(), batch.ids.copy()
        unproven = np.flatnonzero(batch.status)
        if len(unproven):
            distances[unproven], ids[unproven] = self._band(unproven, k)
        return distances, ids

    def _band(self, which: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Answers of the batch's queries `which` that verify could not prove: every row whose float64 key
        is within the query's threshold (its k-th candidate's key, an upper bound of the true k-th), found
        by band_kernel over the queries still in the 'queries' buffer, then sorted here by (key, id).
        Rare (near-ties beyond the margin), so its buffers are allocated per call."""
        self.exact_reruns += len(which)
        loaded = self._kernel(render.band_spec(self.metric, self.dtype, self._arch))
        f = len(which)
        view = self._view
        blocks = max(1, min(math.ceil(view.n / plans.ROW_KERNEL_THREADS), self._sm_count * 8))
        capacity = max(BAND_MIN_CAPACITY, 4 * k)
        which_buffer, counts = self._scratch("the exact band of unproven queries", f * 4, f * 4)
        with which_buffer, counts:
            which_buffer.copy_from_host(np.ascontiguousarray(which, dtype=np.int32), f * 4, self._stream)
            while True:
                keys, band_ids = self._scratch("the exact band of unproven queries", f * capacity * 8,
                                               f * capacity * 8)
                counts.fill_bytes(0, f * 4, self._stream)
                launch = loaded.prepare(self._pointer(view.prefix + "data"), self._pointer(view.prefix + "ids"), view.n,
                                        self._stride, self.dim,
                                        self._pointer("queries"), which_buffer.ptr, self._pointer("thresholds"),
                                        capacity, keys.ptr, band_ids.ptr, counts.ptr)
                launch.launch((blocks, f, 1), loaded.threads, 0, self._stream)
                found = np.empty(f, dtype=np.uint32)
                counts.copy_to_host(found, f * 4, self._stream)
                self._stream.synchronize()
                if int(found.max()) <= capacity:
                    break
                keys.close()
                band_ids.close()
                capacity = int(found.max())
            host_keys, host_ids = np.empty((f, capacity)), np.empty((f, capacity), dtype=np.int64)
            keys.copy_to_host(host_keys, host_keys.nbytes, self._stream)
            band_ids.copy_to_host(host_ids, host_ids.nbytes, self._stream)
            self._stream.synchronize()
            keys.close()
            band_ids.close()
        larger = self.metric != "l2"
        distances = np.full((f, k), -np.inf if larger else np.inf, dtype=np.float32)
        ids = np.full((f, k), -1, dtype=np.int64)
        for i, count in enumerate(found.tolist()):
            order = np.lexsort((host_ids[i, :count], host_keys[i, :count]))[:k]
            chosen = host_keys[i, order]
            distances[i, :len(order)] = (-chosen if larger else chosen).astype(np.float32)
            ids[i, :len(order)] = host_ids[i, order]
        return distances, ids

    def _search_device(self, queries: DeviceArray, k: int):
        """CUDA queries, batch by batch (the caller, search, holds the lock)."""
        interop.check_device(queries, self._ordinal, "queries")
        step = interop.row_step(queries, "queries")
        n_queries = queries.shape[0]
        distances, ids, distances_ptr, ids_ptr = interop.empty_results(queries, n_queries, k, self._ordinal)
        caller = interop.caller_stream(queries)
        self._wait_for_caller(caller)        # after the result arrays were allocated on it
        self._buffers["status"].fill_bytes(0, 4, self._stream)
        item = queries.dtype.itemsize
        statuses = self._device("device_status", min(n_queries, plans.MAX_BATCH) * 4)  # before the plans
        for start in range(0, n_queries, plans.MAX_BATCH):
            count = min(plans.MAX_BATCH, n_queries - start)
            search_plan = self._plan(count, k, "device")
            self._ingest(queries.ptr + start * step * item, queries.dtype, step, count, "float32",
                         self._pointer("queries"), 0, False)
            search_plan.set_outputs(distances_ptr + start * k * 4, ids_ptr + start * k * 8, statuses.ptr,
                                    self._pointer("thresholds"))
            search_plan.launch(self._stream)
            found = np.empty(count, dtype=np.int32)
            statuses.copy_to_host(found, count * 4, self._stream)
            self._raise_if_bad("queries")    # one synchronisation for the flag and the statuses
            unproven = np.flatnonzero(found)
            if len(unproven):               # their rows are rewritten with the band search's answers
                band_d, band_i = self._band(unproven, k)
                for row, d_row, i_row in zip(unproven.tolist(), band_d, band_i):
                    at = start + row
                    copy_host_to_address(distances_ptr + at * k * 4, d_row, self._stream)
                    copy_host_to_address(ids_ptr + at * k * 8, i_row, self._stream)
        done = self._events[1]
        done.record(self._stream)
        Stream.from_handle(caller).wait(done)
        return distances, ids

    def _wait_for_caller(self, caller: int) -> None:
        ready = self._events[0]
        ready.record(Stream.from_handle(caller))
        self._stream.wait(ready)

    # -- plans ----------------------------------------------------------------------------------------
    def _host_batch(self, n_queries: int, k: int, exact: bool = False) -> plans.HostBatch:
        key = (n_queries, k, "host", exact, self._view)
        batch = self._plans.get(key)
        if batch is None:
            main = self._main_spec(n_queries, k, exact)
            result_bytes = plans.result_layout(n_queries, k)[2]
            stage = self._pinned("query_stage", n_queries * self._stride * 4)
            results_stage = self._pinned("result_stage", result_bytes)
            results = self._device("results", result_bytes)
            search_plan = self._plan(n_queries, k, "host", exact)     # after the buffers: they may move
            batch = self._plans[key] = plans.HostBatch(
                search_plan, self._buffers["queries"], stage, n_queries * self._stride * 4, results, results_stage,
                self._stride)
        self._plans.move_to_end(key)
        return batch

    def _main_spec(self, n_queries: int, k: int, exact: bool):
        args = (self.metric, self.dtype, self.dim, k, self._arch)
        variant = plans.choose_variant(n_queries, k)
        if variant == "single":
            return render.single_spec(*args)
        if variant == "scan":
            return render.scan_spec(*args, n_queries=n_queries)
        return render.tiled_spec(*args, exact=exact, n_queries=n_queries)

    def _plan(self, n_queries: int, k: int, purpose: str, exact: bool = False) -> plans.SearchPlan:
        """The cached plan of a batch shape; the buffers it needs are grown first. exact: no filter key."""
        view = self._view
        key = (n_queries, k, purpose, exact, view, "plan")
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
            return found
        main = self._kernel(self._main_spec(n_queries, k, exact))
        verify = None if main.spec.variant == "single" else self._kernel(render.verify_spec(main.spec))
        per_list = plans.list_k(main.spec)
        groups = math.ceil(n_queries / plans.queries_per_block(main.spec))
        slices, rows = plans.split_rows(view.n, groups, main, self._sm_count, per_list, self.slices_override)
        self._device("queries", n_queries * self._stride * 4)
        self._device("candidates", plans.candidate_bytes(n_queries, slices, per_list))
        bounds = self._device("bounds", n_queries * 4)
        self._device("thresholds", n_queries * 8)
        ids_offset, status_offset, _ = plans.result_layout(n_queries, k)
        results = self._pointer("results")
        candidates = self._pointer("candidates")
        search_plan = plans.build_plan(
            main, verify, n_queries=n_queries, k=k, n_data=view.n, dim=self.dim, slices=slices, rows_per_slice=rows,
            row_stride=self._stride, data_ptr=self._pointer(view.prefix + "data"),
            norms_ptr=self._pointer(view.prefix + "norms"), queries_ptr=self._pointer("queries"), keys_ptr=candidates,
            positions_ptr=candidates + n_queries * slices * per_list * 4, ids_ptr=self._pointer(view.prefix + "ids"),
            distances_out=results, ids_out=results + ids_offset, bounds=bounds,
            row_stats_ptr=self._pointer("row_stats"), status_ptr=results + status_offset,
            threshold_ptr=self._pointer("thresholds"))
        self._plans[key] = search_plan
        while len(self._plans) > PLAN_CACHE:
            _, dropped = self._plans.popitem(last=False)
            if isinstance(dropped, plans.HostBatch):
                dropped.close()
        return search_plan

    slices_override: int | None = None   # benchmarks only: force the number of database slices

    # -- index operations (row positions; ids and labels are the Index's) ------------------------------
    def remove_rows(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """Remove rows at once: the last live rows move into the holes (O(removed x dim), no later
        slowdown). Returns (moved_from, moved_to), the rows that moved."""
        positions = np.unique(np.asarray(positions, dtype=np.int64))
        with self._lock:
            self._check_open()
            if len(positions) and (positions[0] < 0 or positions[-1] >= self._n):
                raise ValueError(f"remove_rows: positions must be in [0, {self._n}); got {positions[0]}..{positions[-1]}")
            n_new = self._n - len(positions)
            holes = positions[positions < n_new]
            movers = np.setdiff1d(np.arange(n_new, self._n, dtype=np.int64), positions, assume_unique=True)
            if len(holes):
                self._copy_rows(movers, holes, "")
            self._n = n_new
            self._screen.forget_rows()
            self._forget_plans()
            return movers, holes

    def get_rows(self, positions) -> np.ndarray:
        """Copies of the stored rows at `positions`, (len, dim) in the storage dtype."""
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        out = np.empty((len(positions), self._stride), dtype=numpy_dtype(self.dtype))
        with self._lock:
            self._check_open()
            if len(positions) and (positions.min() < 0 or positions.max() >= self._n):
                raise ValueError(f"get_rows: positions must be in [0, {self._n})")
            if len(positions):
                self._copy_rows(positions, None, "get_")
                self._buffers["get_data"].copy_to_host(out, out.nbytes, self._stream)
                self._stream.synchronize()
        return np.ascontiguousarray(out[:, :self.dim])

    def range_search(self, queries, radius: float, rows=None):
        """(lims, distances, ids): every allowed row whose contract distance is strictly inside `radius`
        (l2 below it; ip and cosine above it), each query's hits nearest first, ties by the smaller id."""
        from . import ranges

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        with self._lock, self._reading(rows):
            return ranges.range_search(self, queries, float(radius))

    # -- the rest of the protocol ---------------------------------------------------------------------
    def truncate(self, n_rows: int) -> None:
        """Drop every row from n_rows on (Index.add undoes a failed piece of a chunked add with it). The
        row statistics stay as they were: a larger maximum or smaller minimum only loosens the bounds."""
        with self._lock:
            self._check_open()
            if not 0 <= n_rows <= self._n:
                raise ValueError(f"truncate: n_rows must be between 0 and {self._n}; got {n_rows}")
            self._n = n_rows
            self._screen.forget_rows()
            self._forget_plans()

    def reset(self) -> None:
        with self._lock:
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
        with self._lock:
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
