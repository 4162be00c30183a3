"""A screened batch's steps replayed as one CUDA graph (screen_launch.SCREEN_GRAPHS, a knob): a shape seen twice is
captured once, and every later batch of that shape, whatever its queries, must answer exactly what the steps run
one by one answer (ids and distance bits, and the float64 oracle's), on both screens; and nothing a replay froze
may outlive what it read: rows added or removed, a buffer grown by a larger batch, a survivor room changed."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact

pytestmark = pytest.mark.gpu


def _graphs(index) -> list:
    from tinyknn.gpu.screen_launch import CapturedSteps

    return [entry for entry in index._searcher._plans.values() if isinstance(entry, CapturedSteps)]


def _search_both(index, queries, k, monkeypatch):
    """(with graphs, without) answers of the same batch, the graph's after its shape's capture."""
    from tinyknn.gpu import screen_launch

    monkeypatch.setattr(screen_launch, "SCREEN_GRAPHS", False)
    plain = index.search(queries, k)
    monkeypatch.setattr(screen_launch, "SCREEN_GRAPHS", True)
    replayed = index.search(queries, k)
    return replayed, plain


def _same(a, b) -> bool:
    return np.array_equal(a[1], b[1]) and np.array_equal(a[0].view(np.int32), b[0].view(np.int32))


@pytest.mark.parametrize("metric,dtype", [("l2", "float32"), ("ip", "float16"), ("l2", "uint8"), ("cosine", "float32")])
def test_replayed_steps_answer_every_batch_exactly(metric, dtype, rng, screen, monkeypatch):
    """Batches of 300 queries (the Hopper screen's large tile) and of 100 (its small one), new queries each time."""
    from tinyknn.gpu import screen_launch

    n, dim, k = 30_000, 64, 10
    db = rng.integers(0, 256, (n, dim)).astype(np.float32) if dtype == "uint8" else \
        rng.standard_normal((n, dim)).astype(np.float32)

    def batch(nq):
        if dtype == "uint8":
            return np.clip(db[rng.choice(n, nq)] + rng.integers(-3, 4, (nq, dim)), 0, 255)
        return rng.standard_normal((nq, dim)).astype(np.float32)

    monkeypatch.setattr(screen_launch, "SCREEN_GRAPHS", True)
    with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
        index.add(db)
        for nq in (300, 100):
            for _ in range(8):          # uses 1 (steps), 2 (captured), 3, 4 (replays); a hand-back's buffers may drop
                queries = batch(nq)     # the entry (the plan cache with them), so a few more batches at most
                assert_exact(*index.search(queries, k), db, queries, k, metric, dtype)
                entries = _graphs(index)
                entry = entries[-1] if entries else None          # this shape's, the newest used
                if entry is not None and entry.uses >= 4:
                    break
            assert entry is not None and entry.uses >= 4 and entry.graph is not None
            replayed, plain = _search_both(index, queries, k, monkeypatch)
            assert _same(replayed, plain)


def test_replays_follow_the_rows_and_the_buffers(rng, screen, monkeypatch):
    """Rows added (a new shape), rows removed and a larger batch (buffers grown: the plan cache and its graphs
    dropped), a smaller survivor room (new verify kernels: a new shape): every answer exact, replayed or not."""
    from tinyknn.gpu import screen_launch
    from tinyknn.jit import render_screen

    n, dim, k = 25_000, 32, 10
    db = rng.standard_normal((n, dim)).astype(np.float32)
    queries = rng.standard_normal((200, dim)).astype(np.float32)
    fresh = lambda: rng.standard_normal((200, dim)).astype(np.float32)   # noqa: E731 - new queries, same shape
    monkeypatch.setattr(screen_launch, "SCREEN_GRAPHS", True)
    with tinyknn.Index(dim, "l2", device="cuda") as index:
        index.add(db, ids=np.arange(n) * 2)
        ids = np.arange(n) * 2
        for _ in range(3):
            assert_exact(*index.search(queries, k), db, queries, k, "l2", id_map=ids)
        assert any(entry.graph is not None for entry in _graphs(index))
        again = fresh()
        assert_exact(*index.search(again, k), db, again, k, "l2", id_map=ids)
        more = rng.standard_normal((5_000, dim)).astype(np.float32)
        index.add(more, ids=np.arange(n, n + 5_000) * 2)
        db, ids = np.concatenate([db, more]), np.concatenate([ids, np.arange(n, n + 5_000) * 2])
        for _ in range(3):
            assert_exact(*index.search(queries, k), db, queries, k, "l2", id_map=ids)
        index.remove(ids[:3_000:3])
        keep = np.ones(len(ids), bool)
        keep[:3_000:3] = False
        db, ids = db[keep], ids[keep]
        assert not any(entry.graph is not None for entry in _graphs(index))   # the removal dropped them
        for _ in range(3):
            assert_exact(*index.search(queries, k), db, queries, k, "l2", id_map=ids)
        larger = rng.standard_normal((700, dim)).astype(np.float32)
        for _ in range(3):
            assert_exact(*index.search(larger, k), db, larger, k, "l2", id_map=ids)
            assert_exact(*index.search(queries, k), db, queries, k, "l2", id_map=ids)
        monkeypatch.setattr(render_screen, "SURVIVOR_CAPACITY", 64)    # room for fewer: more handed back
        for _ in range(3):
            assert_exact(*index.search(queries, k), db, queries, k, "l2", id_map=ids)
