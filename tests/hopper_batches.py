"""Shared by the Hopper screen's knob tests (with conftest's `wgmma` fixture): one batch's screen outcome on a
fresh index under render_screen knobs."""

from __future__ import annotations

import numpy as np

import tinyknn


def screened(db, queries, metric: str, dtype: str, k: int, monkeypatch, **knobs):
    """(distances, ids, survivor counts, handed back, the Hopper screen spec the batch ran: its small tile's for at
    most 128 queries) of one batch on a fresh index, render_screen's attributes set to `knobs` (e.g.
    HOPPER_INT_KEYS=False) before the index is made."""
    from tinyknn.jit import render_screen

    for name, value in knobs.items():
        monkeypatch.setattr(render_screen, name, value)
    with tinyknn.Index(db.shape[1], metric, dtype, device="cuda") as index:
        index.add(db)
        searcher = index._searcher
        distances, ids = searcher.search(queries, k)
        counts = np.zeros(len(queries), np.int32)
        searcher._buffers["screen_counts"].copy_to_host(counts, counts.nbytes)
        return distances, ids, counts, searcher._screen.fallbacks, searcher._screen._hopper_for(len(queries))


def assert_same_batch(a, b) -> None:
    """Two screened() outcomes of one batch under kernels that must agree: every query's survivor count, the
    queries handed back, the ids and the distances' bits."""
    assert np.array_equal(a[2], b[2]), "the survivors per query differ"
    assert_same_answers(a, b)


def assert_same_answers(a, b) -> None:
    """Two screened() outcomes of one batch whose survivors may differ: the queries handed back, the ids and
    the distances' bits."""
    assert a[3] == b[3]
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[0].view(np.int32), b[0].view(np.int32))


def eight_bit_rows(rng, n: int, dim: int, dtype: str) -> np.ndarray:
    """n random int8 or uint8 rows: every third one darker (a spread of |x|^2, odd and even), the first quarter a
    copy of the second (ties)."""
    low, high = (-128, 128) if dtype == "int8" else (0, 256)
    db = rng.integers(low, high, (n, dim))
    db[::3] //= 4
    db[: n // 4] = db[n // 4: n // 2]
    return db.astype(dtype)


def near_queries(rng, db: np.ndarray, count: int, dtype: str) -> np.ndarray:
    """`count` float32 queries a few units off rows of the 8-bit `db`, kept within the dtype's range."""
    low, high = (-128, 127) if dtype == "int8" else (0, 255)
    return np.clip(db[rng.choice(len(db), count)].astype(np.float32)
                   + rng.integers(-3, 4, (count, db.shape[1])), low, high)
