"""GPU side of "nothing crashes, nothing is lost": device memory that does not fit is a clear MemoryError and the
index stays as it was (a configured cap, TINYKNN_DEVICE_MEMORY_LIMIT, makes that cheap to test), and a failed
piece of a chunked add is undone with truncate."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from tinyknn.config import reset_config
from reference import assert_exact

pytestmark = pytest.mark.gpu


@pytest.fixture
def device_cap(monkeypatch):
    def set_cap(text: str):
        monkeypatch.setenv("TINYKNN_DEVICE_MEMORY_LIMIT", text)
        reset_config()
    yield set_cap
    monkeypatch.delenv("TINYKNN_DEVICE_MEMORY_LIMIT", raising=False)
    reset_config()


def test_an_add_beyond_the_cap_raises_and_changes_nothing(device_cap, rng):
    device_cap("8M")
    db = rng.standard_normal((2000, 64)).astype(np.float32)
    q = rng.standard_normal((5, 64)).astype(np.float32)
    with tinyknn.Index(64, "l2", device="cuda") as index:
        index.add(db)
        before = index.search(q, 10)
        big = rng.standard_normal((40_000, 64)).astype(np.float32)      # 10 MB more than the cap allows
        with pytest.raises(MemoryError, match=r"needs [\d,]+ more bytes of device memory.*allows 8,388,608"):
            index.add(big)
        assert index.ntotal == 2000
        after = index.search(q, 10)
        np.testing.assert_array_equal(before[1], after[1])
        assert_exact(*after, db, q, 10, "l2")
        index.add(db[:100] + 1.0)                                          # still usable
        assert index.ntotal == 2100


def test_a_search_whose_scratch_does_not_fit_says_so(device_cap, rng):
    db = rng.standard_normal((30_000, 32)).astype(np.float32)
    with tinyknn.Index(32, "ip", device="cuda") as index:
        index.add(db)
        in_use = sum(b.nbytes for b in index._searcher._buffers.values() if hasattr(b, "fill_bytes"))
        device_cap(str(in_use + (4 << 20)))   # the database fits; candidate lists of 5,000 x k = 2048 do not
        with pytest.raises(MemoryError, match="device memory"):
            index.search(rng.standard_normal((5000, 32)).astype(np.float32), 2048)
        d, i = index.search(db[:3], 5)
        assert_exact(d, i, db, db[:3], 5, "ip")


def test_scratch_slices_are_one_allocation_in_aligned_slices(device_cap, rng):
    """_scratch_slices carves one allocation: each slice its own aligned, disjoint bytes (copies round-trip through
    each), closing any one closes them all, and the cap counts them together, all or none."""
    from tinyknn.gpu.buffers import SCRATCH_ALIGN

    with tinyknn.Index(16, "l2", device="cuda") as index:
        index.add(rng.standard_normal((100, 16)).astype(np.float32))
        searcher = index._searcher
        sizes = (12, 0, 1000, 256, 8)
        parts = searcher._scratch_slices("a test", *sizes)
        assert [p.nbytes for p in parts] == list(sizes)
        assert all(p.ptr % SCRATCH_ALIGN == 0 for p in parts)
        ends = [p.ptr + p.nbytes for p in parts]
        assert all(ends[i] <= parts[i + 1].ptr for i in range(len(parts) - 1))
        written = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
        for part, data in zip(parts, written):
            part.copy_from_host(data, data.nbytes, searcher._stream)
        for part, data in zip(parts, written):
            back = np.empty_like(data)
            part.copy_to_host(back, back.nbytes, searcher._stream)
            searcher._stream.synchronize()
            np.testing.assert_array_equal(back, data)
        parts[2].close()
        assert all(p.closed for p in parts)
        with pytest.raises(ValueError, match="closed"):
            parts[0].copy_to_host(np.empty(12, np.uint8), 12, searcher._stream)
        parts[0].close()                                   # closing again does nothing
        in_use = sum(b.nbytes for b in searcher._buffers.values() if hasattr(b, "fill_bytes"))
        device_cap(str(in_use + (1 << 20)))
        with pytest.raises(MemoryError, match="for a test"):
            searcher._scratch_slices("a test", 600 << 10, 600 << 10)   # each fits under the cap, not both


def test_truncate_drops_the_newest_rows(rng):
    db = rng.standard_normal((500, 16)).astype(np.float32)
    with tinyknn.Index(16, "cosine", device="cuda") as index:
        index.add(db)
        index._searcher.add(db[:50] * 3.0, np.arange(1000, 1050))
        index._searcher.truncate(500)
        d, i = index.search(db[:4], 7)
        assert_exact(d, i, db, db[:4], 7, "cosine")
        with pytest.raises(ValueError, match="between 0 and 500"):
            index._searcher.truncate(501)


# -- device arrays of any layout, dtype and device ----------------------------------------------------
def _framework(name: str):
    module = pytest.importorskip(name, reason=f"{name} is not installed")
    if name == "torch" and not module.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return module


def _layouts(name: str, q: np.ndarray) -> dict:
    """CUDA arrays holding q's values whose rows the kernels cannot read in place."""
    if name == "cupy":
        import cupy

        return {"fortran": cupy.asfortranarray(cupy.asarray(q)),
                "columns": cupy.asarray(np.repeat(q, 2, axis=1))[:, ::2],
                "reversed": cupy.asarray(np.ascontiguousarray(q[::-1]))[::-1],
                "transposed": cupy.asarray(np.ascontiguousarray(q.T)).T}
    import torch

    return {"transposed": torch.as_tensor(np.ascontiguousarray(q.T)).cuda().t(),
            "columns": torch.as_tensor(np.repeat(q, 2, axis=1)).cuda()[:, ::2],
            "column-pairs": torch.as_tensor(np.repeat(q, 3, axis=1)).cuda()[:, 1::3],
            "requires-grad": torch.as_tensor(np.ascontiguousarray(q.T)).cuda().t().requires_grad_()}


def _to_host(array) -> np.ndarray:
    return array.get() if type(array).__module__.startswith("cupy") else array.cpu().numpy()


def _no_host_copies(name: str, monkeypatch) -> None:
    """Make the framework's ways to the host fail: the layout copy must stay on the device."""
    def refuse(*args, **kwargs):
        raise AssertionError("a device array went through the host")

    if name == "cupy":
        import cupy

        monkeypatch.setattr(cupy, "asnumpy", refuse)
    else:
        import torch

        for method in ("cpu", "numpy", "__array__", "tolist"):
            monkeypatch.setattr(torch.Tensor, method, refuse)


@pytest.mark.parametrize("name", ["cupy", "torch"])
def test_a_device_array_of_any_layout_is_copied_on_its_device(name, rng, monkeypatch):
    """Fortran-order, transposed, column-sliced and (CuPy) reversed CUDA queries and vectors used to be refused
    ("must have contiguous rows ... pass a contiguous copy") where NumPy input of any layout is converted; the
    framework now copies them on the device, on the caller's stream, and the answers are the same."""
    from tinyknn.inputs import validate as _validate
    from tinyknn.gpu import interop

    _framework(name)
    dim, k = 24, 7
    db = rng.standard_normal((700, dim)).astype(np.float32)
    q = rng.standard_normal((9, dim)).astype(np.float32)
    with tinyknn.Index(dim, "l2", device="cuda") as index, tinyknn.Index(dim, "l2", device="cuda") as added:
        index.add(db)
        expected = index.search(q, k)
        results = {}
        layouts = _layouts(name, q)
        with monkeypatch.context() as patch:
            _no_host_copies(name, patch)
            for layout, array in layouts.items():
                described = _validate.device_matrix(array, dim, "queries", queries=True)
                assert described.c_contiguous and described.framework == name, layout
                assert interop.device_ordinal(described, "queries") == 0, layout      # device memory
                results[layout] = index.search(array, k)
            added.add(_layouts(name, db)["transposed"])
        for layout, (distances, ids) in results.items():
            assert type(ids).__module__.split(".")[0] == name
            np.testing.assert_array_equal(_to_host(ids), expected[1], err_msg=layout)
            np.testing.assert_array_equal(_to_host(distances), expected[0], err_msg=layout)
            assert_exact(_to_host(distances), _to_host(ids), db, q, k, "l2")
        assert np.array_equal(added._searcher.export()[0], db)


@pytest.mark.parametrize("name", ["cupy", "torch"])
def test_device_arrays_of_a_wrong_dtype_are_type_errors(name, rng):
    module = _framework(name)
    dim = 8
    with tinyknn.Index(dim, "ip", device="cuda") as index:
        index.add(rng.standard_normal((50, dim)))
        before = index.search(np.ones((1, dim), np.float32), 5)
        if name == "cupy":
            bad = [module.ones((2, dim), module.int64), module.ones((2, dim), module.complex64),
                   module.ones((2, dim), bool), module.ones((2, dim), module.int8)]
        else:
            bad = [module.ones((2, dim), dtype=module.int64, device="cuda"),
                   module.ones((2, dim), dtype=module.bool, device="cuda"),
                   module.ones((2, dim), dtype=module.complex64, device="cuda"),
                   module.ones((2, dim), dtype=module.bfloat16, device="cuda")]
        for array in bad:
            with pytest.raises(TypeError, match="dtype|bfloat16|bits"):
                index.search(array, 3)
            with pytest.raises(TypeError, match="dtype|bfloat16|bits"):
                index.add(array)
        assert index.ntotal == 50
        np.testing.assert_array_equal(index.search(np.ones((1, dim), np.float32), 5)[1], before[1])


@pytest.mark.parametrize("name", ["cupy", "torch"])
def test_device_arrays_on_another_gpu_are_refused(name, rng):
    module = _framework(name)
    count = module.cuda.runtime.getDeviceCount() if name == "cupy" else module.cuda.device_count()
    if count < 2:
        pytest.skip("needs two GPUs")
    dim = 8
    q = rng.standard_normal((3, dim)).astype(np.float32)
    if name == "cupy":
        with module.cuda.Device(1):
            elsewhere = [module.asarray(q), module.asfortranarray(module.asarray(q))]
    else:
        elsewhere = [module.as_tensor(q).to("cuda:1"), module.as_tensor(np.ascontiguousarray(q.T)).to("cuda:1").t()]
    with tinyknn.Index(dim, "l2", device="cuda") as index:
        index.add(rng.standard_normal((40, dim)))
        for array in elsewhere:
            with pytest.raises(ValueError, match="is on CUDA device 1 but this index lives on device 0"):
                index.search(array, 3)
            with pytest.raises(ValueError, match="is on CUDA device 1"):
                index.add(array)
        assert index.ntotal == 40


def test_jax_arrays_in_and_of_the_wrong_dtype(rng, monkeypatch):
    """JAX arrays on the GPU (through __cuda_array_interface__ or DLPack): read in place, results as CuPy
    arrays; other dtypes (int32, bfloat16, bool) are TypeErrors."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")      # JAX would take 75 % of the GPU
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if not any(device.platform == "gpu" for device in jax.devices()):
        pytest.skip("JAX has no GPU here")
    pytest.importorskip("cupy")
    dim, k = 16, 5
    db = rng.standard_normal((300, dim)).astype(np.float32)
    q = rng.standard_normal((4, dim)).astype(np.float32)
    with tinyknn.Index(dim, "cosine", device="cuda") as index:
        index.add(jnp.asarray(db))
        distances, ids = index.search(jnp.asarray(q), k)
        assert_exact(distances.get(), ids.get(), db, q, k, "cosine")
        for bad in (jnp.ones((2, dim), jnp.int32), jnp.ones((2, dim), jnp.bfloat16), jnp.ones((2, dim), bool)):
            with pytest.raises(TypeError, match="dtype|bits"):
                index.search(bad, k)
        assert index.ntotal == 300


# -- damaged files, the device cap on every path, close() under searches -----------------------------
def _saved(rng, dim=6, n=40) -> tuple[bytes, tinyknn.Index]:
    import io

    built = tinyknn.Index(dim, "cosine", dtype="float16")
    built.add(rng.standard_normal((n, dim)), ids=rng.choice(10**9, n, replace=False), labels=np.arange(n) % 3)
    buffer = io.BytesIO()
    built.save(buffer)
    return buffer.getvalue(), built


@pytest.fixture
def device_allocations(monkeypatch):
    """The finalizers of the device buffers this process allocates during the test: a leak is one still alive
    once the test's objects are gone. (Free memory of the whole device would count other processes too:
    pytest -n 8 runs GPU tests beside this one.)"""
    from tinyknn.gpu import memory

    made = []
    own = memory._Owned._own

    def recording(self, call, handle, ctx, holder=None):
        own(self, call, handle, ctx, holder)
        if call == "cuMemFree":
            made.append(self._finalizer)

    monkeypatch.setattr(memory._Owned, "_own", recording)
    return made


def _leaked(made: list) -> int:
    import gc

    gc.collect()
    return sum(finalizer.alive for finalizer in made)


def test_damaged_files_loaded_onto_the_gpu_are_value_errors_and_leak_nothing(rng, device_allocations):
    import io

    data, built = _saved(rng)
    tinyknn.Index.load(io.BytesIO(data), device="cuda").close()            # kernels loaded, pools warm
    device_allocations.clear()
    vectors, _ = built._searcher.export()
    nan_rows = io.BytesIO()
    with np.load(io.BytesIO(data)) as archive:
        members = {name: archive[name] for name in archive.files}
    members["vectors"] = members["vectors"].copy()
    members["vectors"][3, 1] = np.nan
    np.savez(nan_rows, **members)
    damaged = [data[:len(data) // 2], data[:-1], b"", bytes(range(256)) * 8, nan_rows.getvalue(), data + data[:100]]
    for offset in rng.choice(len(data), 300, replace=False):
        flipped = bytearray(data)
        flipped[offset] ^= 1 << int(rng.integers(8))
        damaged.append(bytes(flipped))
    outcomes = {"same": 0, "refused": 0}
    for case in damaged:
        stream = io.BytesIO(case)
        try:
            loaded = tinyknn.Index.load(stream, device="cuda")
        except ValueError:
            outcomes["refused"] += 1
            assert stream.tell() == 0
            continue
        with loaded:
            assert loaded.device == "cuda" and loaded.ntotal == built.ntotal
            assert np.array_equal(loaded._searcher.export()[0], vectors)
            outcomes["same"] += 1
    assert outcomes["refused"] > 100 and outcomes["same"] > 0, outcomes
    assert device_allocations and _leaked(device_allocations) == 0, "failed loads left device memory behind"


def test_range_search_under_the_cap_halves_its_pool_and_beyond_it_says_so(device_cap, rng):
    """Range search's hit pool halves when the device (here its memory cap) refuses one, so a search whose
    hits would not fit at once still answers exactly; one query with more hits than the cap leaves room for
    is a MemoryError that says so, and changes nothing."""
    db = rng.standard_normal((30_000, 32)).astype(np.float32)
    q = rng.standard_normal((60, 32)).astype(np.float32)
    with tinyknn.Index(32, "l2", device="cuda") as index, tinyknn.Index(32, "l2") as cpu:
        index.add(db)
        cpu.add(db)
        in_use = sum(b.nbytes for b in index._searcher._buffers.values() if hasattr(b, "fill_bytes"))
        device_cap(str(in_use + (2 << 20)))     # every row is a hit: 60 x 30,000 hits (~36 MB) in pieces
        for got, want in zip(index.range_search(q, 1e9), cpu.range_search(q, 1e9)):
            np.testing.assert_array_equal(got, want)
        device_cap(str(in_use + (64 << 10)))    # one query's 30,000 hits (600 kB) do not fit
        with pytest.raises(MemoryError, match=r"range search"):
            index.range_search(q[:2], 1e9)
        assert index.ntotal == 30_000
        device_cap(str(in_use + (2 << 20)))
        for got, want in zip(index.range_search(q[:2], 40.0), cpu.range_search(q[:2], 40.0)):   # nothing left over
            np.testing.assert_array_equal(got, want)


def test_pickles_copies_and_loads_beyond_the_cap_raise_memory_errors(device_cap, rng, tmp_path, device_allocations):
    import copy
    import pickle

    db = rng.standard_normal((20_000, 64)).astype(np.float32)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    with tinyknn.Index(64, "ip", device="cuda") as index:
        index.add(db, labels=np.arange(20_000) % 5)
        before = index.search(q, 10)
        pickled = pickle.dumps(index)
        index.save(tmp_path / "saved")
        device_cap("2M")                                   # far less than a second copy needs
        device_allocations.clear()
        for attempt in (lambda: pickle.loads(pickled), lambda: copy.deepcopy(index),
                        lambda: tinyknn.Index.load(tmp_path / "saved", device="cuda")):
            with pytest.raises(MemoryError, match="TINYKNN_DEVICE_MEMORY_LIMIT allows 2,097,152"):
                attempt()
        assert _leaked(device_allocations) == 0            # what the failed attempts allocated is freed
        assert index.ntotal == 20_000
        after = index.search(q, 10)
        np.testing.assert_array_equal(before[1], after[1])
        device_cap("64G")
        for clone in (pickle.loads(pickled), copy.deepcopy(index)):
            with clone:
                assert clone.device == "cuda"
                np.testing.assert_array_equal(clone.search(q, 10)[1], before[1])
                assert clone._labels.rows_of(2).tolist() == index._labels.rows_of(2).tolist()


@pytest.mark.parametrize("queries", ["host", "cupy"])
def test_close_while_other_threads_search_and_add(rng, queries):
    """Index.close() from one thread while others search (plain, filtered, labelled), add and range-search:
    every call either answers exactly as before or raises ValueError saying the index was closed; no
    crash, no other exception, no thread left waiting."""
    import threading
    import time

    if queries == "cupy":
        cupy = pytest.importorskip("cupy")
    dim, k = 32, 10
    db = rng.standard_normal((20_000, dim)).astype(np.float32)
    q = rng.standard_normal((16, dim)).astype(np.float32)
    allowed = np.arange(0, 20_000, 3)
    index = tinyknn.Index(dim, "l2", device="cuda")
    index.add(db, labels=np.arange(20_000) % 4)
    expected = {"plain": index.search(q, k), "filter": index.search(q, k, filter=allowed),
                "labels": index.search(q, k, labels=np.arange(16) % 4)}
    device_q = cupy.asarray(q) if queries == "cupy" else q
    calls = {
        "plain": lambda: index.search(device_q, k),
        "filter": lambda: index.search(q, k, filter=allowed),
        "labels": lambda: index.search(q, k, labels=np.arange(16) % 4),
        "range": lambda: index.range_search(q[:2], 20.0),
        "add": lambda: index.add(db[:50] + 1000.0),            # far away: the answers above stay the same
    }
    outcomes, mismatches = [], []
    start = threading.Barrier(len(calls) + 1)

    def worker(name):
        start.wait()
        while True:
            try:
                result = calls[name]()
            except ValueError as exc:
                outcomes.append((name, "closed" in str(exc), str(exc)))
                return
            except BaseException as exc:  # noqa: BLE001 - recorded, asserted below
                outcomes.append((name, False, repr(exc)))
                return
            if name in expected:
                ids = _to_host(result[1]) if not isinstance(result[1], np.ndarray) else result[1]
                if not np.array_equal(ids, expected[name][1]):
                    mismatches.append(name)

    threads = [threading.Thread(target=worker, args=(name,), daemon=True) for name in calls]
    for thread in threads:
        thread.start()
    start.wait()
    time.sleep(0.5)
    index.close()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread is still inside the closed index"
    assert len(outcomes) == len(calls) and all(ok for _, ok, _ in outcomes), outcomes
    assert not mismatches, mismatches
    with pytest.raises(ValueError, match="closed"):
        index.search(q, k)
    with tinyknn.Index(dim, "l2", device="cuda") as fresh:        # the device is fine
        fresh.add(db[:100])
        assert_exact(*fresh.search(q, 5), db[:100], q, 5, "l2")


def test_an_add_under_eight_searching_threads_takes_at_most_5x_its_idle_time(rng):
    """The GPU's side of tests/test_cpu_reliability.py's test of the same name: a GPU index's calls take turns
    (tinyknn.gpu.turns), and a waiting add goes ahead of the searches still waiting, so it waits for the one
    search running, not for a line of them."""
    from test_cpu_reliability import assert_add_under_search_within_5x

    with tinyknn.Index(128, device="cuda") as index:
        assert_add_under_search_within_5x(index, rng)
