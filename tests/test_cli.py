"""The `tinyknn` command end to end, through subprocesses: output, --json and exit codes.

The warm tests compile tinyknn's real kernels (a single small combination, for sm_80 and sm_90) and
share one warmed cache folder; the other cache commands work on toy entries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_jit_compiler import toy_render, toy_spec
from tinyknn.jit.cache import CubinCache
from tinyknn.jit.manifest import default_manifest_path, load_manifest, read_manifest

COMBINATION = ["--metric", "l2", "--dtype", "float32", "--dim", "32", "--k", "4"]


def tinyknn(*args: str, cache_dir: Path, command=(sys.executable, "-m", "tinyknn.cli")):
    env = {name: value for name, value in os.environ.items() if name != "TINYKNN_ARCH"}
    env["TINYKNN_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=env)


def as_json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    """A cache folder for the tests that only need the CPU library built once (info, demo)."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A cache warmed once for COMBINATION on sm_80 and sm_90, and the summary `warm --json` printed."""
    cache_dir = tmp_path_factory.mktemp("warmed")
    summary = as_json(tinyknn("cache", "warm", *COMBINATION, "--arch", "sm_80,sm_90", "--jobs", "2", "--json",
                              cache_dir=cache_dir))
    return cache_dir, summary


@pytest.mark.nvrtc
def test_warm_compiles_every_variant_for_each_arch(warmed):
    from tinyknn.jit.search_kernels import specs_for_search

    cache_dir, summary = warmed
    expected = {spec for arch in ("sm_80", "sm_90") for spec in specs_for_search("l2", "float32", 32, 4, arch)}
    assert summary["failed"] == 0 and summary["failures"] == []
    assert summary["compiled"] == summary["kernels"] == len(expected) and summary["cached"] == 0
    assert summary["arches"] == ["sm_80", "sm_90"] and summary["combinations"] == 1
    rows = as_json(tinyknn("cache", "list", "--json", cache_dir=cache_dir))["entries"]
    assert {(r["variant"], r["arch"]) for r in rows} == {(s.variant, s.arch) for s in expected}
    assert len(rows) == len(expected)
    assert not [r for r in rows if r["registers"] <= 0]       # every kernel's ptxas report was read
    from tinyknn.jit.compiler import SPILL_FREE_NVRTC, nvrtc_version

    if nvrtc_version() >= SPILL_FREE_NVRTC:     # an older NVRTC spills a few bytes in some sm_80 kernels
        assert not [r for r in rows if r["stack_bytes"] or r["spill_bytes"]]
    assert all(r["created"].endswith("+00:00") and r["size"] > 1000 for r in rows)


@pytest.mark.nvrtc
def test_warm_again_finds_everything_cached_and_a_manifest_names_its_arch(warmed, tmp_path):
    cache_dir, first = warmed
    again = as_json(tinyknn("cache", "warm", *COMBINATION, "--arch", "sm_90,sm_80", "--json", cache_dir=cache_dir))
    assert (again["compiled"], again["cached"], again["failed"]) == (0, first["kernels"], 0)

    manifest = tmp_path / "small.toml"
    manifest.write_text('arch = ["sm_90"]\n[[specialisations]]\nmetric = "l2"\ndtype = "float32"\ndim = 32\nk = [4]\n')
    from_manifest = as_json(tinyknn("cache", "warm", "--manifest", str(manifest), "--json", cache_dir=cache_dir))
    assert from_manifest["arches"] == ["sm_90"] and from_manifest["source"] == str(manifest)
    from tinyknn.jit.search_kernels import specs_for_search

    on_90 = len(specs_for_search("l2", "float32", 32, 4, "sm_90"))
    assert from_manifest["compiled"] == 0 and from_manifest["cached"] == on_90

    text = tinyknn("cache", "warm", *COMBINATION, "--arch", "sm_80", cache_dir=cache_dir)
    assert text.returncode == 0 and "compiled and written 0, already cached" in text.stdout and "failed 0" in text.stdout


def test_warm_without_a_gpu_or_arch_asks_for_arch(tmp_path):
    from conftest import gpu_probe

    if gpu_probe() is None:
        pytest.skip("this machine has a GPU, so warm takes its arch")
    result = tinyknn("cache", "warm", *COMBINATION, cache_dir=tmp_path)
    assert result.returncode == 2 and "--arch sm_90" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--manifest", "nowhere.toml", "--arch", "sm_90"], "does not exist"),
    (["--manifest", "x.toml", "--dim", "8", "--k", "1"], "either --manifest or"),
    (["--dim", "8"], "needs --dim and --k"),
    (["--dim", "8", "--k", "1", "--metric", "l1", "--arch", "sm_90"], "metric must be one of"),
    (["--dim", "8", "--k", "1", "--arch", "volta"], "--arch must look like sm_90, 90, sm_90a or 90a; got 'volta'"),
    (["--dim", "8", "--k", "1", "--arch", "sm_90", "--jobs", "0"], "--jobs must be a positive integer"),
])
def test_warm_refuses_a_bad_command_line(tmp_path, args, message):
    result = tinyknn("cache", "warm", *args, cache_dir=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.nvrtc
def test_list_info_verify_clear(tmp_path):
    cache = CubinCache(tmp_path / "cubins", render=toy_render)
    for k in (1, 2, 3):
        cache.get(toy_spec(k=k))
    info = as_json(tinyknn("cache", "info", "--json", cache_dir=tmp_path))
    assert info == {"location": str(tmp_path / "cubins"), "entries": 3, "strays": 0,
                    "bytes": sum(p.stat().st_size for p in cache.entry_paths())}
    table = tinyknn("cache", "list", cache_dir=tmp_path)
    assert table.returncode == 0 and table.stdout.count("sm_90") == 3 and "scan" in table.stdout

    assert tinyknn("cache", "verify", cache_dir=tmp_path).returncode == 0
    bad = cache.entry_paths()[1]
    bad.write_bytes(bad.read_bytes()[:-10])
    verify = tinyknn("cache", "verify", cache_dir=tmp_path)
    assert verify.returncode == 1 and f"CORRUPT {bad}" in verify.stdout and "truncated" in verify.stdout
    assert verify.stdout.count("CORRUPT") == 1

    cleared = tinyknn("cache", "clear", cache_dir=tmp_path)
    assert cleared.returncode == 0 and "removed 3 cubins" in cleared.stdout
    assert as_json(tinyknn("cache", "info", "--json", cache_dir=tmp_path))["entries"] == 0


@pytest.mark.nvrtc
def test_info_reports_versions_nvrtc_gpu_cache_and_cpu_library(shared_dir):
    from tinyknn import __version__
    from tinyknn.jit.compiler import nvrtc_version

    report = as_json(tinyknn("info", "--json", cache_dir=shared_dir))
    assert report["tinyknn"] == __version__
    assert report["nvrtc"] == ".".join(map(str, nvrtc_version()))
    assert report["cache"]["location"] == str(shared_dir / "cubins")
    assert isinstance(report["gpu"]["available"], bool) and ("reason" in report["gpu"]) != report["gpu"]["available"]
    assert report["packages"]["cuda-core"] != "not installed"
    assert report["cpu_library"].startswith("ready (") and "lanes" in report["cpu_library"]
    text = tinyknn("info", cache_dir=shared_dir)
    assert text.returncode == 0 and "NVRTC:" in text.stdout and "cubin cache:" in text.stdout


def test_demo_prints_recall_and_time_per_query(shared_dir):
    result = as_json(tinyknn("demo", "--device", "cpu", "--n", "3000", "--dim", "24", "--k", "5",
                             "--queries", "40", "--metric", "ip", "--json", cache_dir=shared_dir))
    assert result["device"] == "cpu" and result["recall"] == 1.0 and result["recall_queries"] == 40
    assert result["single_query_median_ms"] > 0 and result["batch_ms_per_query"] > 0
    bad = tinyknn("demo", "--n", "0", cache_dir=shared_dir)
    assert bad.returncode == 2 and "--n must be a positive integer" in bad.stderr


def test_demo_warms_every_path_it_times(monkeypatch):
    """A first call loads (or compiles) the kernels of its path: each search shape the demo times must have
    been searched once before the first timer starts."""
    import argparse
    import time
    import types

    import tinyknn
    from tinyknn.cli import demo

    events = []
    search, clock = tinyknn.Index.search, time.perf_counter

    def logged_search(self, queries, k, **kwargs):
        events.append(("search", len(queries)))
        return search(self, queries, k, **kwargs)

    def logged_clock():
        events.append(("clock", None))
        return clock()

    monkeypatch.setattr(tinyknn.Index, "search", logged_search)
    # the demo's own clock only: patching time.perf_counter itself also logged other threads' calls (a pool
    # left by an earlier test), which moved the first timed clock and failed this test now and then
    own_time = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    own_time.perf_counter = logged_clock
    monkeypatch.setattr(demo, "time", own_time)
    args = argparse.Namespace(device="cpu", n=2000, dim=16, k=5, queries=30, metric="l2", dtype="float32",
                              seed=1, check=10, json=True)
    result = demo.run_demo(args)
    first_clock_after_add = [i for i, e in enumerate(events) if e[0] == "clock"][2]   # the add's two clocks first
    warmed = {n for kind, n in events[:first_clock_after_add] if kind == "search"}
    timed = {n for kind, n in events[first_clock_after_add:] if kind == "search"}
    assert timed == {30, 1} and timed <= warmed
    assert result["batch_ms"] > 0 and result["recall"] == 1.0


def test_console_script_is_installed(tmp_path):
    script = shutil.which("tinyknn")
    assert script is not None, "pip install -e . should have installed the `tinyknn` console script"
    result = tinyknn("--version", cache_dir=tmp_path, command=(script,))
    assert result.returncode == 0 and result.stdout.startswith("tinyknn ")


# -- manifests -----------------------------------------------------------------------------------
def test_default_manifest_lists_the_common_embedding_sizes():
    manifest = read_manifest(default_manifest_path())
    combos = manifest.combinations
    assert len(combos) == 3 * 2 * 9 * 4 == len(set(combos)) and manifest.arches == ()
    assert {c[0] for c in combos} == {"l2", "ip", "cosine"} and {c[1] for c in combos} == {"float32", "float16"}
    assert sorted({c[2] for c in combos}) == [64, 96, 128, 256, 384, 512, 768, 1024, 1536]
    assert sorted({c[3] for c in combos}) == [1, 10, 32, 100]


def test_manifest_union_without_repeats_and_clear_errors(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('arch = "90"\n[[specialisations]]\nmetric = ["L2", "ip"]\ndtype = "float16"\ndim = 8\nk = [1, 2]\n'
                    '[[specialisations]]\nmetric = "l2"\ndtype = "float16"\ndim = 8\nk = 1\n')
    assert load_manifest(path) == [("l2", "float16", 8, 1), ("l2", "float16", 8, 2),
                                   ("ip", "float16", 8, 1), ("ip", "float16", 8, 2)]
    assert read_manifest(path).arches == ("sm_90",)
    for text, message in [
        ('[[specialisations]]\nmetric = "l2"\ndtype = "float32"\ndim = 8\n', "missing \\['k'\\]"),
        ('[[specialisations]]\nmetric = "l2"\ndtype = "float32"\ndim = 8\nk = 1\nbatch = 3\n', "unknown \\['batch'\\]"),
        ('[[specialisations]]\nmetric = "l2"\ndtype = "int4"\ndim = 8\nk = 1\n', "#1: dtype must be one of"),
        ('[[specialisations]]\nmetric = "l2"\ndtype = "float32"\ndim = 0\nk = 1\n', "dim must be between"),
        ('format = 2\n[[specialisations]]\nmetric = "l2"\ndtype = "float32"\ndim = 8\nk = 1\n', "format 2"),
        ('arch = ["sm_90"]\n', "at least one \\[\\[specialisations\\]\\]"),
        ('specialisations = [[', "not valid TOML"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_manifest(path)
