"""The cubin cache: memory -> disk -> NVRTC, safe across threads and processes.

`get_cubin(spec)` answers from an in-process dict (no I/O), else from `<cache_dir>/cubins/<key>.cubin`
(checksum verified, see store.py), else compiles with NVRTC and writes the file atomically. The key
is a sha256 over everything that changes the machine code: the rendered source, every NVRTC option
(arch included), the name expressions, the NVRTC version, tinyknn's version and the file format.

Why not cuda.core's FileStreamProgramCache / `Program.compile(cache=...)`: checked on cuda-core
1.2.2, `compile(cache=...)` raises ValueError when name expressions are given (the lowered-name
mapping is not stored), and every tinyknn kernel is a template instantiated by name expression; an
entry is the raw cubin, with no room for the spec, the ptxas report or a checksum, and nothing
checks a read (a truncated file would go to the driver); its constructor creates directories and
lets PermissionError through, where tinyknn must degrade to memory with one warning; its key helper
takes ProgramOptions, which cannot carry the renderer's plain NVRTC option strings; and it is new
(merged in 2026, not in the 1.2.0 release notes) while the GPU machine has 1.2.0. What would remain
of it here is "write a temporary file, os.replace", which store.write_atomic does in ten lines.

A read-only or full cache directory degrades to memory only with one warning. A corrupt, truncated
or foreign entry is reported with a warning, removed and recompiled. A file lock per key (filelock)
keeps processes from compiling one spec twice; correctness never depends on it (atomic renames do).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import threading
import time
import warnings
from pathlib import Path

from .._version import __version__
from ..config import get_config
from ..spec import KernelSpec
from . import maintenance, store, toolchain
from .compiler import Cubin, compile_cubin, compile_options

log = logging.getLogger(__name__)   # "tinyknn.jit.cache": hits, misses, compiles, repairs

LOCK_TIMEOUT_S = 120.0   # a compile takes seconds; past this, compile rather than wait


class CubinCacheWarning(UserWarning):
    """The cubin cache could not use its directory, or found a bad entry; it carries on."""


def _default_render(spec: KernelSpec):
    from .cuda_source import render_source

    return render_source(spec)


def entry_key(rendered, arch: str, nvrtc: tuple[int, int]) -> str:
    """sha256 hex over everything that changes the cubin of `rendered` for `arch`."""
    fields = {
        "format": store.FORMAT_VERSION,
        "tinyknn": __version__,
        "nvrtc": list(nvrtc),
        "options": list(compile_options(rendered, arch)),
        "name_expressions": list(rendered.name_expressions),
        "source": hashlib.sha256(rendered.source.encode()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class CubinCache:
    """Cubins by KernelSpec. `render` (spec -> RenderedSource) defaults to tinyknn.jit.render."""

    def __init__(self, directory: Path, *, render=None):
        self.directory = Path(directory)
        self._render = render or _default_render
        self._lock = threading.Lock()
        self._memory: dict[KernelSpec, Cubin] = {}
        self._spec_locks: dict[KernelSpec, threading.Lock] = {}
        self._stats = {"memory_hits": 0, "disk_hits": 0, "compiles": 0}
        self._writable = True
        self._write_problem = ""
        self._warned: set[str] = set()
        self._version: tuple[int, int] | None = None
        self._unsaved: dict[KernelSpec, str] = {}   # compiled but not written, and why

    # -- lookups ----------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """Counters since this cache was made: memory_hits, disk_hits, compiles."""
        with self._lock:
            return dict(self._stats)

    def get(self, spec: KernelSpec) -> Cubin:
        return self.lookup(spec)[0]

    def lookup(self, spec: KernelSpec) -> tuple[Cubin, str]:
        """(cubin, where it came from: "memory" | "disk" | "compiled")."""
        if not isinstance(spec, KernelSpec):
            raise TypeError(f"spec must be a tinyknn.spec.KernelSpec; got {type(spec).__name__}")
        with self._lock:
            cubin = self._memory.get(spec)
            if cubin is not None:
                self._stats["memory_hits"] += 1
                log.debug("cubin cache: memory hit %s", spec)
                return cubin, "memory"
            spec_lock = self._spec_locks.setdefault(spec, threading.Lock())
        with spec_lock:   # threads wanting the same spec wait for one compile
            with self._lock:
                cubin = self._memory.get(spec)
            if cubin is not None:
                origin = "memory"
            else:
                cubin, origin = self._load_or_compile(spec)
            with self._lock:
                self._memory[spec] = cubin
                self._stats[{"memory": "memory_hits", "disk": "disk_hits", "compiled": "compiles"}[origin]] += 1
        return cubin, origin

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}{store.SUFFIX}"

    def _load_or_compile(self, spec: KernelSpec) -> tuple[Cubin, str]:
        rendered = self._render(spec)
        key = entry_key(rendered, spec.arch, self._nvrtc_version())
        cubin = self._read(key)
        if cubin is not None:
            log.debug("cubin cache: disk hit %s (%s)", spec, key[:16])
            return cubin, "disk"
        log.debug("cubin cache: miss %s (%s)", spec, key[:16])
        with self._interprocess_lock(key):
            cubin = self._read(key)   # another process may have compiled it while we waited
            if cubin is not None:
                log.debug("cubin cache: disk hit after waiting for the lock %s", spec)
                return cubin, "disk"
            start = time.perf_counter()
            cubin = compile_cubin(rendered, spec.arch, spec=spec)
            log.info("compiled %s in %.2f s", spec, time.perf_counter() - start)
            problem = self._write(key, store.encode_entry(key, spec, cubin, compile_options(rendered, spec.arch),
                                                          rendered.name_expressions))
            if problem is not None:
                with self._lock:
                    self._unsaved[spec] = problem
        return cubin, "compiled"

    def unsaved(self, spec: KernelSpec) -> str | None:
        """Why the compiled cubin of `spec` is not on disk (a full or read-only folder), or None if it is."""
        with self._lock:
            return self._unsaved.get(spec)

    # -- disk -------------------------------------------------------------------------------
    def _nvrtc_version(self) -> tuple[int, int]:
        """For the key; from the folder's stamp where it matches (see toolchain.py), once per cache."""
        if self._version is None:
            folder = self.directory if self._writable or self.directory.is_dir() else None
            self._version = toolchain.nvrtc_version_for_key(folder)
        return self._version

    def _read(self, key: str) -> Cubin | None:
        path = self.path_for(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self._warn_once("read", f"cannot read the cubin cache {self.directory} ({exc.strerror or exc}); "
                                    "compiling instead")
            return None
        try:
            return store.decode_entry(data, expected_key=key)[1]
        except store.EntryError as problem:
            removed = self._remove(path)
            log.warning("cubin cache: repairing %s: %s (%s)", path, problem, "removed" if removed else "not removable")
            self._warn(f"cache entry {path} is {problem}; {'removed it' if removed else 'cannot remove it'}"
                       " and compiling again")
            return None

    def _write(self, key: str, data: bytes) -> str | None:
        """None once written; else why not (the folder is then memory only for this cache)."""
        if not self._writable:
            return self._write_problem
        try:
            store.write_atomic(self.path_for(key), data)
        except OSError as exc:
            self._disable_writes(exc)
            return self._write_problem
        return None

    def _disable_writes(self, exc: OSError) -> None:
        self._writable = False
        self._write_problem = f"cannot write to {self.directory}: {exc.strerror or exc}"
        log.warning("cubin cache: cannot write to %s (%s); memory only from now on", self.directory, exc)
        self._warn_once("write", f"cannot write to the cubin cache {self.directory} ({exc.strerror or exc}); "
                                 "compiled kernels stay in memory only, for this process")

    def _warn_once(self, kind: str, message: str) -> None:
        """One warning per kind of directory problem per cache, however many kernels follow."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            self._warn(message)

    @contextlib.contextmanager
    def _interprocess_lock(self, key: str):
        """Hold a file lock for `key` if one can be had; carry on without one if not."""
        from filelock import FileLock, Timeout   # imported here: a disk hit never needs it

        lock = None
        if self._writable:
            try:
                (self.directory / "locks").mkdir(parents=True, exist_ok=True)
                lock = FileLock(str(self.directory / "locks" / f"{key}.lock"), timeout=LOCK_TIMEOUT_S)
                lock.acquire()
            except (OSError, Timeout):
                lock = None   # the lock only saves duplicate work; renames keep the files whole
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(f"tinyknn: {message}", CubinCacheWarning, stacklevel=4)

    # -- maintenance (the CLI): tinyknn.jit.maintenance ----------------------------------------
    def entry_paths(self) -> list[Path]:
        return maintenance.entry_paths(self.directory)

    def list_entries(self) -> list[dict]:
        return maintenance.list_entries(self.directory)

    def verify(self) -> list[tuple[Path, str]]:
        return maintenance.verify(self.directory)

    def info(self) -> dict:
        return maintenance.info(self.directory)

    def clear(self, extra_folders=()) -> maintenance.ClearReport:
        """Forget the in-memory cubins, then remove the folder's files (maintenance.clear)."""
        with self._lock:
            self._memory.clear()
        return maintenance.clear(self.directory, extra_folders)


@functools.lru_cache(maxsize=1)
def default_cache() -> CubinCache:
    """The process-wide cache at `config.get_config().cache_dir / "cubins"`, built on first use."""
    return CubinCache(get_config().cache_dir / "cubins")


def reset_default_cache() -> None:
    """Forget the process-wide cache (tests: after changing TINYKNN_CACHE_DIR and reset_config())."""
    default_cache.cache_clear()


def get_cubin(spec: KernelSpec) -> Cubin:
    """The cubin for `spec`: from memory, else disk, else NVRTC. Never raises for an unusable cache."""
    return default_cache().get(spec)
