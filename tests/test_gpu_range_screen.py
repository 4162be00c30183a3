"""Range search through the tensor-core screen (gpu/range_screen.py): batches of 64 or more queries on an index
the screen applies to are screened with each query's radius as the threshold, the survivors decided in
float64; queries whose survivors overflow the capacity are screened again with room for all of them, and only
what the device refuses the memory for is answered by range_kernel; both counted. Every answer
is the float64 oracle's (tests/reference.py exact_range): offsets, distance bits and ids. On compute
capability 9.0 every case runs against both screens (TINYKNN_SCREEN=mma and wgmma)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import LARGER_IS_BETTER, contract_distances, exact_range, searched, stored
from test_gpu_screen import check_screen_used, data

pytestmark = pytest.mark.gpu
DTYPES = ("float32", "float16", "uint8", "int8")
N, DIM, QUERIES = 20_000, 72, 100


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    """Compile every spec this module launches, in parallel (NVRTC releases the GIL)."""
    import concurrent.futures
    import os

    from tinyknn.gpu.device import current_device
    from tinyknn.jit import render, render_screen, search_kernels
    from tinyknn.jit.cache import get_cubin

    arch = current_device().arch
    specs = {spec for metric in ("l2", "ip", "cosine") for dtype in DTYPES
             for spec in render_screen.specs_for_range_screen(metric, dtype, arch) +
             search_kernels.hopper_specs(metric, dtype, DIM, arch) +
             [render.range_spec(metric, dtype, DIM, arch)] + render.selection_specs(arch)}
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(get_cubin, sorted(specs)))


def build(db, metric, dtype, ids):
    index = tinyknn.Index(db.shape[1], metric, dtype, device="cuda")
    index.add(db, ids=ids)
    return index


def queries_for(rng, db, dtype, n=QUERIES):
    q = db[rng.choice(len(db), n)].astype(np.float32)
    if dtype not in ("int8", "uint8"):
        q = q + rng.standard_normal(q.shape).astype(np.float32) * 0.1
    return q


def radius_for_hits(dist: np.ndarray, hits: float, larger: bool) -> float:
    """A radius at which a query has about `hits` rows inside on average."""
    share = min(1.0, hits / dist.shape[1])
    return float(-np.quantile(-dist, share) if larger else np.quantile(dist, share))


def assert_exact_range(got, db, q, radius, metric, dtype, ids):
    want = exact_range(db, q, radius, metric, dtype, id_map=ids)
    lims, distances, got_ids = got
    assert lims.dtype == np.int64 and distances.dtype == np.float32 and got_ids.dtype == np.int64
    if not np.array_equal(lims, want[0]):
        bad = np.flatnonzero(np.diff(lims) != np.diff(want[0]))
        raise AssertionError(f"radius {radius!r}: {len(bad)} queries' hit counts differ from the oracle's; query "
                             f"{bad[0]}: got {np.diff(lims)[bad[0]]}, expected {np.diff(want[0])[bad[0]]}")
    np.testing.assert_array_equal(got_ids, want[2], err_msg=f"radius {radius!r}: ids")
    np.testing.assert_array_equal(distances.view(np.uint32), want[1].view(np.uint32),
                                  err_msg=f"radius {radius!r}: distance bits")
    return np.diff(lims)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_screened_range_search_is_exact_from_no_hits_to_thousands(metric, dtype, rng, screen,  # noqa: F811
                                                                   monkeypatch):
    """Radii for about 0, 3, 100 and 8,000 hits a query, a first screen with room for 4,096 survivors a query
    (SURVIVOR_BYTES set so; by default 100 queries on 20,000 rows have room for every row): the last radius
    is past that room for most queries, which are screened again with room for all their survivors, and
    counted; a query's hits are among its survivors, so every query with more hits than the room was
    screened again, none handed back to range_kernel."""
    from tinyknn.gpu import range_screen

    monkeypatch.setattr(range_screen, "SURVIVOR_BYTES", 4 * 4096 * QUERIES)
    assert range_screen.first_room(N, QUERIES) == 4096
    db = data(rng, "clustered", N, DIM, dtype)
    q = queries_for(rng, db, dtype)
    ids = rng.permutation(N) + 7
    dist = contract_distances(stored(db, dtype), searched(q), metric)
    larger = LARGER_IS_BETTER[metric]
    index = build(db, metric, dtype, ids)
    check_screen_used(index, screen)
    state = index._searcher._screen
    for hits in (0, 3, 100, 8000):
        radius = radius_for_hits(dist, hits, larger) if hits else float(dist.max() + 1 if larger else dist.min() / 2)
        before = (state.range_queries, state.range_fallbacks, state.range_rescreens)
        counts = assert_exact_range(index.range_search(q, radius), db, q, radius, metric, dtype, ids)
        screened = state.range_queries - before[0]
        handed_back = state.range_fallbacks - before[1]
        again = state.range_rescreens - before[2]
        print(f"{metric} {dtype} ~{hits} hits: mean {counts.mean():.1f}, max {counts.max()}; {screened} screened, "
              f"{again} screened again, {handed_back} handed back")
        assert screened == len(q)
        if hits == 0:
            assert counts.sum() == 0
        assert handed_back == 0
        assert again >= np.count_nonzero(counts > 4096)
        if hits == 8000:
            assert counts.max() > 4096
    index.close()


@pytest.mark.parametrize("metric,dtype", [("l2", "float32"), ("l2", "uint8"), ("ip", "float16"), ("cosine", "int8")])
def test_rows_exactly_at_the_radius_are_not_hits(metric, dtype, rng, screen):  # noqa: F811
    """Duplicated rows: the radius is the contract distance of one query to a duplicated row, so at least
    two rows lie exactly on it; neither is a hit (strictly inside), the rows inside are."""
    db = data(rng, "duplicates", N, DIM, dtype)
    q = queries_for(rng, db, dtype)
    dist = contract_distances(stored(db, dtype), searched(q), metric)
    larger = LARGER_IS_BETTER[metric]
    order = np.argsort(-dist[0] if larger else dist[0], kind="stable")
    tied = next(j for j in order[20:] if j < N // 2)      # a duplicated row (its copy at j + N // 2)
    radius = float(dist[0, tied])
    assert np.count_nonzero(dist[0] == radius) >= 2
    index = build(db, metric, dtype, np.arange(N))
    check_screen_used(index, screen)
    counts = assert_exact_range(index.range_search(q, radius), db, q, radius, metric, dtype, np.arange(N))
    inside = np.count_nonzero(dist[0] > radius if larger else dist[0] < radius)
    assert counts[0] == inside
    assert index._searcher._screen.range_queries == len(q)
    index.close()


def test_small_batches_and_filters_take_range_kernel(rng):
    """Fewer than 64 queries, or a filter: range_kernel alone (nothing screened), exact all the same."""
    db = data(rng, "normal", N, DIM, "float16")
    q = queries_for(rng, db, "float16", 80)
    dist = contract_distances(stored(db, "float16"), searched(q), "l2")
    radius = radius_for_hits(dist, 50, False)
    index = build(db, "l2", "float16", np.arange(N))
    assert_exact_range(index.range_search(q[:40], radius), db, q[:40], radius, "l2", "float16", np.arange(N))
    allowed = np.arange(0, N, 3)
    got = index.range_search(q, radius, filter=allowed)
    assert_exact_range(got, db[allowed], q, radius, "l2", "float16", allowed)
    assert index._searcher._screen.range_queries == 0
    assert_exact_range(index.range_search(q, radius), db, q, radius, "l2", "float16", np.arange(N))
    assert index._searcher._screen.range_queries == len(q)
    index.close()


def test_screened_range_search_under_a_device_cap(rng, monkeypatch):
    """Under a device-memory cap that leaves no room for the screen's survivor lists the batch is handed to
    range_kernel (counted), exact; with room for the screen's own lists but not a first screen's larger room
    the screen answers with its own; with room for all, with the larger room."""
    from tinyknn.config import reset_config
    from tinyknn.gpu import range_screen

    db = data(rng, "normal", N, DIM, "float32")
    q = queries_for(rng, db, "float32")
    dist = contract_distances(stored(db, "float32"), searched(q), "l2")
    radius = radius_for_hits(dist, 100, False)
    try:
        with build(db, "l2", "float32", np.arange(N)) as index:
            searcher = index._searcher
            searcher._screen._rows()            # the shadow and row terms, before the cap
            in_use = sum(b.nbytes for b in searcher._buffers.values() if hasattr(b, "fill_bytes"))
            monkeypatch.setenv("TINYKNN_DEVICE_MEMORY_LIMIT", str(in_use + (1 << 20)))   # < the 1.6 MB lists
            reset_config()
            assert_exact_range(index.range_search(q, radius), db, q, radius, "l2", "float32", np.arange(N))
            state = searcher._screen
            assert state.range_queries == len(q) and state.range_fallbacks == len(q)
            # room for the screen's own lists (1.6 MB), not for a first screen's larger room (every row: 8 MB)
            monkeypatch.setenv("TINYKNN_DEVICE_MEMORY_LIMIT", str(in_use + (6 << 20)))
            reset_config()
            assert range_screen.first_room(N, len(q)) == N
            assert_exact_range(index.range_search(q, radius), db, q, radius, "l2", "float32", np.arange(N))
            assert state.range_queries == 2 * len(q) and state.range_fallbacks == len(q)
            assert searcher._buffers["screen_survivors"].nbytes < len(q) * N * 4
            monkeypatch.setenv("TINYKNN_DEVICE_MEMORY_LIMIT", str(in_use + (256 << 20)))
            reset_config()
            assert_exact_range(index.range_search(q, radius), db, q, radius, "l2", "float32", np.arange(N))
            assert state.range_queries == 3 * len(q) and state.range_fallbacks == len(q)
            assert searcher._buffers["screen_survivors"].nbytes >= len(q) * N * 4
    finally:
        monkeypatch.delenv("TINYKNN_DEVICE_MEMORY_LIMIT", raising=False)
        reset_config()


def test_a_pool_too_small_grows_and_only_step_4_runs_again(rng, monkeypatch):
    """The screened hits overflow a 16-entry pool: step 4 runs again with room for all of them, exact."""
    from tinyknn.gpu import range_screen

    monkeypatch.setattr(range_screen, "POOL_FIRST", 16)
    monkeypatch.setattr(range_screen, "POOL_PER_QUERY", 0)
    db = data(rng, "clustered", N, DIM, "float16")
    q = queries_for(rng, db, "float16")
    dist = contract_distances(stored(db, "float16"), searched(q), "ip")
    radius = radius_for_hits(dist, 100, True)
    with build(db, "ip", "float16", np.arange(N)) as index:
        counts = assert_exact_range(index.range_search(q, radius), db, q, radius, "ip", "float16", np.arange(N))
        assert counts.sum() > 16 and index._searcher._screen.range_queries == len(q)


@pytest.mark.parametrize("staged", ["pinned", "beyond the pinned size", "pinned memory refused"])
def test_hits_come_back_through_pinned_staging_or_pageable_copies(staged, rng, monkeypatch):
    """The grouped hits come back in one copy into a kept pinned buffer, or (past STAGED_BYTES, or when the
    host refuses pinned memory) in two pageable copies, with the same exact answer; the pinned buffer is
    kept only in the first case."""
    from tinyknn.gpu import hit_pool

    if staged == "beyond the pinned size":
        monkeypatch.setattr(hit_pool, "STAGED_BYTES", 0)
    db = data(rng, "random", N, DIM, "float32")
    q = queries_for(rng, db, "float32")
    dist = contract_distances(stored(db, "float32"), searched(q), "l2")
    radius = radius_for_hits(dist, 50, False)
    with build(db, "l2", "float32", np.arange(N) * 3) as index:
        searcher = index._searcher
        if staged == "pinned memory refused":
            pinned = searcher._pinned

            def refused(name, nbytes):
                if name == "range_results":
                    raise MemoryError(f"no pinned memory for {name}")
                return pinned(name, nbytes)
            monkeypatch.setattr(searcher, "_pinned", refused)
        counts = assert_exact_range(index.range_search(q, radius), db, q, radius, "l2", "float32", np.arange(N) * 3)
        assert counts.sum() > len(q) and searcher._screen.range_queries == len(q)
        kept = searcher._buffers.get("range_results")
        assert (kept is not None and kept.nbytes >= counts.sum() * 12) == (staged == "pinned")


@pytest.mark.parametrize("metric,dtype", [("l2", "float32"), ("ip", "float16"), ("cosine", "uint8"), ("l2", "int8")])
def test_overflowed_queries_are_screened_again(metric, dtype, rng, screen, monkeypatch):  # noqa: F811
    """A first screen with room for 64 survivors a query (render_screen.SURVIVOR_CAPACITY, which range_screen
    reads at each call) at ~100 hits a query on clustered rows: the queries with more survivors are screened
    again in groups of at most 16 KB of survivor lists (several groups, some of one query), with room for
    all of them; none goes to range_kernel, and every answer is the oracle's, in CSR order."""
    from tinyknn.gpu import range_screen
    from tinyknn.jit import render_screen

    monkeypatch.setattr(render_screen, "SURVIVOR_CAPACITY", 64)
    monkeypatch.setattr(range_screen, "SURVIVOR_BYTES", 16 << 10)
    db = data(rng, "clustered", N, DIM, dtype)
    q = queries_for(rng, db, dtype)
    ids = rng.permutation(N) + 7
    dist = contract_distances(stored(db, dtype), searched(q), metric)
    larger = LARGER_IS_BETTER[metric]
    radius = radius_for_hits(dist, 100, larger)
    with build(db, metric, dtype, ids) as index:
        check_screen_used(index, screen)
        state = index._searcher._screen
        counts = assert_exact_range(index.range_search(q, radius), db, q, radius, metric, dtype, ids)
        print(f"{metric} {dtype}: hits mean {counts.mean():.1f}, max {counts.max()}; "
              f"{state.range_rescreens} screened again, {state.range_fallbacks} handed back")
        assert state.range_queries == len(q)
        assert state.range_fallbacks == 0
        assert state.range_rescreens >= np.count_nonzero(counts > 64) > 0
