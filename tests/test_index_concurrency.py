"""Index threads: searches from 8 threads while 1 thread adds and removes.

Every answer must be consistent with a serial order of the operations (tests/serial_order.py): the exact
answer, bit for bit, of the index after some prefix of the writer's operations that can have taken effect
within the search's span. A removed id once its remove returned, an id before its add began, half of an add
or of a removal, a vector stored under its id at no such time (a torn or stale vector) all fail that.
Adds alternate between float32 input (one piece) and float64 input that is converted and handed to the
searcher in pieces (CHUNK_BYTES is made small for that); removed ids come back with new vectors.

TINYKNN_STRESS_SECONDS (default 2) sets how long the threads run (the issue's target: 30).
"""

from __future__ import annotations

import functools
import os
import sys
import threading

import numpy as np
import pytest

import tinyknn
from reference import assert_exact, contract_distances, exact_search
from model_searcher import use_shards
from serial_order import Clock, Op, Search, State, answers, judge
from tinyknn.index import layout as _layout
from tinyknn.inputs import validate as _validate

SECONDS = float(os.environ.get("TINYKNN_STRESS_SECONDS", "2"))
DIM, K, ID_SPACE, LABELS = 8, 10, 6000, 4
SIZES = (1200, 2400)                 # the writer keeps the index between these sizes
KINDS = ("knn", "knn", "knn", "filter", "labels", "range", "range-labels", "knn")   # one per searching thread
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@functools.lru_cache(maxsize=None)
def _warm_gpu() -> None:
    from gpu_warm import warm

    warm([("l2", "float32", DIM, k) for k in (K, 600)])


def new_index(device: str):
    if device == "cuda":
        _warm_gpu()              # compile the kernels of both k at once, before any thread runs
    return tinyknn.Index(DIM, "l2", device=device)


def writer(index, clock, log, stop, rng):
    present = set(log[0].ids.tolist())
    while not stop.is_set():
        free = np.setdiff1d(np.arange(ID_SPACE), np.fromiter(present, np.int64))
        if len(present) > SIZES[1] or (len(present) > SIZES[0] and rng.random() < 0.5):
            ids = rng.choice(sorted(present), int(rng.integers(1, 120)), replace=False).astype(np.int64)
            start = clock.tick()
            removed = index.remove(np.concatenate([ids, rng.choice(free, 3)]))   # unknown ids are ignored
            log.append(Op(start, clock.tick(), ids))
            assert removed == len(ids), (removed, len(ids))
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


def one_search(index, kind, q, radius, rng) -> Search:
    """A search of `kind` (its span is set by the caller)."""
    labels = rng.integers(0, LABELS, len(q)) if kind.endswith("labels") else None
    allowed = rng.choice(ID_SPACE, 1500, replace=False) if kind == "filter" else None
    if kind.startswith("range"):
        result = index.range_search(q, radius, labels=labels)
    else:
        result = index.search(q, K, filter=allowed, labels=labels)
    return Search(0, 0, kind, q, result, K, labels, allowed)


def searcher(index, clock, kind, radius, out, stop, rng):
    while not stop.is_set():
        q = rng.standard_normal((int(rng.integers(1, 3)), DIM)).astype(np.float32)
        start = clock.tick()
        search = one_search(index, kind, q, radius, rng)
        search.start, search.end = start, clock.tick()
        out.append(search)


def run_threads(targets, stop: threading.Event) -> list[BaseException]:
    """Runs the (function, args) targets at once for SECONDS (or until one raises, which sets `stop`), the
    GIL switching often (more interleavings); returns what they raised."""
    errors = []

    def guarded(function, *args):
        try:
            function(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(function, *args)) for function, args in targets]
    switching = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    try:
        for thread in threads:
            thread.start()
        stop.wait(SECONDS)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(switching)
    return errors


@pytest.mark.parametrize("device", [*DEVICES, "sharded"])
def test_searches_are_consistent_with_a_serial_order(device, rng, monkeypatch):
    """8 threads search (plain, filtered, labelled, range) while 1 adds and removes; every answer is the
    exact answer of a state in its window; the quiescent index answers exactly. "sharded": 3 CPU searchers
    behind tinyknn.index.shards (an add or a removal there is several shard calls)."""
    if device == "sharded":
        use_shards(monkeypatch, 3)
        device = "cpu"
    monkeypatch.setattr(_validate, "CHUNK_BYTES", 8 * DIM * 4)   # float64 adds go over 8 rows at a time
    monkeypatch.setattr(_layout, "MIN_RUNS", 0)                   # labelled searches reorder the rows often
    monkeypatch.setattr(_layout, "REORDER_FACTOR", 0.2)
    index, clock, stop = new_index(device), Clock(), threading.Event()
    ids = rng.choice(ID_SPACE, 1800, replace=False).astype(np.int64)
    x, labels = rng.standard_normal((len(ids), DIM)).astype(np.float32), rng.integers(0, LABELS, len(ids))
    start = clock.tick()
    index.add(x, ids=ids, labels=labels)
    log = [Op(start, clock.tick(), ids, x, labels)]
    probe = rng.standard_normal((20, DIM)).astype(np.float32)
    radius = float(np.quantile(contract_distances(x.astype(np.float64), probe.astype(np.float64), "l2"), 0.01))
    outputs = [[] for _ in KINDS]
    seeds = [np.random.default_rng(seed) for seed in rng.integers(0, 2**32, len(KINDS) + 1)]
    errors = run_threads([(searcher, (index, clock, kind, radius, out, stop, seed))
                          for kind, out, seed in zip(KINDS, outputs, seeds)]
                         + [(writer, (index, clock, log, stop, seeds[-1]))], stop)
    assert not errors, errors
    searches = [s for out in outputs for s in out]
    assert len(log) > 5 and all(outputs), (len(log), [len(out) for out in outputs])
    failures, overlapping = judge(log, searches, "l2", radius)
    assert not failures, f"{len(failures)} of {len(searches)} searches ({len(log)} writer ops): {failures[:3]}"
    assert overlapping, f"none of {len(searches)} searches overlapped one of the {len(log)} writer operations"
    print(f"{len(searches)} searches, {overlapping} overlapping one of {len(log)} writer operations, "
          f"{index._layout.reorders} label reorders")
    assert index._layout.reorders > 0 or not hasattr(index._searcher, "permute_rows")

    final = State(DIM)               # quiescent: every kind of search answers exactly over the final state
    for op in log:
        final.apply(op)
    assert index.ntotal == len(final.ids) and np.all(index.contains(final.ids))
    q = rng.standard_normal((6, DIM)).astype(np.float32)
    for kind in sorted(set(KINDS)):
        assert answers(final, one_search(index, kind, q, radius, rng), "l2", radius), kind
    assert_exact(*index.search(q, K), final.vectors, q, K, "l2", id_map=final.ids)   # the oracle agrees
    index.close()


# -- an add handed over in pieces, deterministically ------------------------------------------------
def pieces_index(device, rng, monkeypatch):
    monkeypatch.setattr(_validate, "CHUNK_BYTES", 16 * DIM * 4)   # 16 rows a piece
    index = new_index(device)
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


def test_the_judge_accepts_only_answers_of_a_state_in_the_window(rng):
    """serial_order on a made-up history: one removal at ticks 10-11. The answer over the rows before it is
    right for a search that overlaps it or came first, wrong for one that began after it returned; a
    vector's distance that no state holds (torn), a result cut short or reordered are wrong anywhere."""
    x = rng.standard_normal((40, DIM)).astype(np.float32)
    ids = np.arange(100, 140, dtype=np.int64)
    q = rng.standard_normal((2, DIM)).astype(np.float32)
    before_d, before_i = exact_search(x, q, K, "l2", id_map=ids)
    gone = before_i[:, :2].ravel()                      # each query's two nearest go
    log = [Op(1, 2, ids, x, np.zeros(40, np.int64)), Op(10, 11, gone)]
    answer = (before_d, before_i)

    def verdicts(*spans, result=answer):
        searches = [Search(start, end, "knn", q, result, K) for start, end in spans]
        return [f.split()[2] for f in judge(log, searches, "l2", 0.0)[0]]

    assert verdicts((3, 4), (8, 12), (9, 10)) == []                     # before, overlapping
    assert verdicts((3, 4), (12, 13)) == ["1"]                          # after: a removed id
    torn = before_d.copy()
    torn[0, 3] = np.nextafter(torn[0, 3], np.float32(np.inf))
    assert verdicts((3, 4), result=(torn, before_i)) == ["0"]
    swapped = before_i.copy()
    swapped[1, [4, 5]] = swapped[1, [5, 4]]
    assert verdicts((3, 4), result=(before_d, swapped)) == ["0"]
    keep = ~np.isin(ids, gone)
    after = exact_search(x[keep], q, K, "l2", id_map=ids[keep])
    assert verdicts((12, 13), (8, 12), result=after) == []
    assert verdicts((3, 4), result=after) == ["0"]                      # before its remove began: not yet
