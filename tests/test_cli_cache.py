"""`tinyknn cache warm|list|info|verify|clear` in this process, over a toy-rendering cubin cache: what warm
says and writes (a full disk included), arch spellings and refusals, what list shows, strays, clear on a
read-only cache. The kernels planned are tinyknn's real ones (search_kernels.specs_for_search); each is compiled
as a one-line toy kernel of its own (tens of ms), so these run without minutes of NVRTC.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_cli import COMBINATION, tinyknn
from test_jit_compiler import ToySource

from tinyknn.jit.cache import CubinCache, CubinCacheWarning

TOY_KERNEL = "template <int V> __global__ void toy(float* out) { if (threadIdx.x == 0) out[blockIdx.x] = V; }"


def toy_any(spec):
    import zlib

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
    from tinyknn.cli.common import count

    assert (count(1, "kernel"), count(0, "kernel"), count(1274, "kernel"), count(2, "entry", "entries")) == \
        ("1 kernel", "0 kernels", "1,274 kernels", "2 entries")


@pytest.mark.nvrtc
def test_warm_says_what_it_will_do_shows_progress_and_reports(toy_cli):
    from tinyknn.jit.search_kernels import specs_for_search

    code, out, err = toy_cli("cache", "warm", *COMBINATION, "--arch", "90", "--jobs", "2")
    n = len(specs_for_search("l2", "float32", 32, 4, "sm_90"))
    assert code == 0, err
    plan = err.splitlines()[0]
    assert plan.startswith(f"tinyknn cache warm: {n} kernels: ") and "for 1 combination from the command line" in plan
    assert "on sm_90, 2 jobs" in plan and "float16" not in plan
    progress = [line for line in err.splitlines() if line.startswith("warm: ")]
    assert progress and progress[-1].startswith(f"warm: {n}/{n} kernels, ")   # plain lines: no terminal here
    assert all(" left" in line for line in progress[:-1]) and len(progress) >= 2
    assert f"{n} kernels on sm_90: compiled and written {n}, already cached 0, failed 0, in " in out and " s; cache: " in out
    code, out, _ = toy_cli("cache", "warm", *COMBINATION, "--arch", "sm_90")
    assert code == 0 and f"compiled and written 0, already cached {n}, failed 0" in out


@pytest.mark.nvrtc
@pytest.mark.parametrize("dtype, stored", [("float32", {"float32"}), ("float16", {"float16", "float32"}),
                                           ("int8", {"int8", "float32"})])
def test_dtype_means_what_it_says(toy_cli, dtype, stored):
    code, _, err = toy_cli("cache", "warm", "--metric", "ip", "--dtype", dtype, "--dim", "16", "--k", "2", "--arch", "sm_80")
    assert code == 0, err
    _, out, _ = toy_cli("cache", "list", "--json")
    rows = json.loads(out)["entries"]
    assert {r["dtype"] for r in rows} == stored
    searches = {"scan", "tiled", "verify", "band", "range"}   # the kernels that read the stored rows
    assert {r["dtype"] for r in rows if r["variant"] in searches} == {dtype}
    assert any(r["variant"] == "norms" and r["dtype"] == "float32" for r in rows)   # the query ingest


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

    from tinyknn.cli import cache as _cli_cache

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


def test_commands_on_a_cache_that_does_not_exist_yet(toy_cli, cache_dir):
    assert not cache_dir.exists()
    for command in (("cache", "clear"), ("cache", "verify"), ("cache", "info", "--json"), ("cache", "list", "--json")):
        code, out, err = toy_cli(*command)
        assert code == 0 and err == "", (command, err)
    assert json.loads(toy_cli("cache", "info", "--json")[1])["entries"] == 0
