"""The GPU's prepared one-query search issued from native code (kernels/cpu/gpu_call.cpp, tinyknn/gpu/native_search.py),
checked here without a GPU: the driver's cuGraphLaunch and cuStreamSynchronize are stand-ins written in Python that
play the graph (they write an answer into the "pinned" arrays) and record what was called, in what order."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("cuda.bindings")

from reference import assert_exact  # noqa: E402
from test_prepared_search import _fake_gpu_searcher  # noqa: E402
from tinyknn.cpu import build, library, prebuilt  # noqa: E402
from tinyknn.errors import CudaError  # noqa: E402
from tinyknn.gpu import native_search  # noqa: E402
from tinyknn.inputs.validate import MAX_ABS_VALUE  # noqa: E402

K, DIM = 5, 8


class Device:
    """The stand-in driver: a graph that writes `answer` into the staging, a wait that returns `wait_code`."""

    def __init__(self, launch_code: int = 0, wait_code: int = 0, status: int = 0):
        self.stage = np.zeros(DIM, np.float32)
        self.distances, self.ids = np.zeros(K, np.float32), np.zeros(K, np.int64)
        self.status = np.zeros(1, np.int32)
        self.calls: list[str] = []
        self.launch_code, self.wait_code, self.answer_status = launch_code, wait_code, status
        self.launch = native_search._LAUNCH(self._launch)
        self.wait = native_search._SYNCHRONIZE(self._wait)
        self.record = native_search.TkGpuSearch(
            self.launch, self.wait, 0x1234, 0x5678, self.stage.ctypes.data, self.distances.ctypes.data,
            self.ids.ctypes.data, self.status.ctypes.data, DIM, K, MAX_ABS_VALUE)

    def _launch(self, graph, stream) -> int:
        self.calls.append(f"launch {graph:#x} {stream:#x}")
        if self.launch_code:
            return self.launch_code
        self.distances[:] = np.arange(K) + float(self.stage[0])      # "the search": depends on the staged query
        self.ids[:] = np.arange(K) * 7 + 3
        self.status[0] = self.answer_status
        return 0

    def _wait(self, stream) -> int:
        self.calls.append(f"wait {stream:#x}")
        return self.wait_code

    def search(self, query, out=True):
        self.stage[:] = query
        distances, ids = np.full(K, -9.0, np.float32), np.full(K, -9, np.int64)
        code = library.get_library().tk_gpu_search_one(
            ctypes.byref(self.record), distances.ctypes.data if out else None, ids.ctypes.data if out else None)
        return code, distances, ids


def test_a_good_query_launches_waits_and_copies_the_answer():
    device = Device()
    code, distances, ids = device.search(np.full(DIM, 2.5, np.float32))
    assert code == 0
    assert device.calls == ["launch 0x1234 0x5678", "wait 0x5678"]
    np.testing.assert_array_equal(distances, np.arange(K) + 2.5)
    np.testing.assert_array_equal(ids, np.arange(K) * 7 + 3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, float(np.nextafter(np.float32(MAX_ABS_VALUE), np.inf))])
def test_a_refused_value_waits_for_the_device_and_copies_nothing(bad):
    """The check runs while the device works, so the wait still happens: nothing of the search is left running."""
    query = np.ones(DIM, np.float32)
    query[DIM - 1] = bad
    device = Device()
    code, distances, ids = device.search(query)
    assert code == native_search.REFUSED
    assert device.calls == ["launch 0x1234 0x5678", "wait 0x5678"]
    assert (distances == -9).all() and (ids == -9).all()


def test_the_largest_allowed_magnitude_is_accepted():
    query = np.zeros(DIM, np.float32)
    query[0], query[1] = MAX_ABS_VALUE, -MAX_ABS_VALUE          # |x| <= 2**50 exactly, as check_values allows
    assert Device().search(query)[0] == 0


def test_an_unproven_answer_is_copied_and_said():
    code, distances, _ = Device(status=1).search(np.ones(DIM, np.float32))
    assert code == native_search.UNPROVEN
    np.testing.assert_array_equal(distances, np.arange(K) + 1.0)


def test_driver_errors_come_back_as_their_codes():
    device = Device(launch_code=700)
    code, distances, _ = device.search(np.ones(DIM, np.float32))
    assert code == 700 and device.calls == ["launch 0x1234 0x5678"]        # nothing enqueued: no wait
    assert (distances == -9).all()
    device = Device(wait_code=999)
    code, distances, _ = device.search(np.ones(DIM, np.float32))
    assert code == 999 and (distances == -9).all()


def test_null_outputs_leave_the_answer_in_the_staging():
    device = Device()
    code, distances, _ = device.search(np.full(DIM, 4.0, np.float32), out=False)
    assert code == 0 and (distances == -9).all()
    np.testing.assert_array_equal(device.distances, np.arange(K) + 4.0)


def test_a_record_without_driver_functions_does_nothing_and_says_so():
    empty = native_search.TkGpuSearch()
    lib = library.get_library()
    assert lib.tk_gpu_search_one(ctypes.byref(empty), None, None) == native_search.INCOMPLETE
    assert lib.tk_gpu_search_one(None, None, None) == native_search.INCOMPLETE


class _Batch:
    def __init__(self, graph=object(), direct=True, n_queries=1):
        self.graph, self.direct = graph, direct
        self.plan = type("Plan", (), {"n_queries": n_queries})()


@pytest.mark.parametrize("batch", [_Batch(graph=None), _Batch(direct=False), _Batch(n_queries=2)])
def test_only_a_graphed_one_query_batch_with_its_answer_in_the_staging_is_native(batch, monkeypatch):
    monkeypatch.setattr(native_search, "USE_NATIVE", True)
    monkeypatch.setattr(native_search, "driver_entries", lambda: (1, 2))
    assert native_search.for_batch(batch, None, DIM, K) is None


def test_switched_off_or_without_a_driver_the_python_path_stays(monkeypatch):
    monkeypatch.setattr(native_search, "USE_NATIVE", False)
    assert native_search.for_batch(_Batch(), None, DIM, K) is None
    monkeypatch.setattr(native_search, "USE_NATIVE", True)
    monkeypatch.setattr(native_search, "driver_entries", lambda: None)
    assert native_search.for_batch(_Batch(), None, DIM, K) is None


def test_the_driver_functions_come_from_cu_get_proc_address(monkeypatch):
    asked = []

    def answer(symbol, version, flags):
        asked.append((symbol, version, int(flags)))
        return (native_search.driver.CUresult.CUDA_SUCCESS, {b"cuGraphLaunch": 0x1000}.get(symbol, 0x2000), 0)

    monkeypatch.setattr(native_search.driver, "cuGetProcAddress", answer)
    native_search.driver_entries.cache_clear()
    try:
        assert native_search.driver_entries() == (0x1000, 0x2000)
        assert asked == [(b"cuGraphLaunch", 12000, 0), (b"cuStreamSynchronize", 12000, 0)]
        native_search.driver_entries.cache_clear()
        monkeypatch.setattr(native_search.driver, "cuGetProcAddress", lambda *a: (native_search.driver.CUresult(1), 0, 0))
        assert native_search.driver_entries() is None          # an error or a null pointer: the Python path
    finally:
        native_search.driver_entries.cache_clear()


def test_the_native_library_is_never_built_for_it(cache_dir, monkeypatch):
    """Where the library is neither loaded, prebuilt nor cached, the search keeps its Python path: no compile."""
    compiles = []
    monkeypatch.setattr(build, "compile_library", lambda *args: compiles.append(args))
    monkeypatch.setattr(prebuilt, "candidates", lambda: [])
    library.reset_library()
    try:
        assert library.ready_library() is None
        assert compiles == []
    finally:
        library.reset_library()


def test_looking_for_the_library_makes_nothing_and_warns_of_nothing(cache_dir, monkeypatch):
    """A read-only cache: the look neither warns (warnings are errors here) nor makes the fallback folder."""
    import warnings

    from tinyknn.cpu import cache

    made = []
    monkeypatch.setattr(build, "compile_library", lambda *args: made.append(args))
    monkeypatch.setattr(prebuilt, "candidates", lambda: [])
    monkeypatch.setattr(cache, "_writable", lambda folder: False)
    monkeypatch.setattr(cache, "_fallback_dir", lambda folder: made.append(folder) or folder)
    library.reset_library()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert library.ready_library() is None
        assert made == []
    finally:
        library.reset_library()


def test_a_loaded_library_is_the_one_used():
    loaded = library.get_library()
    assert library.ready_library() is loaded


# -- GpuSearcher's native branch (_search_host_batch, _run_native) on a searcher without a device ----------
class FakeNative:
    """Stands in for NativeSearch on a test_prepared_search fake batch: 'searches' (the oracle, as the fake batch's
    run does) and returns `code`; counts its calls."""

    def __init__(self, batch, code: int = 0):
        self.batch, self.code, self.calls = batch, code, 0

    def run(self, out_distances: int = 0, out_ids: int = 0) -> int:
        self.calls += 1
        if self.code in (0, native_search.UNPROVEN):
            type(self.batch).run(self.batch, None, True)     # the fake batch's own search (the oracle)
        return self.code


def _native_searcher(rng, monkeypatch, code: int = 0):
    monkeypatch.setattr(native_search, "USE_NATIVE", True)
    rows = rng.standard_normal((60, 16)).astype(np.float32)
    searcher = _fake_gpu_searcher(rows)
    searcher.search(rows[:1], 4)            # the batch of this shape made (no graph yet: the Python path)
    (batch,) = searcher._plans.values()
    batch.graph = object()                  # "captured"
    batch.native = FakeNative(batch, code)
    batch.run = lambda *args, **kwargs: pytest.fail("the Python path ran where the native one should have")
    return searcher, rows, batch


def test_a_graphed_one_query_batch_searches_natively(rng, monkeypatch):
    searcher, rows, batch = _native_searcher(rng, monkeypatch)
    q = rows[3:4] + 0.01
    for _ in range(3):
        assert_exact(*searcher.search(q, 4), rows, q, 4, "l2")
    assert batch.native.calls == 3


def test_a_value_the_native_check_refuses_is_the_python_paths_error(rng, monkeypatch):
    searcher, rows, batch = _native_searcher(rng, monkeypatch, native_search.REFUSED)
    q = rows[:1].copy()
    q[0, 2] = np.nan
    out = np.full((1, 4), 7.5, np.float32), np.full((1, 4), -7, np.int64)
    with pytest.raises(ValueError, match="queries contains NaN"):
        searcher.search(q, 4, out=out)
    assert (out[0] == 7.5).all() and (out[1] == -7).all()        # nothing written


def test_driver_errors_of_the_native_search_are_cuda_errors(rng, monkeypatch):
    searcher, rows, _ = _native_searcher(rng, monkeypatch, 700)
    with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS.*native search|native search.*ILLEGAL"):
        searcher.search(rows[:1], 4)
    searcher, rows, _ = _native_searcher(rng, monkeypatch, native_search.INCOMPLETE)
    with pytest.raises(RuntimeError, match="no graph launch or wait function"):
        searcher.search(rows[:1], 4)


def test_switched_off_the_batch_takes_the_python_path(rng, monkeypatch):
    searcher, rows, batch = _native_searcher(rng, monkeypatch)
    monkeypatch.setattr(native_search, "USE_NATIVE", False)
    del batch.run                           # the fake batch's own run again
    assert_exact(*searcher.search(rows[:1], 4), rows, rows[:1], 4, "l2")
    assert batch.native.calls == 0
