"""The manifest.json a saved DaskIndex keeps beside its shards' Index files: their names and sizes, and the
index's dim, metric and dtype; written last, through a temporary file, so a directory holds a whole save or none."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_FORMAT, MANIFEST_VERSION = "tinyknn-dask", 1


def write_manifest(directory: Path, files: list[str], totals, dim: int, metric: str, dtype: str) -> None:
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "dim": dim, "metric": metric,
                "dtype": dtype, "shards": [{"file": Path(f).name, "ntotal": int(t)} for f, t in zip(files, totals)]}
    temporary = directory / f"{MANIFEST}.{uuid.uuid4().hex[:8]}.tmp"
    temporary.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(temporary, directory / MANIFEST)


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
