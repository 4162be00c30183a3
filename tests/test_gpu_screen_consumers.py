"""The Hopper screen with three consumer warpgroups (render_screen.HOPPER_CONSUMERS = 3, screen_hopper.cuh's CW; a
probe's knob for 8-bit rows of one 128-byte k-block): 512 threads, 192-query tiles, each consumer's 256 rows in two
halves. The survivors are computed from the same products and keys, so every query's survivor count, the queries
handed back and the answers (bit for bit, and the float64 oracle's) must equal the default kernel's: integer and
float keys, l2 and ip, a batch that is not a whole number of tiles, and enough rows that each block takes many
tiles (its scalar slots and ring stages reused)."""

from __future__ import annotations

import numpy as np
import pytest

from hopper_batches import screened
from reference import assert_exact

pytestmark = pytest.mark.gpu


def _screened(db, queries, metric, dtype, k, consumers, monkeypatch, int_keys=True):
    return screened(db, queries, metric, dtype, k, monkeypatch, HOPPER_CONSUMERS=consumers, HOPPER_INT_KEYS=int_keys)


def _assert_same(three, two) -> None:
    assert three[4].param("cw") == 3 and two[4].param("cw", 2) == 2
    assert np.array_equal(three[2], two[2]), "the survivors per query differ"
    assert three[3] == two[3]
    assert np.array_equal(three[1], two[1]) and np.array_equal(three[0].view(np.int32), two[0].view(np.int32))


@pytest.mark.parametrize("metric,dtype,dim,int_keys", [("l2", "uint8", 128, True), ("ip", "int8", 100, True),
                                                       ("l2", "int8", 128, False), ("ip", "uint8", 96, False)])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_three_consumers_keep_the_same_survivors(metric, dtype, dim, int_keys, k, rng, wgmma, monkeypatch):
    low, high = (0, 256) if dtype == "uint8" else (-128, 128)
    n = 40_000
    db = rng.integers(low, high, (n, dim)).astype(dtype)
    db[: n // 4] = db[n // 4: n // 2]                                  # duplicated rows: ties
    queries = db[rng.choice(n, 250)].astype(np.float32)              # 250: one 192-query tile and a part of one
    queries[:60] = np.clip(queries[:60] + rng.integers(-2, 3, (60, dim)), low, high - 1)
    queries[-2:] += 0.5                                                # not 8-bit: every row survives
    two, three = (_screened(db, queries, metric, dtype, k, c, monkeypatch, int_keys) for c in (2, 3))
    _assert_same(three, two)
    assert three[3] >= 2                                               # the two non-8-bit queries handed back
    assert_exact(three[0], three[1], db, queries, k, metric, dtype)


def test_three_consumers_through_many_tiles_a_block(rng, wgmma, monkeypatch):
    """340,000 uint8 rows and 400 queries: about 20 tiles a block, so every scalar slot and ring stage is filled
    again after the three consumers free it (their 12 warps' and 384 threads' arrivals)."""
    n, dim = 340_000, 128
    db = rng.integers(0, 256, (n, dim)).astype(np.uint8)
    queries = np.clip(db[rng.choice(n, 400)].astype(np.float32) + rng.integers(-3, 4, (400, dim)), 0, 255)
    two, three = (_screened(db, queries, "l2", "uint8", 10, c, monkeypatch) for c in (2, 3))
    _assert_same(three, two)
    assert_exact(three[0], three[1], db, queries, 10, "l2", "uint8")
