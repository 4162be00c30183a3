"""Device and pinned buffers, streams and events, each owning one driver object.

Every owner frees its object exactly once: `close()` (or leaving a `with` block) frees it now, the
garbage collector frees it otherwise, and a second close() does nothing. Frees push the owning
primary context first, so they work from any thread (the GC runs finalizers wherever it runs), and
they never raise from the GC or at interpreter exit; a context that is already gone (driver
deinitialised, context destroyed) counts as freed.

Length: four small owner classes (device buffer, pinned buffer, stream, event) that share one release
discipline; splitting them would scatter it.
"""

from __future__ import annotations

import weakref

import numpy as np
from cuda.bindings import driver

from .device import check, ensure_context, raise_error

_CUresult = driver.CUresult
_GONE = {int(_CUresult.CUDA_ERROR_DEINITIALIZED), int(_CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED),
         int(_CUresult.CUDA_ERROR_INVALID_CONTEXT)}
_cuMemcpyHtoDAsync = driver.cuMemcpyHtoDAsync
_cuMemcpyDtoHAsync = driver.cuMemcpyDtoHAsync
_cuStreamSynchronize = driver.cuStreamSynchronize
_cuEventRecord = driver.cuEventRecord
_H2D, _D2H = "copy_from_host", "copy_to_host"


def _release(call: str, handle, ctx) -> int:
    """Free one driver object inside its context; the CUresult as an int (0 also when already gone)."""
    try:
        free = getattr(driver, call)
        err, = driver.cuCtxPushCurrent(ctx)
        if err:
            return 0 if int(err) in _GONE else int(err)
        try:
            err, = free(handle)
        finally:
            driver.cuCtxPopCurrent()
        return 0 if int(err) in _GONE else int(err)
    except Exception:  # noqa: BLE001 - interpreter shutdown: modules half torn down; nothing to free
        return 0


class _Owned:
    """Shared close()/context-manager behaviour: one weakref.finalize per driver object."""

    _finalizer = None
    _open = False          # a plain flag: the hot paths check it instead of the finalizer
    _call = ""

    def _own(self, call: str, handle, ctx, holder=None) -> None:
        """Free `handle` when `holder` (default: self) is collected, or at close()."""
        self._call = call
        self._finalizer = weakref.finalize(self if holder is None else holder, _release, call, handle, ctx)
        self._finalizer.atexit = False      # at exit the process frees everything; don't call a dying driver
        self._open = True

    @property
    def closed(self) -> bool:
        return not self._open

    def close(self) -> None:
        """Free the driver object now; closing twice is harmless."""
        if self._open:
            self._open = False
            err = self._finalizer()
            if err:
                raise_error(_CUresult(err), self._call)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_nbytes(nbytes, what: str) -> int:
    if nbytes.__class__ is int and nbytes >= 0:       # the common case, first
        return nbytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{what} nbytes must be an int; got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"{what} nbytes must be >= 0; got {nbytes}")
    return int(nbytes)


def _stream_handle(stream):
    return 0 if stream is None else stream.handle


def _host_pointer(host, nbytes, writable: bool, what: str) -> tuple[int, int]:
    """(address, nbytes) of an int address, a PinnedBuffer or a C-contiguous ndarray."""
    if host.__class__ is PinnedBuffer and nbytes.__class__ is int and 0 <= nbytes <= host.nbytes:
        return host.ptr, nbytes                        # the searchers' hot path: staging buffers
    if isinstance(host, (int, np.integer)) and not isinstance(host, bool):
        if nbytes is None:
            raise ValueError(f"{what}: nbytes is required when the host side is a raw address")
        return int(host), _check_nbytes(nbytes, what)
    if isinstance(host, PinnedBuffer):
        ptr, size = host.ptr, host.nbytes
    elif isinstance(host, np.ndarray):
        if not host.flags.c_contiguous:
            raise ValueError(f"{what}: the host array must be C-contiguous; got strides {host.strides}")
        if writable and not host.flags.writeable:
            raise ValueError(f"{what}: the host array must be writable")
        ptr, size = host.__array_interface__["data"][0], host.nbytes
    else:
        raise TypeError(f"{what}: expected an int address, a PinnedBuffer or a numpy array; "
                        f"got {type(host).__name__}")
    nbytes = size if nbytes is None else _check_nbytes(nbytes, what)
    if nbytes > size:
        raise ValueError(f"{what}: {nbytes} bytes requested but the host side holds only {size}")
    return ptr, nbytes


class DeviceBuffer(_Owned):
    """`nbytes` of device memory (cuMemAlloc) in the current device's primary context."""

    def __init__(self, nbytes: int):
        self.nbytes = _check_nbytes(nbytes, "DeviceBuffer")
        self.ptr = 0
        if self.nbytes:
            ctx = ensure_context()
            handle = check(driver.cuMemAlloc(self.nbytes), "cuMemAlloc")
            self.ptr = int(handle)
            self._own("cuMemFree", handle, ctx)
        self.handle = driver.CUdeviceptr(self.ptr)   # pre-wrapped: the bindings take it without converting

    def __repr__(self) -> str:
        return f"DeviceBuffer(nbytes={self.nbytes}, ptr={self.ptr:#x}{', closed' if self.closed else ''})"

    def _span(self, nbytes, offset: int, what: str):
        if offset == 0 and nbytes <= self.nbytes and self._open:
            return self.handle
        if self.nbytes and not self._open:
            raise ValueError(f"{what}: the DeviceBuffer is closed")
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"{what}: bytes [{offset}, {offset + nbytes}) do not fit in a DeviceBuffer "
                             f"of {self.nbytes} bytes")
        return self.handle if offset == 0 else driver.CUdeviceptr(self.ptr + offset)

    def _host_copy(self, to_device: bool, host, nbytes, stream, offset: int) -> None:
        what = _H2D if to_device else _D2H
        host_ptr, nbytes = _host_pointer(host, nbytes, not to_device, what)
        dev = self._span(nbytes, offset, what)
        if not nbytes:
            return
        handle = 0 if stream is None else stream.handle
        if to_device:
            err, = _cuMemcpyHtoDAsync(dev, host_ptr, nbytes, handle)
        else:
            err, = _cuMemcpyDtoHAsync(host_ptr, dev, nbytes, handle)
        if err:
            raise_error(err, "cuMemcpyHtoDAsync" if to_device else "cuMemcpyDtoHAsync")

    def _fits(self, host, nbytes, offset) -> bool:
        """The hot path's test: whole-buffer-start copies between open buffers, sizes in range."""
        return (host.__class__ is PinnedBuffer and nbytes.__class__ is int and offset == 0 and self._open
                and 0 < nbytes <= self.nbytes and nbytes <= host.nbytes)

    def copy_from_host(self, host, nbytes: int | None = None, stream=None, *, offset: int = 0) -> None:
        """Enqueue host -> device on `stream` (pinned host memory makes it truly asynchronous)."""
        if not self._fits(host, nbytes, offset):
            return self._host_copy(True, host, nbytes, stream, offset)
        err, = _cuMemcpyHtoDAsync(self.handle, host.ptr, nbytes, 0 if stream is None else stream.handle)
        if err:
            raise_error(err, "cuMemcpyHtoDAsync")

    def copy_to_host(self, host, nbytes: int | None = None, stream=None, *, offset: int = 0) -> None:
        """Enqueue device -> host on `stream`; the host side is valid after the stream synchronises."""
        if not self._fits(host, nbytes, offset):
            return self._host_copy(False, host, nbytes, stream, offset)
        err, = _cuMemcpyDtoHAsync(host.ptr, self.handle, nbytes, 0 if stream is None else stream.handle)
        if err:
            raise_error(err, "cuMemcpyDtoHAsync")

    def copy_from_device(self, src_ptr: int, nbytes: int, stream=None, *, offset: int = 0) -> None:
        """Enqueue device -> device from a raw device address (CuPy/torch data, another buffer)."""
        dst = self._span(_check_nbytes(nbytes, "copy_from_device"), offset, "copy_from_device")
        if nbytes:
            check(driver.cuMemcpyDtoDAsync(dst, int(src_ptr), nbytes, _stream_handle(stream)),
                  "cuMemcpyDtoDAsync")

    def copy_to_device(self, dst_ptr: int, nbytes: int, stream=None, *, offset: int = 0) -> None:
        """Enqueue device -> device into a raw device address (a CUDA array of the caller's framework)."""
        src = self._span(_check_nbytes(nbytes, "copy_to_device"), offset, "copy_to_device")
        if nbytes:
            check(driver.cuMemcpyDtoDAsync(int(dst_ptr), src, nbytes, _stream_handle(stream)), "cuMemcpyDtoDAsync")

    def fill_bytes(self, value: int, nbytes: int | None = None, stream=None, *, offset: int = 0) -> None:
        """Enqueue a memset of `nbytes` bytes (default: all) to the byte `value`."""
        nbytes = self.nbytes - offset if nbytes is None else _check_nbytes(nbytes, "fill_bytes")
        dst = self._span(nbytes, offset, "fill_bytes")
        if nbytes:
            check(driver.cuMemsetD8Async(dst, value & 0xFF, nbytes, _stream_handle(stream)), "cuMemsetD8Async")


def copy_host_to_address(address: int, host: np.ndarray, stream=None) -> None:
    """Enqueue host -> a raw device address (a CUDA array of the caller's framework). Pageable host
    memory is staged by the driver before this returns, so `host` may be freed afterwards."""
    host = np.ascontiguousarray(host)
    if host.nbytes:
        check(driver.cuMemcpyHtoDAsync(driver.CUdeviceptr(int(address)), host.ctypes.data, host.nbytes,
                                       _stream_handle(stream)), "cuMemcpyHtoDAsync")


class _HostMemory:
    """The pinned allocation itself: NumPy views point at it, and it is freed once nothing does."""

    def __init__(self, ptr: int, nbytes: int):
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class PinnedBuffer(_Owned):
    """`nbytes` of page-locked host memory (cuMemHostAlloc, portable across contexts, mapped for kernels).

    `array()` returns NumPy views that keep the memory alive (not this object, so the views it caches
    form no reference cycle); after close() they must not be used.
    """

    def __init__(self, nbytes: int):
        self.nbytes = _check_nbytes(nbytes, "PinnedBuffer")
        self.ptr = self.device_ptr = 0    # device_ptr: where kernels read and write it (mapped; equal under UVA)
        self._views: dict = {}
        if self.nbytes:
            ctx = ensure_context()
            flags = driver.CU_MEMHOSTALLOC_PORTABLE | driver.CU_MEMHOSTALLOC_DEVICEMAP
            self.ptr = int(check(driver.cuMemHostAlloc(self.nbytes, flags), "cuMemHostAlloc"))
            self._memory = _HostMemory(self.ptr, self.nbytes)
            self._own("cuMemFreeHost", self.ptr, ctx, holder=self._memory)
            self.device_ptr = int(check(driver.cuMemHostGetDevicePointer(self.ptr, 0), "cuMemHostGetDevicePointer"))

    def __repr__(self) -> str:
        return f"PinnedBuffer(nbytes={self.nbytes}, ptr={self.ptr:#x}{', closed' if self.closed else ''})"

    def array(self, dtype, shape) -> np.ndarray:
        """A NumPy view of the first prod(shape) elements of `dtype` (its base keeps the memory alive).

        Views are cached per (dtype, shape): the search hot path asks for the same few every call.
        """
        key = (dtype, shape)
        found = self._views.get(key)
        if found is not None and self._open:
            return found
        if self.nbytes and not self._open:
            raise ValueError("PinnedBuffer is closed")
        view = self._make_view(np.dtype(dtype), (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape))
        if len(self._views) >= 64:
            self._views.clear()
        self._views[key] = view
        return view

    def _make_view(self, dtype: np.dtype, shape: tuple) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(f"PinnedBuffer.array: {shape} x {dtype} needs {count * dtype.itemsize} bytes; "
                             f"the buffer holds {self.nbytes}")
        raw = np.asarray(self._memory) if self.nbytes else np.empty(0, np.uint8)
        return raw[: count * dtype.itemsize].view(dtype).reshape(shape)

    def close(self) -> None:
        self._views.clear()
        super().close()


class Stream(_Owned):
    """A non-blocking stream (no implicit sync with the legacy default stream), or a borrowed one."""

    def __init__(self, *, _borrow: int | None = None):
        if _borrow is not None:
            self.handle = driver.CUstream(_borrow)
        else:
            ctx = ensure_context()
            flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
            self.handle = check(driver.cuStreamCreate(flags), "cuStreamCreate")
            self._own("cuStreamDestroy", self.handle, ctx)
        self.ptr = int(self.handle)

    @classmethod
    def from_handle(cls, handle: int) -> "Stream":
        """Borrow a stream created elsewhere (CuPy, torch, the runtime); close() leaves it alone."""
        return cls(_borrow=int(handle))

    def __repr__(self) -> str:
        return f"Stream({self.ptr:#x})"

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (cuda.core and others accept this object as a stream)."""
        return (0, self.ptr)

    def synchronize(self) -> None:
        """Wait for everything enqueued so far. cuda.bindings releases the GIL around the driver call
        (checked by tests/test_gpu_runtime.py and bench/launch_overhead.py), so other threads run."""
        err, = _cuStreamSynchronize(self.handle)
        if err:
            raise_error(err, "cuStreamSynchronize")

    def wait(self, event: "Event") -> None:
        """Make later work on this stream wait for `event` (no host blocking)."""
        check(driver.cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")


class Event(_Owned):
    """A CUDA event; `timing=False` makes record/wait cheaper when no elapsed time is needed."""

    def __init__(self, timing: bool = True):
        ctx = ensure_context()
        flags = driver.CUevent_flags.CU_EVENT_DEFAULT if timing else driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(driver.cuEventCreate(flags), "cuEventCreate")
        self._own("cuEventDestroy", self.handle, ctx)

    def record(self, stream=None) -> None:
        err, = _cuEventRecord(self.handle, _stream_handle(stream))
        if err:
            raise_error(err, "cuEventRecord")

    def synchronize(self) -> None:
        """Block until the event has happened (the GIL is released while waiting)."""
        check(driver.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def query(self) -> bool:
        """True once the recorded work has finished, without blocking."""
        err, = driver.cuEventQuery(self.handle)
        if err == _CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err:
            raise_error(err, "cuEventQuery")
        return True

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded and completed)."""
        return check(driver.cuEventElapsedTime(self.handle, end.handle), "cuEventElapsedTime")
