"""Labels: one optional int64 label per row, and each label's rows, found without a scan.

Two structures, kept in step by the Index (under its bookkeeping lock):
- a host column (int64 label and a "has a label" flag per row), in row order, for save() and for
  moving labels with their rows when the searcher swap-removes;
- per label, a log of changes: the sorted rows of each add (rows are appended at the end, so they
  follow every row before them) and, for each removal that touched the label, the (rows gone, rows
  arriving) it caused there (the searcher swap-removes: rows from the end move into the holes). The
  first search that asks for a label folds its log into one sorted array, in O(that label's rows), so
  a removal costs O(rows removed or moved) whatever the labels hold, and a label's search pays only for
  the label it reads.
Until the first labelled add nothing is stored (an index without labels costs nothing). When the Index
reorders its rows label by label (tinyknn.index.layout), `partitioned_order` is that order and
`apply_permutation` rebuilds both structures from the permuted column (each label then one run of rows).
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)
LOG_LIMIT = 32                # changes a label's log holds before it is folded


class Labels:
    """Labels of the rows of one index (see the module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self._values: np.ndarray | None = None     # int64 label per row (capacity >= count)
        self._has: np.ndarray | None = None        # bool per row: the row has a label
        self._rows: dict[int, list] = {}           # label -> [sorted rows | (gone, arriving), ...]

    @property
    def any(self) -> bool:
        return self._values is not None

    # -- questions --------------------------------------------------------------------------------
    def rows_of(self, label: int) -> np.ndarray:
        """The sorted rows holding `label` (empty when none)."""
        log = self._rows.get(label)
        if log is None:
            return _EMPTY
        if len(log) > 1 or isinstance(log[0], tuple):
            rows = _EMPTY
            for change in log:
                if isinstance(change, tuple):
                    gone, arriving = change
                    rows = _merged(rows[~_members(rows, gone)], arriving)
                else:
                    rows = np.concatenate([rows, change])
            log[:] = [rows]
        return log[0]

    def column(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(labels int64, has-label bool) per row, or None when no row was ever given a label."""
        if self._values is None:
            return None
        return self._values[:self.count].copy(), self._has[:self.count].copy()

    # -- changes ----------------------------------------------------------------------------------
    def append(self, n: int, values: np.ndarray | None, has: np.ndarray | None = None) -> None:
        """Rows count .. count + n - 1 were added with labels `values` (None: no label); `has` (bool per
        row, optional) says which of them have one."""
        first = self.count
        self.count += n
        if values is None:
            if self._values is not None:
                self._grow()
                self._has[first:self.count] = False
            return
        self._grow()
        has = np.ones(n, dtype=bool) if has is None else has
        self._values[first:self.count] = values
        self._has[first:self.count] = has
        rows = np.flatnonzero(has) + first
        self._file(values[has] if not has.all() else values, rows)

    def _file(self, values: np.ndarray, rows: np.ndarray) -> None:
        """Append sorted `rows` to their labels' pieces (rows grouped by label, keeping their order)."""
        if not len(rows):
            return
        if values[0] == values[-1] and (values == values[0]).all():     # one label for the whole batch
            self._log(int(values[0]), rows)
            return
        order = np.argsort(values, kind="stable")
        grouped, rows = values[order], rows[order]
        starts = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1])))
        for label, piece in zip(grouped[starts].tolist(), np.split(rows, starts[1:])):
            self._log(label, piece)

    def _log(self, label: int, change) -> None:
        """Append a change to a label's log; a long log is folded at once, so that a label no search
        asks for holds O(its rows) and each fold is paid for by LOG_LIMIT changes."""
        log = self._rows.setdefault(label, [])
        log.append(change)
        if len(log) > LOG_LIMIT:
            self.rows_of(label)

    def _grow(self) -> None:
        if self._values is None:
            size = max(16, self.count)
            self._values, self._has = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=bool)
        elif len(self._values) < self.count:
            size = max(self.count, 2 * len(self._values))
            values, has = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=bool)
            values[:len(self._values)], has[:len(self._has)] = self._values, self._has
            self._values, self._has = values, has

    def apply_removal(self, rows: np.ndarray, moved_from: np.ndarray, moved_to: np.ndarray) -> None:
        """The searcher removed `rows` (sorted, unique) and moved rows moved_from[i] -> moved_to[i]."""
        self.count -= len(rows)
        if self._values is None or not len(rows):
            return
        dropped = np.concatenate([rows, moved_from])
        dropped_labelled = self._has[dropped]
        labels_dropped = self._values[dropped][dropped_labelled]
        dropped = dropped[dropped_labelled]
        arriving = self._has[moved_from]
        labels_arriving, rows_arriving = self._values[moved_from][arriving], moved_to[arriving]
        self._values[moved_to], self._has[moved_to] = self._values[moved_from], self._has[moved_from]
        arriving = dict(_by_label(labels_arriving, rows_arriving))
        for label, gone in _by_label(labels_dropped, dropped):
            self._log(label, (gone, arriving.get(label, _EMPTY)))

    def partitioned_order(self) -> np.ndarray:
        """The row order that puts each label's rows together (labels ascending, each label's rows in their
        present order), the rows without a label last (tinyknn.index.layout)."""
        if self._values is None:
            return np.arange(self.count, dtype=np.int64)
        values, has = self._values[:self.count], self._has[:self.count]
        return np.lexsort((values, ~has)).astype(np.int64)

    def apply_permutation(self, order: np.ndarray) -> None:
        """The searcher reordered its rows: new row i holds what row order[i] held (every row once)."""
        if self._values is None:
            return
        values, has = self._values[order], self._has[order]
        self._values[:self.count], self._has[:self.count] = values, has
        rows = np.flatnonzero(has)
        self._rows = {label: [group] for label, group in _by_label(values[rows], rows)}

    def nbytes(self) -> int:
        column = 0 if self._values is None else self._values.nbytes + self._has.nbytes
        return column + sum(sum(np.asarray(part).nbytes for part in (change if isinstance(change, tuple) else [change]))
                            + 100 for log in self._rows.values() for change in log)


def _by_label(labels: np.ndarray, rows: np.ndarray):
    """(label, its rows sorted) for each distinct label: one sort by label, then each group's own."""
    if not len(labels):
        return []
    order = np.argsort(labels)
    labels, rows = labels[order], rows[order]
    starts = np.flatnonzero(np.concatenate(([True], labels[1:] != labels[:-1])))
    return [(label, np.sort(group)) for label, group in zip(labels[starts].tolist(), np.split(rows, starts[1:]))]


def _merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two sorted arrays with no value in both as one sorted array, in O(len(a) + len(b))."""
    at = np.searchsorted(a, b) + np.arange(len(b))
    out, from_a = np.empty(len(a) + len(b), dtype=np.int64), np.ones(len(a) + len(b), dtype=bool)
    from_a[at] = False
    out[at], out[from_a] = b, a
    return out


def _members(sorted_values: np.ndarray, sorted_probe: np.ndarray) -> np.ndarray:
    """Which of sorted_values are in sorted_probe (both sorted, unique), in O(len(probe) log)."""
    found = np.zeros(len(sorted_values), dtype=bool)
    if len(sorted_probe) and len(sorted_values):
        where = np.minimum(np.searchsorted(sorted_values, sorted_probe), len(sorted_values) - 1)
        found[where[sorted_values[where] == sorted_probe]] = True
    return found
