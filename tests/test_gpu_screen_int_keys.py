"""The Hopper screen's integer keys (render_screen.HOPPER_INT_KEYS, screen_hopper.cuh's IK; the default where they apply): on
8-bit rows whose squared norms stay below 2^23 the epilogue compares int32 keys against the floor of the
threshold. Below 2^22 the float keys are those same integers, so the survivors must be the same ones: every
query's survivor count, the answers (bit for bit, and the float64 oracle's) and the queries handed back are equal
to the float epilogue's, for exact 8-bit queries and for queries the 8-bit type cannot hold (every row survives).
On brighter rows a row within one unit of the threshold may go either way; the answers must not. PB
(render_screen.HOPPER_PRODUCER_BIAS, the default with l2's integer keys: l2's |x|^2 bounds stored biased by the
producer) must change nothing against the keyed epilogue without it."""

from __future__ import annotations

import numpy as np
import pytest

from hopper_batches import assert_same_batch, screened
from reference import assert_exact

pytestmark = pytest.mark.gpu


def _screened(db, queries, metric, dtype, k, int_keys, monkeypatch, bias=False):
    return screened(db, queries, metric, dtype, k, monkeypatch, HOPPER_INT_KEYS=int_keys, HOPPER_PRODUCER_BIAS=bias)


def _assert_biased_as_keyed(biased, keyed) -> None:
    """PB's batch (HOPPER_PRODUCER_BIAS) against the keyed epilogue's: survivors, hand-backs, ids, distance bits."""
    assert biased[4].param("pb") == 1
    assert_same_batch(biased, keyed)


@pytest.mark.parametrize("metric,dtype,dim", [("l2", "uint8", 128), ("ip", "uint8", 100), ("l2", "int8", 96),
                                              ("ip", "int8", 128)])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_integer_keys_keep_the_same_survivors(metric, dtype, dim, k, rng, wgmma, monkeypatch):
    low, high = (0, 256) if dtype == "uint8" else (-128, 128)
    n = 40_000
    db = rng.integers(low, high, (n, dim)).astype(dtype)
    db[: n // 4] = db[n // 4: n // 2]                                  # duplicated rows: ties
    queries = db[rng.choice(n, 130)].astype(np.float32)
    queries[:60] = np.clip(queries[:60] + rng.integers(-2, 3, (60, dim)), low, high - 1)
    queries[-2:] += 0.5                                                # not 8-bit: every row survives
    plain, keyed = (_screened(db, queries, metric, dtype, k, flag, monkeypatch) for flag in (False, True))
    assert plain[4].param("ik", 0) == 0 and keyed[4].param("ik") == 1
    assert np.array_equal(plain[2], keyed[2]), "the survivors per query differ"
    assert np.array_equal(plain[1], keyed[1]) and np.array_equal(plain[0].view(np.int32), keyed[0].view(np.int32))
    assert plain[3] == keyed[3] >= 2                                  # the two non-8-bit queries handed back
    assert_exact(keyed[0], keyed[1], db, queries, k, metric, dtype)
    if metric == "l2":                                                 # the producer's biased bounds: the same
        _assert_biased_as_keyed(_screened(db, queries, metric, dtype, k, True, monkeypatch, bias=True), keyed)


def test_integer_keys_on_bright_rows_answer_the_same(rng, wgmma, monkeypatch):
    """uint8 rows of 200-255 (|x|^2 above 2^22, where the rows' lower bounds round to even): exact answers, bit for
    bit those of the float keys."""
    n, dim = 40_000, 128
    db = rng.integers(200, 256, (n, dim)).astype(np.uint8)
    assert (db.astype(np.int64) ** 2).sum(axis=1).min() >= 1 << 22
    queries = np.clip(db[rng.choice(n, 100)].astype(np.float32) + rng.integers(-2, 3, (100, dim)), 0, 255)
    plain, keyed = (_screened(db, queries, "l2", "uint8", 10, flag, monkeypatch) for flag in (False, True))
    assert keyed[4].param("ik") == 1
    assert np.array_equal(plain[1], keyed[1]) and np.array_equal(plain[0].view(np.int32), keyed[0].view(np.int32))
    assert_exact(keyed[0], keyed[1], db, queries, 10, "l2", "uint8")
    biased = _screened(db, queries, "l2", "uint8", 10, True, monkeypatch, bias=True)   # rounded to even alike
    _assert_biased_as_keyed(biased, keyed)


def test_biased_bounds_through_reused_scalar_slots(rng, wgmma, monkeypatch):
    """340,000 uint8 rows: about 10 row tiles a block, so each of the 8 scalar slots is filled again after the
    consumers free it (PB's producer warps wait on its "empty" barrier, whose parity wraps): the survivors,
    answers and hand-backs equal the keyed epilogue's."""
    n, dim = 340_000, 128
    db = rng.integers(0, 256, (n, dim)).astype(np.uint8)
    queries = np.clip(db[rng.choice(n, 100)].astype(np.float32) + rng.integers(-3, 4, (100, dim)), 0, 255)
    keyed, biased = (_screened(db, queries, "l2", "uint8", 10, True, monkeypatch, bias=flag) for flag in (False, True))
    assert keyed[4].param("pb", 0) == 0
    _assert_biased_as_keyed(biased, keyed)
    assert_exact(biased[0], biased[1], db, queries, 10, "l2", "uint8")
