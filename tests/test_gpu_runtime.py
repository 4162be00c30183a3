"""tinyknn.gpu runtime: lazy driver start, error mapping, buffers, streams, events, launches, graphs.

The first block runs everywhere (no GPU needed): import without a driver, has_gpu()'s reason,
CudaError from a failing result tuple, the layout of pre-packed parameters. Tests marked `gpu` need
a device and compile their own small kernels through tinyknn.jit.compiler.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from cuda.bindings import driver

from tinyknn.errors import CudaError
from tinyknn.gpu import device
from tinyknn.gpu.launcher import Kernel, PreparedLaunch


# -- no GPU needed -------------------------------------------------------------------------------
def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_import_touches_no_driver():
    out = _run_python("""
        import sys, tinyknn, tinyknn.gpu, tinyknn.gpu.device
        print(sorted(m for m in sys.modules if m.startswith("cuda")))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture
def fresh_runtime(monkeypatch):
    device.reset_runtime()
    yield monkeypatch
    monkeypatch.undo()
    device.reset_runtime()


def test_has_gpu_false_with_reason_when_the_driver_is_missing(fresh_runtime):
    def no_library(flags):
        raise RuntimeError("libcuda.so.1: cannot open shared object file")

    fresh_runtime.setattr(driver, "cuInit", no_library)
    assert device.has_gpu() is False
    assert "libcuda.so.1" in device.why_no_gpu()
    with pytest.raises(CudaError, match="libcuda.so.1"):
        device.ensure_context()


def test_has_gpu_false_with_reason_when_cuinit_fails(fresh_runtime):
    fresh_runtime.setattr(driver, "cuInit", lambda flags: (driver.CUresult.CUDA_ERROR_NO_DEVICE,))
    assert device.has_gpu() is False
    assert "CUDA_ERROR_NO_DEVICE" in device.why_no_gpu()


def test_check_unwraps_values():
    ok = driver.CUresult.CUDA_SUCCESS
    assert device.check((ok,), "cuCall") is None
    assert device.check((ok, 5), "cuCall") == 5
    assert device.check((ok, 1, 2), "cuCall") == (1, 2)


def test_check_maps_a_failing_result_to_cuda_error():
    with pytest.raises(CudaError) as info:
        device.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuMemAlloc",
                     launch="k grid=(1, 1, 1) block=(2048, 1, 1)")
    err = info.value
    assert err.call == "cuMemAlloc"
    assert err.error_name == "CUDA_ERROR_INVALID_VALUE"
    assert "block=(2048, 1, 1)" in str(err) and "cuMemAlloc failed" in str(err)


class _FakeKernel(Kernel):
    """A kernel with a known parameter layout and no driver behind it."""

    def __init__(self, sizes):
        super().__init__(None, "fake", "fake", None)
        self._sizes = sizes

    def param_sizes(self):
        return self._sizes


class _Pair(ctypes.Structure):
    _fields_ = [("a", ctypes.c_float), ("n", ctypes.c_int), ("c", ctypes.c_double)]


def _read(address: int, ctype):
    return ctypes.cast(address, ctypes.POINTER(ctype)).contents


def test_prepared_launch_packs_once_and_updates_in_place():
    launch = _FakeKernel([8, 4, 4, 16]).prepare(
        [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, _Pair], values=[0xABC0, 7, 2.5, _Pair(1.5, 3, 0.25)])
    array = (ctypes.c_void_p * 4).from_address(launch.address)
    slots_before = list(array)
    assert slots_before == [ctypes.addressof(s) for s in launch.slots]
    assert _read(array[0], ctypes.c_uint64).value == 0xABC0
    assert _read(array[1], ctypes.c_int).value == 7
    assert _read(array[2], ctypes.c_float).value == 2.5
    pair = _read(array[3], _Pair)
    assert (pair.a, pair.n, pair.c) == (1.5, 3, 0.25)
    address = launch.address
    launch.set(1, -42)
    launch.set(2, 0.125)
    launch.set(3, _Pair(2.0, 9, 4.0))
    assert launch.address == address and list(array) == slots_before      # same array, same slots
    assert _read(array[1], ctypes.c_int).value == -42
    assert _read(array[2], ctypes.c_float).value == 0.125
    assert _read(array[3], _Pair).n == 9
    assert launch.values()[:3] == [0xABC0, -42, 0.125]


def test_prepared_launch_refuses_layouts_that_do_not_match_the_kernel():
    with pytest.raises(ValueError, match=r"takes 2 parameters of sizes \[8, 4\]"):
        _FakeKernel([8, 4]).prepare([ctypes.c_void_p, ctypes.c_double])
    with pytest.raises(TypeError, match="expected a ctypes type"):
        _FakeKernel(None).prepare([ctypes.c_void_p, int])
    launch = _FakeKernel(None).prepare([ctypes.c_int])
    with pytest.raises(ValueError, match="takes 1 parameters; got 2"):
        launch.set_all(1, 2)


def test_launch_configuration_is_validated_before_the_driver():
    launch = _FakeKernel(None).prepare([ctypes.c_int])
    with pytest.raises(ValueError, match="grid must be 1-3 positive ints"):
        launch.configure((0, 1), 32)
    with pytest.raises(TypeError, match="block must be an int or a tuple"):
        launch.configure(1, "32")


def test_buffer_sizes_are_checked_before_the_driver():
    from tinyknn.gpu.memory import DeviceBuffer, PinnedBuffer

    with pytest.raises(ValueError, match="nbytes must be >= 0; got -1"):
        DeviceBuffer(-1)
    with pytest.raises(TypeError, match="nbytes must be an int; got float"):
        PinnedBuffer(1.5)
    empty = DeviceBuffer(0)
    assert empty.ptr == 0 and empty.nbytes == 0
    empty.close()
    empty.close()


# -- on a GPU ------------------------------------------------------------------------------------
KERNELS = r"""
struct Pair { float a; int n; double c; };

extern "C" __global__ void axpb(float* y, const float* x, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
extern "C" __global__ void take_pair(Pair p, double* out) { out[0] = p.a * p.n + p.c; }
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
namespace tk_test {
template <typename T> __global__ void fill(T* out, T value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
}
"""
FILL = "tk_test::fill<int>"
F32, I32, VP = ctypes.c_float, ctypes.c_int, ctypes.c_void_p


@pytest.fixture(scope="module")
def module():
    from tinyknn.gpu.launcher import load_module
    from tinyknn.jit.compiler import compile_cubin

    arch = device.current_device().arch
    rendered = SimpleNamespace(source=KERNELS, name_expressions=(FILL,), options=("-std=c++17",))
    return load_module(compile_cubin(rendered, arch))


@pytest.fixture
def stream():
    from tinyknn.gpu.memory import Stream

    with Stream() as s:
        yield s


def _axpb(module, y, x, a, b, n) -> PreparedLaunch:
    return module.kernel("axpb").prepare([VP, VP, F32, F32, I32], values=[y.ptr, x.ptr, a, b, n])


@pytest.mark.gpu
def test_device_info_is_sane():
    info = device.current_device()
    assert info.arch.startswith("sm_") and info.sm_count > 0 and info.warp_size == 32
    assert info.max_shared_per_block_optin >= info.max_shared_per_block > 0
    assert device.ensure_context() is device.ensure_context()


@pytest.mark.gpu
def test_copy_round_trip_pinned_and_pageable(rng, stream):
    from tinyknn.gpu.memory import DeviceBuffer, PinnedBuffer

    host = rng.standard_normal(1000).astype(np.float32)
    with DeviceBuffer(host.nbytes) as dev, PinnedBuffer(host.nbytes) as pinned:
        staged = pinned.array(np.float32, host.shape)
        staged[:] = host
        dev.copy_from_host(pinned, stream=stream)
        back = np.zeros_like(host)
        dev.copy_to_host(back, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(back, host)
        dev.copy_from_host(host[:10] * 2, stream=stream, offset=40)     # pageable, at an offset
        dev.copy_to_host(pinned, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(staged[10:20], host[:10] * 2)
        with pytest.raises(ValueError, match="do not fit"):
            dev.copy_from_host(host, stream=stream, offset=4)


@pytest.mark.gpu
def test_prepared_launch_sees_updates_between_calls(module, rng, stream):
    from tinyknn.gpu.memory import DeviceBuffer

    n = 3000
    x_host = rng.standard_normal(n).astype(np.float32)
    with DeviceBuffer(4 * n) as x, DeviceBuffer(4 * n) as y:
        x.copy_from_host(x_host, stream=stream)
        launch = _axpb(module, y, x, 2.0, 1.0, n)
        out = np.empty(n, np.float32)
        grid = (n + 255) // 256
        for a, b in [(2.0, 1.0), (-0.5, 3.0), (0.0, 7.0)]:
            launch.set(2, a)
            launch.set(3, b)
            launch.launch(grid, 256, 0, stream)
            y.copy_to_host(out, stream=stream)
            stream.synchronize()
            np.testing.assert_allclose(out, np.float32(a) * x_host + np.float32(b), rtol=1e-6, atol=1e-6)
        launch.set(4, 10)                       # only the first 10 elements change now
        launch.set(3, 100.0)
        launch.configure(grid, 256, 0, stream).launch_configured()
        y.copy_to_host(out, stream=stream)
        stream.synchronize()
        assert np.all(out[:10] == 100.0) and np.all(out[10:] == 7.0)


@pytest.mark.gpu
def test_struct_parameters_and_name_expressions(module, stream):
    from tinyknn.gpu.memory import DeviceBuffer

    class Pair(ctypes.Structure):
        _fields_ = [("a", ctypes.c_float), ("n", ctypes.c_int), ("c", ctypes.c_double)]

    with DeviceBuffer(64) as buf:
        take = module.kernel("take_pair").prepare([Pair, VP], values=[Pair(1.5, 4, 0.25), buf.ptr])
        take.launch(1, 1, 0, stream)
        fill = module.kernel(FILL).prepare([VP, I32, I32], values=[buf.ptr + 8, 77, 4])
        assert fill.kernel.lowered_name.startswith("_Z")
        fill.launch(1, 32, 0, stream)
        out = np.zeros(64, np.uint8)
        buf.copy_to_host(out, stream=stream)
        stream.synchronize()
    assert out[:8].view(np.float64)[0] == 6.25
    assert list(out[8:24].view(np.int32)) == [77] * 4
    with pytest.raises(ValueError, match="is not in this cubin"):
        module.kernel("no_such_kernel")
    with pytest.raises(ValueError, match="takes 5 parameters"):
        module.kernel("axpb").prepare([VP, VP, F32])


@pytest.mark.gpu
def test_each_cubin_loads_once(module):
    from tinyknn.gpu.launcher import load_module, module_loads

    loads = module_loads()
    assert load_module(module.cubin) is module
    assert module.kernel("axpb") is module.kernel("axpb")
    assert module_loads() == loads


@pytest.mark.gpu
def test_specs_that_render_to_one_image_share_a_module_and_find_each_kernel():
    """The row copy and the selection kernels come from one template file: their cubins are one image, loaded
    once, and each spec's kernel is found whichever was loaded first."""
    from tinyknn.gpu.device import current_device
    from tinyknn.gpu.launcher import load_module
    from tinyknn.jit import cuda_source, render
    from tinyknn.jit.cache import get_cubin

    arch = current_device().arch
    specs = [render.selection_spec(v, arch) for v in ("scatter", "select", "segment_sort")] + [render.rows_spec(arch)]
    modules = [load_module(get_cubin(spec)) for spec in specs]
    for spec, module in zip(specs, modules):
        assert module.kernel(cuda_source.name_expression(spec)).handle is not None, spec


@pytest.mark.gpu
def test_launch_errors_name_the_configuration(module, stream):
    from tinyknn.gpu.memory import DeviceBuffer

    with DeviceBuffer(64) as buf:
        launch = _axpb(module, buf, buf, 1.0, 0.0, 16)
        with pytest.raises(CudaError) as info:
            launch.launch(1, 4096, 0, stream)          # more threads per block than any GPU allows
        assert info.value.call == "cuLaunchKernel"
        assert "axpb" in str(info.value) and "block=(4096, 1, 1)" in str(info.value)
        launch.launch(1, 16, 0, stream)                # not sticky: the context still works
        stream.synchronize()


@pytest.mark.gpu
def test_events_time_and_order_two_streams(module, stream):
    from tinyknn.gpu.memory import DeviceBuffer, Event, Stream

    spin = module.kernel("spin").prepare([ctypes.c_uint64], values=[20_000_000])   # 20 ms
    start, end = Event(), Event()
    start.record(stream)
    spin.launch(1, 1, 0, stream)
    end.record(stream)
    assert end.query() is False
    end.synchronize()
    assert end.query() is True
    assert 15.0 < start.elapsed_ms(end) < 1000.0

    n = 1 << 16
    with DeviceBuffer(4 * n) as y, Stream() as other:
        fill = module.kernel(FILL).prepare([VP, I32, I32], values=[y.ptr, 5, n])
        done = Event(timing=False)
        spin.launch(1, 1, 0, stream)                   # the fill waits behind 20 ms of spinning
        fill.launch(n // 256, 256, 0, stream)
        done.record(stream)
        other.wait(done)
        out = np.zeros(n, np.int32)
        y.copy_to_host(out, stream=other)
        other.synchronize()
        assert np.all(out == 5)


@pytest.mark.gpu
def test_close_twice_and_use_after_close():
    from tinyknn.gpu.memory import DeviceBuffer, Event, PinnedBuffer, Stream

    for make in (lambda: DeviceBuffer(1024), lambda: PinnedBuffer(1024), Stream, Event):
        obj = make()
        assert not obj.closed
        obj.close()
        obj.close()
        assert obj.closed
    buf = DeviceBuffer(16)
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        buf.copy_from_host(np.zeros(4, np.float32))


def _free_device_bytes() -> int:
    gc.collect()
    free, _total = device.check(driver.cuMemGetInfo(), "cuMemGetInfo")
    return free


@pytest.mark.gpu
def test_garbage_collection_frees_memory_from_any_thread():
    from tinyknn.gpu.memory import DeviceBuffer, PinnedBuffer

    device.ensure_context()
    baseline = _free_device_bytes()
    chunk = 256 << 20
    temporaries = []
    for _ in range(40):                              # 10 GiB in total, never more than 256 MiB alive
        temporaries.append(DeviceBuffer(chunk)._finalizer)
    assert not any(f.alive for f in temporaries)     # each freed as its last reference went
    held = [DeviceBuffer(chunk) for _ in range(4)]
    held_finalizers = [b._finalizer for b in held]
    # The device's free memory is shared with other processes (pytest-xdist runs GPU tests side by side, and a
    # neighbour's 10M-row index takes GBs meanwhile), so the finalizers are the check; free memory is checked
    # only where this test runs alone.
    pinned = PinnedBuffer(1 << 20)
    view = pinned.array(np.float32, 1000)
    assert pinned.array(np.float32, 1000) is view    # views are cached per (dtype, shape)
    del pinned
    gc.collect()
    view[:] = 3.0                                    # the view keeps the pinned memory alive
    assert view.sum() == 3000.0
    gc.disable()                                     # no reference cycle: freed by reference counting
    try:
        pinned = PinnedBuffer(4096)
        pinned.array(np.int32, (4, 8))[:] = 1
        finalizer = pinned._finalizer
        del pinned
        assert not finalizer.alive
    finally:
        gc.enable()
    thread = threading.Thread(target=held.clear)     # finalizers run on a thread with no context
    thread.start()
    thread.join()
    del view
    assert not any(f.alive for f in held_finalizers)  # freed on the thread with no current context
    if "PYTEST_XDIST_WORKER" not in os.environ:       # alone on the device: its free memory came back too
        assert _free_device_bytes() >= baseline - (2 << 30)


@pytest.mark.gpu
def test_stream_synchronize_releases_the_gil(module, stream):
    """A counting thread keeps running while we wait. With the GIL held during the wait it would run at ~2 %
    of its free speed; released, at most of it. The bar sits between the two, far from both, because other
    processes (pytest -n 8) share the CPUs: the free speed is measured in the same test, before and after."""
    spin = module.kernel("spin").prepare([ctypes.c_uint64], values=[300_000_000])   # 300 ms
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    def free_rate() -> float:
        before, t0 = counter[0], time.perf_counter()
        time.sleep(0.1)
        return (counter[0] - before) / (time.perf_counter() - t0)

    thread = threading.Thread(target=count)
    thread.start()
    try:
        rate_before = free_rate()
        spin.launch(1, 1, 0, stream)
        time.sleep(0.01)
        before, t0 = counter[0], time.perf_counter()
        stream.synchronize()
        waiting_rate = (counter[0] - before) / (time.perf_counter() - t0)
        rate_after = free_rate()
    finally:
        stop.set()
        thread.join()
    share = waiting_rate / max(rate_before, rate_after)
    assert share > 0.2, f"the other thread ran at {share:.0%} of its free speed during a 300 ms wait"


@pytest.mark.gpu
def test_threads_launch_on_their_own_streams(module):
    from tinyknn.gpu.memory import DeviceBuffer, Stream

    n, failures = 4096, []

    def work(value: int):
        try:
            device.ensure_context()                  # a new thread has no current context
            with Stream() as s, DeviceBuffer(4 * n) as y:
                fill = module.kernel(FILL).prepare([VP, I32, I32], values=[y.ptr, value, n])
                out = np.empty(n, np.int32)
                for step in range(20):
                    fill.set(1, value + step)
                    fill.launch(n // 128, 128, 0, s)
                    y.copy_to_host(out, stream=s)
                    s.synchronize()
                    if not np.all(out == value + step):
                        failures.append((value, step))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))

    threads = [threading.Thread(target=work, args=(1000 * i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.mark.gpu
def test_graph_replays_copies_and_kernels(module, stream, rng):
    from tinyknn.gpu.launcher import CapturedGraph
    from tinyknn.gpu.memory import DeviceBuffer, PinnedBuffer

    n = 512
    with PinnedBuffer(4 * n) as pin_in, PinnedBuffer(4 * n) as pin_out, DeviceBuffer(4 * n) as x, \
            DeviceBuffer(4 * n) as y:
        launch = _axpb(module, y, x, 3.0, -1.0, n)

        def issue():
            x.copy_from_host(pin_in, stream=stream)
            launch.launch(2, 256, 0, stream)
            y.copy_to_host(pin_out, stream=stream)

        graph = CapturedGraph(stream, issue)
        src, dst = pin_in.array(np.float32, n), pin_out.array(np.float32, n)
        for _ in range(3):
            src[:] = rng.standard_normal(n)
            graph.launch(stream)
            stream.synchronize()
            np.testing.assert_allclose(dst, 3.0 * src - 1.0, rtol=1e-6, atol=1e-6)
        graph.close()
        graph.close()

        def broken():
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            CapturedGraph(stream, broken)
        launch.launch(2, 256, 0, stream)              # the stream left capture mode
        stream.synchronize()


@pytest.mark.gpu
def test_exit_and_lost_context_are_safe():
    out = _run_python("""
        import gc
        from cuda.bindings import driver
        from tinyknn.gpu import device
        from tinyknn.gpu.memory import DeviceBuffer, PinnedBuffer, Stream, Event
        kept = [DeviceBuffer(1 << 20), PinnedBuffer(1 << 20), Stream(), Event()]   # alive at exit
        lost = [DeviceBuffer(1 << 20), PinnedBuffer(4096)]          # freed after the context is reset
        dev = device.check(driver.cuDeviceGet(0), "cuDeviceGet")
        device.check(driver.cuDevicePrimaryCtxReset(dev), "cuDevicePrimaryCtxReset")
        del lost
        gc.collect()
        print("ok")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr
