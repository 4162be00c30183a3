"""The GPU searcher's row operations: rows copied by the rows kernel (a filter's allowed rows gathered, a
removal's movers into its holes, every row in a new order, rows read back by get).

A removal leaves the index as a fresh index of the remaining rows would be when it is warm: the holes are
filled at once, the screen's row terms move with their rows (Screen.move_rows where the screen has it, else
it recomputes them all at its next use), and the whole-index host batches that were cached are built again
for the new row count, their graphs captured, so the next search runs as the one before the removal did.
"""

from __future__ import annotations

import math

import numpy as np

from ..jit import render
from ..spec import numpy_dtype
from . import plan as plans


class RowOperations:
    """Mixin of GpuSearcher: copy_rows, remove_rows, get_rows."""

    def _copy_rows(self, source_rows: np.ndarray, target_rows: np.ndarray | None, target: str) -> None:
        """Rows source_rows of the index go to rows target_rows (in place when target == "") or, with
        target_rows None, to rows 0, 1, ... of the `target` buffers ("sub_" or "get_"): data, ids, norms."""
        count = len(source_rows)
        has_norms = self.metric in ("cosine", "l2")
        if target:
            for name, per_row in (("data", self._row_bytes), ("ids", 8), ("norms", 4 if has_norms else 0)):
                if per_row:
                    self._device(target + name, count * per_row)
        sources, targets = self._scratch("gathering rows", count * 8, count * 8 if target_rows is not None else 0)
        with sources, targets:
            sources.copy_from_host(np.ascontiguousarray(source_rows, dtype=np.int64), count * 8, self._stream)
            if target_rows is not None:
                targets.copy_from_host(np.ascontiguousarray(target_rows, dtype=np.int64), count * 8, self._stream)
            norms = (self._pointer("norms"), self._pointer(target + "norms")) if has_norms else (0, 0)
            self._launch_row_copy(sources.ptr, targets.ptr if target_rows is not None else 0, count,
                                  (self._pointer("data"), self._pointer(target + "data"), self._row_bytes // 16),
                                  (self._pointer("ids"), self._pointer(target + "ids")), norms)
            self._stream.synchronize()        # before the index buffers behind the pointers can move

    def _launch_row_copy(self, sources: int, targets: int, count: int, data: tuple, ids: tuple, norms: tuple) -> None:
        """copy_rows_kernel over `count` rows: data (source, target, 16-byte words a row), ids (source, target)
        and 4-byte norms (source, target); a pair of zeros leaves that column alone."""
        launch = self._kernel(render.rows_spec(self._arch)).prepare(data[0], data[1], data[2], sources, targets, count,
                                                                    ids[0], ids[1], norms[0], norms[1])
        launch.launch(max(1, min(math.ceil(count / 8), self._sm_count * 8)), 256, 0, self._stream)

    def move_row_columns(self, columns, moved_from: np.ndarray, moved_to: np.ndarray) -> None:
        """Per-row device arrays kept beside the rows (the screen's row terms and shadow) follow a removal's
        moves: entry moved_from[i] of each named buffer goes to entry moved_to[i]. columns: (buffer name, bytes
        a row), each 4 or a multiple of 16. Under the change lock (remove_rows); enqueued on the stream."""
        count = len(moved_from)
        if not count:
            return
        for name, per_row in columns:
            if per_row != 4 and per_row % 16:
                raise ValueError(f"move_row_columns: {name!r} has {per_row} bytes a row; 4 or a multiple of 16 move")
        sources, targets = self._scratch("moving row terms", count * 8, count * 8)
        with sources, targets:
            sources.copy_from_host(np.ascontiguousarray(moved_from, dtype=np.int64), count * 8, self._stream)
            targets.copy_from_host(np.ascontiguousarray(moved_to, dtype=np.int64), count * 8, self._stream)
            for name, per_row in columns:
                ptr = self._pointer(name)
                if per_row == 4:
                    self._launch_row_copy(sources.ptr, targets.ptr, count, (0, 0, 0), (0, 0), (ptr, ptr))
                else:
                    self._launch_row_copy(sources.ptr, targets.ptr, count, (ptr, ptr, per_row // 16), (0, 0), (0, 0))
            self._stream.synchronize()        # before the scratch lists are freed

    def remove_rows(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """Remove rows at once: the last live rows move into the holes (O(removed x dim), no later
        slowdown). Returns (moved_from, moved_to), the rows that moved."""
        positions = np.unique(np.asarray(positions, dtype=np.int64))
        with self._lock.change:
            self._check_open()
            if len(positions) and (positions[0] < 0 or positions[-1] >= self._n):
                raise ValueError(f"remove_rows: positions must be in [0, {self._n}); got {positions[0]}..{positions[-1]}")
            n_new = self._n - len(positions)
            holes = positions[positions < n_new]
            movers = np.setdiff1d(np.arange(n_new, self._n, dtype=np.int64), positions, assume_unique=True)
            if len(holes):
                self._copy_rows(movers, holes, "")
            self._n = n_new
            move = getattr(self._screen, "move_rows", None)
            if move is None:
                self._screen.forget_rows()
            else:
                move(movers, holes, n_new)
            self._rebuild_host_batches()
            self._stream.synchronize()    # the graphs' uploads and the tile bounds done here, not in the next search
            return movers, holes

    def _rebuild_host_batches(self) -> None:
        """Every plan dropped (they hold the old row count); the whole-index host batches among them built
        again for the current rows, with as many uses and a graph where they had one, so that the next search
        of those shapes costs what it did before (a fresh index's first searches build theirs)."""
        warm = [(key, batch.uses, batch.graph is not None) for key, batch in self._plans.items()
                if isinstance(batch, plans.HostBatch) and _whole_index_batch(key)]
        self._forget_plans()
        if not warm or not self._n:
            return
        view = self._view
        self._view = type(warm[0][0][4])("", self._n)   # views.Rows: every row, the new count
        try:
            for (n_queries, k, _, exact, _), uses, graphed in warm:
                batch = self._host_batch(n_queries, k, exact)
                batch.uses = uses
                if graphed and self.use_graphs and batch.graph is None:
                    batch.capture(self._stream, batch.issue)
        finally:
            self._view = view

    def permute_rows(self, order) -> None:
        """Reorder the rows: new row i is old row order[i] (every row once; the Index's label-partitioned order,
        tinyknn.index.layout). Every row is copied in the new order into new buffers on the device, which are
        swapped in under the change lock, so a concurrent search sees one order or the other; a bad order
        (ValueError) or an allocation that fails (MemoryError) changes nothing. The screen recomputes its row
        terms at its next use (a permutation moves every row), and the cached whole-index host batches are
        built again, as after a removal."""
        order = _permutation(order, self._n)
        with self._lock.change:
            self._check_open()
            if len(order) != self._n:
                raise ValueError(f"permute_rows: order must name every row once; got {len(order)} positions for "
                                 f"{self._n} rows")
            if not self._n:
                return
            sizes = {"data": self._row_bytes, "ids": 8, "norms": 4 if self.metric in ("cosine", "l2") else 0}
            new = self._allocate_rows(sizes, self._capacity)
            try:
                (sources,) = self._scratch("reordering the rows", self._n * 8)
            except MemoryError:
                for buffer in new.values():
                    buffer.close()
                raise
            with sources:
                sources.copy_from_host(order, self._n * 8, self._stream)
                norms = (self._pointer("norms"), new["norms"].ptr) if "norms" in new else (0, 0)
                self._launch_row_copy(sources.ptr, 0, self._n, (self._pointer("data"), new["data"].ptr,
                                                                self._row_bytes // 16),
                                      (self._pointer("ids"), new["ids"].ptr), norms)
                self._stream.synchronize()      # the copy is done before the old buffers go
            for name, buffer in new.items():
                self._buffers.pop(name).close()
                self._buffers[name] = buffer
            self._screen.forget_rows()
            self._rebuild_host_batches()

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


def _permutation(order, n: int) -> np.ndarray:
    """`order` as C-contiguous int64 if it names each of rows 0 .. n - 1 once, else a ValueError (the CPU
    library's check, made before anything is copied)."""
    array = np.asarray(order)
    if array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
        raise TypeError(f"order must be a 1-D array of integer row positions; got dtype {array.dtype}, "
                        f"shape {array.shape}")
    array = np.ascontiguousarray(array, dtype=np.int64)
    if len(array) != n:
        raise ValueError(f"permute_rows: order must name every row once; got {len(array)} positions for {n} rows")
    if n and (array.min() < 0 or array.max() >= n or np.count_nonzero(np.bincount(array, minlength=n)) != n):
        raise ValueError(f"permute_rows: order must name every row position once (0 .. {n - 1}); it repeats or "
                         "misses some")
    return array


def _whole_index_batch(key) -> bool:
    """A host batch's plan-cache key (n_queries, k, "host", exact, Rows) over every row (host_search.py)."""
    return (isinstance(key, tuple) and len(key) == 5 and key[2] == "host" and getattr(key[4], "prefix", None) == ""
            and isinstance(key[0], int) and isinstance(key[1], int))
