"""The host-memory tier (Index(..., device="cuda", storage="host")): the database in pinned host memory,
streamed through the GPU chunk by chunk, so it may be larger than the GPU.

Two workers, each a GpuSearcher (host_worker.ChunkWorker) with its own stream and device buffers sized to
one chunk, take the chunks in turn on two threads: a worker loads its chunk (reset, then add from pinned
memory: one async DMA at full PCIe speed, then the ingest kernel on the device) while the other searches
the chunk it holds. Each chunk's copy waits on the device for the previous chunk's copy (an event), so one chunk
crosses the bus at a time, back to back: two copies at once would share the bus and then leave it idle
while both workers search. A worker's stream synchronisations release the GIL, so the threads overlap.

Exactness: a worker sees its chunk's rows under local ids 0 .. m-1 and answers exactly over them, ties by
the local id; it is asked for k + 1, and more while the last candidate's float32 distance equals the
k-th's, so every row of the chunk tied in float32 with the chunk's k-th is a candidate. host_merge folds
the chunks' candidates into the k best by (float64 distance, user id), computing float64 distances only
for candidates whose float32 distances are equal. A filter (rows=) gathers its allowed rows on the host
(chunk by chunk, into each worker's pinned staging) so that only they cross the bus.

Device memory: TINYKNN_DEVICE_MEMORY_LIMIT caps both workers together (host_worker.Budget); a chunk's rows
take at most half of it, the searches' scratch the rest. Without a cap a chunk is CHUNK_BYTES of rows (less when
the GPU has little free memory).

Length: one class whose two-worker pipeline, exact merge of the chunks' answers and the protocol's index
operations share its chunk bookkeeping; its helpers already live in host_rows, host_merge and host_worker.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..inputs.validate import DeviceArray, check_values
from ..config import get_config
from ..jit import render
from ..spec import numpy_dtype
from .device import ensure_context
from .host_merge import LARGER_IS_BETTER, Best, contract_keys, hit_order
from .host_rows import HostRows, pinned_memory
from .host_worker import Bus, Budget, ChunkWorker
from .turns import Turns

CHUNK_BYTES = 512 << 20        # host rows per chunk without a cap (6 GB of float16 x 128 on the H200: 85.0 % of H2D
                               # at 512 MiB, 78.4 % at 1 GiB, 79.9 % at 256 MiB; bench/results/host_tier_*T15*)
WORKERS = 2


@dataclass(frozen=True)
class _Unit:
    """One chunk of work: rows start .. start + count - 1 of the store, or (positions) gathered rows."""

    start: int
    count: int
    positions: np.ndarray | None = None

    def global_positions(self, local: np.ndarray) -> np.ndarray:
        found = local >= 0
        safe = np.where(found, local, 0)
        where = safe + self.start if self.positions is None else self.positions[safe]
        return np.where(found, where, -1)


class _Slot:
    """A worker and its pinned staging for gathered rows (allocated at the first filtered search)."""

    def __init__(self, worker):
        self.worker = worker
        self.staging: np.ndarray | None = None
        self.free_staging = None


class HostTierSearcher:
    """The Searcher protocol (tinyknn.index.backends) over rows held in host memory.

    make_worker (tests): a factory of chunk searchers (default: ChunkWorker on the current GPU);
    allocate (tests): host memory (default: pinned); chunk_rows: rows per chunk (default: from the cap)."""

    def __init__(self, dim: int, metric: str, dtype: str, *, chunk_rows: int | None = None, make_worker=None,
                 allocate=pinned_memory):
        self.dim, self.metric, self.dtype = dim, metric, dtype
        self._allocate = allocate
        self._store = HostRows(dim, numpy_dtype(dtype), allocate)
        self._chunk_rows = chunk_rows
        self._budget, self._bus = Budget(), Bus()
        self._on_gpu = make_worker is None
        make = make_worker or (lambda: ChunkWorker(dim, metric, dtype, self._budget, self._bus))
        self._slots: list[_Slot] = []
        self._free: queue.Queue[_Slot] = queue.Queue()
        self._local_ids, self._free_local_ids = np.empty(0, dtype=np.int64), None
        self._lock = Turns()                    # one public operation at a time, changes first
        self._closed = False
        try:
            for _ in range(WORKERS):
                self._slots.append(_Slot(make()))
        except BaseException:
            self.close()
            raise
        for slot in self._slots:
            self._free.put(slot)
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="tinyknn-host-tier")

    # -- chunks -------------------------------------------------------------------------------------
    def chunk_rows(self) -> int:
        """Rows per chunk: CHUNK_BYTES of host rows, fewer where the cap or the GPU's free memory say so.
        A worker holds per row about three stored rows (the rows, their screen shadow, the add staging)
        and its ids, norms and screen terms; both workers' rows together take at most half the cap."""
        if self._chunk_rows is not None:
            return self._chunk_rows
        dense = self.dim * np.dtype(numpy_dtype(self.dtype)).itemsize
        per_row = 3 * render.row_layout(self.dim, self.dtype)[1] * render.ITEMSIZE[self.dtype] + 32
        rows = CHUNK_BYTES // dense
        limit = get_config().device_memory_limit
        if limit is not None:
            rows = min(rows, limit // (2 * WORKERS * per_row))
        if self._on_gpu:
            from cuda.bindings import driver

            from .device import check

            ensure_context(self._slots[0].worker._ordinal)
            free, _ = check(driver.cuMemGetInfo(), "cuMemGetInfo")
            rows = min(rows, int(free) // (4 * WORKERS * per_row))
        return max(1, rows)

    def _units(self, rows) -> list[_Unit]:
        n, step = self._store.n, self.chunk_rows()
        if rows is None:
            return [_Unit(start, min(step, n - start)) for start in range(0, n, step)]
        positions = np.ascontiguousarray(rows, dtype=np.int64)
        units = []
        for first in range(0, len(positions), step):
            part = positions[first:first + step]
            if part[-1] - part[0] + 1 == len(part):          # a contiguous run: no gathering
                units.append(_Unit(int(part[0]), len(part)))
            else:
                units.append(_Unit(int(part[0]), len(part), part))
        return units

    def _prepare(self, units: list[_Unit]) -> None:
        """Before the threads start: the local ids 0 .. m-1 and the gathering staging, pinned, big enough."""
        largest = max((u.count for u in units), default=0)
        if len(self._local_ids) < largest:
            memory, free = self._allocate(largest * 8)
            if self._free_local_ids is not None:
                self._free_local_ids()
            self._local_ids, self._free_local_ids = memory[:largest * 8].view(np.int64), free
            self._local_ids[:] = np.arange(largest, dtype=np.int64)
        gathered = max((u.count for u in units if u.positions is not None), default=0)
        row_bytes = self.dim * self._store.dtype.itemsize
        for slot in self._slots:
            if gathered and (slot.staging is None or len(slot.staging) < gathered):
                memory, free = self._allocate(gathered * row_bytes)
                if slot.free_staging is not None:
                    slot.free_staging()
                slot.staging = memory[:gathered * row_bytes].view(self._store.dtype).reshape(gathered, self.dim)
                slot.free_staging = free

    def _load(self, slot: _Slot, unit: _Unit) -> None:
        """Put the unit's rows on the slot's worker (gathered first where they are not contiguous)."""
        store = self._store
        if unit.positions is None:
            rows = store.rows[unit.start:unit.start + unit.count]
        else:
            rows = slot.staging[:unit.count]
            np.take(store.rows, unit.positions, axis=0, out=rows, mode="clip")   # 'raise' would buffer `out`
        slot.worker.reset()
        slot.worker.add(rows, self._local_ids[:unit.count])

    def _run(self, units: list[_Unit], task) -> None:
        """task(slot, unit) for every unit on the worker threads; the first error is raised after all stop."""
        self._prepare(units)
        failed = threading.Event()

        def one(unit):
            if failed.is_set():
                return
            slot = self._free.get()
            try:
                if self._on_gpu:     # a driver context is current per thread; the pool's start with none
                    ensure_context(slot.worker._ordinal)
                self._load(slot, unit)
                task(slot, unit)
            except BaseException:
                failed.set()
                raise
            finally:
                self._free.put(slot)

        errors = []
        for future in [self._pool.submit(one, unit) for unit in units]:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once every thread is done
                errors.append(exc)
        if errors:
            raise errors[0]

    def _exact(self, queries: np.ndarray):
        rows, metric = self._store.rows, self.metric
        return lambda which, positions: contract_keys(queries[which], rows[positions], metric)

    def _candidates(self, unit: _Unit, distances: np.ndarray, local: np.ndarray):
        """(keys, global positions, user ids) of a unit's answer."""
        positions = unit.global_positions(local)
        ids = np.where(positions >= 0, self._store.ids[np.maximum(positions, 0)], -1)
        keys = -distances if LARGER_IS_BETTER[self.metric] else distances
        return keys, positions, ids

    # -- the Searcher protocol ----------------------------------------------------------------------
    def add(self, vectors, ids: np.ndarray) -> None:
        if isinstance(vectors, DeviceArray):
            raise TypeError("an index with storage='host' adds host (NumPy) arrays; pass x.get() (CuPy) or "
                            "x.cpu().numpy() (torch)")
        with self._lock.change:
            self._check_open()
            self._store.append(vectors, np.asarray(ids, dtype=np.int64))

    def append_with(self, count: int, write) -> None:
        """Append `count` rows that write(rows_view, ids_view) fills in place, straight in pinned memory
        (benchmarks and loaders that produce data there; values are not checked)."""
        with self._lock.change:
            self._check_open()
            self._store.append_with(count, write)

    def reserve(self, n_rows: int) -> None:
        """Allocate room for exactly n_rows rows now (one pinned allocation instead of doublings)."""
        with self._lock.change:
            self._check_open()
            self._store.reserve(n_rows, exact=True)

    def search(self, queries, k: int, rows=None):
        queries = self._host_queries(queries)
        with self._lock:
            self._check_open()
            best = Best(len(queries), k, self._exact(queries))
            for slot in self._slots:
                getattr(slot.worker, "forget_queries", lambda: None)()
            if len(queries):
                self._run(self._units(rows), lambda slot, unit: best.merge(
                    *self._candidates(unit, *self._answer(slot.worker, queries, k, unit.count))))
            return best.result(self.metric)

    def _answer(self, worker, queries: np.ndarray, k: int, count: int):
        """A unit's k + 1 best, widened (for the queries that need it) until every row tied in float32 with
        the unit's k-th is among them."""
        distances, local = worker.search(queries, k + 1)
        kth = distances[:, k - 1]
        need = np.flatnonzero((local[:, -1] >= 0) & (distances[:, -1] == kth))
        width = k + 1
        while len(need) and width < count:
            width = min(2 * width, count)
            more_d, more_i = worker.search(np.ascontiguousarray(queries[need]), width)
            pad = -np.inf if LARGER_IS_BETTER[self.metric] else np.inf
            wide_d = np.full((len(queries), width), pad, dtype=np.float32)
            wide_i = np.full((len(queries), width), -1, dtype=np.int64)
            wide_d[:, :distances.shape[1]], wide_i[:, :local.shape[1]] = distances, local
            wide_d[need], wide_i[need] = more_d, more_i
            distances, local = wide_d, wide_i
            need = need[(more_i[:, -1] >= 0) & (more_d[:, -1] == kth[need])]
        return distances, local

    def range_search(self, queries, radius: float, rows=None):
        queries = self._host_queries(queries)
        radius = float(radius)
        with self._lock:
            self._check_open()
            parts, parts_lock = [], threading.Lock()

            def task(slot, unit):
                lims, distances, local = slot.worker.range_search(queries, radius)
                which = np.repeat(np.arange(len(queries)), np.diff(lims))
                with parts_lock:
                    parts.append((which, *self._candidates(unit, distances, local)))

            if len(queries):
                self._run(self._units(rows), task)
            which, keys, positions, ids = (np.concatenate([p[j] for p in parts]) if parts else
                                           np.empty(0, dtype) for j, dtype in
                                           enumerate((np.int64, np.float32, np.int64, np.int64)))
            order = hit_order(which, keys, positions, ids, self._exact(queries))
            lims = np.zeros(len(queries) + 1, dtype=np.int64)
            np.cumsum(np.bincount(which, minlength=len(queries)), out=lims[1:])
            distances = -keys[order] if LARGER_IS_BETTER[self.metric] else keys[order]
            return lims, distances.astype(np.float32), ids[order]

    def _host_queries(self, queries) -> np.ndarray:
        if isinstance(queries, DeviceArray):
            raise TypeError("an index with storage='host' searches host (NumPy) queries; pass q.get() (CuPy) or "
                            "q.cpu().numpy() (torch)")
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        check_values(queries, "queries", "float32")     # once here, not once per chunk
        return queries

    def remove_rows(self, positions) -> tuple[np.ndarray, np.ndarray]:
        positions = np.unique(np.asarray(positions, dtype=np.int64))
        with self._lock.change:
            self._check_open()
            return self._store.remove(positions)

    def get_rows(self, positions) -> np.ndarray:
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        with self._lock:
            self._check_open()
            return self._store.get(positions)

    def truncate(self, n_rows: int) -> None:
        with self._lock.change:
            self._check_open()
            self._store.truncate(n_rows)

    def reset(self) -> None:
        with self._lock.change:
            self._check_open()
            self._store.truncate(0)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            self._check_open()
            n = self._store.n
            return self._store.rows[:n].copy(), self._store.ids[:n].copy()

    def close(self) -> None:
        """Free the workers (device memory, streams), the pinned rows and staging; once."""
        with self._lock.change:
            if self._closed:
                return
            self._closed = True
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.shutdown(wait=True)
            if self._on_gpu and self._slots:
                ensure_context(self._slots[0].worker._ordinal)
            for slot in self._slots:
                slot.worker.close()
                if slot.free_staging is not None:
                    slot.free_staging()
            if self._free_local_ids is not None:
                self._free_local_ids()
            self._store.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this GPU index was closed")

    @property
    def ntotal(self) -> int:
        return self._store.n

    @property
    def exact_reruns(self) -> int:
        """Queries the workers' band search answered (diagnostics, as GpuSearcher.exact_reruns)."""
        return sum(getattr(slot.worker, "exact_reruns", 0) for slot in self._slots)


__all__ = ["HostTierSearcher", "CHUNK_BYTES"]
