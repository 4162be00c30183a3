"""tinyknn.dask.DaskIndex on a real local Dask cluster (two worker processes): every answer equals one
tinyknn.Index holding the same rows, ids and distances bit for bit, for every metric, with filters, labels
and removals, dask.array input, save/load, bad input (Index's messages, no shard changed) and a worker
killed mid-test (a clear error naming the shard, then the shard reloads from its file). The exact merge
itself (tinyknn.index.merge) is also checked without a cluster, shards being local Index objects, on
adversarial ties (hypothesis)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyknn
from tinyknn.index import merge as _dask_merge
from reference import assert_exact, contract_distances, searched, stored

distributed = pytest.importorskip("distributed")
da = pytest.importorskip("dask.array")
from tinyknn.dask import DaskIndex, ShardUnavailable  # noqa: E402 - after the skip

METRICS = ("l2", "ip", "cosine")


@pytest.fixture(scope="module")
def client():
    tinyknn.Index(4).close()            # the CPU library built (or found) once, before the workers look for it
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                       env={"TINYKNN_CPU_THREADS": "1"})
    client = distributed.Client(cluster)
    yield client
    client.close()
    cluster.close()


@pytest.fixture(scope="module")
def seed():
    base = int(os.environ.get("TINYKNN_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))
    print(f"random seed: TINYKNN_TEST_SEED={base}")
    return base


def same(got, want) -> None:
    """Search answers equal bit for bit (ids, and the distances' bits)."""
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        bits = {4: np.uint32, 8: np.uint64}[g.dtype.itemsize]
        np.testing.assert_array_equal(g.view(bits), w.view(bits))


def refusal(call) -> tuple[type, str]:
    """The ValueError or TypeError call() raises, as (type, message)."""
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    return type(caught.value), str(caught.value)


def pair(client, dim, metric="l2", n_shards=4, dtype="float32"):
    return DaskIndex(client, dim, metric=metric, dtype=dtype, n_shards=n_shards), tinyknn.Index(dim, metric, dtype)


def add_both(both, x, **kwargs) -> None:
    for index in both:
        index.add(x, **kwargs)


# -- 200k x 64 in 4 shards, every metric ------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_200k_in_4_shards_equals_one_index(client, seed, metric):
    rng = np.random.default_rng(seed)
    n, dim = 200_000, 64
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x[1000:1100] = x[:100]                                   # duplicated rows (another shard)
    row_labels = rng.integers(0, 8, n)
    q = np.concatenate([rng.standard_normal((40, dim), dtype=np.float32), x[:8]])
    sharded, one = pair(client, dim, metric)
    add_both((sharded, one), x, labels=row_labels)
    assert sharded.ntotal == n and sharded.shard_sizes == [n // 4] * 4
    allowed = rng.choice(n, n // 10, replace=False)
    query_labels = rng.integers(0, 8, len(q))
    for kwargs in ({}, {"filter": allowed}, {"labels": query_labels}, {"filter": allowed, "labels": query_labels}):
        same(sharded.search(q, 10, **kwargs), one.search(q, 10, **kwargs))
    d, _ = one.search(q[:5], 20)
    radius = float(np.median(d[:, -1]))
    same(sharded.range_search(q[:5], radius), one.range_search(q[:5], radius))
    same(sharded.range_search(q[:5], radius, labels=query_labels[:5]),
         one.range_search(q[:5], radius, labels=query_labels[:5]))
    gone = rng.choice(n, n // 10, replace=False)
    assert sharded.remove(gone) == one.remove(gone) == n // 10
    assert sharded.ntotal == one.ntotal
    same(sharded.search(q, 10), one.search(q, 10))
    same(sharded.search(q, 10, filter=allowed, labels=query_labels), one.search(q, 10, filter=allowed,
                                                                                labels=query_labels))
    sharded.close()


# -- the exact merge across shards -----------------------------------------------------------------
def near_ties(metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Two rows whose float32 distances to the query are equal while their float64 distances differ, the
    float64-nearer one given the larger id: merging by (float32 distance, id) puts them the wrong way."""
    tiny = 2.0 ** -13
    if metric == "l2":      # 1 + 2**-26 and 1: both round to 1.0f; the row with id 1 (distance 1) is nearer
        rows = np.array([[1.0, tiny, 0.0], [1.0, 0.0, 0.0]], dtype=np.float32)
        q = np.zeros((1, 3), dtype=np.float32)
    elif metric == "ip":    # 1 and 1 + 2**-26: the row with id 1 has the larger inner product
        rows = np.array([[1.0, 0.0, 0.0], [1.0, tiny, 0.0]], dtype=np.float32)
        q = np.array([[1.0, tiny, 0.0]], dtype=np.float32)
    else:                   # cosines 1 - ~2**-27 and 1: the row with id 1 points the query's way
        rows = np.array([[1.0, tiny, 0.0], [2.0, 0.0, 0.0]], dtype=np.float32)
        q = np.array([[3.0, 0.0, 0.0]], dtype=np.float32)
    return rows, q


@pytest.mark.parametrize("n_shards", [1, 2])
@pytest.mark.parametrize("metric", METRICS)
def test_float32_ties_across_shards_are_settled_in_float64(client, metric, n_shards):
    """Across shards the float64 distances decide; within one shard its own order stands (not the ids')."""
    rows, q = near_ties(metric)
    sharded, one = pair(client, 3, metric, n_shards=n_shards)
    for i in range(2):                      # one row per add: the emptiest shard takes it, shard 0 then 1
        add_both((sharded, one), rows[i:i + 1])
    assert sharded.locate([0, 1]).tolist() == [0, n_shards - 1]
    d, i = sharded.search(q, 2)
    assert d[0, 0] == d[0, 1] and i[0].tolist() == [1, 0]       # equal float32, float64 order
    same((d, i), one.search(q, 2))
    assert_exact(d, i, rows, q, 2, metric)
    same(sharded.range_search(q, -1.0 if metric != "l2" else 2.0),
         one.range_search(q, -1.0 if metric != "l2" else 2.0))
    sharded.close()


@pytest.mark.parametrize("metric", METRICS)
def test_duplicates_and_near_ties_on_every_shard(client, seed, metric):
    """Rows repeated on every shard and perturbed below float32's resolution: bit for bit Index's answer."""
    rng = np.random.default_rng(seed + 1)
    base = rng.integers(-3, 4, (60, 8)).astype(np.float32)
    wiggle = base + rng.choice([0.0, 2.0 ** -14, -(2.0 ** -14)], base.shape).astype(np.float32)
    x = np.concatenate([base, wiggle, base, wiggle[::-1]])
    ids = rng.permutation(10 * len(x))[:len(x)]
    q = np.concatenate([base[:10], rng.integers(-3, 4, (10, 8)).astype(np.float32)])
    sharded, one = pair(client, 8, metric, n_shards=3)
    for chunk in np.array_split(np.arange(len(x)), 7):
        add_both((sharded, one), x[chunk], ids=ids[chunk])
    for k in (1, 7, 40, len(x) + 5):
        same(sharded.search(q, k), one.search(q, k))
    same(sharded.range_search(q, 30.0 if metric == "l2" else 0.5), one.range_search(q, 30.0 if metric == "l2" else 0.5))
    sharded.close()


def local_merge(shards: list[tinyknn.Index], q: np.ndarray, k: int, metric: str):
    """_dask_merge.knn over local Index objects standing for the shards."""
    queries = q.astype(np.float32)

    def resolve(query_numbers, ids, owners):
        out = np.empty(len(ids))
        for s in np.unique(owners):
            sel = owners == s
            out[sel] = _dask_merge.exact_distances(queries[query_numbers[sel]], shards[s].get(ids[sel]), metric)
        return out

    parts = [shard.search(queries, k) for shard in shards]
    ranges = [shard.range_search(queries, 4.0 if metric == "l2" else 0.25) for shard in shards]
    return _dask_merge.knn(parts, k, metric, resolve), _dask_merge.ranges(ranges, metric, resolve)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 50), dim=st.integers(1, 6), n_shards=st.integers(1, 4), k=st.integers(1, 60),
       metric=st.sampled_from(METRICS), dtype=st.sampled_from(["float32", "float16", "int8"]),
       wiggle=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_hypothesis_merge_equals_one_index(n, dim, n_shards, k, metric, dtype, wiggle, seed):
    """Small integer values (many exact ties and duplicates), optionally perturbed below float32's resolution
    (float32 ties that float64 separates), spread over shards at random: the merge is one Index's answer."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (n, dim)).astype(np.float32)
    if wiggle and dtype == "float32":
        x += rng.choice([0.0, 2.0 ** -13], x.shape).astype(np.float32)
    ids = rng.permutation(4 * n)[:n]
    owner = rng.integers(0, n_shards, n)
    q = np.concatenate([x[:3], rng.integers(-2, 3, (3, dim)).astype(np.float32)])
    shards = [tinyknn.Index(dim, metric, dtype) for _ in range(n_shards)]
    for s, shard in enumerate(shards):
        shard.add(x[owner == s], ids=ids[owner == s])
    one = tinyknn.Index(dim, metric, dtype)
    one.add(x, ids=ids)
    knn, ranges = local_merge(shards, q, k, metric)
    same(knn, one.search(q, k))
    same(ranges, one.range_search(q, 4.0 if metric == "l2" else 0.25))


def test_naive_merge_would_be_wrong_on_near_ties():
    """The property test's setting does reach the float64 step: (float32, id) order differs from the answer."""
    rows, q = near_ties("l2")
    shards = [tinyknn.Index(3), tinyknn.Index(3)]
    shards[0].add(rows[:1], ids=[0])
    shards[1].add(rows[1:], ids=[1])
    calls = []

    def counting(query_numbers, ids, owners):
        calls.append(ids.tolist())
        return _dask_merge.exact_distances(q[query_numbers], rows[ids], "l2")

    parts = [shard.search(q, 2) for shard in shards]
    _, ids = _dask_merge.knn(parts, 2, "l2", counting)
    naive = sorted(((float(d[0, 0]), int(i[0, 0])) for d, i in parts))
    assert [i for _, i in naive] == [0, 1] and ids[0].tolist() == [1, 0] and sorted(calls[0]) == [0, 1]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "uint8"])
@pytest.mark.parametrize("metric", METRICS)
def test_exact_distances_are_the_contracts(rng, metric, dtype):
    x = rng.integers(0, 100, (50, 17)).astype(np.float32) if dtype.endswith("int8") else \
        rng.standard_normal((50, 17), dtype=np.float32) * 1e3
    x[0] = 0
    q = rng.standard_normal((50, 17), dtype=np.float32)
    index = tinyknn.Index(17, metric, dtype)
    index.add(x)
    got = _dask_merge.exact_distances(q, index.get(np.arange(50)), metric)
    want = np.diagonal(contract_distances(stored(x, dtype), searched(q), metric))
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


# -- ids, adds, bad input --------------------------------------------------------------------------
def test_ids_follow_index_rules(client, rng):
    sharded, one = pair(client, 4, n_shards=3)
    x = rng.standard_normal((30, 4), dtype=np.float32)
    add_both((sharded, one), x[:5])
    add_both((sharded, one), x[5:7], ids=[100, 50])
    add_both((sharded, one), x[7:10])                   # automatic ids go on after the largest: 101, 102, 103
    probe = np.arange(120)
    np.testing.assert_array_equal(sharded.contains(probe), one.contains(probe))
    assert sharded.contains([101, 102, 103]).all() and 103 in sharded and 104 not in sharded
    same((sharded.get([103, 0, 50]),), (one.get([103, 0, 50]),))
    same((sharded.get(101),), (one.get(101),))
    sizes = sharded.shard_sizes
    for ids in ([50, 7], [7, 7]):                       # already held (on some shard), repeated in the batch
        assert refusal(lambda: sharded.add(x[:2], ids=ids)) == refusal(lambda: one.add(x[:2], ids=ids))
    assert sharded.shard_sizes == sizes and sharded.ntotal == one.ntotal == 10
    assert sharded.remove([0, 50, 999]) == one.remove([0, 50, 999]) == 2
    assert refusal(lambda: sharded.get([1, 50])) == refusal(lambda: one.get([1, 50]))
    add_both((sharded, one), x[10:12], ids=[50, 0])     # removed ids may come back, on any shard
    add_both((sharded, one), x[12:14])
    same(sharded.search(x, 6), one.search(x, 6))
    sharded.close()


def bad_calls(x):
    nan = x.copy()
    nan[3, 1] = np.nan
    return [("add", (x[:, :3],), {}), ("add", (nan,), {}), ("add", (x,), {"ids": np.arange(5)}),
            ("add", (x,), {"ids": -np.arange(len(x))}), ("add", (x,), {"labels": [1.5] * len(x)}),
            ("search", (x, 0), {}), ("search", (x[:, :2], 3), {}), ("search", (x, 3), {"filter": [0.5]}),
            ("search", (x, 3), {"labels": [1, 2]}), ("range_search", (x, -1.0), {}),
            ("range_search", (x, float("inf")), {}), ("remove", ([1.0],), {}), ("contains", ([[1]],), {}),
            ("search", (x, 2.5), {}), ("search", (x, 3), {"filter": [[1, 2]]}), ("get", ([1, 2**40],), {}),
            ("get", (1.5,), {}), ("add", (x.astype(np.complex64),), {}), ("add", (x[0],), {})]


def test_bad_input_is_refused_as_index_refuses_it(client, rng):
    sharded, one = pair(client, 4, n_shards=2)
    x = rng.standard_normal((20, 4), dtype=np.float32)
    add_both((sharded, one), x, labels=np.arange(20) % 3)
    for method, args, kwargs in bad_calls(x):
        errors = [refusal(lambda: getattr(index, method)(*args, **kwargs)) for index in (sharded, one)]
        assert errors[0] == errors[1], (method, errors)
    assert sharded.shard_sizes == [10, 10]
    same(sharded.search(x, 5), one.search(x, 5))
    for bad in ({"metric": "hamming"}, {"dtype": "float8"}, {"device": "tpu"}, {"dim": 0}):
        arguments = {"dim": 4, **bad}
        assert refusal(lambda: DaskIndex(client, **arguments)) == refusal(lambda: tinyknn.Index(**arguments))
    with pytest.raises(TypeError, match="distributed.Client"):
        DaskIndex("tcp://127.0.0.1:8786", 4)
    with pytest.raises(ValueError, match="n_shards must be at least 1"):
        DaskIndex(client, 4, n_shards=0)
    sharded.close()


# -- dask.array input -------------------------------------------------------------------------------
def test_dask_array_add(client, rng):
    x = rng.standard_normal((9000, 24), dtype=np.float32)
    labels = rng.integers(0, 4, 9000)
    q = rng.standard_normal((20, 24), dtype=np.float32)
    sharded, one = pair(client, 24, "cosine", n_shards=4)
    sharded.add(da.from_array(x[:6000], chunks=(1000, 12)), labels=labels[:6000])   # blocks split columns too
    one.add(x[:6000], labels=labels[:6000])
    ids = rng.permutation(10**6)[:3000] + 10**6
    sharded.add(da.from_array(x[6000:], chunks=(700, 24)), ids=ids, labels=da.from_array(labels[6000:]))
    one.add(x[6000:], ids=ids, labels=labels[6000:])
    assert sharded.ntotal == 9000 and max(sharded.shard_sizes) - min(sharded.shard_sizes) <= 1000
    same(sharded.search(q, 10, labels=labels[:20]), one.search(q, 10, labels=labels[:20]))
    same((sharded.get(ids[:5]),), (one.get(ids[:5]),))
    add_both((sharded, one), x[:10])                     # automatic ids after the dask add, as Index
    same(sharded.search(x[:10], 3), one.search(x[:10], 3))
    sharded.close()


def test_dask_array_with_a_bad_block_changes_no_shard(client, rng):
    x = rng.standard_normal((4000, 8), dtype=np.float32)
    sharded, one = pair(client, 8, n_shards=2)
    add_both((sharded, one), x[:100])
    bad = x.copy()
    bad[3500, 2] = np.inf
    assert refusal(lambda: sharded.add(da.from_array(bad, chunks=(1000, 8)))) == refusal(lambda: one.add(bad))
    for ids in (np.zeros(4000, dtype=np.int64), np.arange(5)):          # the values are checked first, as Index does
        assert refusal(lambda: sharded.add(da.from_array(bad, chunks=(1000, 8)), ids=ids)) == \
            refusal(lambda: one.add(bad, ids=ids))
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        sharded.add(da.from_array(x)[da.from_array(x)[:, 0] > 0])
    assert sharded.shard_sizes == [50, 50]
    add_both((sharded, one), da.from_array(x[100:200], chunks=50))   # still numbered on from 100
    same(sharded.search(x[:10], 4), one.search(x[:10], 4))
    sharded.close()


def test_an_add_failing_on_one_shard_is_undone_on_the_others(client, rng):
    """A shard refusing its part (here: its Index closed under it) leaves every other shard as it was."""
    x = rng.standard_normal((600, 8), dtype=np.float32)
    sharded, one = pair(client, 8, n_shards=3)
    add_both((sharded, one), x[:300])
    sharded._shards.actors[1].close().result()
    for batch in (x[300:], da.from_array(x[300:], chunks=(100, 8))):
        with pytest.raises(ValueError, match="closed"):
            sharded.add(batch)
        assert sharded.shard_sizes == [100, 100, 100]
        assert not sharded.contains(np.arange(300, 600)).any()
    sharded.close()


def test_searches_from_threads_never_see_half_an_add(client, rng):
    """Searches in four threads while another thread adds in batches: each answer is one Index's answer
    after some number of whole batches."""
    x = rng.standard_normal((2000, 8), dtype=np.float32)
    q = x[::100]
    sharded = DaskIndex(client, 8, n_shards=3)
    sharded.add(x[:1000])
    batches = np.split(np.arange(1000, 2000), 5)
    states = []
    for end in [1000] + [int(b[-1]) + 1 for b in batches]:
        one = tinyknn.Index(8)
        one.add(x[:end])
        states.append(one.search(q, 20))
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        searches = [pool.submit(lambda: [sharded.search(q, 20) for _ in range(6)]) for _ in range(4)]
        for batch in batches:
            sharded.add(x[batch])
        for answers in (f.result() for f in searches):
            for d, i in answers:
                assert any(np.array_equal(i, si) and np.array_equal(d, sd) for sd, si in states)
    sharded.close()


# -- files, and a lost worker -------------------------------------------------------------------------
def test_save_and_load(client, tmp_path, rng):
    x = rng.standard_normal((3000, 16), dtype=np.float32)
    sharded, one = pair(client, 16, "ip", n_shards=3)
    add_both((sharded, one), x, labels=np.arange(3000) % 5)
    assert sharded.remove(np.arange(2990, 3000)) == 10 and one.remove(np.arange(2990, 3000)) == 10
    sharded.save(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "manifest.json", "shard-0000.tinyknn", "shard-0001.tinyknn", "shard-0002.tinyknn"]
    sharded.close()
    loaded = DaskIndex.load(client, tmp_path / "saved")
    one.save(tmp_path / "one.tinyknn")
    reloaded = tinyknn.Index.load(tmp_path / "one.tinyknn")
    assert loaded.n_shards == 3 and loaded.ntotal == 2990 and loaded.metric == "ip"
    same(loaded.search(x[:30], 8, labels=np.arange(30) % 5), reloaded.search(x[:30], 8, labels=np.arange(30) % 5))
    add_both((loaded, reloaded), x[:4])               # automatic ids continue as a loaded Index's do
    np.testing.assert_array_equal(loaded.contains(np.arange(2980, 3000)), reloaded.contains(np.arange(2980, 3000)))
    (tmp_path / "saved" / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="tinyknn-dask"):
        DaskIndex.load(client, tmp_path / "saved")
    loaded.close()


def test_lost_worker_is_a_clear_error_then_the_shard_reloads(client, tmp_path, rng):
    """The worker is stopped, a search goes out and waits on it, then the worker is killed: the waiting search
    and every later call raise ShardUnavailable naming the lost shards; reloaded, they answer as before."""
    x = rng.standard_normal((8000, 16), dtype=np.float32)
    q = rng.standard_normal((25, 16), dtype=np.float32)
    sharded, one = pair(client, 16, "l2", n_shards=4)
    add_both((sharded, one), x)
    sharded.save(tmp_path / "saved")
    victim = sharded.shard_workers[1]
    lost = [i for i, w in enumerate(sharded.shard_workers) if w == victim]
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(sharded.search, q, 5)
        time.sleep(1.0)
        assert not waiting.done()                     # no answer without the stopped shards
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ShardUnavailable) as caught:
            waiting.result(timeout=60)
    assert caught.value.shards[0] in lost and f"(worker {victim})" in str(caught.value)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(sharded._shards.alive(i) for i in lost):
        time.sleep(0.05)
    for call in (lambda: sharded.search(q, 5), lambda: sharded.add(x[:3]), lambda: sharded.save(tmp_path / "x")):
        with pytest.raises(ShardUnavailable) as caught:
            call()
        assert caught.value.shards == lost and f"shard {lost[0]} (worker {victim})" in str(caught.value)
        assert "reload_shard" in str(caught.value)
    client.wait_for_workers(2, timeout=60)            # the nanny starts a fresh worker
    for i in lost:
        sharded.reload_shard(i)
    assert sharded.ntotal == 8000 and victim not in sharded.shard_workers
    same(sharded.search(q, 5), one.search(q, 5))
    with pytest.raises(ValueError, match="hold now"):
        sharded.reload_shard(0, tmp_path / "saved" / "shard-0002.tinyknn")     # its ids are shard 2's
    same(sharded.search(q, 5), one.search(q, 5))
    sharded.close()


@pytest.mark.slow
def test_bench_script_runs(tmp_path):
    """bench/dask_search.py end to end at a small size: its answers are identical, its files are written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "bench" / "dask_search.py"), "--quick", "--rows", "20000",
                           "--queries", "50", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout + done.stderr
    (result,) = tmp_path.glob("dask_search_*.json")
    assert json.loads(result.read_text())["results"]["identical_to_single_index"] is True
    assert list(tmp_path.glob("dask_search_*.png"))


# -- GPU workers (the lead runs these on the H200) ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_workers_equal_a_cpu_index(seed, dtype):
    """Workers whose shards use device="cuda": the answers equal a CPU Index bit for bit (the contract)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((100_000, 96), dtype=np.float32)
    x[500:600] = x[:100]
    q = np.concatenate([rng.standard_normal((300, 96), dtype=np.float32), x[:20]])
    query_labels = rng.integers(0, 4, len(q))
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as gpu_client:
        for metric in METRICS:
            sharded = DaskIndex(gpu_client, 96, metric=metric, dtype=dtype, device="cuda", n_shards=2)
            one = tinyknn.Index(96, metric, dtype)
            add_both((sharded, one), da.from_array(x, chunks=(25_000, 96)), labels=np.arange(len(x)) % 4)
            same(sharded.search(q, 10), one.search(q, 10))
            same(sharded.search(q, 100, labels=query_labels), one.search(q, 100, labels=query_labels))
            same(sharded.range_search(q[:20], 50.0 if metric == "l2" else 0.3),
                 one.range_search(q[:20], 50.0 if metric == "l2" else 0.3))
            sharded.close()


@pytest.mark.gpu
def test_local_cuda_cluster(seed):
    """dask_cuda.LocalCUDACluster (one worker per GPU): shards on the GPUs answer as a CPU Index does."""
    dask_cuda = pytest.importorskip("dask_cuda")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((50_000, 64), dtype=np.float32)
    q = rng.standard_normal((200, 64), dtype=np.float32)
    with dask_cuda.LocalCUDACluster(dashboard_address=None) as cluster, distributed.Client(cluster) as gpu_client:
        sharded = DaskIndex(gpu_client, 64, metric="cosine", device="cuda")
        one = tinyknn.Index(64, "cosine")
        add_both((sharded, one), x)
        assert sharded.n_shards == len(gpu_client.ncores())
        same(sharded.search(q, 10), one.search(q, 10))
        sharded.close()
