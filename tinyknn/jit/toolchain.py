"""The NVRTC version for the cache key, without loading NVRTC when this environment was seen before.

The cache key must name the NVRTC version (another NVRTC makes other machine code), but loading NVRTC
to ask costs 50-100 ms (importing cuda.bindings.nvrtc, then dlopen of a ~100 MB library), twenty times
the 5 ms a cached kernel may take. So the first process that loads NVRTC writes a stamp next to the
cubins: the version, the library file it loaded (path, size, mtime), and a fingerprint of what decides
which library a process loads (interpreter, site-packages directories and their mtimes, the library
search variables). A later process whose fingerprint and library file match reads the version from
the stamp; any difference (a pip install, another venv, a new CUDA) loads NVRTC and rewrites it.
Stamps are keyed by the fingerprint, so several environments sharing one cache do not fight.
Linux only (the loaded library is found in /proc/self/maps); elsewhere NVRTC is always loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

from . import compiler
from .store import write_atomic

_SEARCH_VARIABLES = ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX")
_LIBRARY = re.compile(r"(/\S*libnvrtc(?:\.alt)?\.so[.\d]*)$")   # not libnvrtc-builtins


def _fingerprint() -> dict:
    sites = []
    for entry in sys.path:
        if entry.endswith(("site-packages", "dist-packages")):
            try:
                sites.append([entry, os.stat(entry).st_mtime_ns])
            except OSError:
                continue
    return {
        "executable": sys.executable,
        "prefix": sys.prefix,
        "sites": sites,
        "env": {name: os.environ.get(name) for name in _SEARCH_VARIABLES},
    }


def _library_stat(path: str) -> dict | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _loaded_library() -> dict | None:
    """The libnvrtc file this process has mapped, or None where that cannot be told."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                match = _LIBRARY.search(line.strip())
                if match:
                    return _library_stat(match.group(1))
    except OSError:
        return None
    return None


def stamp_path(directory: Path, fingerprint: dict) -> Path:
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"nvrtc-{digest}.json"


def _read_stamp(path: Path, fingerprint: dict) -> tuple[int, int] | None:
    try:
        stamp = json.loads(path.read_text())
        if stamp["fingerprint"] != fingerprint or _library_stat(stamp["library"]["path"]) != stamp["library"]:
            return None
        major, minor = stamp["version"]
        return int(major), int(minor)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def nvrtc_version_for_key(directory: Path | None) -> tuple[int, int]:
    """NVRTC's (major, minor): from a matching stamp in `directory`, else by loading NVRTC (and stamping)."""
    fingerprint = _fingerprint()
    path = stamp_path(directory, fingerprint) if directory is not None else None
    if path is not None and (known := _read_stamp(path, fingerprint)) is not None:
        return known
    version = compiler.nvrtc_version()   # free where this process has loaded NVRTC already
    library = _loaded_library()
    if path is not None and library is not None:
        stamp = {"fingerprint": fingerprint, "library": library, "version": list(version)}
        try:
            write_atomic(path, json.dumps(stamp, indent=1).encode())
        except OSError:
            pass   # an unwritable cache only costs the next process an NVRTC load
    return version
