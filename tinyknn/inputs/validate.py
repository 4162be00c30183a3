"""The one place user inputs are checked and converted.

Length: the conversion policy below is one set of rules, and every check that enforces it sits beside it so
that a rule and its check change together (the index operations' own checks are in validate_ops.py).

Conversion policy (also in docs/index-operations.md, "Input conversion", and the Index docstrings):
- Host arrays (NumPy, anything `np.asarray` turns into a real floating array, torch CPU tensors):
  float16/float32/float64 are accepted. The database is stored in the index's dtype and queries are
  searched in float32, so an input in another float dtype, or not C-contiguous, is copied once
  (`np.ascontiguousarray(x, dtype)`); a C-contiguous input already in that dtype is used without a copy
  for queries (the index's stored database is always its own copy). Read-only inputs are fine: tinyknn
  never writes to an input.
- Integer, boolean, complex and object arrays are refused (TypeError) by a float index: silently casting
  ids or pixel counts is more often a bug than an intent. bfloat16 (ml_dtypes) input is accepted too.
- Storage dtypes (spec.DTYPES): float32, float16, bfloat16 take float16/32/64 and bfloat16 input; a
  bfloat16 index stores float64 -> float32 -> bfloat16, each rounding to nearest (what the GPU ingest
  does, kernels/ingest.cuh), |x| <= 2**50. An int8/uint8 index takes integer arrays and float arrays whose
  values are integers, within the type's range (else a ValueError naming the offending value's position),
  for its vectors and for its queries alike; queries are searched as float32 (exact for 8-bit values).
- NaN or infinity anywhere is refused (ValueError), as is a float32 magnitude above MAX_ABS_VALUE
  (squared distances would overflow float32) and, for a float16 index, a value float16 cannot hold.
- DLPack: a CPU object with __dlpack__ (NumPy >= 1.22, torch, JAX on the CPU) is read in place with
  np.from_dlpack; one on a CUDA device counts as a CUDA array (described from its DLPack capsule).
- Masked arrays and sparse matrices are refused (TypeError): dropping the mask or densifying silently
  would change what is searched.
- CUDA arrays (CuPy, torch CUDA; anything with __cuda_array_interface__ or a CUDA DLPack device) are
  described here, never copied to the host; a CPU index refuses them with a TypeError that says how
  to move them. The kernels read rows that are contiguous, any step apart; an array laid out otherwise
  (Fortran order, a column slice, negative strides) is copied on its device by its own framework
  (torch's .contiguous(), cupy.ascontiguousarray; other frameworks through CuPy), on the caller's
  current stream, as NumPy input of any layout is converted.
(Past 300 lines: host and CUDA arrays follow one conversion policy, and are kept where it is read as one.)
"""

from __future__ import annotations

import numpy as np

from .arrays import (DeviceArray, describe_device_array, dlpack_device_kind, from_dlpack, is_device_array,  # noqa: F401
                     name_of)
from ..spec import MAX_K, parse_k

# Largest |value| accepted in float32 data or queries: with dim up to 65536 the squared L2 distance
# (2 * 2**50)**2 * 2**16 = 2**118 and the inner product stay far inside float32's 2**128.
MAX_ABS_VALUE = float(2**50)
FLOAT16_MAX = float(np.finfo(np.float16).max)
FLOAT32_MAX = float(np.finfo(np.float32).max)
INT64_MAX = int(np.iinfo(np.int64).max)
# Host vectors are converted to the storage dtype and handed to the searcher this many bytes at a time.
CHUNK_BYTES = 64 << 20

_ACCEPTED_FLOATS = (np.float16, np.float32, np.float64)
EIGHT_BIT = ("int8", "uint8")
_FLOAT32 = np.dtype(np.float32)        # NumPy's builtin descriptors are singletons: `dtype is _FLOAT32` is exact
# finite_float32's bound on a float32 sum of squares: check_values's fast path for MAX_ABS_VALUE.
_FINITE_SQUARES = (MAX_ABS_VALUE / 2) ** 2
_vdot = np.vdot


def to_host_array(x, what: str, integers: bool = False) -> np.ndarray:
    """Turn a host input into an ndarray without copying when possible; refuse CUDA arrays, non-floats
    (integers too unless `integers`: an 8-bit index) and inputs that would silently lose information
    (masked arrays, sparse matrices)."""
    if is_device_array(x):
        raise TypeError(
            f"{what} is a CUDA array ({name_of(x)}) but this index lives on the CPU; "
            "move it with .get() (CuPy), .cpu() (torch) or jax.device_put (JAX), or create the index with device='cuda'"
        )
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{what} is a masked array; masks are not supported: fill the masked values first "
                        "(x.filled(value)) or drop the rows that hold them")
    if hasattr(x, "toarray") and hasattr(x, "nnz"):
        raise TypeError(f"{what} is a sparse matrix ({name_of(x)}); tinyknn needs dense rows: pass x.toarray()")
    kind = dlpack_device_kind(x)
    if kind == "other":
        raise TypeError(f"{what} ({name_of(x)}) lives on a device tinyknn cannot read (DLPack device "
                        f"{x.__dlpack_device__()}); move it to the CPU or a CUDA GPU")
    array = from_dlpack(x, what) if kind == "cpu" else None
    if array is None:
        try:
            array = np.asarray(x)
        except Exception as exc:  # noqa: BLE001 - anything that is not array-like
            raise TypeError(f"{what} must be an array of floats; got {name_of(x)} ({exc})") from None
    if integers and array.dtype.kind in "iu":
        return array
    check_float_dtype(array.dtype, what, integers)
    return array


def check_float_dtype(dtype: np.dtype, what: str, integers: bool = False) -> None:
    if dtype.type not in _ACCEPTED_FLOATS and dtype.name != "bfloat16":
        allowed = "integers (an 8-bit index) or float16, float32, float64, bfloat16" if integers else \
            "float16, float32, float64 or bfloat16"
        raise TypeError(f"{what} must be {allowed}; got dtype {dtype}")


def check_integral(array: np.ndarray, what: str, storage_dtype: str) -> None:
    """An 8-bit index's values: integers within int8's or uint8's range (floats holding integers too);
    otherwise a ValueError naming the first offending value and where it is."""
    if array.size == 0:
        return
    info = np.iinfo(storage_dtype)
    if array.dtype.kind in "iu":
        if int(array.min()) >= info.min and int(array.max()) <= info.max:
            return
        bad = (array < info.min) | (array > info.max)
    else:
        wide = array.astype(np.float64)      # bfloat16 and float16 widen exactly
        with np.errstate(invalid="ignore"):
            bad = ~((wide >= info.min) & (wide <= info.max) & (wide == np.trunc(wide)))
        if not bad.any():
            return
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    place = f"row {where[0]}, column {where[1]}" if len(where) == 2 else f"position {where}"
    value = array[where]
    shown = int(value) if array.dtype.kind in "iu" else float(value)
    raise ValueError(f"{what} holds {shown!r} at {place}; an {storage_dtype} index takes integers in "
                     f"{info.min} .. {info.max} only")


def to_storage(source: np.ndarray, out: np.ndarray) -> None:
    """source's values into out (the storage dtype), rounding as the GPU ingest does: bfloat16 through
    float32 (float64 -> float32 -> bfloat16, each to nearest), everything else in one rounding."""
    if out.dtype.name == "bfloat16" and source.dtype not in (np.float32, out.dtype):
        source = source.astype(np.float32)
    np.copyto(out, source, casting="unsafe")


def as_storage(source: np.ndarray, storage: np.dtype) -> np.ndarray:
    """source in the storage dtype, C-contiguous (itself when it already is)."""
    if source.dtype == storage and source.flags.c_contiguous:
        return source
    out = np.empty(source.shape, dtype=storage)
    to_storage(source, out)
    return out


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
        # cannot matter with a factor of 2 to spare (a rounded sum of non-negative terms is never below
        # its largest term's rounded square, whatever the order or the number of terms); anything else
        # takes the exact check below.
        if float(np.vdot(array, array)) < (limit / 2) ** 2:
            return
    largest = float(np.max(np.abs(array)))  # NaN propagates through max, so one pass finds both
    if not np.isfinite(largest):
        bad = "NaN" if np.isnan(array).any() else "infinity"
        raise ValueError(f"{what} contains {bad}; tinyknn accepts finite values only")
    if storage_dtype == "float16" and largest > FLOAT16_MAX:
        raise ValueError(
            f"{what} holds {_largest_at(array)}, beyond float16's largest finite value {FLOAT16_MAX!r}; "
            "use dtype='float32' for this data"
        )
    if largest > MAX_ABS_VALUE:
        beyond = f", beyond float32's range (largest finite {FLOAT32_MAX!r})" if largest > FLOAT32_MAX else ""
        raise ValueError(
            f"{what} holds {_largest_at(array)}{beyond}; tinyknn accepts |value| <= 2**50 ({MAX_ABS_VALUE!r}) so "
            "that squared distances and inner products stay finite in float32"
        )


def _largest_at(array: np.ndarray) -> str:
    """The value of largest magnitude and where it is, e.g. "-65504.001 at row 3, column 7": the float64
    repr (the shortest that reads back exactly), so that it differs visibly from any limit it exceeds."""
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(np.abs(array))), array.shape))
    place = f"row {where[0]}, column {where[1]}" if len(where) == 2 else f"position {where}"
    return f"{float(array[where])!r} at {place}"


def host_rows(x, dim: int, storage_dtype: str) -> np.ndarray:
    """Vectors to add: (n, dim), every value checked, NOT yet converted: the index converts and hands
    them over CHUNK_BYTES at a time, so an add never holds a second full copy of the input."""
    eight_bit = storage_dtype in EIGHT_BIT
    array = to_host_array(x, "vectors to add", integers=eight_bit)
    check_matrix_shape(array.shape, dim, "vectors to add")
    if eight_bit:
        check_integral(array, "vectors to add", storage_dtype)
    else:
        check_values(array, "vectors to add", storage_dtype)
    return array


def host_queries(q, dim: int, check: bool = True, storage_dtype: str = "float32") -> np.ndarray:
    """Queries: (n_queries, dim), finite, C-contiguous float32 (a copy only when needed).

    check=False leaves the values of float32 input unchecked: the GPU searcher checks them itself
    while the device works (other dtypes are checked here, before any conversion). An 8-bit index
    takes queries by its own rule (check_integral), always checked here.

    The common case (a C-contiguous float32 ndarray of width dim, a float index) is decided first, in a
    few attribute reads and one dot product (float32_rows); everything else takes the general path."""
    if q.__class__ is np.ndarray and q.dtype is _FLOAT32 and q.ndim == 2 and q.shape[1] == dim and \
            q.flags.c_contiguous and storage_dtype not in EIGHT_BIT:
        if check:
            finite_float32(q)
        return q
    eight_bit = storage_dtype in EIGHT_BIT
    array = to_host_array(q, "queries", integers=eight_bit)
    check_matrix_shape(array.shape, dim, "queries")
    if eight_bit:
        check_integral(array, "queries", storage_dtype)
    elif check or array.dtype != np.float32:
        check_values(array, "queries", "float32")
    if array.dtype.kind == "V":          # bfloat16 (ml_dtypes); dtype.name costs ~1.7 us, so it is not asked
        return array.astype(np.float32)
    return np.ascontiguousarray(array, dtype=np.float32)


def finite_float32(array: np.ndarray) -> None:
    """check_values(array, "queries", "float32") for a C-contiguous float32 ndarray, in one dot product of
    its flat view (check_values's fast path and its bound, without its general steps); whatever that cannot
    clear (NaN, infinity, |x| near or above MAX_ABS_VALUE) goes to check_values, which raises or returns.
    vdot, not ndarray.dot: an overflowing sum is simply infinite there, with no RuntimeWarning."""
    if not _vdot(array, array) < _FINITE_SQUARES:
        check_values(array, "queries", "float32")


def device_matrix(x, dim: int, what: str, storage_dtype: str = "float32", queries: bool = False) -> DeviceArray:
    """Shape and dtype checks of a CUDA array; values (NaN, 8-bit ranges) are checked on the device by the
    searcher. An 8-bit index takes CUDA vectors of floats or int8/uint8 (the ingest checks their values)
    and CUDA queries of its own dtype only (their values need no check)."""
    described = describe_device_array(x)
    if storage_dtype in EIGHT_BIT and queries:
        if described.dtype.name != storage_dtype:
            raise TypeError(f"{what} for a {storage_dtype} index on the GPU must be {storage_dtype} CUDA arrays "
                            f"(or host arrays of integers); got dtype {described.dtype}")
    elif not (storage_dtype in EIGHT_BIT and described.dtype.name in EIGHT_BIT):
        check_float_dtype(described.dtype, what, storage_dtype in EIGHT_BIT)
    check_matrix_shape(described.shape, dim, what)
    if not rows_readable(described):
        described = describe_device_array(_contiguous_on_device(x, described, what))
    return described


def rows_readable(array: DeviceArray) -> bool:
    """Whether the kernels read `array` (2-D) in place: each row's elements contiguous, rows any whole
    number of elements >= a row apart (tinyknn.gpu.interop.row_step)."""
    if array.strides is None or array.c_contiguous:
        return True
    rows, cols = array.shape
    item = array.dtype.itemsize
    step, column = array.strides
    return not ((cols > 1 and column != item) or step % item or (rows > 1 and step < cols * item))


def _contiguous_on_device(x, described: DeviceArray, what: str):
    """A C-contiguous copy of the CUDA array x on its own device, made by its framework on the caller's
    current stream (which tinyknn's work then waits for): torch's .contiguous(), cupy.ascontiguousarray,
    and for other frameworks (JAX, Numba, ...) cupy.ascontiguousarray of a zero-copy CuPy view. Never
    through the host."""
    nbytes = int(np.prod(described.shape)) * described.dtype.itemsize
    try:
        if described.framework == "torch":
            return x.contiguous()
        try:
            import cupy
        except ImportError:
            raise ValueError(
                f"{what} must have contiguous rows (strides (row_step >= {described.shape[1] * described.dtype.itemsize}, "
                f"{described.dtype.itemsize}) bytes); got strides {described.strides}, and CuPy, which tinyknn uses to "
                f"copy a {described.framework} array on the device, is not installed: pass a contiguous copy") from None
        if described.framework == "cupy":
            with x.device:
                return cupy.ascontiguousarray(x)
        view = cupy.asarray(x) if described.keepalive is None else cupy.from_dlpack(x)
        with view.device:
            return cupy.ascontiguousarray(view)
    except MemoryError as exc:                   # CuPy's OutOfMemoryError is one
        raise MemoryError(f"{what}: a contiguous copy of the {described.framework} array ({nbytes:,} bytes, "
                          f"strides {described.strides}) does not fit in device memory: {exc}") from None
    except RuntimeError as exc:                  # torch.OutOfMemoryError is a RuntimeError
        if "out of memory" not in str(exc).lower():
            raise
        raise MemoryError(f"{what}: a contiguous copy of the {described.framework} array ({nbytes:,} bytes, "
                          f"strides {described.strides}) does not fit in device memory: {exc}") from None


def check_k(k) -> int:
    """k as a Python int in 1..MAX_K, or a TypeError/ValueError that names what was given."""
    if k.__class__ is int and 1 <= k <= MAX_K:   # the common case, without the general parser
        return k
    return parse_k(k)


def user_ids(ids, n: int) -> np.ndarray:
    """The caller's ids of n new vectors as a fresh int64 array: integers in 0 .. 2**63 - 1.

    -1 stays free (FAISS's "no result" marker, tinyknn's padding). Uniqueness is the index's check
    (tinyknn.index.ids), which knows the ids already held."""
    if is_device_array(ids) or dlpack_device_kind(ids) == "cuda":
        raise TypeError("ids must be a host (NumPy) array of integers; got a CUDA array")
    if isinstance(ids, np.ma.MaskedArray):
        raise TypeError("ids must not be a masked array (masks are not supported); pass ids.compressed() "
                        "together with the matching rows")
    if isinstance(ids, (list, tuple)):
        given = _python_ids(ids)
    else:
        given = from_dlpack(ids, "ids") if dlpack_device_kind(ids) == "cpu" else None
        given = np.asarray(ids) if given is None else given
    if given.shape != (n,):
        raise ValueError(f"ids must have shape ({n},), one per added vector; got shape {given.shape}")
    if given.size == 0:
        return np.empty(0, dtype=np.int64)          # ids=[] with no rows: whatever dtype [] became
    if given.dtype.kind == "u" and given.dtype.itemsize == 8 and int(given.max()) > INT64_MAX:
        raise ValueError(f"ids must lie in 0 .. {INT64_MAX} (int64); got {int(given.max())}")
    if given.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers (int64 or smaller); got dtype {given.dtype}")
    created = given.astype(np.int64, copy=True)
    if created.min() < 0:
        raise ValueError(f"ids must be >= 0 (-1 marks a missing result); got {int(created.min())}")
    return created


def _python_ids(ids) -> np.ndarray:
    """A list or tuple of ids: Python ints beyond int64 get a ValueError naming the range, not the
    float64 or object dtype that NumPy would silently pick for them."""
    for value in ids:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            if isinstance(value, (list, tuple, np.ndarray)):
                break                                   # nested: the shape check below explains it
            raise TypeError(f"ids must be integers; got {value!r} ({type(value).__name__})")
        if not -INT64_MAX - 1 <= int(value) <= INT64_MAX:
            raise ValueError(f"ids must lie in 0 .. {INT64_MAX} (int64); got {int(value)}")
    return np.asarray(ids) if len(ids) else np.empty(0, dtype=np.int64)


__all__ = [
    "MAX_ABS_VALUE", "MAX_K", "DeviceArray", "check_k", "device_matrix", "describe_device_array",
    "CHUNK_BYTES", "finite_float32", "host_queries", "host_rows", "is_device_array", "user_ids",
]
