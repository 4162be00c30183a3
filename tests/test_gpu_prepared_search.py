"""GPU-only cases of search(..., out=) and prepared searches (all marked gpu; the cases every backend shares,
the GPU included, are in tests/test_prepared_search.py): the tensor-core screen and batches beyond one launch
written into out, a prepared search's bound host batch re-bound after every change that drops it (adds that
grow the buffers, removals, evictions from the plan cache, reset), CuPy and torch arrays in and out, and the
host-memory tier (whose searcher takes no out=: the Index copies). Exact answers: tests/reference.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact, exact_search

pytestmark = pytest.mark.gpu
METRICS = ("l2", "ip", "cosine")
DIM = 32


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    from gpu_warm import warm

    warm([(m, "float32", DIM, k) for m in METRICS for k in (1, 10)] + [("l2", "float16", DIM, 10)])


def data(rng, n: int, dim: int = DIM) -> np.ndarray:
    return rng.standard_normal((n, dim)).astype(np.float32)


def filled(n: int, k: int):
    return np.full((n, k), 7.5, np.float32), np.full((n, k), -7, np.int64)


def _token(prepared):
    """The GPU searcher's PreparedBatch behind a prepared search (tinyknn.gpu.searcher)."""
    return prepared._bound.token


# -- host queries --------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_screened_batches_write_into_out(metric, rng):
    from tinyknn.gpu import screen

    db, q = data(rng, screen.SCREEN_MIN_ROWS + 3000), data(rng, 100)
    with tinyknn.Index(DIM, metric, device="cuda") as index:
        index.add(db)
        before = index._searcher._screen.queries
        out = filled(100, 10)
        assert index.search(q, 10, out=out)[0] is out[0]
        assert_exact(*out, db, q, 10, metric)
        prepared = index.prepare_search(10, 100)
        for _ in range(3):
            out = filled(100, 10)
            prepared(q, out=out)
            assert_exact(*out, db, q, 10, metric)
        assert_exact(*prepared(q), db, q, 10, metric)
        assert index._searcher._screen.queries > before or metric not in screen.SCREEN_METRICS


def test_batches_beyond_one_launch_write_into_out_and_check_every_value_first(rng):
    from tinyknn.gpu import plan as plans

    db, q = data(rng, 500), data(rng, plans.MAX_BATCH + 100)
    with tinyknn.Index(DIM, "l2", device="cuda") as index:
        index.add(db)
        out = filled(len(q), 10)
        index.search(q, 10, out=out)
        assert_exact(*out, db, q, 10, "l2")
        prepared = index.prepare_search(10, len(q))
        out = filled(len(q), 10)
        prepared(q, out=out)
        assert_exact(*out, db, q, 10, "l2")
        q[-1, 3] = np.nan                  # in the last batch: nothing of the first may reach out
        out = filled(len(q), 10)
        with pytest.raises(ValueError, match="NaN"):
            index.search(q, 10, out=out)
        with pytest.raises(ValueError, match="NaN"):
            prepared(q, out=out)
        assert np.all(out[0] == 7.5) and np.all(out[1] == -7)


def test_prepared_batch_is_bound_once_and_rebound_after_every_change(rng):
    first, q = data(rng, 3000), data(rng, 1)
    with tinyknn.Index(DIM, "l2", device="cuda") as index:
        index.add(first)
        prepared = index.prepare_search(10)
        assert_exact(*prepared(q), first, q, 10, "l2")
        bound = _token(prepared).batch
        for _ in range(3):                                   # the second call captures a graph, later ones replay it
            assert_exact(*prepared(q), first, q, 10, "l2")
            assert _token(prepared).batch is bound
        second = data(rng, 20000)
        index.add(second)                                    # the rows' buffers grow: every plan is dropped
        both = np.concatenate([first, second])
        assert_exact(*prepared(q), both, q, 10, "l2")
        assert _token(prepared).batch is not bound
        for n in range(2, 40):                               # enough other shapes to evict the bound batch
            index.search(data(rng, n), 10)
        out = filled(1, 10)
        prepared(q, out=out)
        assert_exact(*out, both, q, 10, "l2")
        removed = np.unique(out[1])
        index.remove(removed)
        kept = np.setdiff1d(np.arange(len(both)), removed)
        assert_exact(*prepared(q), both[kept], q, 10, "l2", id_map=kept)
        index.reset()
        assert np.all(prepared(q)[1] == -1)
        index.add(first)
        assert_exact(*prepared(q), first, q, 10, "l2")


def test_large_k_and_filters_write_into_out(rng):
    db, q = data(rng, 2500), data(rng, 3)
    with tinyknn.Index(DIM, "ip", device="cuda") as index:
        index.add(db, labels=np.arange(2500) % 4)
        out = filled(3, 2100)                                # beyond the kernels' k: through the host
        index.search(q, 2100, out=out)
        assert_exact(*out, db, q, 2100, "ip")
        out = filled(3, 10)
        index.search(q, 10, filter=np.arange(0, 2500, 3), out=out)
        assert_exact(*out, db[::3], q, 10, "ip", id_map=np.arange(0, 2500, 3))
        out = filled(3, 10)
        index.search(q, 10, labels=[0, 1, 0], out=out)
        for row, label in enumerate((0, 1, 0)):
            rows = np.flatnonzero(np.arange(2500) % 4 == label)
            assert_exact(out[0][row:row + 1], out[1][row:row + 1], db[rows], q[row:row + 1], 10, "ip", id_map=rows)


def test_host_tier_takes_out_and_prepared_searches(rng):
    db, q = data(rng, 4000), data(rng, 5)
    with tinyknn.Index(DIM, "cosine", device="cuda", storage="host") as index:
        index.add(db)
        out = filled(5, 10)
        assert index.search(q, 10, out=out)[1] is out[1]
        assert_exact(*out, db, q, 10, "cosine")
        prepared = index.prepare_search(10, 5)
        assert_exact(*prepared(q), db, q, 10, "cosine")
        out = filled(5, 10)
        prepared(q, out=out)
        assert_exact(*out, db, q, 10, "cosine")


# -- CUDA queries ------------------------------------------------------------------------------------
def _framework(name: str):
    module = pytest.importorskip(name)
    if name == "torch" and not module.cuda.is_available():
        pytest.skip("torch without CUDA")
    return module


def _device_pair(name: str, n: int, k: int):
    if name == "cupy":
        import cupy

        return cupy.full((n, k), 7.5, dtype=cupy.float32), cupy.full((n, k), -7, dtype=cupy.int64)
    import torch

    return (torch.full((n, k), 7.5, dtype=torch.float32, device="cuda"),
            torch.full((n, k), -7, dtype=torch.int64, device="cuda"))


def _host(array):
    return array.get() if hasattr(array, "get") else array.cpu().numpy()


def _on_device(name: str, array: np.ndarray):
    if name == "cupy":
        import cupy

        return cupy.asarray(array)
    import torch

    return torch.as_tensor(array).cuda()


@pytest.mark.parametrize("name", ["cupy", "torch"])
def test_cuda_queries_write_into_arrays_of_their_framework(name, rng):
    _framework(name)
    db, q = data(rng, 3000), data(rng, 20)
    with tinyknn.Index(DIM, "l2", "float16", device="cuda") as index:
        index.add(db, labels=np.arange(3000) % 2)
        device_q = _on_device(name, q)
        out = _device_pair(name, 20, 10)
        got = index.search(device_q, 10, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        assert_exact(_host(out[0]), _host(out[1]), db, q, 10, "l2", "float16")
        with index.prepare_search(10, 20) as prepared:
            out = _device_pair(name, 20, 10)
            assert prepared(device_q, out=out)[1] is out[1]
            assert_exact(_host(out[0]), _host(out[1]), db, q, 10, "l2", "float16")
            fresh = prepared(device_q)
            assert type(fresh[0]).__module__.split(".")[0] == name
            assert_exact(_host(fresh[0]), _host(fresh[1]), db, q, 10, "l2", "float16")
        out = _device_pair(name, 20, 10)
        index.search(device_q, 10, labels=np.zeros(20, np.int64), out=out)   # one label for all of them
        assert_exact(_host(out[0]), _host(out[1]), db[::2], q, 10, "l2", "float16", id_map=np.arange(0, 3000, 2))


@pytest.mark.parametrize("name", ["cupy", "torch"])
def test_bad_cuda_out_is_refused_before_anything_is_written(name, rng):
    module = _framework(name)
    n, k = 6, DIM                              # k == dim: an out[0] can alias the queries
    with tinyknn.Index(DIM, "ip", device="cuda") as index:
        index.add(data(rng, 200))
        q = _on_device(name, data(rng, n))
        good = _device_pair(name, n, k)
        strided = _device_pair(name, n, 2 * k)[0][:, ::2]
        if name == "cupy":
            raw = module.zeros(n * k * 8, dtype=module.uint8)
            overlapping = (raw[:n * k * 4].view(module.float32).reshape(n, k), raw.view(module.int64).reshape(n, k))
            wrong_dtype = module.zeros((n, k), dtype=module.float64)
        else:
            raw = module.zeros(n * k * 8, dtype=module.uint8, device="cuda")
            overlapping = (raw[:n * k * 4].view(module.float32).reshape(n, k), raw.view(module.int64).reshape(n, k))
            wrong_dtype = module.zeros((n, k), dtype=module.float64, device="cuda")
        cases = [
            ((np.zeros((n, k), np.float32), good[1]), TypeError, r"out\[0\] \(distances\) must be one of two"),
            ((wrong_dtype, good[1]), TypeError, r"out\[0\] \(distances\) must have dtype float32"),
            ((good[0], _device_pair(name, n, k + 1)[1]), ValueError, r"out\[1\] \(ids\) must have shape \(6, 32\)"),
            ((strided, good[1]), ValueError, "C-contiguous"),
            (overlapping, ValueError, "share memory"),
            ((q, good[1]), ValueError, "shares memory with the CUDA queries"),
            ((good[0],), TypeError, "pair"),
        ]
        other = "torch" if name == "cupy" else "cupy"
        try:
            cases.append((_device_pair(other, n, k), TypeError, "must be one of two"))
        except ImportError:
            pass
        if name == "torch":
            grad = module.zeros((n, k), dtype=module.float32, device="cuda", requires_grad=True)
            cases.append(((grad, good[1]), ValueError, "requires grad"))
        prepared = index.prepare_search(k, n)
        for out, error, text in cases:
            for search in (lambda: index.search(q, k, out=out), lambda: prepared(q, out=out)):
                with pytest.raises(error, match=text):
                    search()
        assert np.all(_host(good[0]) == 7.5) and np.all(_host(good[1]) == -7)
        host_q = _host(q)
        with pytest.raises(TypeError, match="CUDA array .* but the queries are host"):
            index.search(host_q, k, out=good)


def test_cupy_out_is_ordered_after_the_callers_stream(rng):
    cupy = _framework("cupy")
    db = data(rng, 20000)
    with tinyknn.Index(DIM, "ip", device="cuda") as index:
        index.add(db)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            q = cupy.asarray(data(rng, 50))
            distances = cupy.empty((50, 10), dtype=cupy.float32)
            ids = cupy.empty((50, 10), dtype=cupy.int64)
            ids.fill(123)                           # pending work on the out arrays, on the caller's stream
            q *= 2.0
            index.search(q, 10, out=(distances, ids))
            checksum = ids.sum()                    # consumer on the same stream
        stream.synchronize()
        expected = exact_search(db, cupy.asnumpy(q), 10, "ip")
        np.testing.assert_array_equal(ids.get(), expected[1])
        assert int(checksum.get()) == int(expected[1].sum())
