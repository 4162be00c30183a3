"""What kind of array an input is: a CUDA array (CuPy, torch CUDA, __cuda_array_interface__, a CUDA
DLPack exporter), described without touching its data, or a CPU DLPack exporter read in place."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import dlpack as _dlpack


@dataclass(frozen=True)
class DeviceArray:
    """A CUDA array seen through __cuda_array_interface__ (v2/v3): no data is touched."""

    obj: object
    framework: str            # "cupy", "torch" or the owner's module name
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    strides: tuple[int, ...] | None   # None means C-contiguous
    stream: int | None        # the producer's stream handle, if it named one (v3; 1 for DLPack)
    readonly: bool
    keepalive: object = field(default=None, compare=False, repr=False)   # a DLPack capsule, held while used

    @property
    def c_contiguous(self) -> bool:
        if self.strides is None:
            return True
        expected, step = [], self.dtype.itemsize
        for extent in reversed(self.shape):
            expected.append(step)
            step *= extent
        return tuple(reversed(expected)) == tuple(self.strides) or int(np.prod(self.shape)) <= 1


def is_device_array(x) -> bool:
    """True for CuPy arrays, torch CUDA tensors, anything that exports __cuda_array_interface__, and
    DLPack exporters whose __dlpack_device__ is a CUDA device (e.g. JAX arrays on a GPU)."""
    if x.__class__ is np.ndarray:   # the common case, decided in one comparison
        return False
    if type(x).__module__.startswith("torch"):
        return bool(getattr(x, "is_cuda", False))
    if hasattr(type(x), "__cuda_array_interface__") or hasattr(x, "__cuda_array_interface__"):
        return True
    return dlpack_device_kind(x) == "cuda"


def describe_device_array(x) -> DeviceArray:
    """Where a CUDA array's data lives and how it is laid out, from __cuda_array_interface__ or DLPack."""
    if not (hasattr(type(x), "__cuda_array_interface__") or hasattr(x, "__cuda_array_interface__")):
        return DeviceArray(**_dlpack.describe(x))
    if getattr(x, "requires_grad", False) and type(x).__module__.startswith("torch"):
        x = x.detach()          # tinyknn only reads the values (torch refuses the interface of a grad tensor)
    try:
        interface = x.__cuda_array_interface__
        dtype = np.dtype(interface["typestr"])
    except Exception as exc:  # noqa: BLE001 - torch raises KeyError for float8, others their own errors
        raise TypeError(f"{name_of(x)} of dtype {getattr(x, 'dtype', '?')} cannot be read through "
                        f"__cuda_array_interface__ ({type(exc).__name__}: {exc}); tinyknn reads CUDA arrays of "
                        "float16, float32 and float64 (and int8/uint8 for an 8-bit index)") from None
    if dtype.kind == "V":       # no NumPy type code: torch describes bfloat16 as '<V2'
        raise TypeError(f"{name_of(x)} has dtype {getattr(x, 'dtype', dtype)}, which tinyknn does not read from "
                        "CUDA memory; pass float16, float32 or float64 (e.g. x.float())")
    shape = tuple(int(n) for n in interface["shape"])
    strides = interface.get("strides")
    pointer, readonly = interface["data"]
    framework = type(x).__module__.split(".")[0]
    return DeviceArray(
        obj=x,
        framework=framework,
        ptr=int(pointer),
        shape=shape,
        dtype=dtype,
        strides=None if strides is None else tuple(int(s) for s in strides),
        stream=interface.get("stream"),
        readonly=bool(readonly),
    )


def dlpack_device_kind(x) -> str | None:
    """'cpu' or 'cuda' for a DLPack exporter (by its __dlpack_device__), 'other' for another device,
    None when x exports no DLPack at all."""
    if x.__class__ is np.ndarray or not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        return None
    try:
        device_type = int(x.__dlpack_device__()[0])
    except Exception:  # noqa: BLE001 - a broken exporter is simply not a DLPack array
        return None
    return _dlpack.DEVICE_KINDS.get(device_type, "other")


def name_of(x) -> str:
    return f"{type(x).__module__}.{type(x).__name__}"


def from_dlpack(x, what: str) -> np.ndarray | None:
    """A CPU DLPack array read in place; None when NumPy cannot read it that way (np.asarray then tries)."""
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, ValueError, RuntimeError, AttributeError):
        if hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
            return None
        raise TypeError(f"{what} ({name_of(x)}) exports DLPack but NumPy cannot read it "
                        "(its dtype or layout); pass a NumPy array") from None
