"""tinyknn.groundtruth's shard pipeline on a file (the GPU's path, run here on the CPU): the next shard is read
and added while a shard is searched on the search thread, with the read-ahead and the live Indexes bounded;
a failed search stops the run and its threads; integer distances settle ties by the smaller id without
reading rows. Judged by the order of events, never by how long anything took."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from reference import exact_search

import tinyknn.io as tio
from tinyknn.groundtruth import compute, groundtruth
from tinyknn.groundtruth.batches import READER_NAME
from tinyknn.groundtruth.exact import INTEGER_EXACT, Exact
from tinyknn.groundtruth.inputs import Source
from tinyknn.groundtruth.searches import SEARCH_NAME
from tinyknn.index import Index

N, DIM, SHARD_ROWS, BATCH_ROWS = 1000, 16, 125, 64      # 8 shards of 2 add batches (64 + 61 rows)
HOLD_SECONDS = 120.0     # a safety net only: the event a held search waits for comes at once when it works


@pytest.fixture
def overlapped(monkeypatch):
    """The GPU's file path on the CPU: 8 shards by default, reads up to 3 batches ahead (2: a shard)."""
    monkeypatch.setattr(compute, "_overlaps", lambda base, device, client: base.path is not None)
    monkeypatch.setattr(compute, "MIN_OVERLAP_SHARD_ROWS", 100)
    monkeypatch.setattr(compute, "READ_AHEAD_BYTES", 3 * BATCH_ROWS * DIM)


def _files(tmp_path, rng):
    x = np.minimum(rng.exponential(25.0, (N, DIM)), 255).astype(np.uint8)
    x[500:560] = x[3]                     # the same row in shards 0, 4 and 5: ties across shards
    q = np.concatenate([x[[3, 10, 700]], rng.integers(0, 256, (37, DIM))]).astype(np.uint8)
    tio.write_vectors(tmp_path / "b.u8bin", x)
    tio.write_vectors(tmp_path / "q.u8bin", q)
    return x, q, str(tmp_path / "b.u8bin"), str(tmp_path / "q.u8bin")


def _threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith((READER_NAME, SEARCH_NAME))]


class Events:
    """What happened, in the order it happened (a lock orders events of different threads)."""

    def __init__(self):
        self.list, self._lock = [], threading.Lock()

    def __call__(self, *event) -> None:
        with self._lock:
            self.list.append(event)

    def last(self, *event) -> int:
        return max(i for i, e in enumerate(self.list) if e == event)


def _instrument(monkeypatch, hold: bool, fail: int | None = None):
    """Events of every read, add, search and Index; with `hold`, each shard's searches wait (on the search
    thread) until every row of the next shard has been added; shard `fail`'s search raises."""
    events, shard_of, added = Events(), {}, [threading.Event() for _ in range(N // SHARD_ROWS + 1)]
    real_read, real_add, real_search, real_close = Source.read, Index.add, Index.search, Index.close
    real_new = compute._new_index

    def read(self, start, stop, into=None):
        events("read start", start // SHARD_ROWS)
        rows = real_read(self, start, stop, into)
        events("read end", start // SHARD_ROWS)
        return rows

    def add(self, x, ids=None, labels=None):
        shard_of[id(self)] = s = int(ids[0]) // SHARD_ROWS
        events("add", s)
        real_add(self, x, ids, labels)
        if int(ids[-1]) + 1 == min(N, (s + 1) * SHARD_ROWS):
            added[s].set()

    def search(self, q, k, **kwargs):
        s = shard_of[id(self)]
        events("search start", s)
        if s == fail:
            raise RuntimeError(f"the device failed on shard {s}")
        if threading.current_thread() is threading.main_thread():
            events("searched on the adding thread", s)
        elif hold and s + 1 < len(added) - 1 and not added[s + 1].wait(HOLD_SECONDS):
            events("gave up waiting", s)
        found = real_search(self, q, k, **kwargs)
        events("search end", s)
        return found

    def new_index(*args):
        index = real_new(*args)
        events("index made", id(index))
        return index

    def close(self):
        if self._searcher is not None:
            events("index closed", id(self))
        real_close(self)

    for owner, name, value in ((Source, "read", read), (Index, "add", add), (Index, "search", search),
                               (Index, "close", close), (compute, "_new_index", new_index)):
        monkeypatch.setattr(owner, name, value)
    return events


def test_the_next_shard_is_read_and_added_while_a_shard_is_searched(tmp_path, rng, overlapped, monkeypatch):
    """Each shard's searches are held until all of the next shard's rows are added: the run still ends,
    with the bits of one Index, no search ran on the adding thread, and by the order of events every read
    and add of shard s + 1 ended before shard s's search did. Batches read but not yet added never exceed
    the read-ahead besides the one being added (2 + 1), and at most two Indexes are alive at once."""
    x, q, base, queries = _files(tmp_path, rng)
    want = exact_search(x, q.astype(np.float32), 30, "l2", dtype="uint8")
    events = _instrument(monkeypatch, hold=True)
    got = groundtruth(base, queries, 30, "l2", batch_rows=BATCH_ROWS, query_batch=16)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
    assert not _threads()
    kinds = {e[0] for e in events.list}
    assert "searched on the adding thread" not in kinds and "gave up waiting" not in kinds
    shards = N // SHARD_ROWS
    for s in range(shards - 1):
        search_end = events.last("search end", s)
        assert events.last("add", s + 1) < search_end and events.last("read end", s + 1) < search_end
        assert events.list.index(("search start", s)) < search_end
    held = alive = most_held = most_alive = 0
    for event in events.list:
        held += {"read end": 1, "add": -1}.get(event[0], 0)
        alive += {"index made": 1, "index closed": -1}.get(event[0], 0)
        most_held, most_alive = max(most_held, held), max(most_alive, alive)
    assert most_held <= 3 and most_alive == 2 and alive == 0


def test_in_turn_the_searches_follow_the_adds(tmp_path, rng, monkeypatch):
    """Where nothing overlaps (a file on the CPU, one shard of 125 rows at a time by shard_rows), every
    search runs on the caller's thread after its shard's adds, before the next shard's: the order as
    before, and one Index at a time."""
    x, q, base, queries = _files(tmp_path, rng)
    events = _instrument(monkeypatch, hold=False)
    got = groundtruth(base, queries, 30, "l2", batch_rows=BATCH_ROWS, query_batch=16, shard_rows=SHARD_ROWS)
    want = exact_search(x, q.astype(np.float32), 30, "l2", dtype="uint8")
    np.testing.assert_array_equal(got[1], want[1])
    order = [(e[0], e[1]) for e in events.list if e[0] in ("add", "search end")]
    assert order == sorted(order, key=lambda e: (e[1], e[0] == "search end"))
    assert {e[1] for e in events.list if e[0] == "searched on the adding thread"} == set(range(N // SHARD_ROWS))
    alive = [0]
    for event in events.list:
        alive.append(alive[-1] + {"index made": 1, "index closed": -1}.get(event[0], 0))
    assert max(alive) == 1 and alive[-1] == 0


def test_a_failed_search_stops_the_run_and_its_threads(tmp_path, rng, overlapped, monkeypatch):
    """A search that fails on the search thread (shard 3's) is raised in the caller; the reader and the
    search thread are gone, and every Index made was closed."""
    _, _, base, queries = _files(tmp_path, rng)
    events = _instrument(monkeypatch, hold=False, fail=3)
    with pytest.raises(RuntimeError, match="the device failed on shard 3"):
        groundtruth(base, queries, 30, "l2", batch_rows=BATCH_ROWS, query_batch=16)
    assert not _threads()
    made = sum(e[0] == "index made" for e in events.list)
    assert made >= 4 and sum(e[0] == "index closed" for e in events.list) == made


@pytest.mark.parametrize("dtype,metric,queries,want", [
    ("uint8", "l2", "integers", INTEGER_EXACT), ("int8", "ip", "integers", INTEGER_EXACT),
    ("uint8", "cosine", "integers", 0.0), ("float32", "l2", "integers", 0.0),
    ("uint8", "l2", "fractions", 0.0)])
def test_integer_distances_are_exact_below_2_to_the_24(rng, dtype, metric, queries, want):
    """8-bit rows and integer queries under l2 or ip: every float64 distance is an integer, so float32 holds
    it exactly below 2**24 and the merge settles ties there by id; anything else resolves them."""
    x = rng.integers(0, 100, (50, 8)).astype(dtype)
    q = rng.integers(0, 100, (4, 8)).astype(np.float32) + (np.float32(0.5) if queries == "fractions" else 0)
    run = Exact(Source(x, "the base"), q, len(x), metric, dtype)
    assert run.exact_below == want
