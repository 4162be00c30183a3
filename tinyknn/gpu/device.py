"""The CUDA device and its primary context, through cuda.bindings.driver, initialised lazily.

Importing this module touches no driver: `has_gpu()` runs cuInit the first time it is asked and
turns every failure (no libcuda, no device, a broken driver) into False plus a reason from
`why_no_gpu()`. tinyknn shares the device's *primary* context with the CUDA runtime, CuPy and torch,
so pointers and streams pass freely between them.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass

from ..errors import CudaError


def _driver():
    from cuda.bindings import driver

    return driver


# -- errors --------------------------------------------------------------------------------------
def _error_text(err) -> tuple[str, str]:
    """(name, description) of a CUresult; works without a loaded driver (falls back to the enum)."""
    driver = _driver()
    try:
        name_err, name = driver.cuGetErrorName(err)
        text_err, text = driver.cuGetErrorString(err)
        if int(name_err) == 0 and int(text_err) == 0:
            return name.decode(), text.decode()
    except Exception:  # noqa: BLE001 - no driver loaded: describe the enum we were given
        pass
    try:
        return driver.CUresult(int(err)).name, ""
    except ValueError:
        return f"CUresult {int(err)}", ""


def raise_error(err, call: str, launch: str | None = None):
    """Raise CudaError for a failed CUresult, naming the call, the error and the launch if any."""
    name, text = _error_text(err)
    raise CudaError(call, name, text, launch)


def check(result, call: str, launch: str | None = None):
    """Unwrap a cuda.bindings return tuple (err, *values): the value(s), or CudaError naming `call`."""
    err = result[0]
    if err:
        raise_error(err, call, launch)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


# -- the device ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    """What the planner and the compiler need to know about one device."""

    ordinal: int
    name: str
    arch: str                           # "sm_90"
    compute_capability: tuple[int, int]
    sm_count: int
    max_threads_per_block: int
    max_shared_per_block: int
    max_shared_per_block_optin: int
    max_shared_per_sm: int
    registers_per_sm: int
    l2_bytes: int
    total_memory_bytes: int
    memory_bus_width_bits: int
    memory_clock_khz: int
    warp_size: int

    @property
    def peak_memory_bandwidth_gbs(self) -> float:
        """Theoretical DRAM bandwidth (double data rate x bus width), for 'fraction of peak' reports."""
        return 2.0 * self.memory_clock_khz * 1e3 * self.memory_bus_width_bits / 8 / 1e9

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["peak_memory_bandwidth_gbs"] = round(self.peak_memory_bandwidth_gbs, 1)
        return out


_ATTRIBUTES = {
    "compute_major": "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
    "compute_minor": "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
    "sm_count": "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
    "max_threads_per_block": "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK",
    "max_shared_per_block": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK",
    "max_shared_per_block_optin": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "max_shared_per_sm": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
    "registers_per_sm": "CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR",
    "l2_bytes": "CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE",
    "memory_bus_width_bits": "CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH",
    "memory_clock_khz": "CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE",
    "warp_size": "CU_DEVICE_ATTRIBUTE_WARP_SIZE",
}


def _query_device(ordinal: int) -> DeviceInfo:
    driver = _driver()
    dev = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    raw_name = check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
    attrs = {}
    for key, enum_name in _ATTRIBUTES.items():
        attr = getattr(driver.CUdevice_attribute, enum_name)
        attrs[key] = check(driver.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({enum_name})")
    major, minor = attrs.pop("compute_major"), attrs.pop("compute_minor")
    return DeviceInfo(
        ordinal=ordinal,
        name=raw_name.split(b"\0", 1)[0].decode(errors="replace"),
        arch=f"sm_{major}{minor}",
        compute_capability=(major, minor),
        total_memory_bytes=check(driver.cuDeviceTotalMem(dev), "cuDeviceTotalMem"),
        **attrs,
    )


class _Runtime:
    """The result of cuInit and the primary contexts this process retained (one per device used)."""

    def __init__(self):
        self.reason = ""
        self.device_count = 0
        self._lock = threading.Lock()
        self._contexts: dict[int, object] = {}     # ordinal -> CUcontext (retained, never released)
        self.by_handle: dict[int, tuple] = {}      # int(CUcontext) -> (CUcontext, ordinal): the fast path
        self._infos: dict[int, DeviceInfo] = {}
        self.get_current = None                    # driver.cuCtxGetCurrent once the driver is up
        try:
            driver = _driver()
        except Exception as exc:  # noqa: BLE001
            self.reason = f"cuda.bindings cannot be imported: {exc}"
            return
        try:
            err, = driver.cuInit(0)
            if err:
                name, text = _error_text(err)
                self.reason = f"cuInit failed: {name} ({text})"
                return
            err, count = driver.cuDeviceGetCount()
            if err or count == 0:
                self.reason = "the CUDA driver reports no device" if not err else f"cuDeviceGetCount failed: {err}"
                return
            self.device_count = count
            self.get_current = driver.cuCtxGetCurrent
        except Exception as exc:  # noqa: BLE001 - e.g. libcuda.so not found: no GPU here
            self.reason = f"no usable CUDA driver: {type(exc).__name__}: {exc}"

    @property
    def ok(self) -> bool:
        return not self.reason

    def context(self, ordinal: int):
        ctx = self._contexts.get(ordinal)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(ordinal)
                if ctx is None:
                    driver = _driver()
                    dev = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
                    ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                    self._contexts[ordinal] = ctx
                    self.by_handle[int(ctx)] = (ctx, ordinal)
        return ctx

    def info(self, ordinal: int) -> DeviceInfo:
        info = self._infos.get(ordinal)
        if info is None:
            info = self._infos[ordinal] = _query_device(ordinal)
        return info


@functools.lru_cache(maxsize=1)
def _runtime() -> _Runtime:
    """The process-wide driver state, built on first use (tests may call reset_runtime())."""
    return _Runtime()


def reset_runtime() -> None:
    """Forget the cached cuInit result (for tests); retained contexts stay retained in the driver."""
    _runtime.cache_clear()


def has_gpu() -> bool:
    """True when the driver initialises and reports at least one device. Never raises."""
    return _runtime().ok


def why_no_gpu() -> str:
    """Why has_gpu() is False ('' when it is True)."""
    return _runtime().reason


def _require() -> _Runtime:
    runtime = _runtime()
    if not runtime.ok:
        raise CudaError("cuInit", "NO_GPU", runtime.reason)
    return runtime


def driver_version() -> str:
    """The driver's CUDA version, e.g. '13.0' (cuDriverGetVersion)."""
    _require()
    version = check(_driver().cuDriverGetVersion(), "cuDriverGetVersion")
    return f"{version // 1000}.{version % 1000 // 10}"


def device_count() -> int:
    return _require().device_count


def _current_ordinal() -> int:
    """The device of the context current on this thread (set by us, the runtime, CuPy, torch), else 0."""
    driver = _driver()
    ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        return 0
    return int(check(driver.cuCtxGetDevice(), "cuCtxGetDevice"))


def current_device() -> DeviceInfo:
    """The current CUDA device (cudaGetDevice semantics: the current context's device, else 0)."""
    return _require().info(_current_ordinal())


def get_device(ordinal: int) -> DeviceInfo:
    """DeviceInfo of device `ordinal` (0 <= ordinal < device_count())."""
    runtime = _require()
    if not isinstance(ordinal, int) or not 0 <= ordinal < runtime.device_count:
        raise ValueError(f"device ordinal must be an int in [0, {runtime.device_count}); got {ordinal!r}")
    return runtime.info(ordinal)


def primary_context(ordinal: int = 0):
    """The retained primary context (CUcontext) of device `ordinal`."""
    return _require().context(ordinal)


def ensure_context(ordinal: int | None = None):
    """Make device `ordinal`'s primary context current on this thread (default: the current device's).

    Costs one cuCtxGetCurrent when one of our primary contexts is already current. Returns the CUcontext.
    """
    runtime = _runtime()
    if runtime.reason:
        raise CudaError("cuInit", "NO_GPU", runtime.reason)
    err, current = runtime.get_current()
    if err:
        raise_error(err, "cuCtxGetCurrent")
    known = runtime.by_handle.get(int(current))
    if known is not None and (ordinal is None or known[1] == ordinal):
        return known[0]
    driver = _driver()
    if ordinal is None:
        ordinal = 0 if int(current) == 0 else int(check(driver.cuCtxGetDevice(), "cuCtxGetDevice"))
    ctx = runtime.context(ordinal)
    check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx
