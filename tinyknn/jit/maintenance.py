"""Looking after a cubin folder (what `tinyknn cache list|info|verify|clear` do), apart from lookups.

An entry is a regular file named `<64 hex digits>.cubin` (the key, store.py's format). Anything else in
the folder that looks like one (a `.cubin` file of another name, a directory named `x.cubin`) is a stray:
never counted as an entry, shown as such by list/info/verify, and not a reason for verify to fail.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import store

_KEY_NAME = re.compile(r"^[0-9a-f]{64}" + re.escape(store.SUFFIX) + "$")


def _candidates(directory: Path) -> list[Path]:
    try:
        return sorted(directory.glob(f"*{store.SUFFIX}"))
    except OSError:
        return []


def entry_paths(directory: Path) -> list[Path]:
    """The folder's entries: regular files with a key for a name."""
    return [p for p in _candidates(directory) if _KEY_NAME.match(p.name) and p.is_file() and not p.is_symlink()]


def stray_paths(directory: Path) -> list[Path]:
    """`*.cubin` names in the folder that are not entries (other names, directories, links)."""
    entries = set(entry_paths(directory))
    return [p for p in _candidates(directory) if p not in entries]


def _worst(reports, *fields: str) -> int:
    return max((sum(int(r.get(f, 0)) for f in fields) for r in reports), default=0)


def list_entries(directory: Path) -> list[dict]:
    """One row per entry: spec fields (tile parameters included), size, ptxas's worst kernel, created;
    an unreadable entry is a row with `file` and `problem` only."""
    rows = []
    for path in entry_paths(directory):
        try:
            header = store.read_header(path)
            size = path.stat().st_size
        except (OSError, store.EntryError) as problem:
            rows.append({"file": path.name, "problem": str(problem)})
            continue
        spec = header.get("spec", {})
        reports = list(header.get("reports", {}).values())
        rows.append({
            **{name: spec.get(name) for name in ("variant", "metric", "dtype", "dim", "k")},
            "params": {str(name): value for name, value in spec.get("params", [])},
            "arch": header.get("arch"),
            "size": size,
            "registers": _worst(reports, "registers"),
            "stack_bytes": _worst(reports, "stack_bytes"),
            "spill_bytes": _worst(reports, "spill_store_bytes", "spill_load_bytes"),
            "created": header.get("created"),
            "nvrtc_version": ".".join(map(str, header.get("nvrtc_version", []))),
            "file": path.name,
        })
    return rows


def verify(directory: Path) -> list[tuple[Path, str]]:
    """(path, problem) for every entry that is unreadable, truncated, corrupt or foreign."""
    problems = []
    for path in entry_paths(directory):
        try:
            store.decode_entry(path.read_bytes(), expected_key=path.name[: -len(store.SUFFIX)])
        except (OSError, store.EntryError) as problem:
            problems.append((path, str(problem)))
    return problems


def info(directory: Path) -> dict:
    paths = entry_paths(directory)
    size = 0
    for path in paths:
        with contextlib.suppress(OSError):
            size += path.stat().st_size
    return {"location": str(directory), "entries": len(paths), "bytes": size, "strays": len(stray_paths(directory))}


@dataclass
class ClearReport:
    removed: int = 0                                   # entries removed
    failures: list[tuple[str, str]] = field(default_factory=list)   # (path, why) of what could not go
    left: list[str] = field(default_factory=list)      # strays that are not ours to remove (directories)


def _unlink(path: Path, report: ClearReport) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        report.failures.append((str(path), exc.strerror or str(exc)))
        return False


def clear(directory: Path, extra_folders=()) -> ClearReport:
    """Remove every entry, stray `.cubin` file, lock (and locks/), stamp and temporary file, then each of
    `extra_folders` (the CPU library's) whole; say what could not be removed."""
    report = ClearReport()
    report.removed = sum(_unlink(path, report) for path in entry_paths(directory))
    for path in stray_paths(directory):
        if path.is_file() or path.is_symlink():
            _unlink(path, report)
        else:
            report.left.append(str(path))
    for pattern in ("locks/*.lock", ".*.tmp", "nvrtc-*.json"):
        for path in sorted(directory.glob(pattern)):
            _unlink(path, report)
    locks = directory / "locks"
    try:
        locks.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        report.failures.append((str(locks), exc.strerror or str(exc)))
    for folder in extra_folders:
        if Path(folder).exists():
            _remove_tree(Path(folder), report)
    return report


def _remove_tree(folder: Path, report: ClearReport) -> None:
    def failed(_function, path, error):
        error = error if isinstance(error, BaseException) else error[1]   # onexc: the error; onerror: exc_info
        report.failures.append((str(path), getattr(error, "strerror", None) or str(error)))

    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=failed)
    else:  # pragma: no cover - Python 3.10, 3.11
        shutil.rmtree(folder, onerror=failed)
