"""The Hopper screen's half keys (a probes' knob, off by default; render_screen.HOPPER_HALF_KEYS, screen_hopper.cuh's
HK, with the producer's biased bounds: l2 on 8-bit rows with integer keys) against the kernel without them. A row
survives under HK where dot - (S' >> 1) >= -(ti >> 1), which every row within the threshold meets and, besides
them, only rows whose integer key is one unit over it (an odd S'). So every query's survivors are at least the
keyed epilogue's and barely more, and the answers (bit for bit, and the float64 oracle's) and the queries handed
back are the same: three consumers (the 8-bit default), two, two with the halves' overlap, and the small tile;
duplicated rows (ties), odd and even |x|^2, k = 1, 10 and 100."""

from __future__ import annotations

import numpy as np
import pytest

from hopper_batches import assert_same_answers, eight_bit_rows, near_queries, screened
from reference import assert_exact

pytestmark = pytest.mark.gpu

LAYOUTS = {"three consumers": {}, "two": {"HOPPER_CONSUMERS": 2},
           "two, overlapped": {"HOPPER_CONSUMERS": 2, "HOPPER_OVERLAP_HALVES": True}}


def _compare(db, queries, dtype, k, knobs, monkeypatch):
    plain = screened(db, queries, "l2", dtype, k, monkeypatch, HOPPER_HALF_KEYS=False, **knobs)
    half = screened(db, queries, "l2", dtype, k, monkeypatch, HOPPER_HALF_KEYS=True, **knobs)
    assert half[4].param("hk") == 1 and plain[4].param("hk", 0) == 0, (half[4], plain[4])
    assert np.all(half[2] >= plain[2]), "a row within the threshold was not kept"
    assert half[2].sum() - plain[2].sum() <= max(8, plain[2].sum() // 100), (half[2].sum(), plain[2].sum())
    assert_same_answers(half, plain)
    assert_exact(half[0], half[1], db, queries, k, "l2", dtype)
    return half


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("k", [1, 10, 100])
def test_half_keys_keep_every_survivor_of_the_keyed_epilogue(layout, k, rng, wgmma, monkeypatch):
    """340,000 rows, 250 queries (a tile and a part of one): each block takes many tiles, reusing each scalar
    slot (the producer's stores of -(S' >> 1))."""
    db = eight_bit_rows(rng, 340_000, 128, "uint8")
    half = _compare(db, near_queries(rng, db, 250, "uint8"), "uint8", k, LAYOUTS[layout], monkeypatch)
    assert (half[4].param("cw", 2), half[4].param("xo", 0)) == \
        {"three consumers": (3, 0), "two": (2, 0), "two, overlapped": (2, 1)}[layout]


@pytest.mark.parametrize("dtype,n_queries", [("int8", 300), ("uint8", 100)])
def test_half_keys_of_int8_rows_and_the_small_tile(dtype, n_queries, rng, wgmma, monkeypatch):
    db = eight_bit_rows(rng, 200_000, 128, dtype)
    half = _compare(db, near_queries(rng, db, n_queries, dtype), dtype, 10, {}, monkeypatch)
    assert half[4].param("bn") == 256
