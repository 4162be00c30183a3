"""LabelLayout: when the index puts each label's rows together (DESIGN: "a label-partitioned order").

A labelled search reads the label's rows from the searcher's panels (kernels/cpu/database.h: a panel
holds kPanel rows dimension by dimension). Rows that lie together are copied a panel line at a time; a row
on its own costs a cache line per dimension, so a 1 % label spread over the index touches ~15 % of its
lines (bench/NOTES_INDEX_OPS.md). On the GPU a label that is one run of rows is searched in place as a view
of the index (no list of positions to send, no copy, its plans and graphs kept). Reordering every row so
that each label's rows are contiguous is a copy of every row in the new order.

The policy is the ski-rental one: the runs of scattered rows that labelled searches read since the last
reorder are counted (a run is a stretch of consecutive rows: its first row is the scattered read), and once
they reach REORDER_FACTOR times the rows held, what the searches lost is about what a reorder costs, and the
index reorders (then at most about twice the cost of the better choice made in hindsight). Adds
append at the end and removals fill holes with the last rows, so the order decays and is restored the same
way. Only searchers that can reorder their rows (`permute_rows`: the CPU's and the GPU's) take part; the GPU
uses the CPU's factor (its own costs are not measured yet).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

_log = logging.getLogger(__name__)

# Reorder once the scattered runs read reach this many times the rows held: measured on the CPU (1M x 128
# float32, labels of 1 %: bench/NOTES_INDEX_OPS.md) a reorder costs ~1.6 us a row (a copy of every row in
# the new order, its pages faulted in) and a scattered run ~0.27 us more than reading it in a run.
REORDER_FACTOR = 6.0
MIN_RUNS = 4096               # below this a reorder costs too little to matter, and is never worth planning


class LabelLayout:
    """Counts the scattered reads of labelled searches and says when a reorder has paid for itself."""

    def __init__(self):
        self.scattered_runs = 0       # since the last reorder (or the index's creation)
        self.reorders = 0             # reorders done (diagnostics, tests, bench)

    def record(self, rows: np.ndarray) -> None:
        """A labelled searcher call read `rows` (sorted, unique): count its runs beyond the first."""
        if len(rows) > 1 and int(rows[-1]) - int(rows[0]) != len(rows) - 1:     # not one run (checked in O(1))
            self.scattered_runs += int(np.count_nonzero(np.diff(rows) != 1))

    def due(self, n_rows: int) -> bool:
        return self.scattered_runs >= max(MIN_RUNS, REORDER_FACTOR * n_rows)

    def reorder(self, searcher, ids, labels) -> None:
        """Reorder the searcher's rows label by label, the IdMap `ids` and the Labels `labels` in step (the
        caller holds the Index's locks). A MemoryError from the searcher (which then changed nothing) skips
        it with a RuntimeWarning (shown by default, pointing at the caller's search, as README promises; a
        ResourceWarning would be hidden by default) and a log record; either way the count starts over."""
        order = labels.partitioned_order()
        try:
            searcher.permute_rows(order)
        except MemoryError as exc:
            # stacklevel 4: here <- Index._reorder_if_due <- Index.search / range_search <- the caller
            warnings.warn(f"tinyknn skipped putting each label's rows together ({exc}); searches stay exact, "
                          "scattered labels stay slower", RuntimeWarning, stacklevel=4)
            _log.warning("tinyknn: skipped putting each label's rows together (%s); searches stay exact", exc)
        else:
            ids.apply_permutation(order)
            labels.apply_permutation(order)
        self.scattered_runs = 0
        self.reorders += 1
