"""The tensor-core path of a GPU search (kernels/screen.cuh, screen_steps.cuh): exact answers from a screen.

Length: one batch's four steps share the row terms and buffers kept here, so the launches are mixins that read
them: mma.sync's and the steps both screens share in gpu/screen_launch.py, the Hopper kernels' and their tensor
maps in gpu/screen_hopper.py.

For a batch of host queries on an l2 or ip index stored as float16, bfloat16, int8 or uint8 (or float32,
through a float16 shadow of its rows), or a cosine index of any dtype (through a shadow of its rows divided by
their norms, the query divided by its own):
1. the queries are rounded to the screen's element type, with the error terms of its rigorous bound;
2. the threshold mode runs over a strided sample of rows, each row tile keeping its KT smallest upper bounds
   of each query's key (render_screen.threshold_keep): the k-th smallest of them, bounds of k distinct rows,
   is an upper bound of the query's true k-th key, T (on compute capability 9.0, where step 3 is the Hopper
   screen and KT <= 2, the Hopper screen's threshold mode over whole tiles of the sample);
3. the screen runs over every row (or, SCREEN_RUNS, a label's run of them) on the tensor cores: a row
   survives a query when its lower bound is within T, so every row whose key is within T, the true k nearest
   among them, survives;
4. the survivors get their float64 distances (exactness contract), sorted by (distance, id), k written.
A query with more survivors than SURVIVOR_CAPACITY is answered by the other kernels and counted
(`screen_fallbacks`). The row terms (and shadow) are computed once per added row.
Range search runs steps 1 and 3 with each query's radius as its threshold (screen_within; the rest is
gpu/range_screen.py's).
On compute capability 9.0, steps 2 and 3 run the Hopper screen (gpu/screen_hopper.py).
"""

from __future__ import annotations

import math

import numpy as np

from ..config import get_config
from ..inputs.validate import check_values
from ..jit import render, render_screen as rs
from .screen_hopper import HOPPER_SMALL_MAX_QUERIES, HopperSteps, use_hopper
from .screen_launch import BatchShape, ScreenLaunches, StageMarks

SCREEN_MIN_QUERIES = 64         # smaller batches: the scan and tiled kernels (the screen's tiles hold 128)
SCREEN_MAX_K = 128              # survivors grow with k (about k x sample_step)
SCREEN_MIN_ROWS = 16384
SCREEN_RUNS = True              # screen a run of rows too (a label's rows after the label order) from
SCREEN_RUN_MIN_ROWS = 4096      # this many rows, on mma.sync's screen
SCREEN_METRICS = ("l2", "ip", "cosine")


ROW_PAD = 256                   # row terms are allocated in whole multiples of this many rows: the Hopper
                                # screen's bulk copies read a whole tile of |x|^2 (BN <= 256)
SAMPLE_DENSE_BELOW = 320_000    # rows a neighbour under which the sample takes every 8th row (sample_step)
SURVIVOR_HEADROOM = 2           # the sample keeps k x step (the survivors within T, before the bound's band)
                                # at most 1/2 of the survivor capacity: 10M x 128 uint8, k = 100, 2,048 queries
                                # at step 8 (1/4) had 803 survivors on average, 1,078 at most (H200): step 16
                                # (~2.2x headroom under 4,096) is the most a sample of k = 100 may skip


THRESHOLD_ON_HOPPER = "with-screen"   # step 2 on the Hopper screen's threshold mode where step 3 runs the Hopper
                                      # screen; "always" (probes): on compute capability 9.0 whatever step 3 runs


def padded_rows(n: int) -> int:
    return -(-n // ROW_PAD) * ROW_PAD


def sample_step(n_rows: int, k: int) -> int:
    """Rows between the threshold mode's samples: survivors grow with it (about k x step), the threshold
    pass's cost shrinks. H200, with the Hopper threshold mode (bench/NOTES_HOPPER.md): every 16th row is best
    at a million rows a neighbour (10M x 128 uint8, k = 10: 10.0 ms, 11.0 at 64), every 8th at 10^5 (10M,
    k = 100: 13.1 ms, 15.6 at 16; 1M x 768 float32, k = 10, 1,000 queries: 3.48 ms, 4.54 at 64) and about
    every 8th at 10^4 (1M x 768, k = 100; 100k x 128, k = 10). Large k samples more densely so that its
    survivors fit the capacity."""
    step = 16 if n_rows >= SAMPLE_DENSE_BELOW * k else 8
    while step > 1 and k * step * SURVIVOR_HEADROOM > rs.SURVIVOR_CAPACITY:
        step //= 2
    return step


class Screen(HopperSteps, ScreenLaunches):
    """The screened path's state for one GpuSearcher: row terms (and a float32 index's shadow) for rows [0, ready)."""

    def __init__(self, searcher):
        self.searcher = searcher
        self.ready = 0
        self.usable = True          # False once a float32 row does not fit float16 (then never screened)
        self.fallbacks = 0          # queries with more survivors than the capacity (answered by the other kernels)
        self.queries = 0            # queries the screen answered or handed back
        self.range_fallbacks = 0    # range search: queries range_kernel answered (memory refused, overflowed again)
        self.range_queries = 0      # range search: queries screened (answered or handed back)
        self.hopper_thresholds = 0  # batches whose threshold step ran the Hopper threshold mode
        self.range_rescreens = 0    # range search: queries whose survivors overflowed the capacity, to be screened
                                    # again with room for all (once each; refused memory: range_fallbacks too)
        element = rs.element_of(searcher.metric, searcher.dtype)
        self.shadow = rs.has_shadow(searcher.metric, searcher.dtype)
        self.normalize = searcher.metric == "cosine"
        self.stride = render.row_layout(searcher.dim, element)[1]
        self.row_bytes = self.stride * render.ITEMSIZE[element]
        self.element_bytes = render.ITEMSIZE[element]
        self.hopper = use_hopper(searcher._arch, get_config().screen)
        self.forced = self.hopper and get_config().screen == "wgmma"   # every batch, whatever its size (tests)
        # the Hopper screen's specs by small (a batch of at most 128 queries: its own tile), and the large tile's rows
        self.hopper_specs = ({small: rs.hopper_spec(searcher.metric, searcher.dtype, self.stride, searcher._arch,
                                                    small=small) for small in (False, True)} if self.hopper else {})
        self.hopper_spec = self.hopper_specs.get(False)
        self.tile_rows = self.hopper_spec.param("bn") if self.hopper else 0
        self._maps: dict[str, tuple] = {}     # rows / queries per box, "sample": (what it maps, TensorMapArg)
        self.timings: dict[str, list] | None = None   # benchmarks: set to {} to get each step's milliseconds

    def _packed(self, spec, *values):
        """The searcher's packed launch of `spec` (GpuSearcher._packed)."""
        return self.searcher._packed(spec, *values)

    def forget_rows(self) -> None:
        """Rows moved or went away (truncate, reset): recompute every row's terms before the next use."""
        self.ready = 0

    def move_rows(self, moved_from: np.ndarray, moved_to: np.ndarray, n_rows: int) -> None:
        """A removal moved rows moved_from into its holes moved_to and kept n_rows: their terms and shadow move
        with them (nothing recomputed); terms not computed yet start again from the first hole. The Hopper
        screen's tile bounds are taken again over every kept tile, since a tile's rows changed."""
        if len(moved_to) and self.ready > int(moved_to.min()):
            if self.ready > int(moved_from.max()):
                columns = [("screen_sq_lo", 4), ("screen_sq_hi", 4), ("screen_rx", 4)]
                if self.shadow:
                    columns.append(("screen_shadow", self.row_bytes))
                self.searcher.move_row_columns(columns, moved_from, moved_to)
            else:
                self.ready = int(moved_to.min())
        self.ready = min(self.ready, n_rows)
        if self.hopper and self.ready:
            self._tile_bounds(0, self.ready)

    def applies(self, n_queries: int, k: int, runs: bool = True) -> bool:
        """Whether a batch of the searcher's current view is screened: every row, or (SCREEN_RUNS, `runs`) a
        run of them in place."""
        s = self.searcher
        view = s._view
        rows = ((view.prefix == "" and view.n >= SCREEN_MIN_ROWS) or
                (runs and SCREEN_RUNS and view.prefix == "run" and view.n >= SCREEN_RUN_MIN_ROWS))
        return (self.usable and s.metric in SCREEN_METRICS and n_queries >= SCREEN_MIN_QUERIES and k <= SCREEN_MAX_K
                and rows and s.dim >= 16)

    # -- rows ------------------------------------------------------------------------------------------
    def _rows(self) -> None:
        s = self.searcher
        n = s._n
        for name, per_row in (("screen_sq_lo", 4), ("screen_sq_hi", 4), ("screen_rx", 4),
                              ("screen_shadow", self.row_bytes if self.shadow else 0)):
            if per_row:
                buffer = s._buffers.get(name)
                if buffer is None or buffer.nbytes < padded_rows(n) * per_row:
                    self.ready = 0              # a grown buffer starts empty
                    s._device(name, padded_rows(max(n, s._capacity)) * per_row)
        for bn in self._tile_rows_all() if self.hopper else ():
            buffer = s._buffers.get(self._rmax_name(bn))
            if buffer is None or buffer.nbytes < -(-n // bn) * 4:
                self.ready = 0
                s._device(self._rmax_name(bn), -(-max(n, s._capacity) // bn) * 4)
        if self.ready >= n:
            return
        loaded = s._kernel(rs.step_spec("screen_rows", s.metric, s.dtype, 0, s._arch))
        s._buffers["status"].fill_bytes(0, 4, s._stream)
        launch = loaded.prepare(s._pointer("data"), s._stride, self.ready, n, s.dim,
                                s._pointer("screen_shadow") if self.shadow else 0, self.stride,
                                int(self.normalize), s._pointer("screen_sq_lo"), s._pointer("screen_sq_hi"), s._pointer("screen_rx"),
                                s._pointer("status"))
        launch.launch(max(1, min(math.ceil((n - self.ready) / 8), s._sm_count * 8)), 256, 0, s._stream)
        if self.hopper:                     # the bound of every tile holding a new row
            self._tile_bounds(self.ready, n)
        flag = np.zeros(1, dtype=np.int32)
        s._buffers["status"].copy_to_host(flag, 4, s._stream)
        s._stream.synchronize()
        if flag[0]:
            self.usable = False             # a float32 value beyond float16: this index is not screened
        self.ready = n

    # -- one batch -------------------------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distances, ids, unproven query indices) of one batch of host float32 queries."""
        s = self.searcher
        nq, stream = len(queries), s._stream
        marks = self._marks()
        results = s._pinned("screen_results", nq * k * 12 + nq * 4)   # before a graph's lookup: growth drops plans
        replayed = self._replays()
        stage = self._stage_queries(queries) if replayed else None    # by the host: a graph holds only the copy
        if not self._steps(nq, k, lambda: self._copy_queries(stage, nq) if replayed else self._upload(queries),
                           marks, replayed):
            return None
        s._buffers["screen_out"].copy_to_host(results, nq * k * 12 + nq * 4, stream)
        try:
            check_values(queries, "queries", "float32")
        finally:
            stream.synchronize()
        marks.collect(self.timings)
        raw = results.array(np.uint8, nq * k * 12 + nq * 4)
        distances = raw[:nq * k * 4].view(np.float32).reshape(nq, k).copy()
        ids = raw[nq * k * 4:nq * k * 12].view(np.int64).reshape(nq, k).copy()
        unproven = np.flatnonzero(raw[nq * k * 12:].view(np.int32))
        self.fallbacks += len(unproven)
        self.queries += nq
        return distances, ids, unproven

    def search_resident(self, source_ptr: int, source_dtype, row_step: int, nq: int, k: int, distances_ptr: int,
                        ids_ptr: int) -> bool:
        """One batch of CUDA-array queries (read in place by the ingest kernel, which converts them to float32
        and sets the searcher's bad-value flag), its k distances (float32) and ids (int64) a query copied on
        the device to the caller's addresses, nothing waited for. False when the screen cannot run. After
        the stream synchronised (the caller reads the bad-value flag), resident_unproven() says which
        queries the screen handed back."""
        s = self.searcher
        if not self._steps(nq, k, lambda: s._ingest(source_ptr, source_dtype, row_step, nq, "float32",
                                                       s._pointer("screen_q32"), 0, False), StageMarks(False)):
            return False
        out, stream = s._buffers["screen_out"], s._stream
        out.copy_to_device(distances_ptr, nq * k * 4, stream)
        out.copy_to_device(ids_ptr, nq * k * 8, stream, offset=nq * k * 4)
        out.copy_to_host(s._pinned("screen_flags", nq * 4), nq * 4, stream, offset=nq * k * 12)
        self.queries += nq
        return True

    def resident_unproven(self, nq: int) -> np.ndarray:
        """The queries of the last search_resident batch (of nq) the screen could not settle (read after the
        stream synchronised)."""
        unproven = np.flatnonzero(self.searcher._buffers["screen_flags"].array(np.int32, nq))
        self.fallbacks += len(unproven)
        return unproven

    def _steps(self, nq: int, k: int, bring_queries, marks: "StageMarks", replayed: bool = False) -> bool:
        """Steps 1-4 of a batch of nq queries, enqueued: `bring_queries()` puts them into screen_q32 (float32,
        padded rows), the results land in screen_out (distances, ids, then each query's unproven flag).
        replayed: both through the CapturedSteps of the batch's shape (_replay). False when the screen cannot run
        (a row beyond float16)."""
        shape = self._prepare(nq, k)
        if shape is None:
            return False
        if replayed:
            self._replay(shape, lambda stream: (bring_queries(), self._issue(shape, marks)))
        else:
            bring_queries()
            self._issue(shape, marks)
        self.hopper_thresholds += shape.on_hopper
        return True

    def _prepare(self, nq: int, k: int) -> "BatchShape | None":
        """What steps 1-4 of a batch of nq queries launch, decided, and their buffers grown (the row terms of new
        rows computed first); None when the screen cannot run (a row beyond float16)."""
        s = self.searcher
        self._rows()
        if not self.usable:
            return None
        view = s._view
        n = view.n                          # every row, or a run of them from view.start
        self._first_row = view.start if view.prefix == "run" else 0
        step = sample_step(n, k)
        n_sample = -(-n // step)
        hopper = self._hopper_for(nq)
        if hopper is None and THRESHOLD_ON_HOPPER == "always" and self._hopper_rows():
            hopper_threshold = self.hopper_specs[nq <= HOPPER_SMALL_MAX_QUERIES]
        else:
            hopper_threshold = hopper
        on_hopper, sample_tiles, kept = self._threshold_shape(n_sample, k, hopper_threshold)
        sample = ({"screen_sample_sq": sample_tiles * hopper_threshold.param("bn") * 4,
                   "screen_sample_rmax": sample_tiles * 4} if on_hopper else {})
        # the survivors' room a query is the verify kernel's, read from its spec: one number for both steps
        verifies = [s._kernel(spec) for spec in rs.survivor_specs(s.metric, s.dtype, k, s._arch)]
        capacity = verifies[0].spec.param("cap")
        self._allocate(nq, capacity, screen_upper=nq * sample_tiles * kept * 4, screen_out=nq * k * 12 + nq * 4,
                       **sample)
        return BatchShape(nq, k, n, step, n_sample, hopper, hopper_threshold, on_hopper, sample_tiles, kept,
                          tuple(verifies))

    def _issue(self, shape: "BatchShape", marks: "StageMarks") -> None:
        """Steps 1-4 of a prepared batch whose float32 queries are in screen_q32, enqueued (marks: after each)."""
        s = self.searcher
        stream, ptr = s._stream, s._pointer
        nq, k, n, hopper, on_hopper = shape.nq, shape.k, shape.n, shape.hopper, shape.on_hopper
        step, sample_tiles, kept, view = shape.step, shape.sample_tiles, shape.kept, s._view
        marks.record(stream)
        self._round_queries(nq, hopper is not None or on_hopper)
        marks.record(stream)
        rows = self._screened_rows()
        # 2. threshold mode over the sample (KT bounds per tile), then each query's k-th upper bound of them
        if on_hopper:
            self._threshold_hopper(rows, nq, sample_tiles, step, kept, shape.hopper_threshold)
        else:
            self._screen(True, k, rows, shape.n_sample, step, self._term("screen_sq_hi"), nq, 0, 0,
                         ptr("screen_upper"), sample_tiles)
        self._packed(rs.step_spec("threshold", s.metric, s.dtype, k, s._arch), ptr("screen_upper"),
                     sample_tiles * kept, ptr("screen_t"))[1].launch(nq, 256, 0, stream)
        marks.record(stream)
        self._screen_every_row(nq, hopper, shape.capacity, n)
        marks.record(stream)
        # 4. the survivors (rows of the view) in float64: the queries with few, then those with more
        out = ptr("screen_out")
        for verify in shape.verifies:
            self._packed(verify.spec, ptr("screen_survivors"), ptr("screen_counts"), view.pointer(s, "ids"),
                         view.pointer(s, "data"), ptr("screen_q32"), s._stride, s.dim, out, out + nq * k * 4,
                         out + nq * k * 12)[1].launch(nq, verify.threads, verify.shared_bytes, stream)
        marks.record(stream)

    def screen_within(self, queries: np.ndarray, thresholds: np.ndarray, capacity: int) -> bool:
        """Steps 1 and 3 of a batch with the caller's thresholds (float32, key units, one per query) in place
        of step 2's: every row whose lower bound is within its query's threshold goes to screen_survivors
        (`capacity` a query, counts in screen_counts, past it still counted), the queries stay in screen_q32.
        Range search's first half (gpu/range_screen.py). False when the screen cannot run (a row beyond float16)."""
        s = self.searcher
        self._rows()
        if not self.usable:
            return False
        nq = len(queries)
        self._allocate(nq, capacity)
        self._first_row = 0                 # range search screens every row (applies(runs=False))
        hopper = self._hopper_for(nq)
        self._upload(queries)
        self._round_queries(nq, hopper is not None)
        thresholds = np.ascontiguousarray(thresholds, dtype=np.float32)
        s._buffers["screen_t"].copy_from_host(thresholds, nq * 4, s._stream)
        self._screen_every_row(nq, hopper, capacity)
        return True

    def _allocate(self, nq: int, capacity: int, **more: int) -> None:
        """The per-batch device buffers of steps 1 and 3 (and `more`, name=bytes, of the others)."""
        s = self.searcher
        # screen_q holds whole 256-query tiles, so a TMA query box never reaches past its allocation: with the
        # batch's rows only, its end abutting the small buffers after it, the Hopper screen ran 2.6x slower (H200,
        # 1M x 768 float32, exactly 100 queries, k = 100: 1.05 against 0.40 ms; growing screen_q or
        # screen_counts, whose atomics every tile hits, alone removed it; the hardware's reason is not known)
        tiles = (256, rs.hopper_tile_queries(self.hopper_spec)) if self.hopper else (256,)   # (8-bit: 192)
        tile_rows = max(-(-nq // tile) * tile for tile in tiles)
        sizes = {"screen_q32": nq * s._stride * 4, "screen_q": tile_rows * self.row_bytes, "screen_e": nq * 4,
                 "screen_f": nq * 4, "screen_t": nq * 4, "screen_counts": nq * 4,
                 "screen_survivors": nq * capacity * 4, **more}
        for name, nbytes in sizes.items():
            s._device(name, nbytes)

    def _threshold_shape(self, n_sample: int, k: int, hopper) -> tuple[bool, int, int]:
        """(on the Hopper screen, sample tiles, bounds kept per tile) of step 2, `hopper` the Hopper screen spec
        whose tile it may take (None: mma.sync's). The Hopper threshold mode reads whole tiles only (the
        sample's last n_sample mod BN rows are left out: a smaller sample is still a sample) and keeps at most
        HOPPER_MAX_KEEP bounds a tile; elsewhere mma.sync's threshold mode."""
        if hopper is not None:
            tiles = n_sample // hopper.param("bn")
            kept = rs.threshold_keep(k, tiles) if tiles else 0
            if 1 <= kept <= rs.HOPPER_MAX_KEEP:
                return True, tiles, kept
        tiles = -(-n_sample // rs.SCREEN_BN)
        return False, tiles, rs.threshold_keep(k, tiles)

__all__ = ["Screen", "SCREEN_MIN_QUERIES", "SCREEN_MAX_K", "padded_rows", "sample_step"]
