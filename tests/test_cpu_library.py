"""The CPU library's build (cache key, locking, errors) and its C ABI (status codes, messages)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from tinyknn.config import reset_config
from tinyknn.cpu import library
from tinyknn.errors import CpuLibraryError

TINY_SOURCE = 'extern "C" __attribute__((visibility("default"))) int tk_tiny(void) { return 42; }\n'


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch):
    """A one-function library instead of the real sources: build tests then compile in well under a second."""
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text(TINY_SOURCE)
    monkeypatch.setattr(library, "source_files", lambda: [source])
    return source


@pytest.fixture
def count_compiles(monkeypatch):
    calls = []
    real = library.compile_library

    def counting(*args):
        calls.append(args)
        real(*args)

    monkeypatch.setattr(library, "compile_library", counting)
    return calls


def test_real_library_loads_and_describes_its_build():
    lib = library.get_library()
    assert lib.tk_abi_version() == library.ABI_VERSION
    info = lib.tk_build_info().decode()
    assert "lanes" in info and "float16" in info


def test_build_is_cached_under_cache_dir_and_reused(cache_dir, tiny_sources, count_compiles):
    first = library.build_library()
    assert first.parent == cache_dir / "cpu" and first.is_file()
    assert ctypes.CDLL(str(first)).tk_tiny() == 42
    assert library.build_library() == first
    assert len(count_compiles) == 1
    assert not list(first.parent.glob("*.tmp*")), "temporary build files must not remain"


def test_key_covers_sources_compiler_flags_and_cpu(cache_dir, tiny_sources, monkeypatch):
    cxx = library.find_compiler()
    key = library.library_key(cxx, [tiny_sources])
    tiny_sources.write_text(TINY_SOURCE + "// changed\n")
    assert library.library_key(cxx, [tiny_sources]) != key
    tiny_sources.write_text(TINY_SOURCE)
    monkeypatch.setattr(library, "cpu_identity", lambda: "another CPU with other flags")
    assert library.library_key(cxx, [tiny_sources]) != key
    monkeypatch.undo()
    monkeypatch.setattr(library, "FLAGS", library.FLAGS + ("-DEXTRA",))
    assert library.library_key(cxx, [tiny_sources]) != key


def test_cpu_identity_names_the_features_native_code_depends_on():
    identity = library.cpu_identity()
    if sys.platform.startswith("linux"):
        assert "flags" in identity or "Features" in identity


def test_concurrent_processes_build_once(cache_dir, tiny_sources, tmp_path):
    log = tmp_path / "compiles.log"
    script = textwrap.dedent(f"""
        from pathlib import Path
        from tinyknn.cpu import library
        library.source_files = lambda: [Path({str(tiny_sources)!r})]
        real = library.compile_library
        def logged(*args):
            with open({str(log)!r}, "a") as handle:
                handle.write("compiled\\n")
            real(*args)
        library.compile_library = logged
        print(library.build_library())
    """)
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
                 for _ in range(3)]
    paths = {process.communicate(timeout=120)[0].strip() for process in processes}
    assert all(process.returncode == 0 for process in processes)
    assert len(paths) == 1 and log.read_text().count("compiled") == 1


def test_threads_of_one_process_build_once(cache_dir, tiny_sources, count_compiles):
    paths = []
    workers = [threading.Thread(target=lambda: paths.append(library.build_library())) for _ in range(4)]
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
            library.find_compiler()
        assert "install" in str(raised.value)
    finally:
        monkeypatch.delenv("TINYKNN_CXX")
        reset_config()


def test_no_compiler_on_path_lists_the_defaults(monkeypatch):
    monkeypatch.delenv("TINYKNN_CXX", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    reset_config()
    monkeypatch.setattr(library.shutil, "which", lambda name: None)
    try:
        with pytest.raises(CpuLibraryError, match="g\\+\\+, c\\+\\+, clang\\+\\+"):
            library.find_compiler()
    finally:
        reset_config()


def test_failed_compile_shows_the_compiler_output(cache_dir, tiny_sources):
    tiny_sources.write_text("this is not C++;\n")
    with pytest.raises(CpuLibraryError) as raised:
        library.build_library()
    message = str(raised.value)
    assert "compiler output" in message and "tiny.cpp" in message and "error" in message
    assert not list((cache_dir / "cpu").glob("libtinyknn-*.so*[!k]"))  # no library, no temporary file


def test_unwritable_cache_builds_in_a_private_folder(tmp_path, tiny_sources, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TINYKNN_CACHE_DIR", str(blocker))
    reset_config()
    try:
        with pytest.warns(RuntimeWarning, match="cannot write its cache"):
            path = library.build_library()
        assert path.is_file() and blocker not in path.parents
    finally:
        reset_config()


def test_damaged_cached_library_is_rebuilt(tmp_path, monkeypatch):
    built = Path(library.get_library()._name)   # the real library, already built in the shared cache
    monkeypatch.setenv("TINYKNN_CACHE_DIR", str(tmp_path / "cache"))
    reset_config()
    monkeypatch.setattr(library, "compile_library", lambda cxx, sources, target: shutil.copy(built, target))
    damaged = tmp_path / "cache" / "cpu" / built.name  # same sources, compiler and CPU: the same key
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"\x7fELF but not really a library")
    library.reset_library()
    try:
        with pytest.warns(RuntimeWarning, match="cannot be loaded"):
            lib = library.get_library()
        assert lib.tk_abi_version() == library.ABI_VERSION and damaged.stat().st_size > 1000
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
