"""Writing a run's answer: the format's files, distances in the format's convention, and the JSON record."""

from __future__ import annotations

import datetime
import json
import os

import numpy as np

from .. import io as tio
from .._version import __version__
from . import conventions
from .exact import converted
from .inputs import FirstRows


def write_output(run, result, output, format, k, radius, device, storage, base, n_shards, seconds, key,
                  fingerprints, cluster=None, stages=None) -> None:
    """The format's files, then the JSON record beside them (`stages`: a Stages of the run, or None)."""
    name = conventions.convention(format, run.metric)
    if radius is None:
        distances, ids = result
        written = tio.write_knn_groundtruth(
            output, ids, converted(run, distances, ids, name), format=format,
            distance=conventions.HDF5_DISTANCE[run.metric],
            train=FirstRows(base, run.n) if format == "hdf5" else None,
            test=run.queries if format == "hdf5" else None)
    else:
        lims, distances, ids = result
        query_of = np.repeat(np.arange(len(lims) - 1), np.diff(lims))
        written = tio.write_range_groundtruth(output, lims, ids, converted(run, distances, ids, name, query_of),
                                              format=format)
    if stages is not None:
        stages.done("writing")
    record = {
        "format": "tinyknn.groundtruth.record", "version": 1, "tinyknn": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kind": "knn" if radius is None else "range", "metric": run.metric, "dtype": run.dtype,
        "k": k, "radius": key["radius"], "base": fingerprints["base"], "queries": fingerprints["queries"],
        "device": device, "storage": storage, "shards": n_shards, "shard_rows": key["shard_rows"],
        "query_batch": key["query_batch"], "seconds": round(seconds, 3),
        "output": {"format": format, "files": list(written), "distance_convention": name,
                   "distance_description": conventions.describe(name),
                   "larger_is_better": conventions.larger_is_better(name)},
        "order": "nearest first by the float64 distance (stored vectors widened exactly, queries as float32), "
                 "equal float64 distances by the smaller id; distances are those float64 values in the "
                 "convention above, rounded to float32 once",
    }
    if stages is not None:
        record["stages_seconds"] = stages.rounded()
    if cluster is not None:
        record["dask"] = cluster
    if radius is not None:
        record["hits"] = int(result[0][-1])
        record["radius_meaning"] = "l2: squared distance < radius" if run.metric == "l2" else "similarity > radius"
    with tio.atomic_write(record_path(output)) as handle:
        handle.write((json.dumps(record, indent=2) + "\n").encode())


def record_path(output) -> str:
    """Where the JSON record of a run writing `output` goes."""
    return os.fspath(output) + ".json"
