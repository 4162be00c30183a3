"""The GPU searcher's plan for host (NumPy) queries: pinned staging allocated once, one copy in, the
selection kernel (single, scan or tiled by batch shape) and the verify step, one copy out (none for one query:
the single-query kernel writes into the pinned staging), a CUDA graph for
a shape seen twice; large batches go through the tensor-core screen first; queries verify could not prove
go to the band search (every row within their k-th candidate's float64 distance, sorted by (key, id))."""

from __future__ import annotations

import math

import numpy as np

from ..inputs.validate import check_values
from ..jit import render, render_single
from . import plan as plans

BAND_MIN_CAPACITY = 256         # band entries per query at first (grown to the largest count when exceeded)
PLAN_CACHE = 32
SHADOW_BUFFERS = ("screen_shadow", "screen_sq_lo", "screen_sq_hi", "screen_rx")   # what Screen._rows allocates


class HostQueries:
    """Mixin of GpuSearcher: host batches, their plans and the band search."""

    def _search_host_batch(self, queries: np.ndarray, k: int, exact: bool = False, screen: bool = True,
                           out=None, prepared=None) -> tuple[np.ndarray, np.ndarray]:
        """One batch of host queries; fresh result arrays (the only allocations of the call), or the caller's
        `out` (written only once the queries' values are known good). Large batches on a screened index go
        through the tensor cores (gpu/screen.py); what it cannot settle comes here. prepared: a
        PreparedBatch (searcher.py) of this shape, whose bound batch is used while it is still valid."""
        if screen and not exact and self.use_screen and self._screen.applies(len(queries), k):
            screened = self._screen.search(queries, k)
            if screened is not None:
                distances, ids, unproven = screened
                if len(unproven):
                    distances[unproven], ids[unproven] = self._search_host_batch(queries[unproven], k, screen=False)
                if out is None:
                    return distances, ids
                out[0][...], out[1][...] = distances, ids
                return out
        if prepared is not None and prepared.generation == self._plan_generation and not exact and \
                prepared.n_queries == len(queries) and prepared.k == k and self._view.prefix == "":
            batch = prepared.batch      # still in the plan cache (PreparedBatch): no lookup
        else:
            batch = self._host_batch(len(queries), k, exact)
            if prepared is not None and not exact and prepared.n_queries == len(queries) and prepared.k == k and \
                    self._view.prefix == "":
                prepared.batch, prepared.generation = batch, self._plan_generation
        if self._stride == self.dim:
            np.copyto(batch.stage, queries)
        else:
            batch.stage[:, :self.dim] = queries
        batch.run(self._stream, self.use_graphs)
        try:    # NaN, infinity and magnitude: checked here, on the host, while the device searches
            check_values(queries, "queries", "float32")
        finally:
            self._stream.synchronize()
        if out is None:
            distances, ids = batch.distances.copy(), batch.ids.copy()
        else:
            distances, ids = out
            distances[...], ids[...] = batch.distances, batch.ids      # (np.copyto costs twice as much here)
        status = batch.status       # one query: one element read (np.flatnonzero costs ~1 us more)
        if status[0] if len(status) == 1 else status.any():
            unproven = np.flatnonzero(status)
            distances[unproven], ids[unproven] = self._band(unproven, k)
        return distances, ids

    def _band(self, which: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Answers of the batch's queries `which` that verify could not prove: every row whose float64 key
        is within the query's threshold (its k-th candidate's key, an upper bound of the true k-th), found
        by band_kernel over the queries still in the 'queries' buffer, then sorted here by (key, id).
        Rare (near-ties beyond the margin), so its buffers are allocated per call."""
        view = self._view
        if view.prefix == "list":     # the listed rows gathered into the "sub_" buffers, searched there
            self._copy_rows(self._listed, None, "sub_")
            self._view = type(view)("sub_", view.n)     # views.Rows
            try:
                return self._band(which, k)
            finally:
                self._view = view
        self.exact_reruns += len(which)
        loaded = self._kernel(render.band_spec(self.metric, self.dtype, self._arch))
        f = len(which)
        blocks = max(1, min(math.ceil(view.n / plans.ROW_KERNEL_THREADS), self._sm_count * 8))
        capacity = max(BAND_MIN_CAPACITY, 4 * k)
        which_buffer, counts = self._scratch("the exact band of unproven queries", f * 4, f * 4)
        with which_buffer, counts:
            which_buffer.copy_from_host(np.ascontiguousarray(which, dtype=np.int32), f * 4, self._stream)
            while True:
                keys, band_ids = self._scratch("the exact band of unproven queries", f * capacity * 8,
                                               f * capacity * 8)
                counts.fill_bytes(0, f * 4, self._stream)
                launch = loaded.prepare(view.pointer(self, "data"), view.pointer(self, "ids"), view.n,
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

    def _host_batch(self, n_queries: int, k: int, exact: bool = False) -> plans.HostBatch:
        key = (n_queries, k, "host", exact, self._view)
        batch = self._plans.get(key)
        if batch is None:
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
        # view: None outside a search (tests ask which kernel a shape gets): every row, in stored bytes (a search
        # through the float16 shadow counts half, so its shared_bound may differ)
        view = self._view
        listed = {"listed": True} if view is not None and view.prefix == "list" else {}   # they read the row list
        if variant == "single":
            knobs = {"shadow": self._streams_shadow(), **listed, **dict(self.single_overrides)}
            return render_single.single_spec_over(self._n if view is None else view.n, *args, **knobs)
        if variant == "scan":
            return render.scan_spec(*args, n_queries=n_queries, **listed)
        return render.tiled_spec(*args, exact=exact, n_queries=n_queries, **listed)

    def _streams_shadow(self) -> bool:
        """Whether one query reads the float16 shadow of a float32 l2 index (half the bytes, single.cuh's
        ShadowKeyBound): the index's own rows (every row, a run or a list of them; not a filter's gathered copy)
        and a shadow the screen could make (no value beyond float16's range). Called when a plan is built; the
        screen makes the missing rows' shadow then, or, where it does not fit in device memory, gives its buffers
        back and the rows are streamed."""
        view = self._view
        if not (self.single_shadow and self.metric == "l2" and self.dtype == "float32" and view is not None
                and view.prefix in ("", "run", "list") and view.n > 0):
            return False
        try:
            self._screen._rows()
        except MemoryError:     # no room for the shadow (a device-memory cap, a full GPU): the rows themselves
            self._stream.synchronize()
            self._forget_plans()        # no plan may keep the shadow's address
            for name in SHADOW_BUFFERS:
                buffer = self._buffers.pop(name, None)
                if buffer is not None:
                    buffer.close()
            self._screen.forget_rows()
            return False
        screen = self._screen       # the layout single.cuh reads: float16 rows, unscaled, padded like the index's
        return screen.usable and screen.shadow and not screen.normalize and \
            screen.stride == render.row_layout(self.dim, "float16")[1]

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
        shadow = view.pointer(self, "screen_shadow") if main.spec.param("shadow", 0) else 0
        self._device("queries", n_queries * self._stride * 4)
        self._device("candidates", plans.candidate_bytes(n_queries, slices, per_list))
        bounds = self._device("bounds", max(n_queries, 2) * 4)    # one query: [0] arrivals, [1] single.cuh's GT
        self._device("thresholds", n_queries * 8)
        ids_offset, status_offset, _ = plans.result_layout(n_queries, k)
        results = self._pointer("results")
        candidates = self._pointer("candidates")
        search_plan = plans.build_plan(
            main, verify, n_queries=n_queries, k=k, n_data=view.n, dim=self.dim, slices=slices, rows_per_slice=rows,
            row_stride=self._stride, data_ptr=view.pointer(self, "data"), scan_rows_ptr=shadow,
            listed_rows_ptr=self._pointer("row_list") if view.prefix == "list" else 0,
            norms_ptr=view.pointer(self, "norms"), queries_ptr=self._pointer("queries"), keys_ptr=candidates,
            positions_ptr=candidates + n_queries * slices * per_list * 4, ids_ptr=view.pointer(self, "ids"),
            distances_out=results, ids_out=results + ids_offset, bounds=bounds,
            row_stats_ptr=self._pointer("row_stats"), status_ptr=results + status_offset,
            threshold_ptr=self._pointer("thresholds"))
        self._plans[key] = search_plan
        self._evict_plans(PLAN_CACHE)
        return search_plan
