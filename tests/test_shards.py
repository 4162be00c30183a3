"""ShardedSearcher (tinyknn.index.shards, the multi-GPU logic) over CPU searchers: bit for bit the answer of
one searcher holding every row, ties between shards settled in float64; adds that keep the shards even; a
failed shard add that changes nothing; no search that sees part of an add.

(tests/test_index_ops.py and the threads judge in tests/test_index_concurrency.py also run with 3 shards.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tinyknn
from model_searcher import use_shards
from reference import assert_exact
from tinyknn.index import shards as _shards

METRICS = ("l2", "ip", "cosine")


def both(monkeypatch, dim, metric="l2", dtype="float32", n_shards=3):
    """(one plain CPU index, one over n_shards CPU searchers)."""
    plain = tinyknn.Index(dim, metric=metric, dtype=dtype)
    use_shards(monkeypatch, n_shards)
    return plain, tinyknn.Index(dim, metric=metric, dtype=dtype)


def same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and np.array_equal(x, y), (x, y)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("metric", METRICS)
def test_the_same_bits_as_one_searcher(monkeypatch, rng, metric, dtype):
    """Copies of rows land in other shards (exact ties across shards, broken by the smaller id), and every
    kind of search answers exactly as one CPU index does, also after removals."""
    db = rng.standard_normal((900, 12)).astype(np.float32)
    if dtype == "int8":
        db = np.clip(np.round(db * 20), -127, 127)
    db[600:700] = db[:100]                      # copies, added later: the emptiest shards take them
    labels = rng.integers(0, 4, len(db))
    plain, sharded = both(monkeypatch, 12, metric, dtype)
    for index in (plain, sharded):
        for part in np.array_split(np.arange(len(db)), 5):
            index.add(db[part], ids=part * 7 + 3, labels=labels[part])
    q = np.concatenate([db[:5] + 0.01, rng.standard_normal((6, 12)).astype(np.float32)])
    if dtype == "int8":
        q = np.clip(np.round(np.concatenate([db[:5] + 1, q[5:] * 20])), -127, 127)
    allowed = (np.arange(0, len(db), 3) * 7 + 3)
    for step in range(2):
        for k in (1, 10, 64, 2000):
            same(plain.search(q, k), sharded.search(q, k))
        ql = rng.integers(0, 4, len(q))
        same(plain.search(q, 10, filter=allowed, labels=ql), sharded.search(q, 10, filter=allowed, labels=ql))
        radius = {"l2": 8.0, "ip": 2.0, "cosine": 0.4}[metric] * (400 if dtype == "int8" and metric != "cosine" else 1)
        same(plain.range_search(q, radius), sharded.range_search(q, radius))
        same(plain.range_search(q, radius, labels=ql), sharded.range_search(q, radius, labels=ql))
        gone = rng.choice(len(db), 150, replace=False) * 7 + 3
        assert plain.remove(gone) == sharded.remove(gone)
    held = np.sort(plain._ids.ids_of_rows())
    assert np.array_equal(plain.get(held), sharded.get(held))
    assert np.array_equal(np.sort(sharded._ids.ids_of_rows()), held)


def test_float32_ties_between_shards_are_ordered_in_float64(monkeypatch, rng):
    """Two rows in different shards whose float64 distances to the query differ below float32's resolution:
    both shards report 1.0; the merge asks their float64 distances, and the nearer one (the larger id) comes
    first, as one searcher orders them."""
    plain, sharded = both(monkeypatch, 2, n_shards=2)
    asked = []
    exact = _shards.ShardedSearcher._exact
    monkeypatch.setattr(_shards.ShardedSearcher, "_exact",
                        lambda self, *a: asked.append(len(a[2])) or exact(self, *a))
    near = np.array([[1.0, 0.0]], np.float32), np.array([[1 - 2**-24, 0.00034]], np.float32)   # 1 and 1 - 3.6e-9
    far = rng.standard_normal((50, 2)).astype(np.float32) + 10
    for index in (plain, sharded):
        index.add(near[0], ids=[5])
        index.add(near[1], ids=[9])
        index.add(far, ids=np.arange(100, 150))
    assert sharded._searcher._shard_of[:2].tolist() == [0, 1]
    q = np.zeros((1, 2), np.float32)
    got = sharded.search(q, 2)
    assert got[1][0].tolist() == [9, 5] and got[0][0].tolist() == [1.0, 1.0]
    same(plain.search(q, 2), got)
    assert asked == [2]
    same(plain.range_search(q, 1.5), sharded.range_search(q, 1.5))


def test_adds_keep_the_shards_even(monkeypatch, rng):
    _, index = both(monkeypatch, 4, n_shards=3)
    sizes = lambda: [len(rows) for rows in index._searcher._rows_of_shard]   # noqa: E731
    for n in (10, 1, 2, 7):
        index.add(rng.standard_normal((n, 4)).astype(np.float32))
    assert sorted(sizes()) == [6, 7, 7]
    index.remove(np.arange(6))                      # rows 0-5: the first shards' first rows
    index.add(rng.standard_normal((8, 4)).astype(np.float32))
    assert max(sizes()) - min(sizes()) <= 1 and sum(sizes()) == index.ntotal == 22
    assert np.array_equal(_shards._even_out(np.array([5, 0, 2]), 4), [0, 3, 1])


def test_a_shard_that_cannot_add_changes_nothing(monkeypatch, rng):
    _, index = both(monkeypatch, 6, n_shards=3)
    db = rng.standard_normal((90, 6)).astype(np.float32)
    index.add(db)
    q = rng.standard_normal((4, 6)).astype(np.float32)
    before, sizes = index.search(q, 20), [len(r) for r in index._searcher._rows_of_shard]

    def refuse(vectors, ids):
        raise MemoryError("shard 2 is full (a test)")

    monkeypatch.setattr(index._searcher._shards[2], "add", refuse)
    with pytest.raises(MemoryError, match="shard 2 is full"):
        index.add(rng.standard_normal((30, 6)).astype(np.float32))
    assert index.ntotal == 90 and [len(r) for r in index._searcher._rows_of_shard] == sizes
    assert [s.size() for s in index._searcher._shards] == sizes
    same(before, index.search(q, 20))


def test_a_search_during_an_add_sees_all_of_it(monkeypatch, rng):
    """Shard 1 is held inside its part of an add (shard 0 has taken its part): a search that starts then waits
    for the add and answers over all of its rows, never over shard 0's part alone."""
    _, index = both(monkeypatch, 5, n_shards=2)
    old, new = (rng.standard_normal((n, 5)).astype(np.float32) for n in (40, 40))
    index.add(old)
    started, go = threading.Event(), threading.Event()
    shard = index._searcher._shards[1]
    add = shard.add

    def held_add(vectors, ids):
        started.set()
        assert go.wait(10)
        add(vectors, ids)

    monkeypatch.setattr(shard, "add", held_add)
    adder = threading.Thread(target=index.add, args=(new,))
    adder.start()
    assert started.wait(10)
    q = new[:3] + 0.001
    answer = []
    searcher = threading.Thread(target=lambda: answer.append(index.search(q, 8)))
    searcher.start()
    searcher.join(0.3)
    assert searcher.is_alive(), "the search did not wait for the add"
    go.set()
    adder.join(10)
    searcher.join(10)
    assert_exact(*answer[0], np.concatenate([old, new]), q, 8, "l2")


def test_bad_positions_and_device_arrays_are_refused(monkeypatch, rng):
    _, index = both(monkeypatch, 3, n_shards=2)
    index.add(rng.standard_normal((10, 3)).astype(np.float32))
    searcher = index._searcher
    for bad in ([3, 2], [0, 10], [-1]):
        with pytest.raises(ValueError, match="sorted, unique and in"):
            searcher.remove_rows(np.array(bad, dtype=np.int64))
    with pytest.raises(TypeError, match="host \\(NumPy\\) queries"):
        searcher.search([[0.0, 0.0, 0.0]], 2)
    with pytest.raises(ValueError, match="at least one shard"):
        _shards.ShardedSearcher([], "l2")
    assert index.ntotal == 10 and len(index.search(np.zeros((1, 3), np.float32), 10)[1][0]) == 10
