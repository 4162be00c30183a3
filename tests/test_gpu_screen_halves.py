"""The Hopper screen's ways of taking each consumer's work in two halves, each against the kernel of two consumers
without overlap: three consumer warpgroups (render_screen.HOPPER_CONSUMERS = 3, the default; screen_hopper.cuh's CW:
8-bit rows of one 128-byte k-block, 512 threads, 192-query tiles, each consumer's 256 rows in halves) and the
halves' overlap (a probes' knob, off by default; HOPPER_OVERLAP_HALVES, XO: rows of one or two k-blocks; one half's
products in flight while the other's epilogue runs, across tiles; a half is the rows' half on 8-bit tiles and one of
the two m64 query blocks on 16-bit ones). The survivors come from the same products and keys, so every query's
survivor count, the queries handed back and the answers (bit for bit, and the float64 oracle's) must equal those of
two consumers: integer and float keys, l2, ip and cosine, a batch that is not a whole number of tiles, and enough
rows that each block takes many tiles (its scalar slots and ring stages reused)."""

from __future__ import annotations

import numpy as np
import pytest

from hopper_batches import assert_same_batch, screened
from reference import assert_exact
from test_gpu_screen import data, near_rows

pytestmark = pytest.mark.gpu

KNOBS = {"consumers": ({"HOPPER_CONSUMERS": 3}, ("cw", 3)),
         "overlap": ({"HOPPER_OVERLAP_HALVES": True, "HOPPER_CONSUMERS": 2}, ("xo", 1))}


def _pair(db, queries, metric, dtype, k, knob, monkeypatch, int_keys=True, value=None):
    """The default kernel's batch and the knob's, compared: survivors, hand-backs, ids and distance bits. value: the
    knob's parameter in the spec, where not KNOBS' (XO is the rows' k-blocks)."""
    knobs, (param, usual) = KNOBS[knob]
    value = usual if value is None else value
    plain = screened(db, queries, metric, dtype, k, monkeypatch, HOPPER_INT_KEYS=int_keys, HOPPER_CONSUMERS=2,
                     HOPPER_OVERLAP_HALVES=False)
    halves = screened(db, queries, metric, dtype, k, monkeypatch, HOPPER_INT_KEYS=int_keys, **knobs)
    assert halves[4].param(param) == value and plain[4].param(param, 0) != value
    assert_same_batch(halves, plain)
    return halves


@pytest.mark.parametrize("knob", list(KNOBS))
@pytest.mark.parametrize("metric,dtype,dim,int_keys", [("l2", "uint8", 128, True), ("ip", "int8", 100, True),
                                                       ("l2", "int8", 128, False), ("ip", "uint8", 96, False)])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_halves_keep_the_same_survivors(knob, metric, dtype, dim, int_keys, k, rng, wgmma, monkeypatch):
    low, high = (0, 256) if dtype == "uint8" else (-128, 128)
    n = 40_000
    db = rng.integers(low, high, (n, dim)).astype(dtype)
    db[: n // 4] = db[n // 4: n // 2]                                  # duplicated rows: ties
    queries = db[rng.choice(n, 250)].astype(np.float32)              # 250: a tile (or two) and a part of one
    queries[:60] = np.clip(queries[:60] + rng.integers(-2, 3, (60, dim)), low, high - 1)
    queries[-2:] += 0.5                                                # not 8-bit: every row survives
    halves = _pair(db, queries, metric, dtype, k, knob, monkeypatch, int_keys)
    assert halves[3] >= 2                                              # the two non-8-bit queries handed back
    assert_exact(halves[0], halves[1], db, queries, k, metric, dtype)


@pytest.mark.parametrize("knob", list(KNOBS))
def test_halves_through_many_tiles_a_block(knob, rng, wgmma, monkeypatch):
    """340,000 uint8 rows and 400 queries: 15-20 tiles a block, so every scalar slot and ring stage is filled again
    after the consumers free it, and the overlap carries a tile's first half across the loop each time."""
    n, dim = 340_000, 128
    db = rng.integers(0, 256, (n, dim)).astype(np.uint8)
    queries = np.clip(db[rng.choice(n, 400)].astype(np.float32) + rng.integers(-3, 4, (400, dim)), 0, 255)
    halves = _pair(db, queries, "l2", "uint8", 10, knob, monkeypatch)
    assert_exact(halves[0], halves[1], db, queries, 10, "l2", "uint8")


@pytest.mark.parametrize("knob", list(KNOBS))
def test_halves_with_one_tile_a_block(knob, rng, wgmma, monkeypatch):
    """16,384 rows (64 row tiles) and 250 queries (2 query tiles): fewer tiles than an H200 has SMs, so each block
    takes one, and the overlap's prologue and its after-the-last-tile reissue run on the same tile."""
    n, dim = 16_384, 128
    db = rng.integers(0, 256, (n, dim)).astype(np.uint8)
    queries = np.clip(db[rng.choice(n, 250)].astype(np.float32) + rng.integers(-3, 4, (250, dim)), 0, 255)
    halves = _pair(db, queries, "l2", "uint8", 10, knob, monkeypatch)
    assert_exact(halves[0], halves[1], db, queries, 10, "l2", "uint8")


def _float_rows(rng, n, dim, dtype):
    """test_gpu_screen's clustered rows in `dtype` (16-bit storage, or float32 screened through its float16
    shadow), a quarter of them copies of another quarter (ties)."""
    db = data(rng, "clustered", n, dim, dtype)
    db[: n // 4] = db[n // 4: n // 2]
    return db


@pytest.mark.parametrize("metric,dtype,dim,k_blocks", [("l2", "float16", 128, 2), ("ip", "bfloat16", 64, 1),
                                                       ("cosine", "float32", 100, 2), ("l2", "uint8", 200, 2)])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_overlap_of_16_bit_tiles_and_of_two_k_blocks(metric, dtype, dim, k_blocks, k, rng, wgmma, monkeypatch):
    """XO where a half is one of a consumer's two m64 query blocks (16-bit rows, the float32 shadow), and where each
    half's products span two k-blocks (held in the ring with the next tile's): 300 queries (a 256-query tile and a
    part of one), the same survivors, hand-backs and answers as the default kernel, and the oracle's."""
    n = 40_000
    if dtype == "uint8":
        db = rng.integers(0, 256, (n, dim)).astype(np.uint8)
        db[: n // 4] = db[n // 4: n // 2]
        queries = np.clip(db[rng.choice(n, 300)].astype(np.float32) + rng.integers(-2, 3, (300, dim)), 0, 255)
    else:
        db = _float_rows(rng, n, dim, dtype)
        queries = near_rows(rng, db, 300, dtype)
    halves = _pair(db, queries, metric, dtype, k, "overlap", monkeypatch, value=k_blocks)
    assert_exact(halves[0], halves[1], db, queries, k, metric, dtype)


@pytest.mark.parametrize("n,n_queries", [(340_000, 600), (16_384, 250)])
def test_overlap_of_16_bit_tiles_through_many_tiles_and_one(n, n_queries, rng, wgmma, monkeypatch):
    """float16 x 128 (two k-blocks): 340,000 rows and 600 queries give each block ~60 tiles (every ring stage and
    scalar slot reused, a tile's first half carried across the loop); 16,384 rows and 250 queries give each block
    one tile (the prologue and the after-the-last-tile reissue on the same tile)."""
    db = _float_rows(rng, n, 128, "float16")
    queries = near_rows(rng, db, n_queries, "float16")
    halves = _pair(db, queries, "l2", "float16", 10, "overlap", monkeypatch, value=2)
    assert_exact(halves[0], halves[1], db, queries, 10, "l2", "float16")
