"""The resumable checkpoint of a ground-truth run: an uncompressed .npz written atomically after every query
batch (tinyknn.io's temporary-file-and-rename), holding the run's key (the inputs' fingerprints and every
parameter that shapes the answer), where the run stands (shard, next query batch) and the answer so far.

A checkpoint is only resumed by a run with the same key: another base, other queries, another k, metric,
dtype or shard/batch layout is refused with a ValueError saying what differs. The device is not part of the
key: CPU and GPU answers are bit-identical, so a run begun on one may end on the other (a run that leaves
shard_rows to its default, which depends on the device, takes the checkpoint's: `shard_rows_of`).
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..io import atomic_write

FORMAT = "tinyknn.groundtruth.checkpoint"
VERSION = 1


def _flatten(value, prefix="") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def save(path, key: dict, shard: int, batch: int, arrays: dict[str, np.ndarray]) -> None:
    header = json.dumps({"format": FORMAT, "version": VERSION, "key": key, "shard": shard, "batch": batch})
    with atomic_write(path) as handle:
        np.savez(handle, header=np.frombuffer(header.encode(), dtype=np.uint8), **arrays)


def shard_rows_of(path, key: dict) -> int | None:
    """The shard_rows of the checkpoint at `path` when it is one of this run but for shard_rows (which the
    run left to its default: a run begun on another device resumes with the shards it began with), else
    None (no checkpoint, another run's, or not readable: `load` then says what is wrong)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            theirs = json.loads(bytes(archive["header"]).decode()).get("key", {})
    except Exception:   # noqa: BLE001 - no checkpoint or a damaged one: load() reports it
        return None
    ours = json.loads(json.dumps({**key, "shard_rows": None}))
    rows = theirs.get("shard_rows") if isinstance(theirs, dict) else None
    if isinstance(rows, int) and rows >= 1 and {**theirs, "shard_rows": None} == ours:
        return rows
    return None


def load(path, key: dict) -> tuple[int, int, dict[str, np.ndarray]] | None:
    """(shard, next batch, arrays) of the checkpoint at `path`, None when there is none; a checkpoint of
    another run (or not a checkpoint) is a ValueError naming the path and what differs."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            header = json.loads(bytes(archive["header"]).decode())
            arrays = {name: archive[name] for name in archive.files if name != "header"}
    except Exception as exc:   # noqa: BLE001 - whatever a damaged file raises, the answer is the same
        raise ValueError(f"{os.fspath(path)} is not a readable tinyknn ground-truth checkpoint ({exc}); remove it "
                         "or pass another --checkpoint path") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{os.fspath(path)} is not a tinyknn ground-truth checkpoint of version {VERSION} "
                         f"(format {header.get('format')!r}, version {header.get('version')!r})")
    if header["key"] != json.loads(json.dumps(key)):
        theirs, ours = _flatten(header["key"]), _flatten(json.loads(json.dumps(key)))
        differ = sorted(name for name in set(theirs) | set(ours) if theirs.get(name) != ours.get(name))
        shown = "; ".join(f"{name}: checkpoint {theirs.get(name)!r}, this run {ours.get(name)!r}"
                          for name in differ[:6])
        raise ValueError(f"the checkpoint {os.fspath(path)} was written for different inputs or parameters ({shown}); "
                         "remove it to start afresh, or pass another checkpoint path")
    return int(header["shard"]), int(header["batch"]), arrays
