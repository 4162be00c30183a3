"""ShardedSearcher: one Searcher over several (one per GPU), the rows split between them and the
answers merged exactly (tinyknn.index.merge: the answer one searcher holding every row gives, bit for bit).

The Index's rows are names here: row g lives in shard shard_of[g] at local row local_of[g]. An add goes to
the shards that hold the fewest rows, split so that their counts even out; a removal removes in each shard
(which swap-removes within itself) and then renames the last rows into the holes, so no vector moves
between shards. A call goes to every shard at once, a thread each (a GPU searcher works on its own device
and stream, the CPU library releases the GIL). Equal float32 distances from different shards are ordered
by the float64 distance of their rows (read back with get_rows), then by the smaller id.

An add or a removal is several shard calls: a reader-writer gate keeps a search from seeing part of one.
Host (NumPy) inputs only.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import merge

_EMPTY = np.empty(0, dtype=np.int64)


class _Gate:
    """Many readers or one writer (writers first, so a stream of searches cannot starve an add)."""

    def __init__(self):
        self._state = threading.Condition()
        self._readers = self._writers_waiting = 0
        self._writing = False

    def read(self):
        return _Held(self, False)

    def write(self):
        return _Held(self, True)

    def _enter(self, writer: bool) -> None:
        with self._state:
            if writer:
                self._writers_waiting += 1
                self._state.wait_for(lambda: not self._writing and not self._readers)
                self._writers_waiting -= 1
                self._writing = True
            else:
                self._state.wait_for(lambda: not self._writing and not self._writers_waiting)
                self._readers += 1

    def _leave(self, writer: bool) -> None:
        with self._state:
            if writer:
                self._writing = False
            else:
                self._readers -= 1
            self._state.notify_all()


class _Held:
    def __init__(self, gate: _Gate, writer: bool):
        self._gate, self._writer = gate, writer

    def __enter__(self):
        self._gate._enter(self._writer)

    def __exit__(self, *exc):
        self._gate._leave(self._writer)


class ShardedSearcher:
    """The Searcher protocol (tinyknn.index.backends) over `shards`, searchers of one (dim, metric, dtype)."""

    def __init__(self, shards: list, metric: str):
        if not shards:
            raise ValueError("a sharded searcher needs at least one shard")
        self._shards, self.metric = list(shards), metric
        self._pool = ThreadPoolExecutor(len(self._shards), thread_name_prefix="tinyknn-shard")
        self._gate = _Gate()
        self._clear()

    def _clear(self) -> None:
        self._shard_of = _EMPTY.copy()        # per row: its shard
        self._local_of = _EMPTY.copy()        # per row: its row in that shard
        self._ids = _EMPTY.copy()             # per row: its id (to find a tied row's shard and local row)
        self._rows_of_shard = [_EMPTY.copy() for _ in self._shards]   # per shard: the row of each local row
        self._sorted_ids = None               # (ids sorted, their rows), built when a tie needs it

    def _each(self, call, *per_shard):
        """[call(shard, *args of that shard) for every shard], the shards at once."""
        args = zip(self._shards, *per_shard) if per_shard else ((s,) for s in self._shards)
        return list(self._pool.map(lambda a: call(*a), args))

    @property
    def ntotal(self) -> int:
        return len(self._shard_of)

    # -- changes ------------------------------------------------------------------------------------
    def add(self, vectors, ids: np.ndarray) -> None:
        """Each shard takes a slice, the emptiest first; a shard that fails undoes every shard's part."""
        if not isinstance(vectors, np.ndarray):
            raise TypeError("a sharded index takes host (NumPy) vectors; pass x.get() (CuPy) or x.cpu().numpy()")
        ids = np.asarray(ids, dtype=np.int64)
        with self._gate.write():
            counts = np.array([len(rows) for rows in self._rows_of_shard])
            takes = _even_out(counts, len(ids))
            starts = np.concatenate(([0], np.cumsum(takes)))
            done = []
            try:
                for s, shard in enumerate(self._shards):
                    if takes[s]:
                        shard.add(vectors[starts[s]:starts[s + 1]], ids[starts[s]:starts[s + 1]])
                        done.append(s)
            except BaseException:
                for s in done:
                    self._shards[s].truncate(int(counts[s]))
                raise
            first = self.ntotal
            shard_of = np.repeat(np.arange(len(self._shards)), takes)
            local_of = np.concatenate([np.arange(counts[s], counts[s] + takes[s]) for s in range(len(takes))])
            self._shard_of = np.concatenate([self._shard_of, shard_of])
            self._local_of = np.concatenate([self._local_of, local_of.astype(np.int64)])
            self._ids = np.concatenate([self._ids, ids])
            for s in range(len(self._shards)):
                self._rows_of_shard[s] = np.concatenate([self._rows_of_shard[s], first + np.arange(
                    starts[s], starts[s + 1], dtype=np.int64)])
            self._sorted_ids = None

    def truncate(self, n_rows: int) -> None:
        """Drop rows n_rows and later (the newest: each shard's last ones), undoing an add."""
        with self._gate.write():
            for s, shard in enumerate(self._shards):
                keep = int(np.count_nonzero(self._rows_of_shard[s] < n_rows))
                shard.truncate(keep)
                self._rows_of_shard[s] = self._rows_of_shard[s][:keep]
            self._shard_of, self._local_of, self._ids = (a[:n_rows].copy() for a in
                                                         (self._shard_of, self._local_of, self._ids))
            self._sorted_ids = None

    def remove_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each shard removes its rows (moving its own last rows into its holes); then the last rows are
        renamed into the removed rows' names below the new size: (moved_from, moved_to), as one searcher."""
        positions = np.asarray(positions, dtype=np.int64)
        n = self.ntotal
        if len(positions) and (positions[0] < 0 or positions[-1] >= n or np.any(np.diff(positions) <= 0)):
            raise ValueError(f"row positions must be sorted, unique and in [0, {n})")
        with self._gate.write():
            local = self._split(positions)
            moves = self._each(lambda shard, rows: shard.remove_rows(rows) if len(rows) else (_EMPTY, _EMPTY), local)
            for s, (moved_from, moved_to) in enumerate(moves):
                rows = self._rows_of_shard[s]
                moving = rows[np.asarray(moved_from, dtype=np.int64)]
                self._local_of[moving] = moved_to
                rows[np.asarray(moved_to, dtype=np.int64)] = moving
                self._rows_of_shard[s] = rows[:len(rows) - len(local[s])]
            kept_rows = n - len(positions)
            holes = positions[positions < kept_rows]
            movers = np.setdiff1d(np.arange(kept_rows, n, dtype=np.int64), positions)
            for column in (self._shard_of, self._local_of, self._ids):
                column[holes] = column[movers]
            for s in range(len(self._shards)):
                mine = self._shard_of[holes] == s
                self._rows_of_shard[s][self._local_of[holes[mine]]] = holes[mine]
            self._shard_of, self._local_of, self._ids = (a[:kept_rows].copy() for a in
                                                         (self._shard_of, self._local_of, self._ids))
            self._sorted_ids = None
        return movers, holes

    def reset(self) -> None:
        with self._gate.write():
            self._each(lambda shard: shard.reset())
            self._clear()

    def close(self) -> None:
        with self._gate.write():
            self._each(lambda shard: shard.close())
        self._pool.shutdown()

    # -- questions ----------------------------------------------------------------------------------
    def _locals(self, rows: np.ndarray) -> list[np.ndarray]:
        """Each shard's local rows of `rows`, in the order of `rows`."""
        return [self._local_of[rows[self._shard_of[rows] == s]] for s in range(len(self._shards))]

    def _split(self, rows):
        """Each shard's sorted local rows of `rows` (None: all of them)."""
        if rows is None:
            return [None] * len(self._shards)
        return [np.sort(local) for local in self._locals(np.asarray(rows, dtype=np.int64))]

    def search(self, queries, k: int, rows=None):
        return self._asked(lambda shard, local: shard.search(queries, k, local), queries, rows,
                           lambda parts, resolve: merge.knn(parts, k, self.metric, resolve))

    def range_search(self, queries, radius: float, rows=None):
        return self._asked(lambda shard, local: shard.range_search(queries, radius, local), queries, rows,
                           lambda parts, resolve: merge.ranges(parts, self.metric, resolve))

    def _asked(self, ask, queries, rows, combine):
        """ask(shard, its local rows) of every shard at once; the answers combined exactly (combine(parts,
        resolve), resolve giving the float64 distances of tied candidates)."""
        _host(queries)
        with self._gate.read():
            parts = self._each(ask, self._split(rows))
            if len(parts) == 1:
                return parts[0]
            return combine(parts, lambda query_numbers, ids, shard: self._exact(queries, query_numbers, ids))

    def _exact(self, queries, query_numbers, ids) -> np.ndarray:
        """The contract's float64 distances of (queries[query_numbers[i]], the row of ids[i])."""
        if self._sorted_ids is None:
            order = np.argsort(self._ids, kind="stable")
            self._sorted_ids = self._ids[order], order
        sorted_ids, order = self._sorted_ids
        rows = order[np.searchsorted(sorted_ids, ids)]
        return merge.exact_distances(queries[query_numbers], self._read(rows), self.metric)

    def _read(self, rows: np.ndarray):
        """The stored vectors of `rows`, in their order (call under the gate)."""
        parts = self._each(lambda shard, local: shard.get_rows(local) if len(local) else None, self._locals(rows))
        example = next(p for p in parts if p is not None)
        out = np.empty((len(rows),) + example.shape[1:], dtype=example.dtype)
        for s, part in enumerate(parts):
            if part is not None:
                out[self._shard_of[rows] == s] = part
        return out

    def get_rows(self, positions) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        with self._gate.read():
            if not len(positions):
                return self._shards[0].get_rows(_EMPTY)
            return self._read(positions)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(vectors, ids) in row order."""
        with self._gate.read():
            parts = self._each(lambda shard: shard.export())
            vectors = np.empty((self.ntotal,) + parts[0][0].shape[1:], dtype=parts[0][0].dtype)
            for s, (shard_vectors, _) in enumerate(parts):
                vectors[self._rows_of_shard[s]] = shard_vectors
            return vectors, self._ids.copy()


def _even_out(counts: np.ndarray, n: int) -> np.ndarray:
    """How many of n new rows each shard takes so that the counts end as even as they can: fill the emptiest
    shards up to the highest common level the rows reach, then one more each for the first of them."""
    low, high = int(counts.min()), int(counts.max()) + n
    while low < high:
        level = (low + high + 1) // 2
        low, high = (level, high) if int(np.maximum(0, level - counts).sum()) <= n else (low, level - 1)
    takes = np.maximum(0, low - counts)
    rest = n - int(takes.sum())
    takes[np.flatnonzero(counts + takes == low)[:rest]] += 1
    return takes


def _host(queries) -> None:
    if not isinstance(queries, np.ndarray):
        raise TypeError("a sharded index takes host (NumPy) queries; pass q.get() (CuPy) or q.cpu().numpy()")
