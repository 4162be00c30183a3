"""The tensor-core path (gpu/screen.py): batches of 64 or more queries on l2/ip indexes stored as float16,
bfloat16, int8, uint8 or float32 (through a float16 shadow), and cosine indexes of any dtype (unit-row shadows),
are screened on the tensor cores and their
survivors verified in float64: every answer is the float64 oracle's, bit for bit, and a query the screen
cannot settle (survivors beyond the capacity) is answered by the other kernels and counted. On compute
capability 9.0 every case runs against both screens (TINYKNN_SCREEN=mma and wgmma)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact

pytestmark = pytest.mark.gpu
DTYPES = ("float16", "bfloat16", "int8", "uint8", "float32")
KS = (10, 100)


def check_screen_used(index, screen):
    assert index._searcher._screen.hopper is (screen == "wgmma")


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    """Compile every spec this module launches, in parallel (NVRTC releases the GIL)."""
    import concurrent.futures
    import os

    from tinyknn.gpu.device import current_device
    from tinyknn.jit import render_screen, search_kernels
    from tinyknn.jit.cache import get_cubin

    arch = current_device().arch
    specs = {spec for metric in ("l2", "ip", "cosine") for dtype in DTYPES for k in KS
             for spec in render_screen.specs_for_screen(metric, dtype, k, arch) +
             search_kernels.specs_for_search(metric, dtype, 72, k, arch) +
             search_kernels.hopper_specs(metric, dtype, 72, arch)}
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(get_cubin, sorted(specs)))


def searcher_index(db, metric, dtype, ids=None):
    index = tinyknn.Index(db.shape[1], metric, dtype, device="cuda")
    index._searcher.add(db, np.arange(len(db)) if ids is None else ids)
    return index


def near_rows(rng, db, count, dtype):
    """`count` rows of db as float32 queries, moved a little off the rows where the dtype has fractions."""
    queries = db[rng.choice(len(db), count)].astype(np.float32)
    if dtype not in ("int8", "uint8"):
        queries = queries + rng.standard_normal(queries.shape).astype(np.float32) * 0.1
    return queries


def data(rng, kind, n, dim, dtype):
    if dtype in ("int8", "uint8"):
        low, high = (-128, 128) if dtype == "int8" else (0, 256)
        x = rng.integers(low, high, (n, dim)).astype(dtype)
        if kind == "duplicates":
            x[: n // 2] = x[n // 2: 2 * (n // 2)]
        return x
    x = rng.standard_normal((n, dim))
    if kind == "near_ties":     # pairs one float32 step apart in one coordinate (16-bit types: exact ties)
        x[: n // 2] = x[n // 2: 2 * (n // 2)]
        x[: n // 2, 0] = np.nextafter(x[: n // 2, 0].astype(np.float32), np.float32(np.inf))
    if kind == "clustered":
        centres = rng.standard_normal((20, dim)) * 3
        x = centres[rng.integers(0, 20, n)] + x * 0.3
    if kind == "duplicates":
        x[: n // 2] = x[n // 2: 2 * (n // 2)]
    if dtype == "bfloat16":
        from tinyknn.spec import numpy_dtype

        return x.astype(np.float32).astype(numpy_dtype("bfloat16"))
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("kind", ["normal", "clustered", "duplicates", "near_ties"])
def test_screened_batches_are_exact(dtype, metric, kind, rng, screen):
    n, dim = 20000, 72
    db = data(rng, kind, n, dim, dtype)
    queries = near_rows(rng, db, 100, dtype)
    index = searcher_index(db, metric, dtype, ids=rng.permutation(n))
    check_screen_used(index, screen)
    ids_of_rows = index._searcher.export()[1]
    for k in KS:
        d, i = index._searcher.search(queries, k)
        assert_exact(d, i, db, queries, k, metric, dtype, id_map=ids_of_rows)
    screen = index._searcher._screen
    print(f"{dtype} {metric} {kind}: {screen.queries} queries screened, {screen.fallbacks} handed back")
    assert screen.queries == len(KS) * len(queries)
    if kind == "normal":
        assert screen.fallbacks == 0
    index.close()


def test_the_survivors_room_is_one_number_for_the_screen_and_the_verify(rng, screen, monkeypatch):
    """The screen writes each query's survivors with the room the verify kernel reads them with, both taken
    from render_screen.SURVIVOR_CAPACITY when the search runs, never from a value kept earlier: here 64 (a
    range-search test sets it so), under which every query at k = 100 overflows and is handed back, and the
    answers stay exact at both k. (A room bound when gpu/screen.py was first imported once made the screen
    write 64 a query while the verify read 4,096: an illegal address, seen only after that test.)"""
    from tinyknn.jit import render_screen

    db = data(rng, "clustered", 20000, 72, "float32")
    queries = near_rows(rng, db, 100, "float32")
    index = searcher_index(db, "l2", "float32")
    check_screen_used(index, screen)
    room = render_screen.SURVIVOR_CAPACITY
    monkeypatch.setattr(render_screen, "SURVIVOR_CAPACITY", 64)
    state = index._searcher._screen
    for k in KS:
        before = state.fallbacks
        d, i = index._searcher.search(queries, k)
        assert_exact(d, i, db, queries, k, "l2", "float32")
        if k > 64:
            assert state.fallbacks - before == len(queries)
    monkeypatch.setattr(render_screen, "SURVIVOR_CAPACITY", room)   # its own room again: the same answers
    d, i = index._searcher.search(queries, 10)
    assert_exact(d, i, db, queries, 10, "l2", "float32")
    assert state.queries == (len(KS) + 1) * len(queries)
    index.close()


def stored_by_cluster(rng, n, dim, dtype):
    """Rows of 40 clusters stored cluster by cluster, each row twice (the copies side by side)."""
    labels = np.sort(rng.integers(0, 40, n // 2))
    if dtype == "uint8":
        centres = rng.integers(16, 240, (40, dim))
        half = np.clip(centres[labels] + rng.integers(-12, 13, (n // 2, dim)), 0, 255)
    else:
        half = rng.standard_normal((40, dim))[labels] * 3 + rng.standard_normal((n // 2, dim)) * 0.3
    return np.repeat(half, 2, axis=0).astype(dtype)


def test_the_verify_step_in_two_launches_answers_every_query_once(rng, screen, monkeypatch):
    """The verify step's first launch takes the queries with at most SURVIVOR_FEW survivors, the second the
    rest (and marks the overflowed). With one launch (0), then with SURVIVOR_FEW between the fewest and the
    most survivors of the batch (queries on both sides of it): the same exact answers, no query handed back."""
    from tinyknn.jit import render_screen

    k = 2
    db = data(rng, "clustered", 20000, 72, "float16")
    queries = near_rows(rng, db, 100, "float16")
    index = searcher_index(db, "l2", "float16")
    check_screen_used(index, screen)
    state = index._searcher._screen
    monkeypatch.setattr(render_screen, "SURVIVOR_FEW", 0)
    assert len(render_screen.survivor_specs("l2", "float16", k, "sm_90")) == 1
    whole = index._searcher.search(queries, k)
    assert_exact(*whole, db, queries, k, "l2", "float16")
    counts = np.zeros(len(queries), np.int32)
    index._searcher._buffers["screen_counts"].copy_to_host(counts, counts.nbytes)
    splits = [1 << b for b in range(3, 12) if counts.min() <= 1 << b < counts.max()]
    assert splits, f"survivors {counts.min()}-{counts.max()}: no power of two between"
    monkeypatch.setattr(render_screen, "SURVIVOR_FEW", splits[0])
    assert len(render_screen.survivor_specs("l2", "float16", k, "sm_90")) == 2
    d, i = index._searcher.search(queries, k)
    assert_exact(d, i, db, queries, k, "l2", "float16")
    assert np.array_equal(i, whole[1]) and np.array_equal(d.view(np.uint32), whole[0].view(np.uint32))
    assert state.fallbacks == 0
    index.close()


@pytest.mark.parametrize("n", [280_000, 100_000])
@pytest.mark.parametrize("metric,dtype", [("l2", "float16"), ("ip", "uint8"), ("cosine", "float32")])
def test_large_k_on_rows_stored_by_cluster(metric, dtype, n, rng, screen):
    """k = 100 and 128 on 280,000 rows (a sample of >= k tiles at step 8: two bounds a tile) and on 100,000 (98
    tiles: four a tile), each fewer bounds than k (render_screen.threshold_keep); the interleaved tiles spread a
    cluster's rows, so T stays tight and no query overflows the survivors' capacity (where the bound's band is
    narrow)."""
    from tinyknn.gpu.screen import sample_step
    from tinyknn.jit import render_screen

    dim = 40
    db = stored_by_cluster(rng, n, dim, dtype)
    queries = db[rng.choice(n, 100)].astype(np.float32)
    if dtype != "uint8":
        queries = queries + rng.standard_normal(queries.shape).astype(np.float32) * 0.1
    index = searcher_index(db, metric, dtype)
    check_screen_used(index, screen)
    for k in (100, 128):
        n_sample = -(-n // sample_step(n, k))
        sample_tiles = -(-n_sample // render_screen.SCREEN_BN)
        assert render_screen.threshold_keep(k, sample_tiles) < k
        d, i = index._searcher.search(queries, k)
        assert_exact(d, i, db, queries, k, metric, dtype)
    screen_state = index._searcher._screen
    print(f"{dtype} {metric}: {screen_state.fallbacks} of {screen_state.queries} queries handed back")
    assert screen_state.queries == 2 * len(queries)
    if metric != "cosine":      # a narrow band (uint8: none); cosine's 16-bit band is wide against clustered angles
        assert screen_state.fallbacks == 0
    index.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("kind", ["normal", "stored_by_cluster", "near_ties", "far"])
def test_hopper_threshold_mode_is_exact(dtype, metric, kind, rng, screen):
    """The Hopper screen's threshold mode (one or two bounds per tile of a sample of whole tiles, k = 1 and 10):
    60,000 rows give the sample enough tiles; rows stored cluster by cluster (the tiles' interleave), pairs one
    float32 step apart, rows far from the origin (a loose bound: handed back, counted); answers exact."""
    if screen != "wgmma":
        pytest.skip("the threshold mode of the Hopper screen")
    n, dim = 60000, 40
    if kind == "stored_by_cluster":
        from tinyknn.spec import numpy_dtype

        db = stored_by_cluster(rng, n, dim, "uint8" if dtype in ("int8", "uint8") else "float32")
        db = (db.astype(np.int16) - 128).astype(np.int8) if dtype == "int8" else db.astype(numpy_dtype(dtype))
    elif kind == "far":
        db = data(rng, "normal", n, dim, dtype)
        if dtype not in ("int8", "uint8"):
            db = (db.astype(np.float32) + 300.0).astype(db.dtype)
    else:
        db = data(rng, kind, n, dim, dtype)
    queries = near_rows(rng, db, 130, dtype)
    index = searcher_index(db, metric, dtype, ids=rng.permutation(n))
    check_screen_used(index, screen)
    ids_of_rows = index._searcher.export()[1]
    for k in (1, 10):
        d, i = index._searcher.search(queries, k)
        assert_exact(d, i, db, queries, k, metric, dtype, id_map=ids_of_rows)
    state = index._searcher._screen
    assert state.hopper_thresholds == 2 and state.queries == 2 * len(queries)
    if kind == "normal":
        assert state.fallbacks == 0
    index.close()


@pytest.mark.parametrize("metric,dtype", [("l2", "float16"), ("l2", "uint8"), ("cosine", "float32")])
def test_hopper_threshold_beside_the_mma_screen_is_exact(metric, dtype, rng, monkeypatch):
    """THRESHOLD_ON_HOPPER = "always": a batch too small for the Hopper screen (100 queries) still takes its
    threshold from the Hopper threshold mode, its screen from mma.sync, both under the larger error count."""
    from tinyknn.gpu import screen as screen_module
    from tinyknn.gpu.device import current_device
    from tinyknn.jit import render_screen

    if render_screen.hopper_arch(current_device().arch) is None:
        pytest.skip(f"the Hopper threshold mode needs compute capability 9.0; this device is {current_device().arch}")
    monkeypatch.setattr(screen_module, "THRESHOLD_ON_HOPPER", "always")
    n, dim = 60000, 40
    db = data(rng, "clustered", n, dim, dtype)
    queries = near_rows(rng, db, 100, dtype)
    index = searcher_index(db, metric, dtype)
    state = index._searcher._screen
    assert state.hopper and not state._hopper_for(len(queries))
    for k in (1, 10):
        d, i = index._searcher.search(queries, k)
        assert_exact(d, i, db, queries, k, metric, dtype)
    assert state.hopper_thresholds == 2 and state.queries == 2 * len(queries)
    index.close()


def test_far_data_falls_back_and_stays_exact(rng, screen):
    """Rows far from the origin make the bound loose: survivors overflow, the other kernels answer."""
    db = (rng.standard_normal((20000, 72)) + 300.0).astype(np.float16)
    q = (rng.standard_normal((70, 72)) + 300.0).astype(np.float32)
    index = searcher_index(db, "ip", "float16")
    check_screen_used(index, screen)
    d, i = index._searcher.search(q, 10)
    assert_exact(d, i, db, q, 10, "ip", "float16")
    assert index._searcher._screen.queries == 70
    index.close()


def test_rows_added_after_a_screened_search_are_screened_too(rng, screen):
    db = rng.standard_normal((40000, 72)).astype(np.float16)
    q = rng.standard_normal((64, 72)).astype(np.float32)
    index = searcher_index(db[:20000], "l2", "float16")
    check_screen_used(index, screen)
    index._searcher.search(q, 10)
    index._searcher.add(db[20000:], np.arange(20000, 40000))
    d, i = index._searcher.search(q, 10)
    assert_exact(d, i, db, q, 10, "l2", "float16")
    index._searcher.remove_rows(np.arange(0, 40000, 2))
    vectors, ids = index._searcher.export()
    d, i = index._searcher.search(q, 10)
    assert_exact(d, i, vectors, q, 10, "l2", "float16", id_map=ids)
    index.close()


@pytest.mark.parametrize("metric,dtype", [("l2", "float16"), ("ip", "uint8"), ("l2", "int8"), ("cosine", "float32")])
def test_long_rows_and_several_query_tiles_are_exact(metric, dtype, rng, screen):
    """dim 300: more 128-byte k-blocks than the Hopper ring's 4 stages (16-bit), the rounding-up 8-bit
    conversion (uint8 stride 304: 65025 x 304 >= 2^24); 600 queries: several query tiles and a partial one."""
    n, dim = 30000, 300
    db = data(rng, "clustered", n, dim, dtype)
    queries = near_rows(rng, db, 600, dtype)
    index = searcher_index(db, metric, dtype)
    check_screen_used(index, screen)
    for k in KS:
        d, i = index._searcher.search(queries, k)
        assert_exact(d, i, db, queries, k, metric, dtype)
    assert index._searcher._screen.queries == len(KS) * len(queries)
    index.close()


def test_packed_launches_are_rewritten_for_each_batch(rng, screen):
    """Each step's launch is packed once per searcher (GpuSearcher._packed) and its values rewritten for
    every batch: batches of other sizes and k in turn on one index stay exact, and no new launch is packed
    once every (step, k) has been seen."""
    db = data(rng, "clustered", 30000, 72, "float16")
    index = searcher_index(db, "l2", "float16")
    check_screen_used(index, screen)
    batches = [near_rows(rng, db, count, "float16") for count in (64, 300, 129)]
    for round_ in range(2):
        for queries in batches:
            for k in KS:
                d, i = index._searcher.search(queries, k)
                assert_exact(d, i, db, queries, k, "l2", "float16")
        if round_ == 0:
            packed = dict(index._searcher._launches)
    assert index._searcher._launches.keys() == packed.keys()
    assert all(index._searcher._launches[spec][1] is launch for spec, (_, launch) in packed.items())
    index.close()


def test_tile_bounds_cover_every_row(rng, screen):
    """tile_rmax: one float per tile of the Hopper screen, the largest r_x of its rows (after an add too), for
    the large tile's rows and the small tile's (16-bit: 128 and 256 rows)."""
    if screen != "wgmma":
        pytest.skip("tile_rmax belongs to the Hopper screen")
    db = (rng.standard_normal((33000, 72)) * rng.uniform(0.1, 10, (33000, 1))).astype(np.float16)
    index = searcher_index(db[:20000], "l2", "float16")
    searcher = index._searcher
    for n in (20000, 33000):
        if n > 20000:
            searcher.add(db[20000:], np.arange(20000, n))
        searcher.search(rng.standard_normal((64, 72)).astype(np.float32), 10)
        screen_state = searcher._screen
        assert screen_state._tile_rows_all() == [128, 256]
        for rows in screen_state._tile_rows_all():
            tiles = -(-n // rows)
            r_x, rmax = np.zeros(n, np.float32), np.zeros(tiles, np.float32)
            searcher._buffers["screen_rx"].copy_to_host(r_x, n * 4, searcher._stream)
            searcher._buffers[screen_state._rmax_name(rows)].copy_to_host(rmax, tiles * 4, searcher._stream)
            searcher._stream.synchronize()
            expected = np.array([r_x[t * rows:(t + 1) * rows].max() for t in range(tiles)], np.float32)
            np.testing.assert_array_equal(rmax, expected)
    index.close()


def test_the_query_tiles_buffer_holds_whole_tiles(rng, screen):
    """screen_q is sized in whole 256-query tiles, so that no TMA query box reaches past its allocation (the
    Hopper screen ran 2.6x slower where one did, next to screen_counts: bench/NOTES_SCREEN.md)."""
    db = data(rng, "normal", 20000, 72, "float16")
    index = searcher_index(db, "l2", "float16")
    check_screen_used(index, screen)
    queries = near_rows(rng, db, 100, "float16")
    d, i = index._searcher.search(queries, 10)
    assert_exact(d, i, db, queries, 10, "l2", "float16")
    state = index._searcher._screen
    assert index._searcher._buffers["screen_q"].nbytes >= 256 * state.row_bytes
    index.close()


@pytest.mark.parametrize("metric,dtype", [("l2", "float32"), ("ip", "float16"), ("cosine", "uint8"), ("l2", "uint8"),
                                          ("ip", "bfloat16")])
def test_a_label_run_is_screened_in_place(metric, dtype, rng, screen, monkeypatch):
    """screen.SCREEN_RUNS: once the label order keeps each label's rows together, a label's batch is screened
    over its run of rows in place (mma.sync's screen: the Hopper one's tile bounds start at row 0), the row
    terms, ids and rows read from the run's first row; answers exact at k = 1, 10 and 100 for runs that start
    at row 0 and further in."""
    from tinyknn.gpu import screen as screen_module

    monkeypatch.setattr(screen_module, "SCREEN_RUNS", True)
    n, dim = 60000, 72
    db = data(rng, "clustered", n, dim, dtype)
    labels = rng.integers(0, 4, n)
    index = tinyknn.Index(dim, metric, dtype, device="cuda")
    index.add(db, labels=labels)
    with index._add_lock, index._view:
        index._layout.reorder(index._searcher, index._ids, index._labels)
    state = index._searcher._screen
    for label in (0, 2, 3):
        run = index._labels.rows_of(label)
        assert run[-1] - run[0] == len(run) - 1 and len(run) >= screen_module.SCREEN_RUN_MIN_ROWS
        allowed = np.flatnonzero(labels == label)
        queries = near_rows(rng, db[allowed], 300, dtype)
        for k in (1, 10, 100):
            before, handed_back = state.queries, state.fallbacks
            d, i = index.search(queries, k, labels=np.full(len(queries), label))
            assert state.queries == before + len(queries)                  # screened
            assert state.fallbacks - handed_back < len(queries) // 10      # and answered by the screen
            assert_exact(d, i, db[allowed], queries, k, metric, dtype, id_map=allowed)
        with index._searcher._reading(run):
            assert index._searcher._view.prefix == "run" and state._hopper_for(300) is None   # mma.sync's
    index.close()
