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
from tinyknn.jit.cache import CubinCache, CubinCacheWarning
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
    from tinyknn.jit.render import specs_for_search

    cache_dir, summary = warmed
    expected = {spec for arch in ("sm_80", "sm_90") for spec in specs_for_search("l2", "float32", 32, 4, arch)}
    assert summary["failed"] == 0 and summary["failures"] == []
    assert summary["compiled"] == summary["kernels"] == len(expected) and summary["cached"] == 0
    assert summary["arches"] == ["sm_80", "sm_90"] and summary["combinations"] == 1
    rows = as_json(tinyknn("cache", "list", "--json", cache_dir=cache_dir))["entries"]
    assert {(r["variant"], r["arch"]) for r in rows} == {(s.variant, s.arch) for s in expected}
    assert len(rows) == len(expected)
    assert all(r["stack_bytes"] == 0 and r["spill_bytes"] == 0 and r["registers"] > 0 for r in rows), rows
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
    assert from_manifest["compiled"] == 0 and from_manifest["cached"] == first["kernels"] // 2

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
        ('[[specialisations]]\nmetric = "l2"\ndtype = "int8"\ndim = 8\nk = 1\n', "#1: dtype must be one of"),
        ('[[specialisations]]\nmetric = "l2"\ndtype = "float32"\ndim = 0\nk = 1\n', "dim must be between"),
        ('format = 2\n[[specialisations]]\nmetric = "l2"\ndtype = "float32"\ndim = 8\nk = 1\n', "format 2"),
        ('arch = ["sm_90"]\n', "at least one \\[\\[specialisations\\]\\]"),
        ('specialisations = [[', "not valid TOML"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_manifest(path)


# -- the frictions of the ecosystem issue, in-process with a toy renderer ------------------------------
# The kernels planned are tinyknn's real ones (render.specs_for_search); each is compiled as a one-line toy
# kernel of its own (tens of ms), so these tests exercise warm/list/clear without minutes of NVRTC.
TOY_KERNEL = "template <int V> __global__ void toy(float* out) { if (threadIdx.x == 0) out[blockIdx.x] = V; }"


def toy_any(spec):
    import zlib

    from test_jit_compiler import ToySource

    return ToySource(TOY_KERNEL, (f"toy<{zlib.crc32(str(spec).encode()) % 1_000_000}>",))


@pytest.fixture
def toy_cli(cache_dir, monkeypatch):
    """`run(*args) -> (exit code, stdout, stderr)` of cli.main in this process, over a toy-rendering cache
    at cache_dir/cubins (cache_dir is also TINYKNN_CACHE_DIR, so the CPU library folder is cache_dir/cpu)."""
    from tinyknn import cli
    from tinyknn.jit import cache as cache_module

    caches = [CubinCache(cache_dir / "cubins", render=toy_any)]
    monkeypatch.setattr(cache_module, "default_cache", lambda: caches[-1])

    def run(*args):
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
        return code, out.getvalue(), err.getvalue()

    def fresh():
        """A new process's view of the folder: nothing in memory, writes allowed again."""
        caches.append(CubinCache(cache_dir / "cubins", render=toy_any))
        run.cache = caches[-1]

    run.cache, run.fresh = caches[-1], fresh
    return run


def test_bare_tinyknn_prints_help_and_exits_0(tmp_path):
    result = tinyknn(cache_dir=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("usage: tinyknn") and "cache" in result.stdout


def test_counted_nouns_are_singular_and_plural():
    from tinyknn._cli_common import count

    assert (count(1, "kernel"), count(0, "kernel"), count(1274, "kernel"), count(2, "entry", "entries")) == \
        ("1 kernel", "0 kernels", "1,274 kernels", "2 entries")


@pytest.mark.nvrtc
def test_warm_says_what_it_will_do_shows_progress_and_reports(toy_cli):
    from tinyknn.jit.render import specs_for_search

    code, out, err = toy_cli("cache", "warm", *COMBINATION, "--arch", "90", "--jobs", "2")
    n = len(specs_for_search("l2", "float32", 32, 4, "sm_90"))
    assert code == 0, err
    plan = err.splitlines()[0]
    assert plan.startswith(f"tinyknn cache warm: {n} kernels: ") and "for 1 combination from the command line" in plan
    assert "on sm_90, 2 jobs" in plan and "float16" not in plan
    progress = [line for line in err.splitlines() if line.startswith("warm: ")]
    assert progress and progress[-1].startswith(f"warm: {n}/{n} kernels, ")   # plain lines: no terminal here
    assert f"{n} kernels on sm_90: compiled and written {n}, already cached 0, failed 0, in " in out and " s; cache: " in out
    code, out, _ = toy_cli("cache", "warm", *COMBINATION, "--arch", "sm_90")
    assert code == 0 and f"compiled and written 0, already cached {n}, failed 0" in out


@pytest.mark.nvrtc
@pytest.mark.parametrize("dtype, stored", [("float32", {"float32"}), ("float16", {"float16", "float32"})])
def test_dtype_means_what_it_says(toy_cli, dtype, stored):
    code, _, err = toy_cli("cache", "warm", "--metric", "ip", "--dtype", dtype, "--dim", "16", "--k", "2", "--arch", "sm_80")
    assert code == 0, err
    _, out, _ = toy_cli("cache", "list", "--json")
    rows = json.loads(out)["entries"]
    assert {r["dtype"] for r in rows} == stored
    assert {r["dtype"] for r in rows if r["variant"] != "norms"} == {dtype}   # float32 only as the query ingest


@pytest.mark.nvrtc
def test_an_arch_nvrtc_cannot_compile_for_is_refused_once_up_front(toy_cli):
    code, out, err = toy_cli("cache", "warm", *COMBINATION, "--arch", "sm_90,sm_50")
    assert code == 2 and out == "" and err.count("sm_50") == 1 and err.count("\n") == 1
    assert "cannot compile for sm_50" in err and "sm_75" in err and "sm_90" in err
    assert toy_cli.cache.entry_paths() == []


@pytest.mark.nvrtc
@pytest.mark.parametrize("spelling, arch", [("90a", "sm_90a"), ("sm_90a", "sm_90a"), ("90", "sm_90"), ("SM_90", "sm_90")])
def test_arch_spellings(toy_cli, spelling, arch):
    code, out, err = toy_cli("cache", "warm", "--metric", "l2", "--dtype", "float32", "--dim", "8", "--k", "1",
                             "--arch", spelling, "--json")
    assert code == 0, err
    assert json.loads(out)["arches"] == [arch]


@pytest.mark.nvrtc
def test_list_shows_tile_parameters_real_fields_only_and_fits_the_width(toy_cli):
    toy_cli("cache", "warm", *COMBINATION, "--arch", "sm_90")
    _, out, _ = toy_cli("cache", "list", "--json")
    rows = json.loads(out)["entries"]
    identity = [(r["variant"], r["metric"], r["dtype"], r["dim"], r["k"], tuple(sorted(r["params"].items()))) for r in rows]
    assert len(set(identity)) == len(rows)   # no two rows look alike
    assert len({i[:5] for i in identity}) < len(rows)   # ... though some differ only in their tile parameters
    by_variant = {r["variant"]: r for r in rows}
    assert by_variant["norms"]["k"] is None and by_variant["norms"]["dim"] == 32
    assert by_variant["verify"]["dim"] is None and by_variant["verify"]["k"] == 4
    assert by_variant["band"]["dim"] is None and by_variant["band"]["k"] is None
    assert by_variant["tiled"]["params"]["bq"] > 0

    from rich.console import Console

    from tinyknn import _cli_cache

    shown = [_cli_cache._shown(r) for r in toy_cli.cache.list_entries()]
    columns = _cli_cache._columns(shown)
    for width, expected in ((80, _cli_cache._ESSENTIAL), (250, len(columns))):
        table = _cli_cache._table("t", columns, width)
        assert len(table.columns) == expected
        console = Console(width=width, record=True, file=open(os.devnull, "w"))
        console.print(table)
        assert max(map(len, console.export_text().splitlines())) <= width
    _, plain, _ = toy_cli("cache", "list")   # not a terminal: one line per entry, whatever the width
    assert len([line for line in plain.splitlines() if line.startswith(("scan ", "tiled ", "norms "))]) == \
        sum(r["variant"] in ("scan", "tiled", "norms") for r in rows)


@pytest.mark.nvrtc
def test_junk_is_not_an_entry_and_unreadable_entries_are_named(toy_cli):
    toy_cli("cache", "warm", "--metric", "l2", "--dtype", "float32", "--dim", "8", "--k", "1", "--arch", "sm_90")
    folder = toy_cli.cache.directory
    entries = len(toy_cli.cache.entry_paths())
    (folder / "notes.cubin").write_text("not a cubin")
    (folder / "sub.cubin").mkdir()
    damaged = folder / ("0" * 64 + ".cubin")
    damaged.write_bytes(b"garbage")
    _, out, _ = toy_cli("cache", "info", "--json")
    assert json.loads(out)["entries"] == entries + 1 and json.loads(out)["strays"] == 2
    _, out, _ = toy_cli("cache", "list")
    assert f"unreadable entry {damaged.name}: truncated" in out
    assert "not a cache entry (ignored): notes.cubin" in out and "not a cache entry (ignored): sub.cubin" in out
    code, out, _ = toy_cli("cache", "verify")
    assert code == 1 and out.count("CORRUPT") == 1 and damaged.name in out
    damaged.unlink()
    assert toy_cli("cache", "verify")[0] == 0   # the strays do not fail verify
    code, out, _ = toy_cli("cache", "clear")
    assert code == 0 and f"removed {entries} cubins" in out and "left " in out and "sub.cubin" in out
    assert not (folder / "notes.cubin").exists() and toy_cli("cache", "verify")[0] == 0


@pytest.mark.nvrtc
def test_clear_removes_locks_and_the_cpu_library_and_reports_what_it_cannot(toy_cli, cache_dir, monkeypatch):
    toy_cli("cache", "warm", "--metric", "l2", "--dtype", "float32", "--dim", "8", "--k", "1", "--arch", "sm_90")
    (cache_dir / "cpu").mkdir()
    (cache_dir / "cpu" / "libtinyknn-0123.so").write_bytes(b"\x7fELF")
    assert (cache_dir / "cubins" / "locks").is_dir()
    code, out, _ = toy_cli("cache", "clear")
    assert code == 0 and "removed " in out
    assert not (cache_dir / "cubins" / "locks").exists() and not (cache_dir / "cpu").exists()
    assert toy_cli.cache.entry_paths() == []

    toy_cli("cache", "warm", "--metric", "l2", "--dtype", "float32", "--dim", "8", "--k", "1", "--arch", "sm_80")
    entries = len(toy_cli.cache.entry_paths())

    def read_only(self, *args, **kwargs):   # a read-only folder (root ignores permission bits, so say it here)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    code, out, err = toy_cli("cache", "clear")
    assert code == 1 and "removed 0 cubins" in out
    assert "tinyknn: error: could not remove " in err and "Permission denied" in err
    monkeypatch.undo()
    assert len(toy_cli.cache.entry_paths()) == entries


@pytest.mark.nvrtc
def test_warm_onto_a_full_disk_reports_what_was_written_and_fails(toy_cli, monkeypatch):
    import errno

    from tinyknn.jit import store

    real_write, written = store.write_atomic, []

    def fills_up(path, data):
        if path.suffix == ".cubin" and len(written) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)
        written.append(path)

    monkeypatch.setattr(store, "write_atomic", fills_up)
    with pytest.warns(CubinCacheWarning, match="No space left on device"):
        code, out, err = toy_cli("cache", "warm", *COMBINATION, "--arch", "sm_90", "--jobs", "1")
    cubins = [p for p in written if p.suffix == ".cubin"]
    assert code == 1 and len(cubins) == 3 == len(toy_cli.cache.entry_paths())
    assert "compiled and written 3, compiled but NOT written " in out and "No space left on device" in out
    toy_cli.fresh()
    with pytest.warns(CubinCacheWarning):
        code, out, _ = toy_cli("cache", "warm", *COMBINATION, "--arch", "sm_90", "--jobs", "1", "--json")
    summary = json.loads(out)
    assert code == 1 and summary["compiled"] == 0 and summary["unsaved"] == summary["kernels"] - 3
    assert summary["cached"] == 3 and "No space left on device" in summary["not_written"][0]


@pytest.mark.nvrtc
def test_verbose_shows_the_compile_events(toy_cli):
    code, _, err = toy_cli("-v", "cache", "warm", "--metric", "l2", "--dtype", "float32", "--dim", "8", "--k", "1",
                           "--arch", "sm_90")
    assert code == 0 and "tinyknn.jit.cache: compiled KernelSpec(" in err
