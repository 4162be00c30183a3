"""l2's Hopper screen with group minima (render_screen.HOPPER_GROUP_MINIMA, a probes' knob, off by default;
screen_hopper.cuh's GM): the producer stores each group's least |x|^2 bound and the epilogue tests a group's
products against it before it loads the rows' own bounds, with integer keys (8-bit rows) and float keys (16-bit
rows, the float32 shadow, 8-bit rows too long for integer keys). The test is implied by the exact one, so every
query's survivor count, the queries handed back and the answers (bit for bit, and the float64 oracle's) must equal
those of the kernel without it: three consumer warpgroups (the 8-bit default), two, and two with the halves'
overlap; rows whose |x|^2 differ within a group, copies (ties), a batch that is not a whole number of tiles, an
index that is not a whole number of row tiles, and enough rows that each block takes many tiles."""

from __future__ import annotations

import numpy as np
import pytest

from hopper_batches import screened
from reference import assert_exact
from test_gpu_screen import data, near_rows

pytestmark = pytest.mark.gpu

LAYOUTS = {"three consumers": {}, "two consumers": {"HOPPER_CONSUMERS": 2},
           "two, overlapped": {"HOPPER_CONSUMERS": 2, "HOPPER_OVERLAP_HALVES": True}}


def _same(db, queries, dtype, k, knobs, monkeypatch):
    """The batch of `knobs` without group minima and with them: the same survivors, hand-backs and answers."""
    plain = screened(db, queries, "l2", dtype, k, monkeypatch, HOPPER_GROUP_MINIMA=False, **knobs)
    minima = screened(db, queries, "l2", dtype, k, monkeypatch, HOPPER_GROUP_MINIMA=True, **knobs)
    assert minima[4].param("gm") == 1 and plain[4].param("gm", 0) == 0, (minima[4], plain[4])
    assert np.array_equal(minima[2], plain[2]), "the survivors per query differ"
    assert minima[3] == plain[3]
    assert np.array_equal(minima[1], plain[1]) and np.array_equal(minima[0].view(np.int32), plain[0].view(np.int32))
    assert_exact(minima[0], minima[1], db, queries, k, "l2", dtype)
    return minima


def _pair(db, queries, dtype, k, layout, monkeypatch):
    """_same for a layout of LAYOUTS, whose kernel it checks it got."""
    knobs = LAYOUTS[layout]
    minima = _same(db, queries, dtype, k, knobs, monkeypatch)
    layout_params = (minima[4].param("cw", 2), minima[4].param("xo", 0))
    assert layout_params == (knobs.get("HOPPER_CONSUMERS", 3), int(knobs.get("HOPPER_OVERLAP_HALVES", False)))
    return minima


def _rows(rng, n, dim, dtype):
    """8-bit rows whose |x|^2 differ widely within each group of 8 (every third row a quarter of its values,
    every fifth a row of zeros), a quarter of them copies of another quarter."""
    low, high = (0, 256) if dtype == "uint8" else (-128, 128)
    db = rng.integers(low, high, (n, dim))
    db[::3] //= 4
    db[::5] = 0
    db[: n // 4] = db[n // 4: n // 2]
    return db.astype(dtype), (low, high)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_group_minima_keep_the_same_survivors(layout, dtype, k, rng, wgmma, monkeypatch):
    n, dim = 40_000, 128                                               # 156.25 row tiles of 256
    db, (low, high) = _rows(rng, n, dim, dtype)
    queries = db[rng.choice(n, 250)].astype(np.float32)              # 250: a tile (or two) and a part of one
    queries[:60] = np.clip(queries[:60] + rng.integers(-2, 3, (60, dim)), low, high - 1)
    queries[-2:] += 0.5                                                # not 8-bit: every row survives
    minima = _pair(db, queries, dtype, k, layout, monkeypatch)
    assert minima[3] >= 2                                              # the two non-8-bit queries handed back


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_group_minima_through_many_tiles_a_block(layout, rng, wgmma, monkeypatch):
    """340,000 rows and 400 queries: 15-20 tiles a block, so every scalar slot (with its minima) is filled again
    after the consumers free it."""
    n, dim = 340_000, 128
    db, _ = _rows(rng, n, dim, "uint8")
    queries = np.clip(db[rng.choice(n, 400)].astype(np.float32) + rng.integers(-3, 4, (400, dim)), 0, 255)
    _pair(db, queries, "uint8", 10, layout, monkeypatch)


@pytest.mark.parametrize("layout", ["two consumers", "two, overlapped"])
def test_group_minima_of_rows_of_two_k_blocks(layout, rng, wgmma, monkeypatch):
    """int8 rows of 200 elements (two 128-byte k-blocks, integer keys still): two consumers, and their overlap
    with XO = 2 (three consumers take rows of one k-block only)."""
    n, dim = 40_000, 200
    db, _ = _rows(rng, n, dim, "int8")
    queries = np.clip(db[rng.choice(n, 250)].astype(np.float32) + rng.integers(-2, 3, (250, dim)), -128, 127)
    knobs = LAYOUTS[layout]
    minima = _same(db, queries, "int8", 10, knobs, monkeypatch)
    assert minima[4].param("xo", 0) == (2 if "HOPPER_OVERLAP_HALVES" in knobs else 0)   # XO: the rows' k-blocks


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype,dim", [("float16", 128), ("bfloat16", 64), ("float32", 100)])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_group_minima_of_float_keys(overlap, dtype, dim, k, rng, wgmma, monkeypatch):
    """Float keys (the 16-bit tile, 256 queries x 128 rows, groups of 2 chunks): clustered rows, every third scaled
    to a tenth and every fifth zero (|x|^2 differing within a group), a quarter copies of another; 300 queries near
    rows; with the halves' overlap where a half is one of the two m64 query blocks."""
    n = 40_000
    db = data(rng, "clustered", n, dim, dtype).astype(np.float32)
    db[::3] *= 0.1
    db[::5] = 0
    db[: n // 4] = db[n // 4: n // 2]
    db = db.astype(np.float16 if dtype == "float16" else np.float32)
    queries = near_rows(rng, db, 300, dtype)
    minima = _same(db, queries, dtype, k, {"HOPPER_OVERLAP_HALVES": overlap}, monkeypatch)
    assert (minima[4].param("bn"), minima[4].param("mw"), minima[4].param("xo", 0) > 0) == (128, 2, overlap)


def test_group_minima_of_float_keys_on_small_batches_and_8_bit_rows(rng, wgmma, monkeypatch):
    """The small tile (100 queries on 400,000 rows: 128 x 256, groups of 4 chunks) of float16 rows, and uint8 rows of
    200 elements, whose |x|^2 may pass 2^23 (float keys on the 8-bit tile)."""
    db = data(rng, "clustered", 400_000, 64, "float16")
    db[::3] *= 0.1
    queries = near_rows(rng, db, 100, "float16")
    small = _same(db, queries, "float16", 10, {}, monkeypatch)
    assert (small[4].param("bn"), small[4].param("mw")) == (256, 1)
    db, _ = _rows(rng, 40_000, 200, "uint8")
    queries = np.clip(db[rng.choice(len(db), 250)].astype(np.float32) + rng.integers(-2, 3, (250, 200)), 0, 255)
    eight_bit = _same(db, queries, "uint8", 10, {"HOPPER_CONSUMERS": 2}, monkeypatch)
    assert eight_bit[4].param("ik", 0) == 0 and eight_bit[4].param("bn") == 256


@pytest.mark.parametrize("dtype,overlap", [("float16", False), ("float16", True), ("uint8", False),
                                           ("uint8", True), ("float32", False)])
def test_each_group_reads_its_own_minimum(dtype, overlap, rng, wgmma, monkeypatch):
    """Rows in runs of 32, every third run large (|x|^2 ~50x the others), queries near the small rows: a group
    tested against another group's minimum (a large one) would drop its survivors, so the survivors would differ.
    Both tiles (8-bit 256 rows, 16-bit 128), three consumers' halves and the overlap's halves."""
    n, dim = 40_000, 128
    large = (np.arange(n) // 32) % 3 == 1
    if dtype == "uint8":
        db = rng.integers(0, 256, (n, dim))
        db[~large] //= 8
        db = db.astype(np.uint8)
        queries = np.clip(db[rng.choice(np.flatnonzero(~large), 250)].astype(np.float32)
                          + rng.integers(-1, 2, (250, dim)), 0, 255)
    else:
        db = data(rng, "clustered", n, dim, dtype).astype(np.float32)
        db[large] *= 7
        db = db.astype(np.float16 if dtype == "float16" else np.float32)
        queries = near_rows(rng, db[~large], 300, dtype)
    knobs = {"HOPPER_OVERLAP_HALVES": overlap, **({"HOPPER_CONSUMERS": 2} if overlap else {})}
    minima = _same(db, queries, dtype, 10, knobs, monkeypatch)
    assert (minima[4].param("xo", 0) > 0) == overlap
