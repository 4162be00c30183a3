"""The CPU library's build (cache key, locking, errors) and its C ABI (status codes, messages)."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from tinyknn.config import reset_config
from tinyknn.cpu import build, cache, library, prebuilt
from tinyknn.errors import CpuLibraryError

TINY_SOURCE = 'extern "C" __attribute__((visibility("default"))) int tk_tiny(void) { return 42; }\n'


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch):
    """A one-function library instead of the real sources: build tests then compile in well under a second."""
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text(TINY_SOURCE)
    monkeypatch.setattr(build, "source_files", lambda: [source])
    return source


@pytest.fixture
def count_compiles(monkeypatch):
    calls = []
    real = build.compile_library

    def counting(*args):
        calls.append(args)
        real(*args)

    monkeypatch.setattr(build, "compile_library", counting)
    return calls


def test_real_library_loads_and_describes_its_build():
    lib = library.get_library()
    assert lib.tk_abi_version() == library.ABI_VERSION
    info = lib.tk_build_info().decode()
    assert "lanes" in info and "float16" in info


def test_build_is_cached_under_cache_dir_and_reused(cache_dir, tiny_sources, count_compiles):
    first = build.build_library()
    assert first.parent == cache_dir / "cpu" and first.is_file()
    assert ctypes.CDLL(str(first)).tk_tiny() == 42
    assert build.build_library() == first
    assert len(count_compiles) == 1
    assert not list(first.parent.glob("*.tmp*")), "temporary build files must not remain"


def test_key_covers_sources_compiler_flags_and_cpu(cache_dir, tiny_sources, monkeypatch):
    cxx = build.find_compiler()
    key = build.library_key(cxx, [tiny_sources])
    tiny_sources.write_text(TINY_SOURCE + "// changed\n")
    assert build.library_key(cxx, [tiny_sources]) != key
    tiny_sources.write_text(TINY_SOURCE)
    monkeypatch.setattr(build, "cpu_identity", lambda: "another CPU with other flags")
    assert build.library_key(cxx, [tiny_sources]) != key
    monkeypatch.undo()
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-DEXTRA",))
    assert build.library_key(cxx, [tiny_sources]) != key


def test_cpu_identity_names_the_features_native_code_depends_on():
    identity = build.cpu_identity()
    if sys.platform.startswith("linux"):
        assert "flags" in identity or "Features" in identity


def test_concurrent_processes_build_once(cache_dir, tiny_sources, tmp_path):
    log = tmp_path / "compiles.log"
    script = textwrap.dedent(f"""
        from pathlib import Path
        from tinyknn.cpu import build
        build.source_files = lambda: [Path({str(tiny_sources)!r})]
        real = build.compile_library
        def logged(*args):
            with open({str(log)!r}, "a") as handle:
                handle.write("compiled\\n")
            real(*args)
        build.compile_library = logged
        print(build.build_library())
    """)
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
                 for _ in range(3)]
    paths = {process.communicate(timeout=120)[0].strip() for process in processes}
    assert all(process.returncode == 0 for process in processes)
    assert len(paths) == 1 and log.read_text().count("compiled") == 1


def test_threads_of_one_process_build_once(cache_dir, tiny_sources, count_compiles):
    paths = []
    workers = [threading.Thread(target=lambda: paths.append(build.build_library())) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(set(paths)) == 1 and len(count_compiles) == 1


def test_no_compiler_says_what_was_tried_and_what_to_install(monkeypatch):
    monkeypatch.setenv("TINYKNN_CXX", "/nonexistent/c++-compiler")
    reset_config()
    try:
        with pytest.raises(CpuLibraryError, match="nonexistent/c\\+\\+-compiler") as raised:
            build.find_compiler()
        assert "install" in str(raised.value)
    finally:
        monkeypatch.delenv("TINYKNN_CXX")
        reset_config()


def test_no_compiler_on_path_lists_the_defaults(monkeypatch):
    monkeypatch.delenv("TINYKNN_CXX", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    reset_config()
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    try:
        with pytest.raises(CpuLibraryError, match="g\\+\\+, c\\+\\+, clang\\+\\+"):
            build.find_compiler()
    finally:
        reset_config()


def test_failed_compile_shows_the_compiler_output(cache_dir, tiny_sources):
    tiny_sources.write_text("this is not C++;\n")
    with pytest.raises(CpuLibraryError) as raised:
        build.build_library()
    message = str(raised.value)
    assert "compiler output" in message and "tiny.cpp" in message and "error" in message
    assert not list((cache_dir / "cpu").glob("libtinyknn-*.so*[!k]"))  # no library, no temporary file


@pytest.fixture
def unwritable_cache(tmp_path, monkeypatch):
    """TINYKNN_CACHE_DIR names a regular file (a cache that cannot be written); temporary folders go to
    tmp_path/tmp. Yields the blocking file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TINYKNN_CACHE_DIR", str(blocker))
    monkeypatch.setattr(cache.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    reset_config()
    cache._fallback_dir.cache_clear()
    yield blocker
    cache._fallback_dir.cache_clear()
    reset_config()


def test_unwritable_cache_builds_once_in_a_per_user_folder(tmp_path, tiny_sources, count_compiles, unwritable_cache):
    """A cache that cannot be written: one warning, the build goes to a persistent per-user
    folder (not a fresh temporary one per process), a later process finds it there, nothing is left behind."""
    blocker = unwritable_cache
    with pytest.warns(RuntimeWarning, match="cannot write its cache") as caught:
        path = build.build_library()
    assert len([w for w in caught if "cannot write" in str(w.message)]) == 1
    assert path.is_file() and blocker not in path.parents and path.parent.parent.name.startswith("tinyknn-")
    cache._fallback_dir.cache_clear()      # a new process
    with pytest.warns(RuntimeWarning, match="cannot write its cache"):
        assert build.build_library() == path
    assert len(count_compiles) == 1
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == [path.parent.parent.name]
    assert not list(path.parent.glob("*.tmp*"))


def test_a_later_process_with_an_unwritable_cache_is_not_told_of_a_build(tmp_path, tiny_sources, count_compiles,
                                                                         unwritable_cache):
    """The warning of a process that finds the library already built in the per-user folder (in 0.2 s)
    used to say "building the CPU library in ..."; it now says where the library is kept, and claims no build."""
    blocker = unwritable_cache
    with pytest.warns(RuntimeWarning, match="cannot write its cache"):
        path = build.build_library()
    cache._fallback_dir.cache_clear()      # a new process
    with pytest.warns(RuntimeWarning) as caught:
        assert build.build_library() == path
    messages = [str(w.message) for w in caught]
    assert len(count_compiles) == 1 and len(messages) == 1, messages
    assert messages[0] == (f"tinyknn cannot write its cache {blocker / 'cpu'}; it keeps the CPU library in "
                           f"{path.parent} instead"), messages


def test_a_compiler_that_produces_nothing_is_a_clear_error(cache_dir, tiny_sources, monkeypatch):
    """TINYKNN_CXX=/bin/true: every step exits 0 and writes nothing; that was a raw FileNotFoundError from
    os.replace of the missing temporary library."""
    true = shutil.which("true")
    if true is None:
        pytest.skip("no `true` on PATH")
    monkeypatch.setenv("TINYKNN_CXX", true)
    reset_config()
    try:
        with pytest.raises(CpuLibraryError, match=f"the C\\+\\+ compiler {true} exited 0 but produced no library") \
                as raised:
            build.build_library()
        assert "TINYKNN_CXX" in str(raised.value)
        assert not list((cache_dir / "cpu").glob("libtinyknn-*.so*[!k]"))  # no library, no temporary file
    finally:
        reset_config()


def test_read_only_cache_with_a_build_loads_it_without_writing(tmp_path, tiny_sources, count_compiles, monkeypatch):
    """A read-only cache that already holds the build (a shared, pre-warmed cache): loaded from there."""
    monkeypatch.setenv("TINYKNN_CACHE_DIR", str(tmp_path / "cache"))
    reset_config()
    try:
        path = build.build_library()
        monkeypatch.setattr(cache, "_writable", lambda folder: False)
        assert build.build_library() == path and len(count_compiles) == 1
    finally:
        reset_config()


def real_library_in(cache: Path, monkeypatch) -> Path:
    """The cache path the real library would be built at under `cache` (the test's compile copies the shared
    cache's build there instead of compiling)."""
    built = Path(library.get_library()._name)
    monkeypatch.setenv("TINYKNN_CACHE_DIR", str(cache))
    reset_config()
    monkeypatch.setattr(build, "compile_library", lambda cxx, sources, target: shutil.copy(built, target))
    target = cache / "cpu" / built.name  # same sources, compiler and CPU: the same key
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def libm_file() -> Path | None:
    for name in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6", "/lib64/libm.so.6",
                 "/usr/lib64/libm.so.6"):
        if Path(name).is_file():
            return Path(name)
    return None


@pytest.mark.parametrize("damage", ["garbage", "truncated", "libm", "directory"])
def test_damaged_or_foreign_cached_library_is_rebuilt(tmp_path, monkeypatch, damage):
    """A truncated library (which the loader would map and die on with SIGBUS),
    another valid library in its place, or a directory at its path: never loaded; removed, rebuilt once,
    one warning, no temporary file left."""
    built = Path(library.get_library()._name)
    target = real_library_in(tmp_path / "cache", monkeypatch)
    shutil.copy(built, target)
    cache._write_json(cache.sidecar(target), {**build.build_facts(build.source_files()),
                                              "sha256": cache.file_sha256(target)})
    if damage == "garbage":
        target.write_bytes(b"\x7fELF but not really a library")
    elif damage == "truncated":
        with open(target, "r+b") as handle:
            handle.truncate(target.stat().st_size // 3)
    elif damage == "libm":
        if libm_file() is None:
            pytest.skip("no libm file found")
        shutil.copy(libm_file(), target)
    else:
        target.unlink()
        (target / "sub").mkdir(parents=True)
    library.reset_library()
    try:
        with pytest.warns(RuntimeWarning, match="does not match the checksum"):
            lib = library.get_library()
        assert lib.tk_abi_version() == library.ABI_VERSION and cache.verified(target)
        assert not list(target.parent.glob("*.tmp*"))
    finally:
        library.reset_library()
        reset_config()


def test_foreign_library_with_a_matching_sidecar_is_refused_and_removed(tmp_path, monkeypatch):
    """Even a foreign file that its sidecar vouches for is never bound: no tk_* symbols -> a CpuLibraryError
    that says so, the file removed (the loader keeps what it mapped under that path, so the rebuild is the next
    process's), which then rebuilds it."""
    if libm_file() is None:
        pytest.skip("no libm file found")
    target = real_library_in(tmp_path / "cache", monkeypatch)
    shutil.copy(libm_file(), target)
    cache._write_json(cache.sidecar(target), {**build.build_facts(build.source_files()),
                                              "sha256": cache.file_sha256(target)})
    library.reset_library()
    try:
        with pytest.warns(RuntimeWarning, match="cannot be used"):
            with pytest.raises(CpuLibraryError, match="not its own"):
                library.get_library()
        assert not target.exists() and not cache.sidecar(target).exists()
        assert build.build_library() == target and cache.verified(target)
    finally:
        library.reset_library()
        reset_config()


def test_cached_library_loads_without_a_compiler(tmp_path, monkeypatch):
    """With the library cached, TINYKNN_CXX=/nonexistent still loads it; and no process with
    a cached library runs the compiler (its identity is remembered by path, size and mtime)."""
    target = real_library_in(tmp_path / "cache", monkeypatch)
    library.reset_library()
    try:
        library.get_library()                     # "builds" (copies) it, remembers the compiler
        assert cache.verified(target)
        library.reset_library()
        runs = []
        real_run = build.subprocess.run
        monkeypatch.setattr(build.subprocess, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k))
        assert library.get_library().tk_abi_version() == library.ABI_VERSION
        assert runs == [], "a cached library must load without running the compiler"
        monkeypatch.setenv("TINYKNN_CXX", "/nonexistent/c++")
        reset_config()
        library.reset_library()
        assert Path(library.get_library()._name) == target
    finally:
        library.reset_library()
        reset_config()


def test_c_driver_gives_one_clear_error(cache_dir, monkeypatch):
    """TINYKNN_CXX=gcc (a C driver: no C++ runtime linked) fails once, at link time, with a
    CpuLibraryError that says to use a C++ compiler; never a second compile or a raw OSError."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc on PATH")
    monkeypatch.setenv("TINYKNN_CXX", gcc)
    reset_config()
    calls = []
    real = build.compile_library
    monkeypatch.setattr(build, "compile_library", lambda *args: calls.append(args) or real(*args))
    library.reset_library()
    try:
        with pytest.raises(CpuLibraryError, match="C\\+\\+ compiler") as raised:
            library.get_library()
        assert "undefined reference" in str(raised.value) and len(calls) == 1
        assert not list((cache_dir / "cpu").glob("*.tmp*")) and not list((cache_dir / "cpu").glob("*.so"))
    finally:
        library.reset_library()


def test_first_use_build_says_what_it_does_on_stderr_and_logs(cache_dir, tiny_sources, capfd, caplog):
    with caplog.at_level("INFO", logger="tinyknn.cpu"):
        build.build_library()
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and "building the CPU library" in err[0] and "built the CPU library in" in err[1]
    assert any("built the CPU library" in r.getMessage() for r in caplog.records if r.name == "tinyknn.cpu")
    build.build_library()
    assert capfd.readouterr().err == ""          # cached: silent


def test_prebuilt_levels_follow_the_cpu_features():
    v2 = {"sse4_1", "sse4_2", "ssse3", "popcnt"}
    v3 = v2 | {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert prebuilt.supported_levels(set()) == []
    assert prebuilt.supported_levels(v2) == [2]
    assert prebuilt.supported_levels(v3) == [3, 2]
    assert prebuilt.supported_levels(v3 - {"movbe"}) == [2]
    assert prebuilt.supported_levels(v4) == [4, 3, 2]
    assert prebuilt.supported_levels(v4 - {"avx2"}) == [2]   # AVX-512 flags without v3's: not v4


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() != "x86_64", reason="x86-64 Linux")
def test_prebuilt_library_is_used_without_a_compiler_and_checked(tmp_path, cache_dir, monkeypatch):
    """A wheel's prebuilt library (here v2, which every x86-64-v2 CPU runs) is chosen by the
    CPU's features and used with no compiler on PATH; one built from other sources, or damaged, is not."""
    if 2 not in prebuilt.supported_levels(prebuilt.cpu_features()):
        pytest.skip("this CPU is below x86-64-v2")
    folder = tmp_path / "_prebuilt"
    path = prebuilt.build_prebuilt(2, folder)
    monkeypatch.setattr(prebuilt, "prebuilt_dir", lambda: folder)
    monkeypatch.setenv("TINYKNN_CXX", "/nonexistent/c++")
    reset_config()
    library.reset_library()
    try:
        lib = library.get_library()
        assert Path(lib._name) == path and "4 lanes" in lib.tk_build_info().decode()
        assert prebuilt.candidates() == [path]
        facts = cache.read_sidecar(path)
        cache._write_json(cache.sidecar(path), {**facts, "sources": "other sources"})
        assert prebuilt.candidates() == []
        cache._write_json(cache.sidecar(path), facts)
        # the damaged file is a copy in place of the one this process has mapped (truncating a mapped
        # library under the loader is what makes a process die of SIGBUS later, at exit at the latest)
        damaged = path.with_name(path.name + ".damaged")
        shutil.copy(path, damaged)
        with open(damaged, "r+b") as handle:
            handle.truncate(damaged.stat().st_size // 2)
        os.replace(damaged, path)
        assert prebuilt.candidates() == []
    finally:
        library.reset_library()
        reset_config()


@pytest.fixture(scope="module")
def lib():
    return library.get_library()


def new_index(lib, dim=4, metric="l2", dtype="float32"):
    handle = ctypes.c_void_p()
    library.check(lib, lib.tk_index_new(dim, library.METRIC_CODES[metric], library.DTYPE_CODES[dtype],
                                        ctypes.byref(handle)), "new")
    return handle.value


def test_bad_arguments_become_value_errors_with_the_library_message(lib):
    handle = ctypes.c_void_p()
    with pytest.raises(ValueError, match="dim must be >= 1"):
        library.check(lib, lib.tk_index_new(0, 0, 0, ctypes.byref(handle)), "new")
    with pytest.raises(ValueError, match="metric must be"):
        library.check(lib, lib.tk_index_new(4, 7, 0, ctypes.byref(handle)), "new")
    with pytest.raises(ValueError, match="dtype must be"):
        library.check(lib, lib.tk_index_new(4, 0, 9, ctypes.byref(handle)), "new")
    with pytest.raises(ValueError, match="handle is null"):
        library.check(lib, lib.tk_index_reset(None), "reset")
    index = new_index(lib)
    try:
        out = np.empty(4, np.float32), np.empty(4, np.int64)
        with pytest.raises(ValueError, match="k must be >= 1"):
            library.check(lib, lib.tk_index_search(index, out[0].ctypes.data, 1, 0, 1, out[0].ctypes.data,
                                                   out[1].ctypes.data), "search")
        with pytest.raises(ValueError, match="more rows than"):
            library.check(lib, lib.tk_index_export(index, 5, out[0].ctypes.data, out[1].ctypes.data), "export")
    finally:
        lib.tk_index_free(index)


def test_worker_thread_failures_come_back_as_status_codes(lib):
    """An allocation that fails inside the pool's threads is a MemoryError in Python, not a crash, whichever
    thread ran the failing task (the first task is the caller's, later ones mostly a worker's)."""
    for failing_task in (0, 5, 63):
        with pytest.raises(MemoryError, match="out of memory"):
            library.check(lib, lib.tk_pool_selftest(2, 64, failing_task), "pool self-test")
    library.check(lib, lib.tk_pool_selftest(2, 64, -1), "pool self-test")   # no failure: status 0


def test_last_error_belongs_to_the_calling_thread(lib):
    handle = ctypes.c_void_p()
    assert lib.tk_index_new(0, 0, 0, ctypes.byref(handle)) == library.STATUS_INVALID_ARGUMENT
    seen = []
    other = threading.Thread(target=lambda: seen.append(lib.tk_last_error()))
    other.start()
    other.join()
    assert seen == [b""] and b"dim" in lib.tk_last_error()
