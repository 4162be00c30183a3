"""The cubin cache: memory -> disk -> NVRTC, bad entries, unusable directories, many processes.

The toy renderer from test_jit_compiler stands in for tinyknn.jit.render (a fraction of a second per
compile). Subprocesses prove what one process cannot: that a second process reads the cubin without
loading NVRTC at all, and that eight processes asking for one spec at once leave one valid file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

from test_jit_compiler import ToySource, toy_render, toy_spec
from tinyknn.config import reset_config
from tinyknn.jit import cache as cache_module
from tinyknn.jit import store
from tinyknn.jit.cache import CubinCache, CubinCacheWarning, default_cache, entry_key, reset_default_cache

pytestmark = pytest.mark.nvrtc
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture
def cache(tmp_path):
    return CubinCache(tmp_path / "cubins", render=toy_render)


def only_entry(cache: CubinCache) -> Path:
    paths = cache.entry_paths()
    assert len(paths) == 1, paths
    return paths[0]


def test_miss_compiles_then_memory_then_disk(tmp_path, cache):
    spec = toy_spec()
    first, origin = cache.lookup(spec)
    assert origin == "compiled" and cache.stats == {"memory_hits": 0, "disk_hits": 0, "compiles": 1}
    again, origin = cache.lookup(spec)
    assert origin == "memory" and again is first
    assert cache.stats == {"memory_hits": 1, "disk_hits": 0, "compiles": 1}

    fresh = CubinCache(tmp_path / "cubins", render=toy_render)   # a new process's view of the same folder
    from_disk, origin = fresh.lookup(spec)
    assert origin == "disk" and fresh.stats == {"memory_hits": 0, "disk_hits": 1, "compiles": 0}
    assert from_disk == first   # image, lowered names, reports, arch, NVRTC version all round-trip

    other, origin = fresh.lookup(toy_spec(k=32))
    assert origin == "compiled" and other.image != first.image
    assert len(fresh.entry_paths()) == 2


def test_key_covers_everything_that_changes_the_cubin():
    base = ToySource("source", ("toy<8, 1>",))
    key = entry_key(base, "sm_90", (13, 0))
    assert key == entry_key(ToySource("source", ("toy<8, 1>",)), "sm_90", (13, 0))
    variants = [
        entry_key(ToySource("source ", ("toy<8, 1>",)), "sm_90", (13, 0)),
        entry_key(ToySource("source", ("toy<8, 2>",)), "sm_90", (13, 0)),
        entry_key(ToySource("source", ("toy<8, 1>",), ("-std=c++20",)), "sm_90", (13, 0)),
        entry_key(base, "sm_80", (13, 0)),
        entry_key(base, "sm_90", (13, 5)),
    ]
    assert len({key, *variants}) == 6


def test_threads_asking_for_one_spec_share_one_compile(cache):
    spec, results = toy_spec(dim=64, k=4), []
    threads = [threading.Thread(target=lambda: results.append(cache.get(spec))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert cache.stats == {"memory_hits": 5, "disk_hits": 0, "compiles": 1}


def test_lookup_refuses_what_is_not_a_spec(cache):
    with pytest.raises(TypeError, match="KernelSpec"):
        cache.get(("l2", "float32", 128, 10))


# -- bad entries ---------------------------------------------------------------------------------
def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _foreign_bytes(path: Path) -> None:
    path.write_bytes(b"\x7fELF not a tinyknn entry" * 20)


def _other_entry(path: Path) -> None:   # a valid entry, but of another key (e.g. copied by hand)
    other = CubinCache(path.parent.parent / "other", render=toy_render)
    other.get(toy_spec(dim=32, k=1))
    path.write_bytes(only_entry(other).read_bytes())


@pytest.mark.parametrize("damage, problem", [
    (_flip_a_byte, "checksum"), (_truncate, "truncated"), (_foreign_bytes, "foreign"), (_other_entry, "foreign"),
])
def test_bad_entry_is_reported_removed_and_recompiled(tmp_path, cache, damage, problem):
    spec = toy_spec(dim=96, k=8)
    good = cache.get(spec)
    path = only_entry(cache)
    damage(path)
    assert [p for p, _ in cache.verify()] == [path] and problem in cache.verify()[0][1]

    fresh = CubinCache(tmp_path / "cubins", render=toy_render)
    with pytest.warns(CubinCacheWarning, match=problem):
        again, origin = fresh.lookup(spec)
    assert origin == "compiled" and again.image == good.image
    assert cache.verify() == [] and only_entry(cache) == path


# -- unusable directories ------------------------------------------------------------------------
def test_cache_under_a_regular_file_degrades_to_memory_with_one_warning(tmp_path):
    # chmod does not stop root (CI runs as root); a path below a regular file fails for everybody.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache folder should be")
    cache = CubinCache(blocker / "cubins", render=toy_render)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for spec in (toy_spec(k=1), toy_spec(k=2), toy_spec(k=1)):
            assert cache.get(spec).image[:4] == b"\x7fELF"
    messages = [str(w.message) for w in caught if issubclass(w.category, CubinCacheWarning)]
    assert len(messages) == 1 and "memory only" in messages[0], messages
    assert cache.stats == {"memory_hits": 1, "disk_hits": 0, "compiles": 2}
    assert cache.entry_paths() == [] and cache.info()["entries"] == 0


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root ignores permission bits; the regular-file and file-size-limit tests cover root")
def test_read_only_directory_degrades_to_memory_with_one_warning(tmp_path):
    folder = tmp_path / "cubins"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        cache = CubinCache(folder, render=toy_render)
        with pytest.warns(CubinCacheWarning, match="memory only"):
            cache.get(toy_spec(k=3))
        assert cache.stats["compiles"] == 1 and cache.entry_paths() == []
    finally:
        folder.chmod(0o755)


PREAMBLE = f"""
import json, sys
sys.path.insert(0, {str(TESTS_DIR)!r})
from test_jit_compiler import toy_render, toy_spec
from tinyknn.jit.cache import CubinCache
"""


def run_python(code: str, *, block_nvrtc: bool = False) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; block_nvrtc makes any import of cuda.bindings.nvrtc fail."""
    prelude = "import sys\nsys.modules['cuda.bindings.nvrtc'] = None\n" if block_nvrtc else ""
    return subprocess.run([sys.executable, "-c", prelude + PREAMBLE + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_full_disk_degrades_to_memory_with_one_warning(tmp_path):
    # RLIMIT_FSIZE makes every write past 1 KiB fail with EFBIG, as a full disk fails with ENOSPC.
    result = run_python(f"""
        import resource, signal, warnings
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
        cache = CubinCache({str(tmp_path / 'cubins')!r}, render=toy_render)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            images = [cache.get(toy_spec(k=k)).image[:4] for k in (1, 2)]
        print(json.dumps({{"images": [i.hex() for i in images], "stats": cache.stats,
                          "warnings": [str(w.message) for w in caught]}}))
    """)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["images"] == ["7f454c46"] * 2 and report["stats"]["compiles"] == 2
    assert len(report["warnings"]) == 1 and "File too large" in report["warnings"][0]
    assert list((tmp_path / "cubins").glob("*.cubin")) == []
    assert list((tmp_path / "cubins").glob(".*.tmp")) == [], "a failed write leaves no temporary file"


# -- other processes -----------------------------------------------------------------------------
def test_second_process_reads_the_cubin_without_loading_nvrtc(tmp_path, cache):
    spec = toy_spec(dim=128, k=16)
    image = cache.get(spec).image
    def probe(folder: Path) -> subprocess.CompletedProcess:
        return run_python(f"""
            cache = CubinCache({str(folder)!r}, render=toy_render)
            cubin = cache.get(toy_spec(dim=128, k=16))
            print(json.dumps({{"stats": cache.stats, "image": cubin.image.hex(),
                              "nvrtc_loaded": any("libnvrtc" in line for line in open("/proc/self/maps"))}}))
        """, block_nvrtc=True)

    result = probe(cache.directory)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["stats"] == {"memory_hits": 0, "disk_hits": 1, "compiles": 0}
    assert bytes.fromhex(report["image"]) == image and report["nvrtc_loaded"] is False

    # the control: with an empty cache the same process must compile, and cannot
    empty = probe(tmp_path / "empty")
    assert empty.returncode != 0 and "NVRTC is not available" in empty.stderr


@pytest.mark.parametrize("lock", ["filelock", "no lock"])
def test_eight_processes_warming_one_spec(tmp_path, lock):
    folder = tmp_path / "cubins"
    start_at = time.time() + 3.0   # all eight import first, then ask at the same moment
    worker = f"""
        import time
        from tinyknn.jit import cache as cache_module
        if {lock == "no lock"}:
            import contextlib
            cache_module.CubinCache._interprocess_lock = lambda self, key: contextlib.nullcontext()
        cache = CubinCache({str(folder)!r}, render=toy_render)
        time.sleep(max(0.0, {start_at} - time.time()))
        cubin = cache.get(toy_spec(dim=256, k=32))
        print(json.dumps({{"stats": cache.stats, "image": cubin.image.hex()}}))
    """
    processes = [subprocess.Popen([sys.executable, "-c", PREAMBLE + textwrap.dedent(worker)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err for _, err in outputs]
    reports = [json.loads(out) for out, _ in outputs]
    assert len({r["image"] for r in reports}) == 1
    compiles = sum(r["stats"]["compiles"] for r in reports)
    assert compiles == 1 if lock == "filelock" else compiles >= 1
    checker = CubinCache(folder, render=toy_render)
    assert len(checker.entry_paths()) == 1 and checker.verify() == []
    assert list(folder.glob(".*.tmp")) == []


# -- the process-wide default and the maintenance calls -------------------------------------------
def test_default_cache_follows_the_configured_directory(cache_dir):
    reset_default_cache()
    try:
        first = default_cache()
        assert first is default_cache() and first.directory == cache_dir / "cubins"
        reset_default_cache()
        assert default_cache() is not first
    finally:
        reset_default_cache()
        reset_config()


def test_info_list_verify_clear(cache):
    for k in (1, 10):
        cache.get(toy_spec(dim=64, k=k, arch="sm_80"))
    info = cache.info()
    assert info["entries"] == 2 and info["bytes"] == sum(p.stat().st_size for p in cache.entry_paths())
    rows = sorted(cache.list_entries(), key=lambda row: row["k"])
    assert [(r["metric"], r["dtype"], r["dim"], r["k"], r["variant"], r["arch"]) for r in rows] == [
        ("l2", "float32", 64, 1, "scan", "sm_80"), ("l2", "float32", 64, 10, "scan", "sm_80")]
    assert all(r["registers"] > 0 and r["stack_bytes"] == 0 and r["spill_bytes"] == 0 for r in rows)
    assert all(r["size"] > 1000 and abs(r["created"] - time.time()) < 600 for r in rows)
    assert cache.verify() == []
    report = cache.clear()
    assert (report.removed, report.failures, report.left) == (2, [], []) and cache.info()["entries"] == 0
    assert list(cache.directory.iterdir()) == []   # locks/ goes too
    assert cache.lookup(toy_spec(dim=64, k=1, arch="sm_80"))[1] == "compiled"   # memory was cleared too


def test_entry_header_carries_spec_and_reports(cache):
    spec = toy_spec(dim=32, k=2)
    cubin = cache.get(spec)
    header = store.read_header(only_entry(cache))
    assert store.spec_from_dict(header["spec"]) == spec
    assert header["lowered_names"] == cubin.lowered_names
    assert header["nvrtc_version"] == list(cubin.nvrtc_version)
    assert "-arch=sm_90" in header["options"] and header["key"] == only_entry(cache).stem


# -- the NVRTC version stamp (toolchain.py) -------------------------------------------------------
def test_stamp_answers_for_nvrtc_only_while_environment_and_library_match(tmp_path, monkeypatch):
    from tinyknn.jit import compiler, toolchain

    version = toolchain.nvrtc_version_for_key(tmp_path)
    [path] = tmp_path.glob("nvrtc-*.json")
    stamp = json.loads(path.read_text())
    assert stamp["version"] == list(version) and "libnvrtc" in stamp["library"]["path"]

    stamp["version"] = [99, 9]   # a version no NVRTC reports: only the stamp can answer it
    path.write_text(json.dumps(stamp))
    real = compiler.nvrtc_version
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: pytest.fail("NVRTC asked despite a matching stamp"))
    assert toolchain.nvrtc_version_for_key(tmp_path) == (99, 9)

    monkeypatch.setattr(compiler, "nvrtc_version", real)
    stamp["library"]["mtime_ns"] += 1   # the library file changed (a new NVRTC): ask NVRTC, stamp again
    path.write_text(json.dumps(stamp))
    assert toolchain.nvrtc_version_for_key(tmp_path) == version
    assert json.loads(path.read_text())["version"] == list(version)

    monkeypatch.setenv("LD_LIBRARY_PATH", "/another/cuda/lib64")   # another environment: its own stamp
    assert toolchain.nvrtc_version_for_key(tmp_path) == version
    assert len(list(tmp_path.glob("nvrtc-*.json"))) == 2


# -- warm-up (warm.py) ---------------------------------------------------------------------------
def test_warm_reports_compiled_cached_and_failed_per_spec(tmp_path):
    from tinyknn.jit.warm import plan_specs, warm_specs

    def render(spec):   # k = 3 stands for a kernel that does not compile
        source = toy_render(spec)
        return ToySource(source.source + ("\nint broken = ;\n" if spec.k == 3 else ""), source.name_expressions)

    def specs_for(metric, dtype, dim, k, arch):   # two kernels per combination, one shared by all
        return [toy_spec(dim=16, k=1, arch=arch), toy_spec(dim=dim, k=k, arch=arch, metric=metric)]

    specs = plan_specs([("l2", "float32", 16, 1), ("ip", "float32", 16, 2), ("l2", "float32", 16, 3)], ["sm_90"],
                       specs_for=specs_for)
    assert specs == [toy_spec(dim=16, k=1), toy_spec(dim=16, k=2, metric="ip"), toy_spec(dim=16, k=3)]
    cache = CubinCache(tmp_path / "cubins", render=render)
    cache.get(specs[0])
    seen = []
    outcomes = warm_specs(cache, specs, jobs=2, on_done=seen.append)
    assert seen == outcomes
    status = {outcome.spec: outcome.status for outcome in outcomes}
    assert status == {specs[0]: "cached", specs[1]: "compiled", specs[2]: "failed"}
    [failed] = [outcome for outcome in outcomes if outcome.status == "failed"]
    assert "error" in failed.error and failed.seconds > 0
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        warm_specs(cache, specs, jobs=0)


def test_cache_events_go_to_the_tinyknn_logger(tmp_path, cache, caplog):
    """Compiles, misses, hits and repairs are visible through stdlib logging (logger tinyknn.jit.cache)."""
    spec = toy_spec(dim=24)
    with caplog.at_level("DEBUG", logger="tinyknn"):
        cache.lookup(spec)
        cache.lookup(spec)
        fresh = CubinCache(tmp_path / "cubins", render=toy_render)
        fresh.lookup(spec)
        _flip_a_byte(only_entry(cache))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CubinCacheWarning)
            CubinCache(tmp_path / "cubins", render=toy_render).lookup(spec)
    messages = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert all(name == "tinyknn.jit.cache" for name, _, _ in messages)
    texts = [text for _, _, text in messages]
    assert any(text.startswith("cubin cache: miss") for text in texts)
    assert sum(text.startswith("compiled KernelSpec(") for text in texts) == 2   # first, and after the repair
    assert any(text.startswith("cubin cache: memory hit") for text in texts)
    assert any(text.startswith("cubin cache: disk hit") for text in texts)
    assert any(level == "WARNING" and "repairing" in text for _, level, text in messages)


def test_jit_reads_the_version_without_the_package_face():
    """Layering: jit/ takes __version__ from tinyknn._version, never from tinyknn/__init__."""
    for module in ("cache.py", "store.py"):
        source = (TESTS_DIR.parent / "tinyknn" / "jit" / module).read_text()
        assert "from .. import" not in source and "from .._version import __version__" in source
