"""Loaded cubins, their kernels, pre-packed launches and captured graphs.

A launch from Python costs what the bindings do per call, so everything that can be done once is:
`load_module` loads each cubin once per process (and context); `Kernel.prepare` packs the kernel's
parameters once into a ctypes `void*[]` whose slots point at ctypes values that `set()` updates in
place; `PreparedLaunch.launch` hands that array's address to cuLaunchKernel as an int, which the
bindings pass straight through (no per-call tuple conversion). This module holds tinyknn's only
cuLaunchKernel call.
"""

from __future__ import annotations

import ctypes
import functools
import threading

from cuda.bindings import driver

from .device import check, ensure_context, raise_error
from .memory import _Owned

_cuLaunchKernel = driver.cuLaunchKernel
_cuGraphLaunch = driver.cuGraphLaunch
_MAX_PARAMS = 1024


def _dim3(value, what: str) -> tuple[int, int, int]:
    if isinstance(value, int):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) for v in value):
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints; got {value!r}")
    dims = tuple(value)
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"{what} must be 1-3 positive ints; got {value!r}")
    return dims + (1,) * (3 - len(dims))


def _stream_handle(stream):
    return 0 if stream is None else stream.handle


class Kernel:
    """One CUfunction of a loaded module."""

    def __init__(self, module: "LoadedModule", name: str, lowered_name: str, handle):
        self.module = module
        self.name = name                    # the name expression (or the symbol, for extern "C")
        self.lowered_name = lowered_name    # the mangled symbol in the cubin
        self.handle = handle                # CUfunction
        self._param_sizes: list[int] | None = None

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"

    def param_sizes(self) -> list[int] | None:
        """Byte size of each parameter from the cubin (cuFuncGetParamInfo); None if the driver can't say.

        Probed once per kernel: the probe ends on the driver's CUDA_ERROR_INVALID_VALUE past the last
        parameter, which compute-sanitizer reports, so later prepare() calls reuse the answer.
        """
        if self._param_sizes is None:
            self._param_sizes = self._probe_param_sizes()
        return None if self._param_sizes is None else list(self._param_sizes)

    def _probe_param_sizes(self) -> list[int] | None:
        sizes = []
        for index in range(_MAX_PARAMS):
            try:
                err, _offset, size = driver.cuFuncGetParamInfo(self.handle, index)
            except Exception:  # noqa: BLE001 - bindings/driver without cuFuncGetParamInfo (CUDA < 12.4)
                return None
            if err == driver.CUresult.CUDA_ERROR_INVALID_VALUE:
                return sizes
            if err:
                return None
            sizes.append(int(size))
        return sizes

    def attribute(self, name: str) -> int:
        """A CUfunction attribute by its short name, e.g. 'NUM_REGS', 'LOCAL_SIZE_BYTES'."""
        attr = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
        return check(driver.cuFuncGetAttribute(attr, self.handle), f"cuFuncGetAttribute({name})")

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow launches with up to `nbytes` of dynamic shared memory (above 48 KiB needs this)."""
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(driver.cuFuncSetAttribute(self.handle, attr, int(nbytes)),
              f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) for {self.name}")

    def max_active_blocks_per_sm(self, block_threads: int, shared_bytes: int = 0) -> int:
        """Occupancy: resident blocks per SM at this block size and dynamic shared memory."""
        return check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.handle, block_threads, shared_bytes),
                     "cuOccupancyMaxActiveBlocksPerMultiprocessor")

    def prepare(self, arg_ctypes, values=None) -> "PreparedLaunch":
        """Pack parameters of these ctypes types once (checked against the cubin's parameter sizes)."""
        return PreparedLaunch(self, arg_ctypes, values)


def _check_ctype(t, index: int):
    if not (isinstance(t, type) and issubclass(t, (ctypes._SimpleCData, ctypes.Structure, ctypes.Array))):
        raise TypeError(f"parameter {index}: expected a ctypes type (c_void_p, c_int, c_float, a Structure, ...); "
                        f"got {t!r}")
    return t


class PreparedLaunch:
    """Kernel parameters packed once; `set()` rewrites a slot in place, `launch()` passes the array."""

    __slots__ = ("kernel", "slots", "_array", "address", "_args", "_config", "_function")

    def __init__(self, kernel: Kernel, arg_ctypes, values=None):
        types = [_check_ctype(t, i) for i, t in enumerate(arg_ctypes)]
        expected = kernel.param_sizes()
        given = [ctypes.sizeof(t) for t in types]
        if expected is not None and expected != given:
            raise ValueError(f"kernel {kernel.name} takes {len(expected)} parameters of sizes {expected} bytes; "
                             f"prepare() got {len(given)} ctypes of sizes {given}")
        self.kernel = kernel
        self._function = kernel.handle
        self.slots = [t() for t in types]
        self._array = (ctypes.c_void_p * max(1, len(types)))(*[ctypes.addressof(s) for s in self.slots])
        self.address = ctypes.addressof(self._array)    # what cuLaunchKernel receives as kernelParams
        self._args = None
        self._config = None
        if values is not None:
            self.set_all(*values)

    def set(self, index: int, value) -> None:
        """Write one parameter in place (ints/floats for simple types, an instance for structures)."""
        slot = self.slots[index]
        if isinstance(slot, ctypes._SimpleCData):
            slot.value = value
        else:
            ctypes.memmove(ctypes.addressof(slot), ctypes.addressof(value), ctypes.sizeof(slot))

    def set_all(self, *values) -> None:
        if len(values) != len(self.slots):
            raise ValueError(f"{self.kernel.name} takes {len(self.slots)} parameters; got {len(values)} values")
        for index, value in enumerate(values):
            self.set(index, value)

    def values(self) -> list:
        """The current parameter values (simple types as Python numbers)."""
        return [s.value if isinstance(s, ctypes._SimpleCData) else s for s in self.slots]

    def describe(self, grid, block, shared_bytes, stream) -> str:
        handle = int(_stream_handle(stream))
        grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid)
        block = (block, 1, 1) if isinstance(block, int) else tuple(block)
        return f"{self.kernel.name} grid={grid} block={block} shared_bytes={shared_bytes} stream={handle:#x}"

    def launch(self, grid, block, shared_bytes: int = 0, stream=None) -> None:
        """Enqueue the kernel with the current parameter values. grid/block: int or (x, y, z)."""
        try:
            gx, gy, gz = (grid, 1, 1) if grid.__class__ is int else grid
            bx, by, bz = (block, 1, 1) if block.__class__ is int else block
            err, = _cuLaunchKernel(self._function, gx, gy, gz, bx, by, bz, shared_bytes,
                                   0 if stream is None else stream.handle, self.address, 0)
        except (OverflowError, TypeError, ValueError) as exc:   # the slow path: explain or normalise
            dims = _dim3(grid, "grid"), _dim3(block, "block")
            if dims != (grid, block):
                return self.launch(*dims, shared_bytes, stream)
            raise ValueError(f"bad launch configuration {self.describe(grid, block, shared_bytes, stream)}: "
                             f"{exc}") from None
        if err:
            raise_error(err, "cuLaunchKernel", self.describe(grid, block, shared_bytes, stream))

    def configure(self, grid, block, shared_bytes: int = 0, stream=None) -> "PreparedLaunch":
        """Fix the launch configuration too, so that `launch_configured()` passes one prebuilt tuple."""
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        self._config = (grid, block, int(shared_bytes), stream)
        self._args = (self.kernel.handle, *grid, *block, int(shared_bytes), _stream_handle(stream), self.address, 0)
        return self

    def launch_configured(self) -> None:
        """The cheapest launch: configuration and parameter array fixed, values as last set()."""
        err, = _cuLaunchKernel(*self._args)
        if err:
            raise_error(err, "cuLaunchKernel", self.describe(*self._config))


class LoadedModule:
    """A cubin loaded into one context (cuModuleLoadData), with its kernels fetched on first use."""

    def __init__(self, cubin, ctx):
        self.cubin = cubin
        self.context = ctx
        self.handle = check(driver.cuModuleLoadData(cubin.image), "cuModuleLoadData")
        self._kernels: dict[str, Kernel] = {}
        self._names = dict(cubin.lowered_names)   # of every cubin with this image (see learn_names)
        self._lock = threading.Lock()

    def learn_names(self, lowered_names) -> None:
        """Specs whose sources render to one image (a template file with several kernels) share a module: each
        brings its own name expressions."""
        with self._lock:
            for name, lowered in lowered_names.items():
                self._names.setdefault(name, lowered)

    def kernel(self, name: str) -> Kernel:
        """The kernel for a name expression of cubin.lowered_names (or a plain extern "C" symbol)."""
        found = self._kernels.get(name)
        if found is not None:
            return found
        with self._lock:
            lowered = self._names.get(name, name)
            err, handle = driver.cuModuleGetFunction(self.handle, lowered.encode())
            if err == driver.CUresult.CUDA_ERROR_NOT_FOUND:
                known = sorted(self._names) or ["(no name expressions)"]
                raise ValueError(f"kernel {name!r} is not in this cubin; its name expressions are {known}")
            if err:
                raise_error(err, f"cuModuleGetFunction({lowered!r})")
            found = self._kernels[name] = Kernel(self, name, lowered, handle)
        return found


class _ModuleRegistry:
    def __init__(self):
        self.lock = threading.Lock()
        self.modules: dict[tuple[int, bytes], LoadedModule] = {}
        self.loads = 0


@functools.lru_cache(maxsize=1)
def _registry() -> _ModuleRegistry:
    """Process-wide loaded modules, keyed by (context, cubin image); built on first use."""
    return _ModuleRegistry()


def load_module(cubin) -> LoadedModule:
    """Load `cubin` (anything with .image bytes and .lowered_names) once per process and context."""
    ctx = ensure_context()
    key = (int(ctx), bytes(cubin.image))
    registry = _registry()
    module = registry.modules.get(key)
    if module is None:
        with registry.lock:
            module = registry.modules.get(key)
            if module is None:
                module = registry.modules[key] = LoadedModule(cubin, ctx)
                registry.loads += 1
    module.learn_names(cubin.lowered_names)
    return module


def module_loads() -> int:
    """How many cuModuleLoadData calls this process made (tests check 'once per cubin')."""
    return _registry().loads


class CapturedGraph(_Owned):
    """Work captured from a stream once and replayed with one cuGraphLaunch.

    Kernel parameters and copy addresses are fixed at capture: replay suits repeated shapes whose
    buffers stay put (pinned staging in, results out), where it saves one call per captured node.
    """

    def __init__(self, stream, issue):
        ctx = ensure_context()
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(stream.handle, mode), "cuStreamBeginCapture")
        try:
            issue()
        except BaseException:
            err, graph = driver.cuStreamEndCapture(stream.handle)   # leave the stream usable
            if not err and int(graph):
                driver.cuGraphDestroy(graph)
            raise
        graph = check(driver.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
        try:
            self.handle = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            driver.cuGraphDestroy(graph)        # the executable graph does not need it
        self._own("cuGraphExecDestroy", self.handle, ctx)
        # Its device-side setup now, on the stream, rather than in its first launch: a search right after a
        # removal (whose graphs are captured again) would pay it.
        check(driver.cuGraphUpload(self.handle, stream.handle), "cuGraphUpload")

    def launch(self, stream) -> None:
        err, = _cuGraphLaunch(self.handle, stream.handle)
        if err:
            raise_error(err, "cuGraphLaunch")


class ReplayedIssue:
    """Work issued the same way call after call (a host batch, a screened batch's steps): issued as it is until
    its GRAPH_AFTER_USES-th use, then captured once as a CapturedGraph and replayed from then on."""

    GRAPH_AFTER_USES = 2
    uses = 0
    graph: CapturedGraph | None = None

    def replay(self, stream, issue, use_graphs: bool = True) -> None:
        """issue(stream), or the graph captured from it (use_graphs: False issues it as it is)."""
        self.uses += 1
        if use_graphs and self.graph is None and self.uses >= self.GRAPH_AFTER_USES:
            self.capture(stream, issue)
        if use_graphs and self.graph is not None:
            self.graph.launch(stream)
        else:
            issue(stream)

    def capture(self, stream, issue) -> None:
        """issue(stream) captured as the graph replayed from now on (a rebuilt batch that had one gets it back)."""
        self.graph = CapturedGraph(stream, lambda: issue(stream))

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None
