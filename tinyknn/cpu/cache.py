"""The CPU library's cache folder and its verified entries (build.py writes them, build.py and prebuilt.py
read them).

Beside each library a sidecar `<library>.json` records its sha256 and what it was built from; a library is
loaded only when its bytes match it. The folder is `get_config().cache_dir / "cpu"`, or, where that cannot be
written, a persistent per-user folder under the system's temporary directory (one warning per process), so
later processes find the build there instead of compiling again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from ..config import get_config
from ..errors import CpuLibraryError

log = logging.getLogger("tinyknn.cpu")


def primary_dir() -> Path:
    return get_config().cache_dir / "cpu"


def _fallback_path() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"tinyknn-{uid}" / "cpu"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(handle)
        os.unlink(probe)
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=4)
def _fallback_dir(unwritable: Path) -> Path:
    """A persistent per-user folder for builds when the cache cannot be written (one warning per process):
    later processes find the build there instead of compiling again."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    folder = _fallback_path()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        owner_ok = not hasattr(os, "getuid") or folder.parent.stat().st_uid == uid
        if folder.parent.is_symlink() or not owner_ok or not _writable(folder):
            raise OSError(f"{folder} is not a private folder of this user")
    except OSError as exc:
        raise CpuLibraryError(f"tinyknn cannot write its cache {unwritable} nor a fallback folder ({exc}); set "
                              "TINYKNN_CACHE_DIR to a writable folder") from None
    # (said whether this process builds the library there or finds it built: build.py says when it builds)
    warnings.warn(f"tinyknn cannot write its cache {unwritable}; it keeps the CPU library in {folder} instead",
                  RuntimeWarning, stacklevel=4)
    log.warning("cache %s is not writable; CPU library builds go to %s", unwritable, folder)
    return folder


def library_dir() -> Path:
    """cache_dir/cpu, or the per-user fallback folder where that cannot be written."""
    folder = primary_dir()
    return folder if _writable(folder) else _fallback_dir(folder)


def _write_json(path: Path, value: dict) -> None:
    """Atomically (a temporary file replaced into place); a failure only costs the memo."""
    temporary = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        temporary.write_text(json.dumps(value, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sidecar(library: Path) -> Path:
    return library.with_name(library.name + ".json")


def read_sidecar(library: Path) -> dict | None:
    try:
        found = json.loads(sidecar(library).read_text())
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


def verified(library: Path) -> bool:
    """The file is a regular file whose bytes are those its sidecar recorded after its build."""
    facts = read_sidecar(library)
    try:
        return bool(facts) and library.is_file() and not library.is_symlink() and file_sha256(library) == facts.get("sha256")
    except OSError:
        return False


def remove(path: Path, why: str) -> None:
    """A damaged or foreign entry, and its sidecar, gone (with one warning)."""
    warnings.warn(f"tinyknn's cached CPU library {path} {why}; removing it and building it again", RuntimeWarning,
                  stacklevel=4)
    log.warning("cached CPU library %s %s; rebuilding", path, why)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        sidecar(path).unlink(missing_ok=True)
    except OSError as exc:
        raise CpuLibraryError(f"cannot remove the damaged cached CPU library {path}: {exc}") from None
