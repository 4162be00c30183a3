"""IdMap: which user id lives in which searcher row, without sorting every id on every add.

Ids are the user's currency, rows are the searcher's. Each id gets a serial number when it is first
added (0, 1, 2, ... in the order of adds); three stores map id -> serial:
- runs: (first id, first row, length) of consecutive ids in consecutive rows. Auto ids always form one
  (they continue after the largest id the index has held), so an index of auto ids costs ~0 bytes per id;
- sorted segments: pairs of int64 arrays (ids sorted, their rows), 16 bytes per id, searched with
  np.searchsorted. A new segment merges with the last one while that is at most twice its size (a
  binary counter), so there are O(log n) segments and adding n ids costs O(n log n) in all;
- a recent dict for the latest small batches (~100 bytes per entry), turned into a segment once it
  holds RECENT_LIMIT ids, so an add of one id costs a dict insert and O(log n) searches.
A batch is checked against all three before anything is committed (`check_new`), then committed
after the searcher has taken the rows (`commit`), so a failed add leaves the map as it was.

Until the first removal serial == row, and no more is stored. A removal (the searcher swap-removes: rows
from the end move into the holes) creates two int64 columns, serial -> row (-1: removed) and row ->
serial, and updates them in O(removed) (`apply_removal`); the stores never change for it. An id added
again after its removal gets its old serial back, so no store ever holds an id twice. Once removed
serials outnumber the rows held, the stores are rebuilt from the live rows (serial == row again). A
reorder of every row (tinyknn.index.layout) is the same two columns permuted, O(rows).
"""

from __future__ import annotations

import bisect

import numpy as np

INT64_MAX = int(np.iinfo(np.int64).max)
MIN_RUN = 64                  # shorter runs of explicit ids go to the base or the dict
SMALL_BATCH = 1024            # batches up to this size go to the dict, larger ones become a segment
RECENT_LIMIT = 4096           # the dict becomes a segment beyond this many ids
FEW_RUNS = 16                 # rows_present slices increasing ids run by run up to this many runs
MEMO_IDS = 1 << 20            # rows_allowed keeps its last answer for a filter of at most this many ids
_EMPTY = np.empty(0, dtype=np.int64)


class IdMap:
    """id -> row for the rows of one index (see the module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.count = 0                 # rows held (== the searcher's rows)
        self.next_auto = 0             # the first auto id: 1 + the largest id held since creation/reset
        self.next_serial = 0           # serials issued (== count until the first removal)
        self._row_of_serial: np.ndarray | None = None    # None: serial == row (nothing removed yet)
        self._serial_of_row: np.ndarray | None = None
        self._dead = 0                 # serials whose id is not in the index now
        self._run_start: list[int] = []   # sorted by first id; runs never overlap
        self._run_row: list[int] = []
        self._run_len: list[int] = []
        self._runs_cache = None
        self._segments: list[tuple[np.ndarray, np.ndarray]] = []   # (sorted ids, rows), largest first
        self._recent: dict[int, int] = {}
        self._memo = None               # rows_allowed's last (ids, rows); every change below forgets it

    # -- questions --------------------------------------------------------------------------------
    def auto_ids(self, n: int) -> np.ndarray:
        """The ids an add of n rows without ids gets: next_auto, next_auto + 1, ... (never in use)."""
        if self.next_auto + n - 1 > INT64_MAX:
            raise ValueError(f"automatic ids would pass int64's largest value {INT64_MAX} (the largest id in "
                             f"use is {self.next_auto - 1}); pass ids explicitly")
        return np.arange(self.next_auto, self.next_auto + n, dtype=np.int64)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id, -1 where the id is not in the index."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size > 256 and self._segments:   # sorted probes walk each segment in order, not missing the cache
            order = np.argsort(ids)
            rows = np.empty(ids.shape, dtype=np.int64)
            rows[order] = self._rows_of(ids[order])
            return rows
        return self._rows_of(ids)

    def rows_present(self, ids: np.ndarray) -> np.ndarray:
        """The sorted, unique rows of those ids that are in the index (a filter's or a removal's rows).
        Ids not already increasing (a filter's often are) are sorted first where that pays: sorted probes walk
        the segments in order, and where rows follow id order the rows come out sorted. Where only runs (or
        the recent dict) map ids and rows no longer follow them (after a removal or a reorder), the ids are
        looked up as given and the rows sorted once (10,000 random auto ids of a reordered 1M-row index:
        151-153 -> 114-120 us on the 2-core development VM)."""
        ordered = np.asarray(ids, dtype=np.int64)
        increasing = len(ordered) < 2 or bool(np.all(ordered[1:] > ordered[:-1]))
        if increasing and len(ordered) and not self._segments and not self._recent and \
                0 < len(self._run_start) <= FEW_RUNS:
            rows = self._rows_of_serials(self._serials_in_runs(ordered))
        else:
            if not increasing and (self._segments or self._row_of_serial is None):
                ordered = _sorted_unique(ordered)
                increasing = True
            rows = self._rows_of(ordered)
        if len(rows) and rows.min() < 0:
            rows = rows[rows >= 0]
        if len(rows) > 1 and not bool(np.all(rows[1:] > rows[:-1])):
            rows = _sorted_unique(rows) if not increasing else np.sort(rows)
        return rows

    def rows_allowed(self, ids: np.ndarray) -> np.ndarray:
        """rows_present of a filter, remembered for the next call with the same ids until the map changes: a
        filter is often the same one search after search (a tenant's, a user's), and its rows cost ~60 us
        for 10,000 ids on the H200's host against ~4 us for comparing them. The rows are read-only."""
        ordered = np.asarray(ids, dtype=np.int64)
        memo = self._memo
        if memo is not None and np.array_equal(memo[0], ordered):
            return memo[1]
        rows = self.rows_present(ordered)
        if ordered.ndim == 1 and len(ordered) <= MEMO_IDS:
            rows = rows.copy()              # its own (not a shared constant, nor a view others may write through)
            rows.flags.writeable = False
            self._memo = (ordered.copy(), rows)
        return rows

    def _serials_in_runs(self, ordered: np.ndarray) -> np.ndarray:
        """The serials of the held ones of increasing ids where a few runs hold every id (the usual index of
        given or auto ids), for rows_present: each run's ids are one slice of them (two binary searches), their
        serials that slice shifted, without the per-id masks of _serials_of (10,000 ids of a 1M-row index,
        development VM: 21 -> 12 us, and 34 -> 22 us once a removal made the serial -> row column)."""
        starts, first_serials, lengths = self._runs()
        lows = np.searchsorted(ordered, starts)
        highs = np.searchsorted(ordered, starts + (lengths - 1), side="right")     # a run may end at INT64_MAX
        parts = [ordered[low:high] + (serial - start) for low, high, start, serial
                 in zip(lows.tolist(), highs.tolist(), starts.tolist(), first_serials.tolist()) if high > low]
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _EMPTY.copy()

    def _rows_of(self, ids: np.ndarray) -> np.ndarray:
        return self._rows_of_serials(self._serials_of(ids))

    def _rows_of_serials(self, serials: np.ndarray) -> np.ndarray:
        """The row of each serial (-1: never held, or removed); `serials` may be written."""
        if self._row_of_serial is None:
            return serials
        if not len(serials) or serials.min() >= 0:      # every id known (a filter's usually are): one gather
            return np.take(self._row_of_serial, serials)    # (np.take: ~30 % less than indexing here)
        known = serials >= 0
        serials[known] = self._row_of_serial[serials[known]]
        return serials

    def _serials_of(self, ids: np.ndarray) -> np.ndarray:
        """The serial of each id in the stores (also of removed ids), -1 where an id was never held."""
        rows = np.full(ids.shape, -1, dtype=np.int64)
        if not ids.size:
            return rows
        if len(self._run_start) == 1 and not self._segments and not self._recent:   # one run only: arithmetic
            offset = ids - self._run_start[0]
            inside = offset.view(np.uint64) < self._run_len[0]      # 0 <= offset < length
            return np.where(inside, offset + self._run_row[0], -1)
        if self._run_start:
            starts, first_rows, lengths = self._runs()
            which = np.maximum(np.searchsorted(starts, ids, side="right") - 1, 0)
            offset = ids - starts[which]
            inside = (offset >= 0) & (offset < lengths[which])
            rows[inside] = first_rows[which[inside]] + offset[inside]
        for sorted_ids, segment_rows in self._segments:
            _look_up(sorted_ids, segment_rows, ids, rows)
        recent = self._recent
        if ids.size <= len(recent):
            for position, user_id in enumerate(ids.tolist()):
                row = recent.get(user_id)
                if row is not None:
                    rows[position] = row
        elif recent:
            _look_up(*_sorted_pairs(recent), ids, rows)
        return rows

    def check_new(self, ids: np.ndarray, given: bool) -> None:
        """Refuse ids that repeat within the batch or are already in the index (nothing is changed).

        `given` says whether the caller passed the ids, so the message never blames them for ours."""
        ordered = np.sort(ids) if len(ids) > 1 else ids
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if len(repeated):
            raise ValueError(f"ids must be unique; the ids passed repeat {np.unique(repeated)[:5].tolist()}")
        taken = ordered[self._rows_of(ordered) >= 0] if self.count else _EMPTY   # sorted probes: see rows_of
        if len(taken):
            whose = "the ids passed include" if given else "automatic ids collided with"
            raise ValueError(f"ids must be unique in the index; {whose} ids already in it: "
                             f"{np.unique(taken)[:5].tolist()}")

    # -- changes ----------------------------------------------------------------------------------
    def commit(self, ids: np.ndarray) -> None:
        """Record that rows count, count + 1, ... now hold `ids` (already checked by check_new)."""
        self._memo = None
        n = len(ids)
        if n == 0:
            return
        if self._row_of_serial is None:
            self._store(ids, self.next_serial)
            self.next_serial += n
        else:
            serials = self._serials_of(ids)        # ids held before keep their serial (check_new: all removed)
            fresh = serials < 0
            n_fresh = int(np.count_nonzero(fresh))
            if n_fresh:
                self._store(ids if n_fresh == n else ids[fresh], self.next_serial)
                serials[fresh] = np.arange(self.next_serial, self.next_serial + n_fresh, dtype=np.int64)
                self.next_serial += n_fresh
            self._dead -= n - n_fresh
            self._row_of_serial = _grown(self._row_of_serial, self.next_serial)
            self._row_of_serial[serials] = np.arange(self.count, self.count + n, dtype=np.int64)
            self._serial_of_row = _grown(self._serial_of_row, self.count + n)
            self._serial_of_row[self.count:self.count + n] = serials
        self.count += n
        self.next_auto = max(self.next_auto, int(ids.max()) + 1)

    def apply_removal(self, rows: np.ndarray, moved_from: np.ndarray, moved_to: np.ndarray) -> None:
        """The searcher removed `rows` (sorted, unique) and moved rows moved_from[i] -> moved_to[i]."""
        self._memo = None
        if len(rows) == 0:
            return
        self._keep_columns()
        gone, moving = self._serial_of_row[rows], self._serial_of_row[moved_from]
        self._row_of_serial[gone] = -1
        self._row_of_serial[moving] = moved_to
        self._serial_of_row[moved_to] = moving
        self.count -= len(rows)
        self._dead += len(rows)
        if self._dead > max(RECENT_LIMIT, self.count):
            self._rebuild()

    def apply_permutation(self, order: np.ndarray) -> None:
        """The searcher reordered its rows: new row i holds what row order[i] held (every row once)."""
        self._memo = None
        self._keep_columns()
        serials = self._serial_of_row[order]
        self._serial_of_row[:self.count] = serials
        self._row_of_serial[serials] = np.arange(self.count, dtype=np.int64)

    def _keep_columns(self) -> None:
        """Create the serial <-> row columns (serial == row so far) before the first move of rows."""
        if self._row_of_serial is None:
            self._row_of_serial = np.arange(max(self.next_serial, 16), dtype=np.int64)
            self._serial_of_row = np.arange(max(self.count, 16), dtype=np.int64)

    def ids_of_rows(self) -> np.ndarray:
        """The id of every row (row order), from the stores: O(ids ever held since the last rebuild)."""
        starts, first_serials, lengths = self._runs() if self._run_start else (_EMPTY, _EMPTY, _EMPTY)
        total = int(lengths.sum()) if len(lengths) else 0
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        run_ids = np.repeat(starts, lengths) + offsets
        run_serials = np.repeat(first_serials, lengths) + offsets
        recent_ids, recent_serials = _sorted_pairs(self._recent) if self._recent else (_EMPTY, _EMPTY)
        all_ids = np.concatenate([run_ids, recent_ids, *(ids for ids, _ in self._segments)])
        serials = np.concatenate([run_serials, recent_serials, *(s for _, s in self._segments)])
        rows = serials if self._row_of_serial is None else self._row_of_serial[serials]
        live = rows >= 0
        by_row = np.empty(self.count, dtype=np.int64)
        by_row[rows[live]] = all_ids[live]
        return by_row

    def _rebuild(self) -> None:
        """Fresh stores over the live rows only (serial == row again): frees what removed ids held."""
        by_row, next_auto = self.ids_of_rows(), self.next_auto
        self.reset()
        self.commit(by_row)
        self.next_auto = max(self.next_auto, next_auto)

    def _store(self, ids: np.ndarray, first_serial: int) -> None:
        """Put ids (never held before) with serials first_serial, first_serial + 1, ... into the stores."""
        n = len(ids)
        first_row = first_serial
        first, last = int(ids[0]), int(ids[-1])
        consecutive = last - first == n - 1 and (n <= 2 or bool(np.all(np.diff(ids) == 1)))
        if consecutive and (n >= MIN_RUN or self._extends_last_run(first, first_row)):
            self._add_run(first, first_row, n)
        elif n <= SMALL_BATCH:
            self._recent.update(zip(ids.tolist(), range(first_row, first_row + n)))
            if len(self._recent) > RECENT_LIMIT:
                self._add_segment(*_sorted_pairs(self._recent))
                self._recent = {}
        else:
            order = np.argsort(ids, kind="stable")
            self._add_segment(ids[order], (first_row + order).astype(np.int64))

    def _extends_last_run(self, first_id: int, first_row: int) -> bool:
        return bool(self._run_start) and (self._run_start[-1] + self._run_len[-1] == first_id
                                          and self._run_row[-1] + self._run_len[-1] == first_row)

    def _runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first ids, first rows, lengths) of the runs as arrays, rebuilt only after a change."""
        if self._runs_cache is None:
            self._runs_cache = tuple(np.asarray(values, dtype=np.int64)
                                     for values in (self._run_start, self._run_row, self._run_len))
        return self._runs_cache

    def _add_run(self, first_id: int, first_row: int, length: int) -> None:
        self._runs_cache = None
        position = bisect.bisect(self._run_start, first_id)
        before = position - 1
        if (before >= 0 and self._run_start[before] + self._run_len[before] == first_id
                and self._run_row[before] + self._run_len[before] == first_row):
            self._run_len[before] += length      # consecutive auto adds extend one run
            return
        self._run_start.insert(position, first_id)
        self._run_row.insert(position, first_row)
        self._run_len.insert(position, length)

    def _add_segment(self, sorted_ids: np.ndarray, rows: np.ndarray) -> None:
        while self._segments and len(self._segments[-1][0]) <= 2 * len(sorted_ids):
            sorted_ids, rows = _merged(*self._segments.pop(), sorted_ids, rows)
        self._segments.append((sorted_ids, rows))

    def nbytes(self) -> int:
        """Approximate memory the map holds (for the footprint table in docs/index-operations.md and tests)."""
        columns = sum(column.nbytes for column in (self._row_of_serial, self._serial_of_row) if column is not None)
        return (sum(ids.nbytes + rows.nbytes for ids, rows in self._segments) + 100 * len(self._recent)
                + 3 * 36 * len(self._run_start) + columns)


def _grown(column: np.ndarray, size: int) -> np.ndarray:
    """column itself when it holds `size` entries, else a copy with room for twice as many."""
    if len(column) >= size:
        return column
    grown = np.empty(max(size, 2 * len(column)), dtype=column.dtype)
    grown[:len(column)] = column
    return grown


def _sorted_pairs(mapping: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    keys = np.fromiter(mapping.keys(), dtype=np.int64, count=len(mapping))
    values = np.fromiter(mapping.values(), dtype=np.int64, count=len(mapping))
    order = np.argsort(keys)
    return keys[order], values[order]


def _merged(a_ids: np.ndarray, a_rows: np.ndarray, b_ids: np.ndarray, b_rows: np.ndarray):
    """Two sorted segments (no id in both) as one, in O(len(a) + len(b))."""
    n = len(a_ids) + len(b_ids)
    to_b = np.searchsorted(a_ids, b_ids) + np.arange(len(b_ids))   # where each b lands in the merge
    from_a = np.ones(n, dtype=bool)
    from_a[to_b] = False
    ids, rows = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    ids[to_b], rows[to_b] = b_ids, b_rows
    ids[from_a], rows[from_a] = a_ids, a_rows
    return ids, rows


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """values sorted, each once (np.unique without its extra passes)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) > 1 else values


def _look_up(sorted_ids: np.ndarray, rows_of_sorted: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """rows[i] = the row of ids[i] where sorted_ids holds it."""
    where = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    found = sorted_ids[where] == ids
    rows[found] = rows_of_sorted[where[found]]
