"""Builds the C++ CPU library on first use, caches it, loads it with ctypes and binds its ABI.

Why compile on the user's machine: `-march=native` then uses every instruction the running CPU has
(AVX2/FMA, AVX-512, F16C) and none it lacks, and `pip install` needs no compiler step of its own.
The build is cached under `get_config().cache_dir / "cpu"`, one file per key; the key hashes the
sources, the compiler's identity, the flags and the CPU's identity, so a cache directory shared by
several machines never serves one CPU another's build. Builds go to a temporary file that is
`os.replace`d into place under a file lock: concurrent processes build once and never load half a file.

The library is loaded with `ctypes.CDLL`, which releases the GIL for the duration of every call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from .._paths import kernels_dir
from ..config import get_config
from ..errors import CpuLibraryError

ABI_VERSION = 4          # must equal TK_ABI_VERSION in kernels/cpu/tinyknn_cpu.h
COMPILERS = ("g++", "c++", "clang++")
# -march=native: exactly the running CPU's instructions (arm64 compilers spell it -mcpu=native)
_NATIVE = "-mcpu=native" if platform.machine().lower() in ("arm64", "aarch64") else "-march=native"
FLAGS = ("-O3", _NATIVE, "-std=c++17", "-fPIC", "-shared", "-pthread", "-ffp-contract=fast",
         "-fvisibility=hidden", "-fno-math-errno")
STATUS_INVALID_ARGUMENT, STATUS_OUT_OF_MEMORY = 1, 2
METRIC_CODES = {"l2": 0, "ip": 1, "cosine": 2}
DTYPE_CODES = {"float32": 0, "float16": 1}

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "tk_abi_version": ([], _int),
    "tk_last_error": ([], ctypes.c_char_p),
    "tk_build_info": ([], ctypes.c_char_p),
    "tk_pool_selftest": ([_int, _int, _int], _int),
    "tk_index_new": ([_i64, _int, _int, ctypes.POINTER(_ptr)], _int),
    "tk_index_free": ([_ptr], _int),
    "tk_index_add": ([_ptr, _ptr, _i64, _ptr], _int),
    "tk_build_param": ([ctypes.c_char_p, ctypes.POINTER(_i64)], _int),
    "tk_index_reset": ([_ptr], _int),
    "tk_index_truncate": ([_ptr, _i64], _int),
    "tk_index_exact_fallbacks": ([_ptr, ctypes.POINTER(_i64)], _int),
    "tk_index_size": ([_ptr, ctypes.POINTER(_i64)], _int),
    "tk_index_export": ([_ptr, _i64, _ptr, _ptr], _int),
    "tk_index_sketch_counts": ([_ptr, ctypes.POINTER(_i64), ctypes.POINTER(_i64)], _int),
    "tk_index_winograd_counts": ([_ptr, ctypes.POINTER(_i64), ctypes.POINTER(_i64)], _int),
    "tk_index_use_first_passes": ([_ptr, _int], _int),
    "tk_index_search": ([_ptr, _ptr, _i64, _i64, _int, _ptr, _ptr], _int),
}


def source_files() -> list[Path]:
    """Everything the library is compiled from: kernels/cpu/* plus the shared headers."""
    root = kernels_dir()
    files = sorted((root / "cpu").glob("*.cpp")) + sorted((root / "cpu").glob("*.h"))
    return files + sorted(root.glob("*.cuh"))


def find_compiler() -> str:
    """The C++ compiler to use: config.cxx (TINYKNN_CXX or CXX) if set, else the first of COMPILERS."""
    wanted = get_config().cxx
    candidates = [wanted] if wanted else list(COMPILERS)
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    tried = f"TINYKNN_CXX/CXX={wanted!r}" if wanted else ", ".join(COMPILERS)
    raise CpuLibraryError(
        f"tinyknn's CPU search needs a C++17 compiler to build its library on first use; tried {tried} "
        "and found none on PATH. Install one (Debian/Ubuntu: `apt install g++`; Fedora: `dnf install "
        "gcc-c++`; macOS: `xcode-select --install`) or point TINYKNN_CXX at one."
    )


def compiler_identity(cxx: str) -> str:
    """The compiler's own description of itself (its version banner), part of the cache key."""
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuLibraryError(f"cannot run the C++ compiler {cxx} --version: {exc}") from None
    return f"{cxx}\n{result.stdout.strip()}"


def cpu_identity() -> str:
    """Model and feature flags of the running CPU: what -march=native compiles for."""
    parts = [platform.machine(), platform.processor()]
    try:
        wanted = ("vendor_id", "model name", "flags", "features", "cpu family", "model\t", "cpu part")
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(wanted):
                parts.append(line)
            elif not line.strip() and len(parts) > 2:
                break  # the first processor describes them all
    except OSError:
        pass
    if sys.platform == "darwin":
        for key in ("machdep.cpu.brand_string", "machdep.cpu.features", "hw.optional.arm64"):
            try:
                parts.append(subprocess.run(["sysctl", "-n", key], capture_output=True, text=True).stdout)
            except OSError:
                pass
    return "\n".join(parts)


def library_key(cxx: str, sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for item in (f"abi {ABI_VERSION}", compiler_identity(cxx), " ".join(FLAGS), cpu_identity()):
        digest.update(item.encode() + b"\0")
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def _library_dir() -> Path:
    """cache_dir/cpu, or a private temporary folder (with one warning) where that cannot be written."""
    folder = get_config().cache_dir / "cpu"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(handle)
        os.unlink(probe)
        return folder
    except OSError as exc:
        private = Path(tempfile.mkdtemp(prefix="tinyknn-cpu-"))
        warnings.warn(f"tinyknn cannot write its cache {folder} ({exc}); building the CPU library in {private}",
                      RuntimeWarning, stacklevel=3)
        return private


def compile_library(cxx: str, sources: list[Path], target: Path) -> None:
    """Compile to a temporary file next to `target`, then os.replace it into place."""
    temporary = target.with_name(f"{target.name}.tmp{os.getpid()}")
    command = [cxx, *FLAGS, *(str(p) for p in sources if p.suffix == ".cpp"), "-o", str(temporary)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuLibraryError(f"could not run the C++ compiler: {' '.join(command)}: {exc}") from None
    if result.returncode != 0:
        temporary.unlink(missing_ok=True)
        raise CpuLibraryError(
            f"the C++ compiler failed to build tinyknn's CPU library (exit {result.returncode})\n"
            f"command: {' '.join(command)}\n--- compiler output ---\n{(result.stderr + result.stdout).strip()}"
        )
    os.replace(temporary, target)


def build_library() -> Path:
    """The path of a built library for this machine: from the cache, else compiled now (once)."""
    from filelock import FileLock

    cxx = find_compiler()
    sources = source_files()
    folder = _library_dir()
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    target = folder / f"libtinyknn-{library_key(cxx, sources)}{suffix}"
    if target.is_file():
        return target
    with FileLock(str(target) + ".lock", timeout=900):
        if not target.is_file():  # another process may have built it while we waited
            compile_library(cxx, sources, target)
    return target


def _bind(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))  # CDLL, not PyDLL: every call releases the GIL
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = restype
    version = library.tk_abi_version()
    if version != ABI_VERSION:
        raise CpuLibraryError(f"{path} has ABI version {version}; tinyknn expects {ABI_VERSION}")
    return library


@functools.lru_cache(maxsize=1)
def get_library() -> ctypes.CDLL:
    """The loaded library of this process (built on first use); reset_library() forgets it."""
    path = build_library()
    try:
        return _bind(path)
    except OSError as exc:  # a damaged file in the cache: remove it and build once more
        warnings.warn(f"tinyknn's cached CPU library {path} cannot be loaded ({exc}); rebuilding it",
                      RuntimeWarning, stacklevel=2)
        path.unlink(missing_ok=True)
        return _bind(build_library())


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
