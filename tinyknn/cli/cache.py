"""`tinyknn cache list|info|verify|clear`: what is in the cubin cache, whether it is sound, and emptying it."""

from __future__ import annotations

import datetime
import sys

from .common import count, print_json
from ..config import get_config

# The renderer gives variants that the dim or k do not change a canonical value (k 0; dim 1 for all but the
# ingest, scan and tiled kernels: verify, band, range, rows... in jit/render.py); those are not dims or ks of
# anything, so list leaves them blank (null in --json).
_DIM_VARIANTS = {"norms", "scan", "single", "tiled"}


def _cache():
    from ..jit.cache import default_cache

    return default_cache()


def _iso(timestamp) -> str | None:
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="seconds")


def _shown(row: dict) -> dict:
    if "problem" in row:
        return row
    canonical_dim = row.get("variant") not in _DIM_VARIANTS and row.get("dim") == 1
    return {**row, "dim": None if canonical_dim else row.get("dim"),
            "k": row.get("k") or None, "created": _iso(row.get("created"))}


def cmd_list(args) -> int:
    from ..jit.maintenance import stray_paths

    cache = _cache()
    rows = [_shown(row) for row in cache.list_entries()]
    rows.sort(key=lambda r: ("problem" in r, str(r.get("arch")), str(r.get("variant")), str(r.get("metric")),
                             str(r.get("dtype")), r.get("dim") or 0, r.get("k") or 0, sorted((r.get("params") or {}).items())))
    strays = [path.name for path in stray_paths(cache.directory)]
    if args.json:
        print_json({"entries": rows, "strays": strays, "location": str(cache.directory)})
        return 0
    from rich.console import Console

    good = [r for r in rows if "problem" not in r]
    console = Console()
    title = f"{count(len(good), 'cubin')} in {cache.directory}"
    columns = _columns(good)
    if console.is_terminal:
        console.print(_table(title, columns, console.width))
    else:   # a pipe or a file: aligned plain lines at full width, one per entry (grep- and awk-friendly)
        print(title)
        widths = [max([len(name)] + [len(v) for v in values]) for name, _, values in columns]
        for line in zip(*([name] + values for name, _, values in columns)):
            print("  ".join(cell.rjust(w) if justify == "right" else cell.ljust(w)
                            for cell, w, (_, justify, _) in zip(line, widths, columns)).rstrip())
    for r in rows:
        if "problem" in r:
            print(f"unreadable entry {r['file']}: {r['problem']}")
    for name in strays:
        print(f"not a cache entry (ignored): {name}")
    return 0


_ESSENTIAL = 7   # variant .. arch; the rest are shown as the terminal's width allows, in this order


def _columns(rows) -> list[tuple[str, str, list[str]]]:
    """(name, justify, cells) for every column `cache list` can show."""
    def cells(make):
        return [make(r) for r in rows]

    return [
        ("variant", "left", cells(lambda r: r["variant"])), ("metric", "left", cells(lambda r: r["metric"])),
        ("dtype", "left", cells(lambda r: r["dtype"])), ("dim", "right", cells(lambda r: _blank(r["dim"]))),
        ("k", "right", cells(lambda r: _blank(r["k"]))),
        ("tile parameters", "left", cells(lambda r: " ".join(f"{k}={v}" for k, v in sorted(r["params"].items())))),
        ("arch", "left", cells(lambda r: r["arch"])), ("bytes", "right", cells(lambda r: f"{r['size']:,}")),
        ("regs", "right", cells(lambda r: str(r["registers"]))), ("spill", "right", cells(lambda r: str(r["spill_bytes"]))),
        ("stack", "right", cells(lambda r: str(r["stack_bytes"]))),
        ("created (UTC)", "left", cells(lambda r: (r["created"] or "")[:19].replace("T", " "))),
    ]


def _table(title: str, columns, width: int):
    """A rich table of the essential columns plus as many others as fit in `width`."""
    from rich.table import Table

    def need(column):
        name, _, values = column
        return max([len(name)] + [len(v) for v in values]) + 3

    shown, used = columns[:_ESSENTIAL], sum(map(need, columns[:_ESSENTIAL])) + 1
    for column in columns[_ESSENTIAL:]:
        if used + need(column) <= width:
            shown.append(column)
            used += need(column)
    table = Table(title=title, title_justify="left")
    for name, justify, _ in shown:
        table.add_column(name, justify=justify, overflow="fold")
    for line in zip(*(values for _, _, values in shown)):
        table.add_row(*line)
    return table


def _blank(value) -> str:
    return "" if value is None else str(value)


def cmd_info(args) -> int:
    info = _cache().info()
    if args.json:
        print_json(info)
    else:
        print(f"location: {info['location']}\nentries:  {info['entries']:,}\nbytes:    {info['bytes']:,}"
              + (f"\nstrays:   {info['strays']} (not cache entries; `tinyknn cache list` names them)" if info["strays"] else ""))
    return 0


def cmd_verify(args) -> int:
    cache = _cache()
    problems = cache.verify()
    for path, problem in problems:
        print(f"CORRUPT {path}: {problem}")
    print(f"{count(len(cache.entry_paths()), 'entry', 'entries')} checked in {cache.directory}, {len(problems)} bad"
          + ("; `tinyknn cache clear` removes them, or the next use replaces them" if problems else ""))
    return 1 if problems else 0


def cmd_clear(args) -> int:
    """Every cubin, lock and stamp, and the CPU library folder; exit 1 naming what could not be removed."""
    cache = _cache()
    cpu_folder = get_config().cache_dir / "cpu"
    report = cache.clear(extra_folders=[cpu_folder])
    print(f"removed {count(report.removed, 'cubin')} from {cache.directory} and the CPU library folder {cpu_folder}")
    for path in report.left:
        print(f"left {path}: not a cache entry (remove it by hand if it is not needed)")
    if report.failures:
        path, why = report.failures[0]
        print(f"tinyknn: error: could not remove {count(len(report.failures), 'file')}: {path}: {why}"
              + (f" (and {len(report.failures) - 1} more)" if len(report.failures) > 1 else ""), file=sys.stderr)
        return 1
    return 0
