"""The GPU searcher's row operations: rows copied by the rows kernel (a filter's allowed rows gathered, a
removal's movers into its holes, rows read back by get)."""

from __future__ import annotations

import math

import numpy as np

from ..jit import render
from ..spec import numpy_dtype


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
