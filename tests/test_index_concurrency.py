"""Index threads (issue 14's "Threads" target): searches from 8 threads while 1 thread adds and removes.

The judgement is linearizability with one writer: every search's answer must be the exact answer (the
contract, bit for bit) of the index as it stood after some prefix of the writer's operations that can have
taken effect within the search's own time span: at least every operation that returned before the search
began, at most those that began before it returned. A removed id after its remove returned, an id before its
add began, half of an add or of a removal, a vector stored under an id at no such time (a torn or stale
vector) all fail it. Times are ticks of one lock-guarded counter, so the judgement does not depend on
timing, only on the order of events. Adds alternate between float32 input (one piece) and float64 input
that is converted and handed to the searcher in pieces (CHUNK_BYTES is made small for that).

TINYKNN_STRESS_SECONDS (default 2) sets how long the threads run (the issue's target: 30).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

import numpy as np
import pytest

import tinyknn
from reference import assert_exact, contract_distances, exact_search
from tinyknn import _validate

SECONDS = float(os.environ.get("TINYKNN_STRESS_SECONDS", "2"))
DIM, K, ID_SPACE, LABELS = 8, 10, 6000, 4
SIZES = (1200, 2400)                 # the writer keeps the index between these sizes
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Clock:
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
    result: tuple
    query_labels: np.ndarray | None = None
    filter: np.ndarray | None = None


class State:
    """The index's contents after a prefix of the writer's operations."""

    def __init__(self):
        self.ids = np.empty(0, np.int64)
        self.vectors = np.empty((0, DIM), np.float32)
        self.labels = np.empty(0, np.int64)
        self._order = None

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The positions of `ids` in the state (any position where an id is absent: callers compare)."""
        if self._order is None:
            self._order = np.argsort(self.ids)
        return self._order[np.minimum(np.searchsorted(self.ids[self._order], ids), len(self.ids) - 1)]

    def apply(self, op: Op) -> None:
        self._order = None
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


def answers(state: State, search: Search, metric: str, radius: float) -> bool:
    """Whether `search`'s result is the exact answer over `state`, bit for bit (see best_first)."""
    q = search.queries
    d64 = contract_distances(state.vectors.astype(np.float64), q.astype(np.float64), metric)
    ranges = search.kind.startswith("range")
    for row in range(len(q)):
        mask = state.allowed(search, row)
        if ranges:
            lims, distances, ids = search.result
            got_i, got_d = ids[lims[row]:lims[row + 1]], distances[lims[row]:lims[row + 1]]
            m = int(np.count_nonzero(mask & (d64[row] < radius)))
            if len(got_i) != m:
                return False
        else:
            got_i, got_d = search.result[1][row], search.result[0][row]
            m = min(K, int(np.count_nonzero(mask)))
            if not (np.all(got_i[m:] == -1) and np.all(got_d[m:] == np.inf)):
                return False
        if not best_first(d64[row], state, mask, got_i[:m], got_d[:m]):
            return False
    return True


def best_first(d64: np.ndarray, state: State, mask: np.ndarray, got_i: np.ndarray, got_d: np.ndarray) -> bool:
    """Whether got_i are the len(got_i) allowed rows of `state` that come first in (float64 distance, id)
    order, in that order, with got_d their distances rounded to float32: they are allowed rows, strictly
    increasing in that order, and exactly len - 1 allowed rows come before the last one."""
    m = len(got_i)
    if not m:
        return True
    where = state.positions(got_i)
    if not (np.all(state.ids[where] == got_i) and np.all(mask[where])):
        return False
    mine = d64[where]
    if not np.array_equal(mine.astype(np.float32).view(np.uint32), got_d.view(np.uint32)):
        return False
    if not np.all((mine[1:] > mine[:-1]) | ((mine[1:] == mine[:-1]) & (got_i[1:] > got_i[:-1]))):
        return False
    before_last = mask & ((d64 < mine[-1]) | ((d64 == mine[-1]) & (state.ids < got_i[-1])))
    return int(np.count_nonzero(before_last)) == m - 1


def judge(log: list[Op], searches: list[Search], metric: str, radius: float) -> tuple[list[str], int]:
    """Replays the writer's log; each search must match one state in its window. Returns the failures
    and how many searches overlapped a writer operation (a window of more than one state)."""
    ends, starts = np.array([op.end for op in log]), np.array([op.start for op in log])
    first = np.searchsorted(ends, [s.start for s in searches])    # ops surely done when the search began
    last = np.searchsorted(starts, [s.end for s in searches])     # ops begun before it returned
    order = np.argsort(first, kind="stable")
    state, active, failures, next_search = State(), [], [], 0
    for j in range(len(log) + 1):
        if j:
            state.apply(log[j - 1])
        while next_search < len(order) and first[order[next_search]] == j:
            active.append(order[next_search])
            next_search += 1
        still = []
        for i in active:
            if answers(state, searches[i], metric, radius):
                continue
            if last[i] == j:
                s = searches[i]
                failures.append(f"{s.kind} search {i} (ticks {s.start}-{s.end}) matches no state after "
                                f"writer ops {first[i]}..{last[i]}: ids {np.asarray(s.result[-1]).ravel()[:12]}")
            else:
                still.append(i)
        active = still
    return failures, int(np.count_nonzero(last > first))


def writer(index, clock, log, stop, rng):
    present = set(log[0].ids.tolist())
    while not stop.is_set():
        free = np.setdiff1d(np.arange(ID_SPACE), np.fromiter(present, np.int64))
        if len(present) > SIZES[1] or (len(present) > SIZES[0] and rng.random() < 0.5):
            ids = rng.choice(sorted(present), int(rng.integers(1, 120)), replace=False).astype(np.int64)
            start = clock.tick()
            assert index.remove(np.concatenate([ids, rng.choice(free, 3)])) == len(ids)   # unknown ids: ignored
            log.append(Op(start, clock.tick(), ids))
            present -= set(ids.tolist())
        else:
            ids = rng.choice(free, int(rng.integers(1, 200)), replace=False).astype(np.int64)
            x = rng.standard_normal((len(ids), DIM))            # float64: converted in pieces
            labels = rng.integers(0, LABELS, len(ids))
            given = x if rng.random() < 0.5 else x.astype(np.float32)
            start = clock.tick()
            index.add(given, ids=ids, labels=labels)
            log.append(Op(start, clock.tick(), ids, x.astype(np.float32), labels))
            present |= set(ids.tolist())


def searcher(index, clock, kind, radius, out, stop, rng):
    while not stop.is_set():
        q = rng.standard_normal((int(rng.integers(1, 3)), DIM)).astype(np.float32)
        labels = rng.integers(0, LABELS, len(q)) if kind.endswith("labels") else None
        allowed = rng.choice(ID_SPACE, 1500, replace=False) if kind == "filter" else None
        start = clock.tick()
        if kind.startswith("range"):
            result = index.range_search(q, radius, labels=labels)
        else:
            result = index.search(q, K, filter=allowed, labels=labels)
        out.append(Search(start, clock.tick(), kind, q, result, labels, allowed))


KINDS = ("knn", "knn", "knn", "filter", "labels", "range", "range-labels", "knn")


@pytest.mark.parametrize("device", DEVICES)
def test_searches_are_consistent_with_a_serial_order(device, rng, monkeypatch):
    """8 threads search (plain, filtered, labelled, range) while 1 adds and removes; every answer is the
    exact answer of a state in its window; the quiescent index answers exactly."""
    monkeypatch.setattr(_validate, "CHUNK_BYTES", 8 * DIM * 4)   # float64 adds go over 8 rows at a time
    index, clock, stop = tinyknn.Index(DIM, "l2", device=device), Clock(), threading.Event()
    ids = rng.choice(ID_SPACE, 1800, replace=False).astype(np.int64)
    x, labels = rng.standard_normal((len(ids), DIM)).astype(np.float32), rng.integers(0, LABELS, len(ids))
    start = clock.tick()
    index.add(x, ids=ids, labels=labels)
    log = [Op(start, clock.tick(), ids, x, labels)]
    probe = rng.standard_normal((20, DIM)).astype(np.float32)
    radius = float(np.quantile(contract_distances(x.astype(np.float64), probe.astype(np.float64), "l2"), 0.01))
    outputs = [[] for _ in KINDS]
    seeds = rng.integers(0, 2**32, len(KINDS) + 1)
    threads = [threading.Thread(target=searcher, args=(index, clock, kind, radius, out, stop,
                                                       np.random.default_rng(seed)))
               for kind, out, seed in zip(KINDS, outputs, seeds)]
    threads.append(threading.Thread(target=writer, args=(index, clock, log, stop, np.random.default_rng(seeds[-1]))))
    switching = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)        # the GIL changes hands often: more interleavings, a busier writer
    try:
        for thread in threads:
            thread.start()
        stop.wait(SECONDS)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(switching)
    searches = [s for out in outputs for s in out]
    assert len(log) > 5 and all(outputs), (len(log), [len(out) for out in outputs])
    failures, overlapping = judge(log, searches, "l2", radius)
    assert not failures, f"{len(failures)} of {len(searches)} searches ({len(log)} writer ops): {failures[:3]}"
    assert overlapping, f"none of {len(searches)} searches overlapped one of the {len(log)} writer operations"
    print(f"{len(searches)} searches, {overlapping} overlapping one of {len(log)} writer operations")

    final = State()                  # quiescent: every kind of search answers exactly over the final state
    for op in log:
        final.apply(op)
    assert index.ntotal == len(final.ids) and np.all(index.contains(final.ids))
    q = rng.standard_normal((6, DIM)).astype(np.float32)
    for kind in set(KINDS):
        labels = rng.integers(0, LABELS, len(q)) if kind.endswith("labels") else None
        allowed = rng.choice(ID_SPACE, 1500, replace=False) if kind == "filter" else None
        result = (index.range_search(q, radius, labels=labels) if kind.startswith("range")
                  else index.search(q, K, filter=allowed, labels=labels))
        assert answers(final, Search(0, 0, kind, q, result, labels, allowed), "l2", radius), kind
    assert_exact(*index.search(q, K), final.vectors, q, K, "l2", id_map=final.ids)   # the oracle agrees
    index.close()


# -- an add handed over in pieces, deterministically ------------------------------------------------
def pieces_index(device, rng, monkeypatch):
    monkeypatch.setattr(_validate, "CHUNK_BYTES", 16 * DIM * 4)   # 16 rows a piece
    index = tinyknn.Index(DIM, "l2", device=device)
    base = rng.standard_normal((500, DIM)).astype(np.float32)
    index.add(base)
    more = rng.standard_normal((100, DIM))                        # float64: 7 pieces
    return index, base, more, np.concatenate([base, more.astype(np.float32)])


@pytest.mark.parametrize("device", DEVICES)
def test_a_search_begun_during_a_piecewise_add_sees_all_of_it_or_none(device, rng, monkeypatch):
    """A search that starts after the first piece was handed over waits for the rest."""
    index, base, more, after = pieces_index(device, rng, monkeypatch)
    q = rng.standard_normal((3, DIM)).astype(np.float32)
    real_add, results, calls = index._searcher.add, [], []

    def add(vectors, ids):
        real_add(vectors, ids)
        calls.append(len(ids))
        if len(calls) == 1:
            thread = threading.Thread(target=lambda: results.append(index.search(q, 600)))
            thread.start()
            thread.join(0.5)       # the search blocks until the add completes (else it would finish here)

    monkeypatch.setattr(index._searcher, "add", add)
    index.add(more)
    while not results:
        threading.Event().wait(0.01)
    assert len(calls) == 7
    d, i = results[0]
    assert any(np.array_equal(i, exact_search(db, q, 600, "l2")[1]) for db in (base, after)), "a part of the add"
    assert np.array_equal(i, exact_search(after, q, 600, "l2")[1])
    index.close()


@pytest.mark.parametrize("kind", ["search", "range_search"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_search_that_overlaps_a_piecewise_add_is_answered_again(device, kind, rng, monkeypatch):
    """A search already under way when the pieces start (it sees the first piece) is not returned: it is
    answered again once the add is complete."""
    index, base, more, after = pieces_index(device, rng, monkeypatch)
    q = rng.standard_normal((3, DIM)).astype(np.float32)
    real_add, real_search = index._searcher.add, getattr(index._searcher, kind)
    first_piece, searched, calls = threading.Event(), threading.Event(), []

    def add(vectors, ids):
        real_add(vectors, ids)
        calls.append(len(ids))
        if len(calls) == 1:
            first_piece.set()
            assert searched.wait(10)

    def search(*args):
        if not searched.is_set():
            adder = threading.Thread(target=index.add, args=(more,))
            adder.start()
            assert first_piece.wait(10)
            try:
                return real_search(*args)               # sees the base and the first piece only
            finally:
                searched.set()
        return real_search(*args)

    monkeypatch.setattr(index._searcher, "add", add)
    monkeypatch.setattr(index._searcher, kind, search)
    radius = 30.0
    result = index.search(q, 600) if kind == "search" else index.range_search(q, radius)
    while index.ntotal < len(after):
        threading.Event().wait(0.01)
    full = exact_search(after, q, 600, "l2")[1]
    if kind == "search":
        assert np.array_equal(result[1], full)
    else:
        lims, _, ids = result
        d64 = contract_distances(after.astype(np.float64), q.astype(np.float64), "l2")
        assert np.array_equal(np.diff(lims), (d64 < radius).sum(axis=1))
    index.close()
