"""The single-query kernel's verify step with its candidates' rows staged in shared memory, a thread a
candidate (render_single.single_params stage=1, verify.cuh's verify_distances_staged; 4 and 8: the chain loading that
many chunks a step, 4 the default on Hopper where the rows fit): the same answers as the groups of lanes
(stage=0), bit for bit, and the float64 oracle's, on every storage type and metric, on
clustered rows with ties, with and without the float16 shadow, for a filter's rows read in place."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact

pytestmark = pytest.mark.gpu

STAGES = (1, 4, 8)      # staged, the chain loading 1, 4 or 8 chunks a step
CASES = [("l2", "float32", 128), ("l2", "float32", 37), ("l2", "float16", 100), ("ip", "bfloat16", 64),
         ("cosine", "float32", 96), ("l2", "uint8", 130), ("ip", "int8", 33)]


def _rows(rng, n: int, dim: int, dtype: str) -> np.ndarray:
    """Clustered rows in the storage type's range, a row repeated across the index (ties beyond the margin)."""
    if dtype in ("uint8", "int8"):
        low, high = (0, 256) if dtype == "uint8" else (-128, 128)
        centres = rng.integers(low, high, (8, dim))
        rows = np.clip(centres[rng.integers(0, 8, n)] + rng.integers(-3, 4, (n, dim)), low, high - 1)
    else:
        rows = rng.standard_normal((8, dim))[rng.integers(0, 8, n)] * 3.0 + 0.05 * rng.standard_normal((n, dim))
    rows = rows.astype(np.float32)
    rows[rng.integers(0, n, 40)] = rows[5]
    return rows


def _answers(index, queries, k: int, stage: int, **filters):
    searcher = index._searcher
    searcher.single_overrides = (("stage", stage),)
    searcher._forget_plans()
    try:
        return [index.search(q[None], k, **filters) for q in queries]
    finally:
        searcher.single_overrides = ()
        searcher._forget_plans()


@pytest.mark.parametrize("metric,dtype,dim", CASES)
def test_the_staged_verify_step_answers_as_the_lanes_do(metric, dtype, dim, rng):
    n = 30_000
    db = _rows(rng, n, dim, dtype)
    queries = np.concatenate([db[5:6], db[rng.integers(0, n, 3)]]).astype(np.float32)
    if dtype not in ("uint8", "int8"):
        queries[1:] += 0.01 * rng.standard_normal((3, dim)).astype(np.float32)
    with tinyknn.Index(dim, metric, dtype, device="cuda") as index:
        index.add(db)
        searcher = index._searcher
        for k in (1, 10, 100):
            lanes = _answers(index, queries, k, 0)
            for stage in STAGES:
                staged = _answers(index, queries, k, stage)
                for q, (d0, i0), (d1, i1) in zip(queries, lanes, staged):
                    assert_exact(d1, i1, db, q[None], k, metric, dtype)
                    assert np.array_equal(i0, i1) and np.array_equal(d0.view(np.int32), d1.view(np.int32)), stage
            ran = {s.param("stage", 0) for s in searcher._kernels if s.variant == "single"}
            assert ran == {0, *STAGES}, f"single-query kernels of stages {ran} ran, not {[0, *STAGES]}"


def test_the_staged_verify_step_reads_a_filters_rows_in_place(rng):
    dim, n = 64, 40_000
    db = _rows(rng, n, dim, "float32")
    allowed = np.sort(rng.choice(n, 3_000, replace=False))
    queries = db[allowed[:3]] + 0.01 * rng.standard_normal((3, dim)).astype(np.float32)
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        lanes = _answers(index, queries, 10, 0, filter=allowed)
        for stage in STAGES:
            staged = _answers(index, queries, 10, stage, filter=allowed)
            for q, (d0, i0), (d1, i1) in zip(queries, lanes, staged):
                assert_exact(d1, i1, db[allowed], q[None], 10, "l2", id_map=allowed)
                assert np.array_equal(i0, i1) and np.array_equal(d0.view(np.int32), d1.view(np.int32)), stage
