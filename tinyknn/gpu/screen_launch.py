"""The launches of a screened batch's steps that do not depend on the Hopper screen (a mixin of gpu/screen.py's
Screen, which keeps the row terms and buffers they read): the queries' upload and rounding (step 1), mma.sync's
screen in its threshold mode (step 2) and over every row (step 3), and the CUDA events that time the steps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..jit import render_screen as rs
from .host_search import PLAN_CACHE
from .launcher import ReplayedIssue
from .memory import Event

WAVES = 8                       # screen grid: about this many waves of resident blocks (persistent tiles)
STAGES = ("queries", "threshold", "screen", "verify")   # what `timings` records, in order


SCREEN_GRAPHS = False           # a knob (probes, tests): a host batch's shape seen twice replays its steps (the
                                # queries' copy in and every launch of steps 1-4) as one CUDA graph


@dataclass(frozen=True)
class BatchShape:
    """What steps 1-4 of one batch launch (Screen._prepare): its size, the sample, which screens run steps 2 and 3
    (the Hopper screen's specs, or None for mma.sync's), and the verify kernels."""

    nq: int
    k: int
    n: int                      # rows of the view
    step: int                   # the sample takes every step-th row
    n_sample: int
    hopper: object              # the Hopper screen spec of step 3, or None
    hopper_threshold: object    # ... of step 2
    on_hopper: bool             # step 2 on the Hopper threshold mode
    sample_tiles: int
    kept: int                   # bounds kept a tile in step 2
    verifies: tuple             # step 4's loaded kernels

    @property
    def capacity(self) -> int:
        """Survivors' room a query: the verify kernel's."""
        return self.verifies[0].spec.param("cap")

    def key(self) -> tuple:
        return (self.nq, self.k, self.n, self.step, self.hopper, self.hopper_threshold, self.on_hopper,
                self.sample_tiles, self.kept, tuple(verify.spec for verify in self.verifies))


class CapturedSteps(ReplayedIssue):
    """A host batch shape's steps in the searcher's plan cache (dropped with its plans, whose buffers they read),
    replayed as a CUDA graph from their second use."""


class ScreenLaunches:
    """Mixin of Screen: the step launches both screens share, and mma.sync's."""

    def _replays(self) -> bool:
        """Whether this batch's steps go through a graph (SCREEN_GRAPHS and the searcher's use_graphs; not while
        timing the steps, nor for a host-tier worker, which keeps its queries on the device between chunks)."""
        s = self.searcher
        return (SCREEN_GRAPHS and self.timings is None and getattr(s, "use_graphs", True)
                and not getattr(s, "keeps_queries", False))

    def _replay(self, shape: BatchShape, issue) -> None:
        """`issue(stream)` (the queries' copy in and steps 1-4) through the CapturedSteps of this shape and view. Its
        buffers' addresses are in no key: a buffer that grows, like every change of the rows' storage, drops the
        plan cache (Buffers._forget_plans), and with it these."""
        s = self.searcher
        key = ("screen", shape.key(), s._view, self._first_row)
        entry = s._plans.get(key)
        if entry is None:
            entry = s._plans[key] = CapturedSteps()
            s._evict_plans(PLAN_CACHE)
        else:
            s._plans.move_to_end(key)
        entry.replay(s._stream, issue)

    def _screened_rows(self) -> int:
        """The address of the first row the screen reads: of the float16 shadow or the stored rows, from the
        view's first row."""
        return self.searcher._pointer("screen_shadow" if self.shadow else "data") + self._first_row * self.row_bytes

    _first_row = 0          # the batch's first row: a run's start, else 0 (set by _steps and screen_within)

    def _term(self, name: str) -> int:
        """The address of a row term (screen_sq_lo, screen_sq_hi, screen_rx: 4 bytes a row) from the batch's
        first row."""
        return self.searcher._pointer(name) + self._first_row * 4

    def _round_queries(self, nq: int, hopper: bool) -> None:
        """1. queries rounded, error terms (gamma's n: instructions per dot product, zero-filled ones included;
        hopper: a Hopper kernel runs step 2 or 3, whose count, the larger, then holds for both)."""
        s = self.searcher
        ptr = s._pointer
        if hopper:
            n_mma = 4 * rs.hopper_k_blocks(self.row_bytes)
        else:
            n_mma = -(-self.row_bytes // rs.SCREEN_BKB) * (rs.SCREEN_BKB // 32)
        self._packed(rs.step_spec("screen_queries", s.metric, s.dtype, 0, s._arch), ptr("screen_q32"), nq,
                     s._stride, s.dim, ptr("screen_q"), self.stride, n_mma, int(self.shadow), int(self.normalize),
                     2.0 if s.metric == "l2" else 1.0, ptr("screen_e"), ptr("screen_f"))[1].launch(
            max(1, math.ceil(nq / 8)), 256, 0, s._stream)

    def _screen_every_row(self, nq: int, hopper, capacity: int, n_rows: int | None = None) -> None:
        """3. the screen over every row (of the view: n_rows from the batch's first row) against screen_t:
        survivors (`capacity` a query) and their counts; `hopper` the Hopper screen spec to run (None:
        mma.sync's, the only one a run takes)."""
        s = self.searcher
        ptr = s._pointer
        n_rows = s._n if n_rows is None else n_rows
        s._buffers["screen_counts"].fill_bytes(0, nq * 4, s._stream)
        if hopper is not None:
            self._screen_hopper(self._screened_rows(), n_rows, nq, capacity, hopper)
        else:
            self._screen(False, 1, self._screened_rows(), n_rows, 1, self._term("screen_sq_lo"), nq,
                         ptr("screen_counts"), ptr("screen_survivors"), 0, capacity=capacity)

    def _upload(self, queries: np.ndarray) -> None:
        """The float32 queries, padded, into screen_q32. A searcher that keeps_queries (the host tier's chunk
        workers: the same queries for every chunk, whose copy would otherwise queue behind the other worker's
        chunk on the bus) uploads them once until forget_queries()."""
        s = self.searcher
        target = s._buffers["screen_q32"]
        keeps = getattr(s, "keeps_queries", False)    # its kept_queries: (array, buffer address) or None
        if keeps and s.kept_queries is not None and s.kept_queries[0] is queries and s.kept_queries[1] == target.ptr:
            return
        self._copy_queries(self._stage_queries(queries), len(queries))
        if keeps:
            s.kept_queries = (queries, target.ptr)

    def _stage_queries(self, queries: np.ndarray):
        """The float32 queries, padded, in the pinned screen_stage (the host's copy; nothing enqueued)."""
        s = self.searcher
        stage = s._pinned("screen_stage", len(queries) * s._stride * 4)
        staged = stage.array(np.float32, (len(queries), s._stride))
        staged[:, :s.dim] = queries
        if s._stride > s.dim:
            staged[:, s.dim:] = 0.0
        return stage

    def _copy_queries(self, stage, nq: int) -> None:
        """The staged queries' copy into screen_q32, enqueued."""
        s = self.searcher
        s._buffers["screen_q32"].copy_from_host(stage, nq * s._stride * 4, s._stream)

    def _marks(self) -> "StageMarks":
        return StageMarks(self.timings is not None)

    def _screen(self, threshold: bool, k: int, rows: int, n_rows: int, row_step: int, sq_norms: int, nq: int,
                counts: int, survivors: int, upper: int, sample_tiles: int | None = None,
                capacity: int = 0) -> None:
        """mma.sync's screen: threshold mode (bounds into `upper`, no survivors: capacity 0) or step 3 (survivors
        with `capacity` room a query, the verify kernel's)."""
        s = self.searcher
        spec = rs.screen_spec(s.metric, s.dtype, k, s._arch, threshold=threshold, sample_tiles=sample_tiles)
        loaded = s._kernel(spec)
        ptr = s._pointer
        row_tiles = -(-n_rows // spec.param("bn"))
        query_tiles = -(-nq // spec.param("bq"))
        resident = s._sm_count * loaded.blocks_per_sm
        per_block = max(1, query_tiles * row_tiles // (WAVES * resident))
        grid = query_tiles * -(-row_tiles // per_block)
        _, launch = self._packed(spec, rows, n_rows, row_step, sq_norms if s.metric == "l2" else 0,
                                 self._term("screen_rx"),
                                 ptr("screen_q"), nq, self.row_bytes, ptr("screen_t"), ptr("screen_e"),
                                 ptr("screen_f"), counts, survivors, capacity, upper, per_block)
        launch.launch(grid, loaded.threads, loaded.shared_bytes, s._stream)


class StageMarks:
    """CUDA events between the steps of one batch (when asked for): each step's milliseconds into `timings`."""

    def __init__(self, on: bool):
        self.events = [] if on else None

    def record(self, stream) -> None:
        if self.events is not None:
            event = Event(timing=True)
            event.record(stream)
            self.events.append(event)

    def collect(self, timings) -> None:
        """After the stream synchronised: append each step's time to timings[step]."""
        if self.events is None or timings is None:
            return
        for name, start, end in zip(STAGES, self.events, self.events[1:]):
            timings.setdefault(name, []).append(start.elapsed_ms(end))


__all__ = ["BatchShape", "CapturedSteps", "SCREEN_GRAPHS", "ScreenLaunches", "StageMarks", "STAGES", "WAVES"]
