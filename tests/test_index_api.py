"""tinyknn.Index on device="cpu": the API, input validation and conversion (save/load: test_persistence.py)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import check_search
from tinyknn.inputs import validate as _validate

METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16")


@pytest.fixture
def index(rng):
    built = tinyknn.Index(8, metric="l2", dtype="float32", device="cpu")
    built.add(rng.standard_normal((50, 8)).astype(np.float32))
    return built


class FakeCudaArray:
    """Looks like a CuPy array to tinyknn (only __cuda_array_interface__ is read)."""

    def __init__(self, shape, typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (1 << 20, False),
                                         "version": 3, "strides": None}


# -- construction and the basic surface ------------------------------------------------------------
def test_surface(index):
    assert index.ntotal == 50 and len(index) == 50
    assert "dim=8" in repr(index) and "ntotal=50" in repr(index)
    assert (index.dim, index.metric, index.dtype, index.device) == (8, "l2", "float32", "cpu")
    index.reset()
    assert index.ntotal == 0


@pytest.mark.parametrize("kwargs, error, text", [
    ({"dim": 0}, ValueError, "dim must be between 1 and"),
    ({"dim": 2.5}, TypeError, "dim must be a positive integer"),
    ({"dim": True}, TypeError, "dim must be a positive integer"),
    ({"dim": 4, "metric": "L1"}, ValueError, "metric must be one of 'l2', 'ip', 'cosine'; got 'L1'"),
    ({"dim": 4, "dtype": "complex64"}, ValueError, "dtype must be one of 'float32', 'float16'"),
    ({"dim": 4, "dtype": "float64"}, ValueError, "got 'float64'"),
    ({"dim": 4, "device": "tpu"}, ValueError, "device must be one of 'cpu', 'cuda'"),
])
def test_bad_construction(kwargs, error, text):
    with pytest.raises(error, match=text):
        tinyknn.Index(**kwargs)


def test_every_storage_dtype_is_built_or_refused_by_name_on_the_cpu():
    from tinyknn.spec import DTYPES

    for dtype in DTYPES:
        try:
            built = tinyknn.Index(4, dtype=dtype, device="cpu")
        except ValueError as exc:
            assert f"dtype {dtype!r} is not available on device='cpu'" in str(exc) and "'float32'" in str(exc)
        else:
            assert built.dtype == dtype


def test_names_are_case_insensitive_and_dtype_objects_work():
    built = tinyknn.Index(3, metric="COSINE", dtype=np.float16, device="CPU")
    assert (built.metric, built.dtype, built.device) == ("cosine", "float16", "cpu")


def test_closed_index_refuses_work(index):
    with index:
        pass
    with pytest.raises(ValueError, match="closed"):
        index.search(np.zeros((1, 8), np.float32), 1)
    with pytest.raises(ValueError, match="closed"):
        index.add(np.zeros((1, 8), np.float32))
    index.close()  # closing twice is harmless


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, error, text", [
    (np.zeros(8, np.float32), ValueError, "must be 2-D"),
    (np.zeros((2, 2, 8), np.float32), ValueError, "must be 2-D"),
    (np.zeros((2, 7), np.float32), ValueError, "must have 8 columns"),
    (np.full((2, 8), np.nan, np.float32), ValueError, "NaN"),
    (np.full((2, 8), np.inf, np.float32), ValueError, "infinity"),
    (np.full((2, 8), 2.0**60, np.float64), ValueError, "2\\*\\*50"),
    (np.zeros((2, 8), np.int32), TypeError, "float16, float32, float64 or bfloat16; got dtype int32"),
    (np.zeros((2, 8), np.complex64), TypeError, "got dtype complex64"),
    (np.zeros((2, 8), bool), TypeError, "got dtype bool"),
    (np.array([["a"] * 8]), TypeError, "got dtype <U1"),
    ([[object()] * 8], TypeError, "got dtype object"),
    (FakeCudaArray((2, 8)), TypeError, "CUDA array .*lives on the CPU"),
])
def test_bad_vectors_and_queries(index, bad, error, text):
    with pytest.raises(error, match=text):
        index.add(bad)
    with pytest.raises(error, match=text):
        index.search(bad, 3)
    assert index.ntotal == 50


@pytest.mark.parametrize("k, error, text", [
    (0, ValueError, "k must be between 1 and 2147483647; got 0"),
    (-3, ValueError, "got -3"),
    (2**31, ValueError, "got 2147483648"),
    (3.0, TypeError, "k must be a positive integer; got 3.0"),
    ("3", TypeError, "got '3'"),
    (True, TypeError, "got True"),
    (None, TypeError, "got None"),
])
def test_bad_k(index, k, error, text):
    with pytest.raises(error, match=text):
        index.search(np.zeros((1, 8), np.float32), k)


def test_k_as_numpy_integer_is_fine(index):
    assert index.search(np.zeros((1, 8), np.float32), np.int64(4))[1].shape == (1, 4)


@pytest.mark.parametrize("ids, error, text", [
    (np.arange(3), ValueError, "ids must have shape \\(4,\\)"),
    (np.arange(5), ValueError, "got shape \\(5,\\)"),
    (np.arange(4).reshape(2, 2), ValueError, "got shape \\(2, 2\\)"),
    (np.array([100, 200, 200, 300]), ValueError, "the ids passed repeat \\[200\\]"),
    (np.array([100, 101, 102, 7]), ValueError, "the ids passed include ids already in it: \\[7\\]"),
    (np.array([5, -1, 1000, 1001]), ValueError, "ids must be >= 0"),
    ([5, -1, 1000, 1001], ValueError, "ids must be >= 0"),
    (np.arange(4, dtype=np.float64), TypeError, "ids must be integers .*got dtype float64"),
    ([1.0, 2.0, 3.0, 4.0], TypeError, "ids must be integers; got 1.0"),
    ([1, 2, True, 4], TypeError, "ids must be integers; got True"),
    ([2**63, 1, 2, 3], ValueError, "ids must lie in 0 .. 9223372036854775807 \\(int64\\); got 9223372036854775808"),
    (np.array([2**63, 1, 2, 3], np.uint64), ValueError, "ids must lie in 0 .. 9223372036854775807"),
    ([2**70, 1, 2, 3], ValueError, "int64"),
    (np.ma.masked_array(np.arange(4), [0, 1, 0, 0]), TypeError, "masked array"),
    (FakeCudaArray((4,), "<i8"), TypeError, "ids must be a host"),
])
def test_bad_ids(index, ids, error, text):
    with pytest.raises(error, match=text):
        index.add(np.ones((4, 8), np.float32), ids=ids)
    assert index.ntotal == 50


def test_float16_index_refuses_values_it_cannot_hold():
    built = tinyknn.Index(2, dtype="float16")
    with pytest.raises(ValueError, match="beyond float16's largest finite value"):
        built.add(np.array([[70000.0, 0.0]], np.float32))
    built.add(np.array([[65504.0, -65504.0]], np.float32))
    assert built.ntotal == 1


# -- accepted input and its conversion ------------------------------------------------------------
def test_non_contiguous_read_only_and_float64_inputs(rng):
    base = rng.standard_normal((40, 16))
    db = base[::2, ::2]                                   # strided view, float64
    q = np.asfortranarray(rng.standard_normal((5, 8)).astype(np.float32))
    q.flags.writeable = False
    built = tinyknn.Index(8)
    built.add(db)
    distances, ids = built.search(q, 6)
    check_search(distances, ids, db, q, 6, "l2")
    frozen = np.ascontiguousarray(db, np.float32)
    frozen.flags.writeable = False
    built.add(frozen)                                     # read-only database rows are fine too
    assert built.ntotal == 40 and not q.flags.writeable


def test_lists_and_empty_batches(rng):
    built = tinyknn.Index(3, metric="ip")
    built.add([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    built.add(np.zeros((0, 3), np.float32))
    assert built.ntotal == 2
    distances, ids = built.search([[0.0, 1.0, 0.0]], 1)
    assert ids.tolist() == [[1]] and distances.tolist() == [[2.0]]
    distances, ids = built.search(np.zeros((0, 3), np.float32), 4)
    assert distances.shape == (0, 4) and ids.shape == (0, 4)


def test_results_are_fresh_writable_arrays(index):
    q = np.zeros((2, 8), np.float32)
    first = index.search(q, 3)
    second = index.search(q, 3)
    assert first[0] is not second[0] and first[0].flags.writeable and first[0].flags.c_contiguous
    assert first[0].dtype == np.float32 and first[1].dtype == np.int64


# -- array-likes that would lose information, and DLPack ------------------------------------------
def test_masked_arrays_are_refused(index):
    masked = np.ma.masked_array(np.ones((2, 8), np.float32), mask=np.zeros((2, 8), bool))
    masked.mask[0, 3] = True
    for call in (lambda: index.add(masked), lambda: index.search(masked, 2)):
        with pytest.raises(TypeError, match="masked array; masks are not supported: fill the masked values"):
            call()
    assert index.ntotal == 50


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_sparse_matrices_are_refused_and_matrices_accepted(index):
    sparse = pytest.importorskip("scipy.sparse")
    with pytest.raises(TypeError, match="sparse matrix .*pass x.toarray\\(\\)"):
        index.add(sparse.csr_matrix(np.ones((2, 8), np.float32)))
    index.add(np.matrix(np.ones((2, 8), np.float32)))            # a 2-D np.matrix loses nothing
    assert index.ntotal == 52


class DLPackOnly:
    """Exposes only __dlpack__ and __dlpack_device__ (like a JAX array), delegating to a NumPy array;
    `device` is what __dlpack_device__ claims (1 = CPU, 2 = CUDA)."""

    def __init__(self, array, device=(1, 0)):
        self._array, self._device = array, device

    def __dlpack__(self, stream=None, **kwargs):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._device


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_cpu_dlpack_arrays_are_read_in_place(rng, dtype):
    db = rng.standard_normal((30, 8)).astype(dtype)
    q = rng.standard_normal((4, 8)).astype(dtype)
    seen = _validate.to_host_array(DLPackOnly(db), "vectors to add")
    assert np.shares_memory(seen, db) and seen.dtype == dtype
    index = tinyknn.Index(8, metric="ip")
    index.add(DLPackOnly(db))
    got = index.search(DLPackOnly(q), 5)
    expected = index.search(q, 5)
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    check_search(*got, db, q, 5, "ip")


def test_dlpack_ids(index):
    index.add(np.ones((3, 8)), ids=DLPackOnly(np.array([900, 901, 902])))
    assert index.ntotal == 53
    with pytest.raises(TypeError, match="ids must be integers .*got dtype float32"):
        index.add(np.ones((1, 8)), ids=DLPackOnly(np.array([5.0], np.float32)))


def test_dlpack_arrays_of_other_kinds_are_refused(index):
    with pytest.raises(TypeError, match="got dtype int32"):
        index.add(DLPackOnly(np.ones((2, 8), np.int32)))
    with pytest.raises(TypeError, match="lives on a device tinyknn cannot read"):
        index.add(DLPackOnly(np.ones((2, 8), np.float32), device=(10, 0)))   # e.g. ROCm
    with pytest.raises(TypeError, match="CUDA array .*lives on the CPU"):
        index.search(DLPackOnly(np.ones((2, 8), np.float32), device=(2, 0)), 3)
    with pytest.raises(TypeError, match="ids must be a host"):
        index.add(np.ones((2, 8)), ids=DLPackOnly(np.arange(2), device=(2, 0)))
    assert index.ntotal == 50


def test_a_cuda_dlpack_array_is_described_from_its_capsule(rng):
    """A DLPack-only object on a CUDA device counts as a device array, described from the capsule's
    DLTensor (here a NumPy array's capsule posing as CUDA memory: nothing is dereferenced; the strided
    one is only described, as device_matrix would have it copied on the device)."""
    base = rng.standard_normal((6, 10)).astype(np.float32)
    for array, strides in ((base, None), (base[1:, ::2], (40, 8))):
        fake = DLPackOnly(array, device=(2, 0))
        assert _validate.is_device_array(fake)
        described = _validate.describe_device_array(fake) if strides else \
            _validate.device_matrix(fake, array.shape[1], "queries")
        assert _validate.rows_readable(described) == (strides is None)
        assert described.ptr == array.ctypes.data and described.shape == array.shape
        assert described.dtype == np.float32 and described.strides in (strides, array.strides)
        assert described.c_contiguous == (strides is None) and described.stream == 1
    with pytest.raises(TypeError, match="got dtype int64"):
        _validate.device_matrix(DLPackOnly(np.ones((2, 2), np.int64), device=(2, 0)), 2, "queries")
    with pytest.raises(ValueError, match="must have 3 columns"):
        _validate.device_matrix(DLPackOnly(base, device=(2, 0)), 3, "queries")


def test_dlpack_dtypes_without_a_numpy_equivalent():
    from tinyknn.inputs import dlpack as _dlpack

    assert _dlpack._dtype(2, 16, 1) == np.float16 and _dlpack._dtype(0, 64, 1) == np.int64
    with pytest.raises(TypeError, match="code 4, 16 bits.*no NumPy equivalent"):
        _dlpack._dtype(4, 16, 1)                                  # bfloat16
    with pytest.raises(TypeError, match="4 lanes"):
        _dlpack._dtype(2, 32, 4)


class CudaDLPackOnly:
    """A CuPy array seen only through DLPack (as JAX arrays are): no __cuda_array_interface__."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None, **kwargs):
        return self._array.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.gpu
def test_dlpack_only_cuda_arrays_on_a_cuda_index(rng):
    cupy = pytest.importorskip("cupy")
    db = rng.standard_normal((300, 16)).astype(np.float32)
    q = rng.standard_normal((7, 16)).astype(np.float32)
    index = tinyknn.Index(16, metric="cosine", device="cuda")
    index.add(CudaDLPackOnly(cupy.asarray(db)))
    distances, ids = index.search(CudaDLPackOnly(cupy.asarray(q)), 5)
    expected = index.search(q, 5)
    assert np.array_equal(cupy.asnumpy(distances), expected[0]) and np.array_equal(cupy.asnumpy(ids), expected[1])
    check_search(*expected, db, q, 5, "cosine")


@pytest.mark.gpu
def test_jax_arrays_on_a_cuda_index(rng):
    jax = pytest.importorskip("jax")
    if not any(device.platform == "gpu" for device in jax.devices()):
        pytest.skip("JAX has no GPU here")
    db = rng.standard_normal((300, 16)).astype(np.float32)
    q = rng.standard_normal((7, 16)).astype(np.float32)
    index = tinyknn.Index(16, device="cuda")
    index.add(jax.numpy.asarray(db))
    distances, ids = index.search(jax.numpy.asarray(q), 5)
    expected = index.search(q, 5)
    assert np.array_equal(np.asarray(distances.get() if hasattr(distances, "get") else distances), expected[0])
    assert np.array_equal(np.asarray(ids.get() if hasattr(ids, "get") else ids), expected[1])


def test_import_loads_no_cuda_module():
    import subprocess
    import sys

    code = ("import sys, tinyknn; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cuda', 'cupy', 'torch', 'jax')]; "
            "print(bad); assert not bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
