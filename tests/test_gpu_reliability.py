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
    from tinyknn import _validate
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
    """JAX arrays (DLPack only) on the GPU: read in place, results as CuPy arrays; other dtypes refused."""
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
