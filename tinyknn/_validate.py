"""The one place user inputs are checked and converted.

Conversion policy (also in README and the Index docstrings):
- Host arrays (NumPy, anything `np.asarray` turns into a real floating array, torch CPU tensors):
  float16/float32/float64 are accepted. The database is stored in the index's dtype and queries are
  searched in float32, so an input in another float dtype, or not C-contiguous, is copied once
  (`np.ascontiguousarray(x, dtype)`); a C-contiguous input already in that dtype is used without a copy
  for queries (the index's stored database is always its own copy). Read-only inputs are fine: tinyknn
  never writes to an input.
- Integer, boolean, complex and object arrays are refused (TypeError): silently casting ids or pixel
  counts is more often a bug than an intent.
- NaN or infinity anywhere is refused (ValueError), as is a float32 magnitude above MAX_ABS_VALUE
  (squared distances would overflow float32) and, for a float16 index, a value float16 cannot hold.
- CUDA arrays (CuPy, torch CUDA; anything with __cuda_array_interface__) are described here, never
  copied to the host; a CPU index refuses them with a TypeError that says how to move them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .spec import MAX_K, parse_k

# Largest |value| accepted in float32 data or queries: with dim up to 65536 the squared L2 distance
# (2 * 2**50)**2 * 2**16 = 2**118 and the inner product stay far inside float32's 2**128.
MAX_ABS_VALUE = float(2**50)
FLOAT16_MAX = float(np.finfo(np.float16).max)

_ACCEPTED_FLOATS = (np.float16, np.float32, np.float64)


@dataclass(frozen=True)
class DeviceArray:
    """A CUDA array seen through __cuda_array_interface__ (v2/v3): no data is touched."""

    obj: object
    framework: str            # "cupy", "torch" or the owner's module name
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    strides: tuple[int, ...] | None   # None means C-contiguous
    stream: int | None        # the producer's stream handle, if it named one (v3)
    readonly: bool

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
    """True for CuPy arrays, torch CUDA tensors and anything else that exports __cuda_array_interface__."""
    if x.__class__ is np.ndarray:   # the common case, decided in one comparison
        return False
    if type(x).__module__.startswith("torch"):
        return bool(getattr(x, "is_cuda", False))
    return hasattr(type(x), "__cuda_array_interface__") or hasattr(x, "__cuda_array_interface__")


def describe_device_array(x) -> DeviceArray:
    interface = x.__cuda_array_interface__
    shape = tuple(int(n) for n in interface["shape"])
    dtype = np.dtype(interface["typestr"])
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


def _name_of(x) -> str:
    return f"{type(x).__module__}.{type(x).__name__}"


def to_host_array(x, what: str) -> np.ndarray:
    """Turn a host input into an ndarray without copying when possible; refuse CUDA arrays and non-floats."""
    if is_device_array(x):
        raise TypeError(
            f"{what} is a CUDA array ({_name_of(x)}) but this index lives on the CPU; "
            "move it with .get() (CuPy) or .cpu() (torch), or create the index with device='cuda'"
        )
    try:
        array = np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - anything that is not array-like
        raise TypeError(f"{what} must be an array of floats; got {_name_of(x)} ({exc})") from None
    check_float_dtype(array.dtype, what)
    return array


def check_float_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.type not in _ACCEPTED_FLOATS:
        raise TypeError(f"{what} must be float16, float32 or float64; got dtype {dtype}")


def check_matrix_shape(shape: tuple[int, ...], dim: int, what: str) -> None:
    if len(shape) != 2:
        hint = " (for one vector use x[None, :])" if len(shape) == 1 else ""
        raise ValueError(f"{what} must be 2-D (n, {dim}); got shape {tuple(shape)}{hint}")
    if shape[1] != dim:
        raise ValueError(f"{what} must have {dim} columns (the index's dim); got shape {tuple(shape)}")


def check_values(array: np.ndarray, what: str, storage_dtype: str) -> None:
    """Refuse NaN, infinity and magnitudes tinyknn cannot represent (see MAX_ABS_VALUE)."""
    if array.size == 0:
        return
    limit = FLOAT16_MAX if storage_dtype == "float16" else MAX_ABS_VALUE
    if array.dtype.itemsize >= 4:
        # Fast path, one BLAS pass and no temporary: every |x| is at most the norm of all of them, and
        # NaN or infinity make the sum NaN or infinite (vdot raises no overflow warning). Rounding
        # cannot matter with a factor of 2 to spare; anything else takes the exact check below.
        if float(np.vdot(array, array)) < (limit / 2) ** 2:
            return
    largest = float(np.max(np.abs(array)))  # NaN propagates through max, so one pass finds both
    if not np.isfinite(largest):
        bad = "NaN" if np.isnan(array).any() else "infinity"
        raise ValueError(f"{what} contains {bad}; tinyknn accepts finite values only")
    if storage_dtype == "float16" and largest > FLOAT16_MAX:
        raise ValueError(
            f"{what} holds {largest:g}, beyond float16's largest finite value {FLOAT16_MAX:g}; "
            "use dtype='float32' for this data"
        )
    if largest > MAX_ABS_VALUE:
        raise ValueError(
            f"{what} holds {largest:g}; tinyknn accepts |value| <= 2**50 ({MAX_ABS_VALUE:g}) so that "
            "squared distances and inner products stay finite in float32"
        )


def host_database(x, dim: int, storage_dtype: str) -> np.ndarray:
    """Vectors to add: (n, dim), finite, C-contiguous, in the storage dtype (a copy when needed)."""
    array = to_host_array(x, "vectors to add")
    check_matrix_shape(array.shape, dim, "vectors to add")
    check_values(array, "vectors to add", storage_dtype)
    return np.ascontiguousarray(array, dtype=storage_dtype)


def host_queries(q, dim: int, check: bool = True) -> np.ndarray:
    """Queries: (n_queries, dim), finite, C-contiguous float32 (a copy only when needed).

    check=False leaves the values of float32 input unchecked: the GPU searcher checks them itself
    while the device works (other dtypes are checked here, before any conversion)."""
    array = to_host_array(q, "queries")
    check_matrix_shape(array.shape, dim, "queries")
    if check or array.dtype != np.float32:
        check_values(array, "queries", "float32")
    return np.ascontiguousarray(array, dtype=np.float32)


def device_matrix(x, dim: int, what: str) -> DeviceArray:
    """Shape and dtype checks of a CUDA array; values (NaN) are checked on the device by the searcher."""
    described = describe_device_array(x)
    check_float_dtype(described.dtype, what)
    check_matrix_shape(described.shape, dim, what)
    return described


def check_k(k) -> int:
    """k as a Python int in 1..MAX_K, or a TypeError/ValueError that names what was given."""
    if k.__class__ is int and 1 <= k <= MAX_K:   # the common case, without the general parser
        return k
    return parse_k(k)


def new_ids(ids, n: int, existing: np.ndarray | None) -> np.ndarray:
    """The int64 ids of n new vectors: the caller's, or the next n after `existing`'s count.

    Ids must be unique across the whole index, and -1 is reserved for padding.
    """
    n_existing = 0 if existing is None else len(existing)
    if ids is None:
        created = np.arange(n_existing, n_existing + n, dtype=np.int64)
        # The existing ids are n_existing distinct values >= 0; if all lie below n_existing they are
        # exactly 0..n_existing-1 and the next ones cannot collide: one pass instead of a sort of the
        # whole index on every add.
        if n_existing == 0 or int(existing.max()) < n_existing:
            return created
    else:
        if is_device_array(ids):
            raise TypeError("ids must be a host (NumPy) array of integers; got a CUDA array")
        given = np.asarray(ids)
        if given.dtype.kind not in "iu" or given.dtype == np.uint64:
            raise TypeError(f"ids must be integers that fit int64; got dtype {given.dtype}")
        if given.shape != (n,):
            raise ValueError(f"ids must have shape ({n},), one per added vector; got shape {given.shape}")
        created = given.astype(np.int64, copy=True)
        if n and created.min() < 0:
            raise ValueError(f"ids must be >= 0 (-1 marks padding); got {int(created.min())}")
    combined = created if existing is None else np.concatenate([existing, created])
    if len(np.unique(combined)) != len(combined):
        values, counts = np.unique(combined, return_counts=True)
        duplicated = values[counts > 1][:5].tolist()
        raise ValueError(f"ids must be unique in the index; duplicated: {duplicated}")
    return created


__all__ = [
    "MAX_ABS_VALUE", "MAX_K", "DeviceArray", "check_k", "device_matrix", "describe_device_array",
    "host_database", "host_queries", "is_device_array", "new_ids",
]
