"""The tensor-core path (gpu/screen.py): batches of 64 or more queries on l2/ip indexes stored as float16,
bfloat16, int8, uint8 or float32 (through a float16 shadow) are screened on the tensor cores and their
survivors verified in float64: every answer is the float64 oracle's, bit for bit, and a query the screen
cannot settle (survivors beyond the capacity) is answered by the other kernels and counted."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact

pytestmark = pytest.mark.gpu


def searcher_index(db, metric, dtype, ids=None):
    index = tinyknn.Index(db.shape[1], metric, dtype, device="cuda")
    index._searcher.add(db, np.arange(len(db)) if ids is None else ids)
    return index


def data(rng, kind, n, dim, dtype):
    if dtype in ("int8", "uint8"):
        low, high = (-128, 128) if dtype == "int8" else (0, 256)
        x = rng.integers(low, high, (n, dim)).astype(dtype)
        if kind == "duplicates":
            x[: n // 2] = x[n // 2: 2 * (n // 2)]
        return x
    x = rng.standard_normal((n, dim))
    if kind == "clustered":
        centres = rng.standard_normal((20, dim)) * 3
        x = centres[rng.integers(0, 20, n)] + x * 0.3
    if kind == "duplicates":
        x[: n // 2] = x[n // 2: 2 * (n // 2)]
    if dtype == "bfloat16":
        from tinyknn.spec import numpy_dtype

        return x.astype(np.float32).astype(numpy_dtype("bfloat16"))
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "uint8", "float32"])
@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("kind", ["normal", "clustered", "duplicates"])
def test_screened_batches_are_exact(dtype, metric, kind, rng):
    n, dim = 30000, 72
    db = data(rng, kind, n, dim, dtype)
    queries = db[rng.choice(n, 150)].astype(np.float32)
    if dtype not in ("int8", "uint8"):
        queries = queries + rng.standard_normal(queries.shape).astype(np.float32) * 0.1
    index = searcher_index(db, metric, dtype, ids=rng.permutation(n))
    ids_of_rows = index._searcher.export()[1]
    for k in (1, 10, 100):
        d, i = index._searcher.search(queries, k)
        assert_exact(d, i, db, queries, k, metric, dtype, id_map=ids_of_rows)
    screen = index._searcher._screen
    print(f"{dtype} {metric} {kind}: {screen.queries} queries screened, {screen.fallbacks} handed back")
    assert screen.queries == 3 * len(queries)
    if kind == "normal":
        assert screen.fallbacks == 0
    index.close()


def test_far_data_falls_back_and_stays_exact(rng):
    """Rows far from the origin make the bound loose: survivors overflow, the other kernels answer."""
    db = (rng.standard_normal((20000, 32)) + 300.0).astype(np.float16)
    q = (rng.standard_normal((70, 32)) + 300.0).astype(np.float32)
    index = searcher_index(db, "ip", "float16")
    d, i = index._searcher.search(q, 10)
    assert_exact(d, i, db, q, 10, "ip", "float16")
    assert index._searcher._screen.queries == 70
    index.close()


def test_rows_added_after_a_screened_search_are_screened_too(rng):
    db = rng.standard_normal((40000, 64)).astype(np.float16)
    q = rng.standard_normal((64, 64)).astype(np.float32)
    index = searcher_index(db[:20000], "l2", "float16")
    index._searcher.search(q, 10)
    index._searcher.add(db[20000:], np.arange(20000, 40000))
    d, i = index._searcher.search(q, 10)
    assert_exact(d, i, db, q, 10, "l2", "float16")
    index._searcher.remove_rows(np.arange(0, 40000, 2))
    vectors, ids = index._searcher.export()
    d, i = index._searcher.search(q, 10)
    assert_exact(d, i, vectors, q, 10, "l2", "float16", id_map=ids)
    index.close()
