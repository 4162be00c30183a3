"""The host-memory tier (Index(..., device="cuda", storage="host"), tinyknn/gpu/host_tier.py).

Without a GPU: the tier's own logic (chunks, filters gathered, the k + 1 widening, the exact merge, range
hits, removals) with stand-in chunk workers (tests/model_searcher.py, exact by construction) on data full of
float64 ties (duplicates) and float32-only ties (rows whose float64 distances differ below float32's
resolution), against the float64 oracle bit for bit. On the GPU (marked gpu): real chunk workers under a
device-memory cap a quarter of the database, against an ordinary device="cuda" Index and the oracle.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import tinyknn
from model_searcher import ModelSearcher, use_model
from reference import assert_exact, exact_search
from tinyknn.config import reset_config
from tinyknn.gpu.host_merge import contract_keys
from tinyknn.gpu.host_rows import plain_memory
from tinyknn.gpu.host_tier import HostTierSearcher

METRICS = ("l2", "ip", "cosine")


def model_tier(dim: int, metric: str, dtype: str, chunk_rows: int) -> HostTierSearcher:
    """A tier whose chunk workers are stand-in searchers in plain memory: no GPU needed."""
    return HostTierSearcher(dim, metric, dtype, chunk_rows=chunk_rows, allocate=plain_memory,
                            make_worker=lambda: ModelSearcher(dim, metric, dtype))


def assert_same(a, b) -> None:
    """Nested tuples of arrays equal element for element, dtypes included."""
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), (a, b)


def tied_data(rng, n_base: int, dim: int, n_queries: int):
    """Rows: a base, its exact duplicates, and copies with coordinates 0 and 1 swapped; queries whose first two
    coordinates differ by 2**-22 .. 2**-16, so a row and its swapped copy are near-ties (often equal in
    float32, never in float64). Values are multiples of 1/4: exact in every float dtype."""
    base = rng.integers(-8, 9, size=(n_base, dim)) / 4.0
    swapped = base.copy()
    swapped[:, [0, 1]] = base[:, [1, 0]]
    db = np.concatenate([base, base, swapped])[rng.permutation(3 * n_base)].astype(np.float32)
    q = (rng.integers(-8, 9, size=(n_queries, dim)) / 4.0).astype(np.float32)
    q[:, 1] = q[:, 0] + np.float32(2.0) ** -rng.choice([22, 19, 16], size=n_queries).astype(np.float32)
    ids = rng.permutation(10 * len(db))[:len(db)].astype(np.int64)     # ties go to the smaller user id
    return db, q, ids


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_chunked_answers_merge_exactly(metric, dtype, rng):
    db, q, ids = tied_data(rng, 200, 6, 25)
    stored = db.astype(dtype)
    tier = model_tier(6, metric, dtype, chunk_rows=37)
    tier.add(stored, ids)
    for k in (1, 4, 30, 700):                      # 700: more than the 600 rows
        distances, found = tier.search(q, k)
        assert_exact(distances, found, stored, q, k, metric, dtype, id_map=ids)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_contract_keys_are_the_oracles_bit_for_bit(metric, dtype, rng):
    """The merge's float64 distances are the contract's (reference.contract_distances), zero vectors included."""
    from reference import LARGER_IS_BETTER, contract_distances, searched, stored
    from tinyknn.spec import numpy_dtype

    raw = rng.integers(-100, 101, size=(40, 13)) if dtype == "int8" else rng.standard_normal((40, 13)) * 30
    rows = raw.astype(np.float32).astype(numpy_dtype(dtype))
    rows[3] = 0
    q = rng.standard_normal((40, 13)).astype(np.float32)
    q[5] = 0
    want = np.diagonal(contract_distances(stored(rows, dtype), searched(q), metric))
    got = contract_keys(q, rows, metric)
    expected = -want if LARGER_IS_BETTER[metric] else want
    assert np.array_equal(got.view(np.uint64) & ~np.uint64(1 << 63), expected.view(np.uint64) & ~np.uint64(1 << 63))
    assert np.array_equal(got, expected)


def test_the_data_really_has_float32_only_ties(rng):
    """The near-ties the merge must settle in float64 are there (else the test above proves less)."""
    db, q, _ = tied_data(rng, 200, 6, 25)
    keys = np.stack([contract_keys(np.repeat(q[i:i + 1], len(db), 0), db, "l2") for i in range(len(q))])
    k32 = keys.astype(np.float32)
    same32 = (k32[:, :, None] == k32[:, None, :]) & (keys[:, :, None] != keys[:, None, :])
    assert same32.any()


@pytest.mark.parametrize("metric", METRICS)
def test_filters_gathered_or_contiguous(metric, rng):
    db, q, ids = tied_data(rng, 150, 5, 12)
    tier = model_tier(5, metric, "float32", chunk_rows=29)
    tier.add(db, ids)
    scattered = np.sort(rng.choice(len(db), 97, replace=False)).astype(np.int64)
    run = np.arange(40, 120, dtype=np.int64)
    for rows in (scattered, run, np.empty(0, dtype=np.int64)):
        distances, found = tier.search(q, 9, rows)
        assert_exact(distances, found, db[rows], q, 9, metric, id_map=ids[rows])


@pytest.mark.parametrize("metric", METRICS)
def test_range_search_is_the_models(metric, rng):
    db, q, ids = tied_data(rng, 120, 4, 10)
    tier = model_tier(4, metric, "float32", chunk_rows=31)
    tier.add(db, ids)
    model = ModelSearcher(4, metric, "float32")
    model.add(db, ids)
    radius = float(np.median(exact_search(db, q, 40, metric, id_map=ids)[0]))
    rows = np.sort(rng.choice(len(db), 200, replace=False)).astype(np.int64)
    for chosen in (None, rows):
        got, want = tier.range_search(q, radius, chosen), model.range_search(q, radius, chosen)
        assert int(got[0][-1]) > 0
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_remove_get_truncate_export_reset(rng):
    db, q, ids = tied_data(rng, 100, 4, 6)
    tier = model_tier(4, "l2", "float32", chunk_rows=23)
    tier.add(db, ids)
    gone = np.array([0, 5, 17, 250, 299], dtype=np.int64)
    moved_from, moved_to = tier.remove_rows(gone)
    keep = np.setdiff1d(np.arange(300), gone)
    assert tier.ntotal == 295 and set(moved_to.tolist()) == {0, 5, 17, 250}
    rows, row_ids = tier.export()
    assert sorted(row_ids.tolist()) == sorted(ids[keep].tolist())
    assert np.array_equal(tier.get_rows(np.array([3, 0])), rows[[3, 0]])
    assert_exact(*tier.search(q, 7), rows, q, 7, "l2", id_map=row_ids)
    tier.truncate(100)
    assert_exact(*tier.search(q, 7), rows[:100], q, 7, "l2", id_map=row_ids[:100])
    with pytest.raises(ValueError, match="between 0 and 100"):
        tier.truncate(101)
    tier.reset()
    distances, found = tier.search(q, 3)
    assert np.all(found == -1) and np.all(distances == np.inf)
    tier.close()
    with pytest.raises(ValueError, match="closed"):
        tier.search(q, 3)


def test_an_index_over_the_tier_answers_as_over_the_model(monkeypatch, rng):
    """Labels, filters, removals and persistence through Index: the tier (stand-in workers) == the model."""
    db, q, ids = tied_data(rng, 100, 6, 9)
    labels = rng.integers(0, 3, size=len(db))
    allowed = ids[rng.permutation(len(ids))[:150]]
    query_labels = rng.integers(0, 3, size=len(q))
    answers = []
    for kind in ("model", "tier"):
        if kind == "model":
            use_model(monkeypatch)
        else:
            monkeypatch.setattr(tinyknn.index.index, "_make_searcher",
                                lambda device, dim, metric, dtype: model_tier(dim, metric, dtype, chunk_rows=41))
        index = tinyknn.Index(6, "cosine", device="cpu")
        index.add(db, ids=ids, labels=labels)
        index.remove(ids[::7])
        answers.append((index.search(q, 8), index.search(q, 8, filter=allowed),
                        index.search(q, 8, labels=query_labels),
                        index.range_search(q, 0.5, filter=allowed), index.get(ids[1:4])))
        again = pickle.loads(pickle.dumps(index))
        answers[-1] += (again.search(q, 5),)
    assert_same(*answers)


def test_storage_is_checked(monkeypatch):
    use_model(monkeypatch)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        tinyknn.Index(8, device="cpu", storage="host")
    with pytest.raises(ValueError, match="storage must be one of 'device', 'host'; got 'disk'"):
        tinyknn.Index(8, device="cpu", storage="disk")
    assert tinyknn.Index(8, device="cpu", storage="DEVICE").storage == "device"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_bench_fill_writes_finite_values_in_place(dtype):
    """bench/host_tier.py's in-place random fill: +-[1, 2), both signs, every row written, threads agree."""
    import importlib.util
    from pathlib import Path

    from tinyknn.spec import numpy_dtype

    path = Path(__file__).resolve().parent.parent / "bench" / "host_tier.py"
    spec = importlib.util.spec_from_file_location("tinyknn_bench_host_tier", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = np.zeros((3000, 24), dtype=numpy_dtype(dtype))
    saved, bench.FILL_ROWS_BYTES = bench.FILL_ROWS_BYTES, 4096      # many tasks
    try:
        bench.fill_random(rows, 5, dtype, threads=3)
        again = np.zeros_like(rows)
        bench.fill_random(again, 5, dtype, threads=1)
    finally:
        bench.FILL_ROWS_BYTES = saved
    values = np.abs(rows.astype(np.float64))
    assert np.all((values >= 1.0) & (values < 2.0)) and (rows.astype(np.float64) < 0).mean() > 0.4
    assert np.array_equal(rows.view(np.uint8), again.view(np.uint8))


# -- on the GPU ----------------------------------------------------------------------------------------
CAP = 1 << 20          # the device-memory cap of the GPU tests; their databases are 4x this


@pytest.fixture
def device_cap(monkeypatch):
    def set_cap(nbytes: int | None):
        if nbytes is None:
            monkeypatch.delenv("TINYKNN_DEVICE_MEMORY_LIMIT", raising=False)
        else:
            monkeypatch.setenv("TINYKNN_DEVICE_MEMORY_LIMIT", str(nbytes))
        reset_config()
    yield set_cap
    monkeypatch.delenv("TINYKNN_DEVICE_MEMORY_LIMIT", raising=False)
    reset_config()


def first(answer, k: int):
    """The first k columns of a search answer (the contract's order makes it the answer for k)."""
    return np.ascontiguousarray(answer[0][:, :k]), np.ascontiguousarray(answer[1][:, :k])


def _database(rng, dtype: str, dim: int = 16):
    """4x CAP of stored rows, random, with a block of exact duplicates (float64 ties across chunks)."""
    n = 4 * CAP // (dim * np.dtype(dtype).itemsize)
    db = rng.standard_normal((n, dim)).astype(np.float32)
    db[-500:] = db[:500]
    return db, rng.standard_normal((12, dim)).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_tier_equals_a_device_index_and_the_oracle(metric, dtype, device_cap, rng):
    db, q = _database(rng, dtype)
    with tinyknn.Index(16, metric, dtype, device="cuda") as plain:        # no cap: it holds all of it
        plain.add(db)
        want = first(plain.search(q, 11), 10)     # k = 11: the kernels the tier's workers use (k + 1)
    device_cap(CAP)
    with tinyknn.Index(16, metric, dtype, device="cuda", storage="host") as index:
        index.add(db)
        assert index._searcher.chunk_rows() * 4 < len(db)                 # many chunks, really streamed
        got = index.search(q, 10)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert_exact(*got, db, q, 10, metric, dtype)


@pytest.mark.gpu
def test_gpu_tier_index_operations(device_cap, rng):
    """Filter, labels, removal, range search and k beyond 2,048 through the tier, under the cap."""
    db, q = _database(rng, "float32")
    labels = rng.integers(0, 4, size=len(db))
    ids = rng.permutation(len(db)).astype(np.int64) * 3
    allowed = ids[rng.permutation(len(ids))[:len(ids) // 5]]
    query_labels = rng.integers(0, 4, size=len(q))
    answers = []
    for storage in ("device", "host"):
        device_cap(None if storage == "device" else CAP)
        with tinyknn.Index(16, "l2", device="cuda", storage=storage) as index:
            index.add(db, ids=ids, labels=labels)
            index.remove(ids[:2000:3])
            k = 10 if storage == "host" else 11       # the device index: the tier workers' kernels (k + 1)
            answers.append((first(index.search(q, k, filter=allowed), 10),
                            first(index.search(q, k, labels=query_labels), 10),
                            index.search(q, 2100), index.range_search(q, 9.0, filter=allowed),
                            index.get(ids[2001:2005])))
    assert_same(*answers)
    live = np.setdiff1d(np.arange(len(db)), np.arange(0, 2000, 3))
    assert_exact(*answers[1][2], db[live], q, 2100, "l2", id_map=ids[live])


@pytest.mark.gpu
def test_gpu_add_beyond_the_cap(device_cap, rng):
    """A device index 4x the cap cannot be built (MemoryError); with storage='host' it can, and grows."""
    db, q = _database(rng, "float16")
    device_cap(CAP)
    with tinyknn.Index(16, "ip", "float16", device="cuda") as plain:
        with pytest.raises(MemoryError, match="TINYKNN_DEVICE_MEMORY_LIMIT allows 1,048,576"):
            plain.add(db)
    with tinyknn.Index(16, "ip", "float16", device="cuda", storage="host") as index:
        index.add(db[:1000])
        index.add(db[1000:])
        assert index.ntotal == len(db)
        assert_exact(*index.search(q, 5), db, q, 5, "ip", "float16")
        copy = pickle.loads(pickle.dumps(index))
        assert copy.storage == "host"
        assert_exact(*copy.search(q, 5), db, q, 5, "ip", "float16")
        copy.close()


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_gpu_tier_chunks_big_enough_for_the_screen(metric, rng):
    """Chunks of 20,000 rows and 64 queries: the workers take the tensor-core screen (16,384 rows and up)."""
    db = rng.standard_normal((60_000, 16)).astype(np.float16)
    q = rng.standard_normal((64, 16)).astype(np.float32)
    tier = HostTierSearcher(16, metric, "float16", chunk_rows=20_000)
    try:
        tier.add(db, np.arange(len(db), dtype=np.int64))
        assert_exact(*tier.search(q, 10), db, q, 10, metric, "float16")
        assert sum(slot.worker._screen.queries for slot in tier._slots) > 0
    finally:
        tier.close()


@pytest.mark.gpu
def test_gpu_tier_searched_from_a_thread_without_a_context(device_cap, rng):
    """The tier makes the CUDA context current on its own threads and on the caller's."""
    import threading

    db, q = _database(rng, "float32")
    device_cap(CAP)
    with tinyknn.Index(16, "l2", device="cuda", storage="host") as index:
        index.add(db)
        here = index.search(q, 10)
        there = []
        thread = threading.Thread(target=lambda: there.append(index.search(q, 10)))
        thread.start()
        thread.join()
        assert len(there) == 1 and np.array_equal(there[0][1], here[1]) and np.array_equal(there[0][0], here[0])
        assert_exact(*here, db, q, 10, "l2")
