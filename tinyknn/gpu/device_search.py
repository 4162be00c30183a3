"""The GPU searcher's plan for CUDA-array queries (CuPy, torch, JAX): read in place by the ingest kernel,
results written straight into arrays of the caller's framework, ordered after the caller's stream both ways;
large batches through the tensor-core screen as host batches are (gpu/screen.py)."""

from __future__ import annotations

import numpy as np

from ..inputs.validate import DeviceArray
from . import interop, plan as plans
from .memory import Stream, copy_host_to_address


class DeviceQueries:
    """Mixin of GpuSearcher: batches of CUDA-array queries (the caller, search, holds the lock)."""

    def _search_device(self, queries: DeviceArray, k: int, out: tuple[DeviceArray, DeviceArray] | None = None):
        """CUDA queries, batch by batch (the caller, search, holds the lock). out: the caller's result arrays
        (checked by tinyknn.inputs.outputs; their device here), written in place of fresh ones."""
        interop.check_device(queries, self._ordinal, "queries")
        step = interop.row_step(queries, "queries")
        n_queries = queries.shape[0]
        if out is None:
            distances, ids, distances_ptr, ids_ptr = interop.empty_results(queries, n_queries, k, self._ordinal)
        else:
            interop.check_device(out[0], self._ordinal, "out[0] (distances)")
            interop.check_device(out[1], self._ordinal, "out[1] (ids)")
            distances, distances_ptr = out[0].obj, out[0].ptr
            ids, ids_ptr = out[1].obj, out[1].ptr
        caller = interop.caller_stream(queries)
        self._wait_for_caller(caller)        # after the result arrays were allocated (or last used) on it
        self._buffers["status"].fill_bytes(0, 4, self._stream)
        item = queries.dtype.itemsize
        statuses = self._device("device_status", min(n_queries, plans.MAX_BATCH) * 4)  # before the plans
        for start in range(0, n_queries, plans.MAX_BATCH):
            count = min(plans.MAX_BATCH, n_queries - start)
            if self._screened_resident(queries.ptr + start * step * item, queries.dtype, step, count, k,
                                       distances_ptr + start * k * 4, ids_ptr + start * k * 8):
                continue
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

    def _screened_resident(self, source_ptr: int, dtype, row_step: int, count: int, k: int, distances_ptr: int,
                           ids_ptr: int) -> bool:
        """A large batch through the tensor-core screen (gpu/screen.py), as host batches go: True when every
        query's answer is written; False where the screen does not apply or handed a query back (then the
        caller runs the batch through the other kernels, whose answers are the same where the screen's were
        proven). Bad values raise here, after the stream synchronised."""
        if not (self.use_screen and self._screen.applies(count, k)):
            return False
        if not self._screen.search_resident(source_ptr, dtype, row_step, count, k, distances_ptr, ids_ptr):
            return False
        self._raise_if_bad("queries")       # one synchronisation for the flag and the screen's hand-backs
        return not len(self._screen.resident_unproven(count))

    def _wait_for_caller(self, caller: int) -> None:
        ready = self._events[0]
        ready.record(Stream.from_handle(caller))
        self._stream.wait(ready)
