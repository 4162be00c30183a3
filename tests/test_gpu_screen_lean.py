"""The Hopper screen's lean tiles (the default; render_screen.HOPPER_LEAN_TILES, screen_hopper.cuh's
LT: waits that sleep, the wgmma descriptors of a k step as the stage's plus a constant, a query tile's terms loaded
once while a block's tiles stay in it) against the kernel without them. The products, keys and thresholds are the
same, so every query's survivor count, the queries handed back and the answers (bit for bit, and the float64
oracle's) must be equal: three consumers (the 8-bit default), two with the halves' overlap, 16-bit tiles and the
small tile; a grid that is a multiple of the query tiles (a block keeps its terms) and one that is not (a block's
tiles change query tile, so its terms are loaded again), with many tiles a block."""

from __future__ import annotations

import pytest

from hopper_batches import assert_same_batch, eight_bit_rows, near_queries, screened
from reference import assert_exact
from test_gpu_screen import data, near_rows

pytestmark = pytest.mark.gpu


def _same(db, queries, dtype, k, knobs, monkeypatch, metric="l2"):
    """The batch without lean tiles and with them: the same survivors, hand-backs and answers."""
    plain = screened(db, queries, metric, dtype, k, monkeypatch, HOPPER_LEAN_TILES=False, **knobs)
    lean = screened(db, queries, metric, dtype, k, monkeypatch, HOPPER_LEAN_TILES=True, **knobs)
    assert lean[4].param("lt") == 1 and plain[4].param("lt", 0) == 0, (lean[4], plain[4])
    assert_same_batch(lean, plain)
    assert_exact(lean[0], lean[1], db, queries, k, metric, dtype)
    return lean


@pytest.mark.parametrize("n_queries", [250, 900])        # 2 query tiles of 192 (132 blocks keep theirs), 5 (not)
@pytest.mark.parametrize("layout", ["three consumers", "two, overlapped"])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_lean_8_bit_tiles_keep_the_same_survivors(n_queries, layout, k, rng, wgmma, monkeypatch):
    db = eight_bit_rows(rng, 340_000, 128, "uint8")
    queries = near_queries(rng, db, n_queries, "uint8")
    knobs = {} if layout == "three consumers" else {"HOPPER_CONSUMERS": 2, "HOPPER_OVERLAP_HALVES": True}
    lean = _same(db, queries, "uint8", k, knobs, monkeypatch)
    assert (lean[4].param("cw", 2), lean[4].param("xo", 0)) == ((3, 0) if not knobs else (2, 1))


@pytest.mark.parametrize("metric,dtype,n_queries", [("l2", "float16", 1100), ("cosine", "bfloat16", 600),
                                                    ("ip", "float32", 300), ("l2", "float16", 100)])
def test_lean_16_bit_tiles_keep_the_same_survivors(metric, dtype, n_queries, rng, wgmma, monkeypatch):
    """Tiles of 256 queries (1,100: 5 query tiles, which 132 blocks do not divide; 600: 3, which they do), the
    float32 shadow, and the small tile (100 queries)."""
    db = data(rng, "clustered", 200_000, 128, dtype)
    queries = near_rows(rng, db, n_queries, dtype)
    lean = _same(db, queries, dtype, 10, {}, monkeypatch, metric)
    assert (lean[4].param("bn"), lean[4].param("mw")) == ((256, 1) if n_queries <= 128 else (128, 2))
