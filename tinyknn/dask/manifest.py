"""The manifest.json a saved DaskIndex keeps beside its shards' Index files: their names and sizes, and the
index's dim, metric and dtype; written last, through tinyknn.io's atomic_write (a temporary file fsync'ed and
renamed, removed if the write fails), so a directory holds a whole save or none."""

from __future__ import annotations

import json
from pathlib import Path

from ..io import atomic_write

MANIFEST = "manifest.json"
MANIFEST_FORMAT, MANIFEST_VERSION = "tinyknn-dask", 1


def write_manifest(directory: Path, files: list[str], totals, dim: int, metric: str, dtype: str) -> None:
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "dim": dim, "metric": metric,
                "dtype": dtype, "shards": [{"file": Path(f).name, "ntotal": int(t)} for f, t in zip(files, totals)]}
    with atomic_write(directory / MANIFEST) as handle:
        handle.write((json.dumps(manifest, indent=2) + "\n").encode())


def read_manifest(directory: Path) -> dict:
    """The manifest of `directory`, or a ValueError saying why it is not a saved DaskIndex's."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory} holds no readable {MANIFEST} of a saved DaskIndex: {exc}") from exc
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{directory / MANIFEST} is not a {MANIFEST_FORMAT} manifest of version "
                         f"{MANIFEST_VERSION}; got format {manifest.get('format')!r} version "
                         f"{manifest.get('version')!r}")
    return manifest
