"""Loads the C++ CPU library with ctypes and binds its ABI: a prebuilt one the wheel ships (prebuilt.py) when
it fits this CPU and these sources, else the one build.py builds for this machine (cached, verified).

The library is loaded with `ctypes.CDLL`, which releases the GIL for the duration of every call. A library
that is not ours (a foreign file in its place that its checksum sidecar vouches for: no tk_* symbols, another
ABI, other sources) is refused with CpuLibraryError and removed, so the next process rebuilds it (build.py
already rebuilds any file whose bytes do not match its sidecar, before loading it); a fresh build that
cannot load is an error, never a second compile.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from ..errors import CpuLibraryError
from . import build, cache, prebuilt
from .build import ABI_VERSION

STATUS_INVALID_ARGUMENT, STATUS_OUT_OF_MEMORY = 1, 2
METRIC_CODES = {"l2": 0, "ip": 1, "cosine": 2}
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "uint8": 4}

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "tk_abi_version": ([], _int),
    "tk_last_error": ([], ctypes.c_char_p),
    "tk_build_info": ([], ctypes.c_char_p),
    "tk_sources_digest": ([], ctypes.c_char_p),
    "tk_build_param": ([ctypes.c_char_p, ctypes.POINTER(_i64)], _int),
    "tk_pool_selftest": ([_int, _int, _int], _int),
    "tk_index_new": ([_i64, _int, _int, ctypes.POINTER(_ptr)], _int),
    "tk_index_free": ([_ptr], _int),
    "tk_index_add": ([_ptr, _ptr, _i64, _ptr], _int),
    "tk_index_reset": ([_ptr], _int),
    "tk_index_truncate": ([_ptr, _i64], _int),
    "tk_index_size": ([_ptr, ctypes.POINTER(_i64)], _int),
    "tk_index_export": ([_ptr, _i64, _ptr, _ptr], _int),
    "tk_index_sketch_counts": ([_ptr, ctypes.POINTER(_i64), ctypes.POINTER(_i64)], _int),
    "tk_index_winograd_counts": ([_ptr, ctypes.POINTER(_i64), ctypes.POINTER(_i64)], _int),
    "tk_index_exact_fallbacks": ([_ptr, ctypes.POINTER(_i64)], _int),
    "tk_index_use_first_passes": ([_ptr, _int], _int),
    "tk_index_search": ([_ptr, _ptr, _i64, _i64, _int, _ptr, _ptr], _int),
    "tk_index_search_rows": ([_ptr, _ptr, _i64, _i64, _int, _ptr, _i64, _ptr, _ptr], _int),
    "tk_index_row_copy": ([_ptr, _int, _int], _int),
    "tk_index_row_copy_counts": ([_ptr, ctypes.POINTER(_i64), ctypes.POINTER(_i64), ctypes.POINTER(_i64)], _int),
    "tk_index_remove_rows": ([_ptr, _ptr, _i64, _ptr, _ptr, ctypes.POINTER(_i64)], _int),
    "tk_index_get_rows": ([_ptr, _ptr, _i64, _ptr], _int),
    "tk_index_permute_rows": ([_ptr, _ptr, _i64, _int], _int),
    "tk_index_range_search": ([_ptr, _ptr, _i64, ctypes.c_double, _ptr, _i64, _int, ctypes.POINTER(_ptr)], _int),
    "tk_range_total": ([_ptr, ctypes.POINTER(_i64)], _int),
    "tk_range_copy": ([_ptr, _ptr, _ptr, _ptr], _int),
    "tk_range_free": ([_ptr], _int),
}


def bind(path: Path, digest: str | None = None) -> ctypes.CDLL:
    """Load `path` (a verified file) and bind the ABI; CpuLibraryError when it is not a tinyknn library of this
    ABI (and, given `digest`, of these sources)."""
    try:
        library = ctypes.CDLL(str(path))  # CDLL, not PyDLL: every call releases the GIL
    except OSError as exc:
        raise CpuLibraryError(f"{path} cannot be loaded: {exc}") from None
    try:
        for name, (argtypes, restype) in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = restype
    except AttributeError as exc:
        raise CpuLibraryError(f"{path} is not tinyknn's CPU library of ABI {ABI_VERSION}: {exc}") from None
    version = library.tk_abi_version()
    if version != ABI_VERSION:
        raise CpuLibraryError(f"{path} has ABI version {version}; tinyknn expects {ABI_VERSION}")
    if digest is not None and library.tk_sources_digest().decode() != digest:
        raise CpuLibraryError(f"{path} was built from other sources than this installation's")
    return library


@functools.lru_cache(maxsize=1)
def get_library() -> ctypes.CDLL:
    """The loaded library of this process (prebuilt, cached, or built on first use); reset_library() forgets it."""
    digest = build.sources_digest(build.source_files())
    for path in prebuilt.candidates():
        try:
            library = bind(path, digest)
            cache.log.info("using the prebuilt CPU library %s", path)
            return library
        except CpuLibraryError as exc:
            cache.log.warning("prebuilt CPU library not used: %s", exc)
    path, compiled = build.build_library_reporting()
    try:
        return bind(path, digest)
    except CpuLibraryError as exc:
        if compiled:
            raise CpuLibraryError(f"tinyknn's freshly built CPU library cannot be used: {exc}") from None
        # (the dynamic loader keeps what it loaded under this path: a rebuild could not be loaded in this process)
        cache.remove(path, f"cannot be used ({exc})")
        raise CpuLibraryError(f"tinyknn's cached CPU library {path} was not its own ({exc}); it has been removed, "
                              "and the next process builds it again") from None


def reset_library() -> None:
    """Forget the loaded library (tests use it after changing the cache directory or compiler)."""
    get_library.cache_clear()


def build_param(name: str, library: ctypes.CDLL | None = None) -> int:
    """One number of the loaded build's shape (tk_build_param): "lanes", "panel_rows", "sketch_min_panels", ..."""
    library = library or get_library()
    value = ctypes.c_int64()
    check(library, library.tk_build_param(name.encode(), ctypes.byref(value)), f"reading build parameter {name!r}")
    return value.value


def check(library: ctypes.CDLL, status: int, what: str) -> None:
    """Turn a non-zero status into ValueError, MemoryError or CpuLibraryError with the library's message."""
    if status == 0:
        return
    message = (library.tk_last_error() or b"").decode(errors="replace")
    if status == STATUS_INVALID_ARGUMENT:
        raise ValueError(f"{what}: {message}")
    if status == STATUS_OUT_OF_MEMORY:
        raise MemoryError(f"{what}: {message}")
    raise CpuLibraryError(f"{what} failed in tinyknn's CPU library (status {status}): {message}")
