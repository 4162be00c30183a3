"""Judging concurrent index operations against serial orders (tests/test_index_concurrency.py).

With one writer, the index is linearizable when every search's answer is the exact answer (the contract,
bit for bit) of the index as it stood after some prefix of the writer's operations that can have taken
effect within the search's own span: at least every operation that returned before the search began, at
most those that began before it returned. Spans are ticks of one Clock, so the judgement depends only on
the order of events, never on timing. `judge` replays the writer's log into States and tries each search's
window; `answers` proves an answer exact over a State without sorting it (`best_first`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from reference import contract_distances


class Clock:
    """Ticks of one lock-guarded counter: the order of events across threads."""

    def __init__(self):
        self._lock, self._now = threading.Lock(), 0

    def tick(self) -> int:
        with self._lock:
            self._now += 1
            return self._now


@dataclass
class Op:                      # one writer operation: add (vectors not None) or remove
    start: int
    end: int
    ids: np.ndarray
    vectors: np.ndarray | None = None   # as stored (float32)
    labels: np.ndarray | None = None


@dataclass
class Search:                  # one search and what it returned
    start: int
    end: int
    kind: str                  # "knn", "filter", "labels", "range", "range-labels"
    queries: np.ndarray
    result: tuple              # (distances, ids) of k nearest, or range search's (lims, distances, ids)
    k: int = 0                 # the k of a k-nearest search
    query_labels: np.ndarray | None = None
    filter: np.ndarray | None = None


class State:
    """The index's contents after a prefix of the writer's operations."""

    def __init__(self, dim: int):
        self.ids = np.empty(0, np.int64)
        self.vectors = np.empty((0, dim), np.float32)
        self.labels = np.empty(0, np.int64)
        self._order = self._vectors64 = None

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The positions of `ids` in the state (any position where an id is absent: callers compare)."""
        if self._order is None:
            self._order = np.argsort(self.ids)
        return self._order[np.minimum(np.searchsorted(self.ids[self._order], ids), len(self.ids) - 1)]

    def distances(self, queries: np.ndarray, metric: str) -> np.ndarray:
        """(len(queries), n) contract distances (tests/reference.py) to the state's rows."""
        if self._vectors64 is None:
            self._vectors64 = self.vectors.astype(np.float64)
        return contract_distances(self._vectors64, queries.astype(np.float64), metric)

    def apply(self, op: Op) -> None:
        self._order = self._vectors64 = None
        if op.vectors is None:
            keep = ~np.isin(self.ids, op.ids)
            self.ids, self.vectors, self.labels = self.ids[keep], self.vectors[keep], self.labels[keep]
        else:
            self.ids = np.concatenate([self.ids, op.ids])
            self.vectors = np.concatenate([self.vectors, op.vectors])
            self.labels = np.concatenate([self.labels, op.labels])

    def allowed(self, search: Search, query: int) -> np.ndarray:
        mask = np.ones(len(self.ids), bool)
        if search.filter is not None:
            mask &= np.isin(self.ids, search.filter)
        if search.query_labels is not None:
            mask &= self.labels == search.query_labels[query]
        return mask


def best_first(d64: np.ndarray, state: State, got_i: np.ndarray, got_d: np.ndarray, mask=None) -> np.ndarray:
    """Per row r: whether got_i[r] (m ids) are the m allowed rows of `state` that come first in (float64
    distance d64[r], id) order (l2: smallest first), in that order, with got_d[r] their distances rounded to
    float32. The proof, without sorting: they are allowed rows of the state, strictly increasing in that
    order, and exactly m - 1 allowed rows come before the last one. mask: (rows, n) allowed, None: all."""
    rows, m = got_i.shape
    if m == 0:
        return np.ones(rows, bool)
    where = state.positions(got_i)
    ok = np.all(state.ids[where] == got_i, axis=1)
    if mask is not None:
        ok &= np.all(np.take_along_axis(mask, where, axis=1), axis=1)
    mine = np.take_along_axis(d64, where, axis=1)
    ok &= np.all(mine.astype(np.float32).view(np.uint32) == got_d.view(np.uint32), axis=1)
    ok &= np.all((mine[:, 1:] > mine[:, :-1]) | ((mine[:, 1:] == mine[:, :-1]) & (got_i[:, 1:] > got_i[:, :-1])),
                 axis=1)
    last, last_id = mine[:, -1:], got_i[:, -1:]
    before_last = (d64 < last) | ((d64 == last) & (state.ids < last_id))
    if mask is not None:
        before_last &= mask
    return ok & (np.count_nonzero(before_last, axis=1) == m - 1)


def answers(state: State, search: Search, metric: str, radius: float) -> bool:
    """Whether `search`'s result is the exact answer over `state`, bit for bit (l2; see best_first)."""
    q = search.queries
    d64 = state.distances(q, metric)
    for row in range(len(q)):
        mask = state.allowed(search, row)
        if search.kind.startswith("range"):
            lims, distances, ids = search.result
            got_i, got_d = ids[lims[row]:lims[row + 1]], distances[lims[row]:lims[row + 1]]
            m = int(np.count_nonzero(mask & (d64[row] < radius)))
            if len(got_i) != m:
                return False
        else:
            got_i, got_d = search.result[1][row], search.result[0][row]
            m = min(search.k, int(np.count_nonzero(mask)))
            if not (np.all(got_i[m:] == -1) and np.all(got_d[m:] == np.inf)):
                return False
        if not best_first(d64[row:row + 1], state, got_i[None, :m], got_d[None, :m], mask[None])[0]:
            return False
    return True


def verdicts(state: State, searches: list[Search], metric: str, radius: float) -> list[bool]:
    """answers() of each search; the plain k-nearest ones (no filter, no labels) of one k all at once."""
    out = [None] * len(searches)
    plain: dict[int, list[int]] = {}
    for i, search in enumerate(searches):
        if search.kind.startswith("range") or search.filter is not None or search.query_labels is not None:
            out[i] = answers(state, search, metric, radius)
        else:
            plain.setdefault(search.k, []).append(i)
    for k, members in plain.items():
        got_d = np.concatenate([searches[i].result[0] for i in members])
        got_i = np.concatenate([searches[i].result[1] for i in members])
        m = min(k, len(state.ids))
        ok = best_first(state.distances(np.concatenate([searches[i].queries for i in members]), metric), state,
                        got_i[:, :m], got_d[:, :m])
        ok &= np.all(got_i[:, m:] == -1, axis=1) & np.all(got_d[:, m:] == np.inf, axis=1)
        bounds = np.cumsum([0] + [len(searches[i].queries) for i in members])
        for j, i in enumerate(members):
            out[i] = bool(np.all(ok[bounds[j]:bounds[j + 1]]))
    return out


def judge(log: list[Op], searches: list[Search], metric: str, radius: float) -> tuple[list[str], int]:
    """Replays the writer's log; each search must match one state in its window. Returns the failures
    and how many searches overlapped a writer operation (a window of more than one state)."""
    ends, starts = np.array([op.end for op in log]), np.array([op.start for op in log])
    first = np.searchsorted(ends, [s.start for s in searches])    # ops surely done when the search began
    last = np.searchsorted(starts, [s.end for s in searches])     # ops begun before it returned
    order = np.argsort(first, kind="stable")
    state, active, failures, next_search = State(searches[0].queries.shape[1]), [], [], 0
    for j in range(len(log) + 1):
        if j:
            state.apply(log[j - 1])
        while next_search < len(order) and first[order[next_search]] == j:
            active.append(order[next_search])
            next_search += 1
        still = []
        for i, right in zip(active, verdicts(state, [searches[i] for i in active], metric, radius)):
            if right:
                continue
            if last[i] == j:
                s = searches[i]
                failures.append(f"{s.kind} search {i} (ticks {s.start}-{s.end}) matches no state after "
                                f"writer ops {first[i]}..{last[i]}: ids {np.asarray(s.result[-1]).ravel()[:12]}")
            else:
                still.append(i)
        active = still
    return failures, int(np.count_nonzero(last > first))
