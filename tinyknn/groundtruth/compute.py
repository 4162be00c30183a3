"""Exact ground truth at any scale: the base streamed from its (memory-mapped) file into tinyknn Indexes.

How: the base's first `rows` rows are cut into shards of `shard_rows`. Each shard is added to one
`tinyknn.Index`, `batch_rows` rows at a time, with the rows' numbers as ids, and searched as soon as it is
whole (the queries in batches of `query_batch`); each query batch's running answer is merged with the
shard's by tinyknn's exact merge (float32 ties between shards ordered by their float64 distances, then by
the smaller id), so the result is bit for bit the answer one Index holding every row gives: the float64
oracle's ids, ties by the smaller id, distances its float32 roundings.

A file on a GPU is read by reader threads (batches.py), up to READ_AHEAD_BYTES of batches (never more
than a shard) ahead of the adds and across shard boundaries, and cut into about OVERLAP_SHARDS shards (none
below MIN_OVERLAP_SHARD_ROWS rows). Each finished shard is searched on a search thread (searches.py) while
this thread adds the next one's rows, and its answers are merged while the next one is searched: the reads
go on throughout, the adds wait for a search only where it takes longer than the next shard's read, and
only the last shard's search and merge follow the read. Elsewhere (arrays, the CPU, a Dask cluster) one
shard takes every row that fits the memory budget, and the batches are read, added and searched in turn.

Resumable: with `checkpoint=PATH` the answer so far is saved atomically after every query batch; a run
with the same inputs and parameters resumes there and gives the same bits; a checkpoint of other inputs is
refused. With `output=PATH` the answer is written in `format`, its distances in that format's convention
(tinyknn.groundtruth.conventions), with a JSON record beside it (PATH.json).

On a Dask cluster (`client=`, a distributed.Client): each shard is a tinyknn.dask.DaskIndex whose rows
live on the workers (default: one shard of every row, the cluster's memory being the budget); this
process streams the file through and keeps only the queries and the answer.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np

from .. import io as tio
from ..spec import parse_metric
from . import checkpoint as _checkpoint
from .answer import Answer
from .batches import Batches, spans_of
from .exact import Exact, storage_dtype
from .inputs import Source, open_pair
from .output import write_output
from .searches import Searches
from .stages import Stages

DEFAULT_QUERY_BATCH = 4096
ADD_CHUNK_BYTES = 64 << 20
CUDA_INDEX_BYTES = 32 << 30          # default device-memory budget of one shard (override: shard_rows)
READ_AHEAD_BYTES = 1 << 30           # host memory of the batches read ahead of the adds (never more than a shard)
OVERLAP_SHARDS = 8                   # default shards of a file on a GPU: each searched while the next is read
MIN_OVERLAP_SHARD_ROWS = 2_000_000   # ... but none smaller (a shard's search and merge have a fixed cost)


def _memory_budget(device: str) -> int:
    """Bytes one shard's Index may take: half the machine's memory on the CPU, CUDA_INDEX_BYTES on a GPU."""
    if device == "cuda":
        return CUDA_INDEX_BYTES
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):
        return 8 << 30


def _positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{what} must be a positive integer; got {value!r}")
    return int(value)


def _limit(value, available: int, what: str, source: Source) -> int:
    if value is None:
        return available
    value = _positive(value, what)
    if value > available:
        raise ValueError(f"{what} = {value:,} but {source.name} holds {available:,} rows")
    return value


def _overlaps(base: Source, device: str, client) -> bool:
    """Whether the read of the base overlaps the searches: a file on a GPU of this process."""
    return device == "cuda" and client is None and base.path is not None


def _searches_concurrently(overlapped: bool, storage: str, shard_rows: int, row_bytes: int) -> bool:
    """Whether each shard is searched on a thread of its own while the next one is filled (searches.py):
    where the read overlaps (a file on a GPU) and two shards in device memory fit the budget of one."""
    return overlapped and storage == "device" and 2 * shard_rows * (row_bytes + 16) <= CUDA_INDEX_BYTES


def _default_shard_rows(n: int, row_bytes: int, device: str, client, overlapped: bool) -> int:
    """Rows per shard when none is given: a function of the inputs and the device alone, so a rerun of the
    same inputs cuts the same shards (the checkpoint's key holds them)."""
    if client is not None:
        return n
    budget = max(1, _memory_budget(device) // (2 * (row_bytes + 16)))
    if overlapped:
        return min(budget, max(MIN_OVERLAP_SHARD_ROWS, -(-n // OVERLAP_SHARDS)))
    return budget


def _new_index(dim: int, metric: str, dtype: str, device: str, storage: str, client):
    """One shard's index: a tinyknn.Index here, or a DaskIndex over the workers of `client`."""
    if client is None:
        from ..index import Index

        return Index(dim, metric=metric, dtype=dtype, device=device, storage=storage)
    from ..dask import DaskIndex       # imported on use: tinyknn.dask needs distributed

    return DaskIndex(client, dim, metric=metric, dtype=dtype, device=device)


def _cluster(client) -> dict | None:
    """What the record says of a Dask cluster: its scheduler and how many workers it had."""
    if client is None:
        return None
    info = client.scheduler_info()
    return {"scheduler": info.get("address"), "workers": len(info.get("workers", {}))}


def groundtruth(base, queries, k: int | None = None, metric: str = "l2", device: str = "cpu", rows: int | None = None,
                queries_limit: int | None = None, batch_rows: int | None = None, checkpoint=None, progress=None, *,
                radius: float | None = None, dtype=None, query_batch: int = DEFAULT_QUERY_BATCH,
                shard_rows: int | None = None, storage: str = "device", output=None, format: str = "bigann",
                keep_checkpoint: bool = False, client=None):
    """Exact k-NN (or, with `radius`, range) ground truth of `queries` against `base`.

    base, queries: arrays (anything with shape, dtype and row slicing) or vector files (tinyknn.io: .fvecs,
    .bvecs, .fbin, .u8bin, .i8bin, .f16bin, .npy, FILE.hdf5 - its `train` for the base, its `test` for the
    queries). rows / queries_limit: use only the first N of each. metric 'l2' | 'ip' | 'cosine'; dtype: the
    Index's storage dtype (default: the base's own; a float64 base needs it said). device 'cpu' | 'cuda'
    (storage='host' streams a base larger than the GPU through it). batch_rows: rows added to an Index at a
    time (default: 64 MiB of them); query_batch: queries searched at a time (the checkpoint's step);
    shard_rows: rows per Index (default: a file on a GPU in about 8 shards of at least 2M rows, each
    searched while the next is read; otherwise all rows that fit half the memory, 32 GiB on a GPU; a
    resumed checkpoint's own).
    client: a distributed.Client: the shards are tinyknn.dask.DaskIndex objects on its workers (each
    worker's Index on `device`), for bases no single machine holds; default shard_rows: every row.
    progress(done_rows, total_rows, stage): called after every step; done_rows counts base rows searched
    against every query (so done_rows / seconds is a rate in rows/s).

    Returns (distances float32 (nq, k), ids int64 (nq, k)) in tinyknn's convention (l2: squared distances;
    ip, cosine: similarities, larger first), bit for bit the float64 oracle's answer, ties by the smaller
    id; padded with (+inf / -inf, -1) where k exceeds the rows. With `radius`: (lims, distances, ids) in
    FAISS's layout (l2: d < radius; ip, cosine: d > radius). With `output`, also writes `format`'s files
    (distances in its convention) and OUTPUT.json, the record of what was computed.
    """
    metric = parse_metric(metric)
    if (k is None) == (radius is None):
        raise ValueError("give exactly one of k (k-NN ground truth) or radius (range ground truth)")
    k = None if k is None else _positive(k, "k")
    if client is not None and storage != "device":
        raise ValueError(f"storage={storage!r} is not available on a Dask cluster (client=...): each worker's "
                         "shard holds its rows in its device's memory; give storage='device'")
    if format not in (tio.RANGE_FORMATS if radius is not None else tio.FORMATS):
        allowed = tio.RANGE_FORMATS if radius is not None else tio.FORMATS
        raise ValueError(f"format must be one of {', '.join(allowed)}" + (" for range ground truth" if radius is not
                         None else "") + f"; got {format!r}")
    base_source, query_source = open_pair(base, queries)
    try:
        n = _limit(rows, base_source.shape[0], "rows", base_source)
        nq = _limit(queries_limit, query_source.shape[0], "queries_limit", query_source)
        if n == 0 or nq == 0:
            raise ValueError(f"nothing to search: {n:,} base rows ({base_source.name}) and {nq:,} queries "
                             f"({query_source.name})")
        return _compute(base_source, query_source, n, nq, k, radius, metric, device, dtype, batch_rows, query_batch,
                        shard_rows, storage, checkpoint, progress, output, format, keep_checkpoint, client)
    finally:
        base_source.close()
        query_source.close()


def _compute(base, query_source, n, nq, k, radius, metric, device, dtype, batch_rows, query_batch, shard_rows,
             storage, checkpoint_path, progress, output, format, keep_checkpoint, client):
    started, stages = time.perf_counter(), Stages()
    dtype = storage_dtype(base, dtype)
    dim = base.shape[1]
    queries = query_source.rows(0, nq)
    run = Exact(base, queries, n, metric, dtype)
    row_bytes = dim * run.storage.itemsize
    query_batch = _positive(query_batch, "query_batch")
    batch_rows = max(1, ADD_CHUNK_BYTES // row_bytes) if batch_rows is None else _positive(batch_rows, "batch_rows")
    overlapped = _overlaps(base, device, client)
    fingerprints = {"base": base.fingerprint(n), "queries": query_source.fingerprint(nq)}
    # the checkpoint's key: what the inputs hold, not where they are (a moved file still resumes)
    key = {**{name: {f: v for f, v in value.items() if f != "file"} for name, value in fingerprints.items()},
           "metric": metric, "dtype": dtype,
           "k": k, "radius": None if radius is None else float(radius), "shard_rows": shard_rows,
           "query_batch": query_batch}
    if shard_rows is None:       # a run resumed on another device keeps the shards it began with
        shard_rows = _checkpoint.shard_rows_of(checkpoint_path, key) if checkpoint_path is not None else None
        if shard_rows is None:
            shard_rows = _default_shard_rows(n, row_bytes, device, client, overlapped)
    shard_rows = min(n, _positive(shard_rows, "shard_rows"))
    key["shard_rows"] = shard_rows
    n_shards, n_batches = -(-n // shard_rows), -(-nq // query_batch)
    read_ahead = max(1, min(READ_AHEAD_BYTES // (batch_rows * row_bytes), -(-shard_rows // batch_rows))) \
        if overlapped else 0

    shard, batch, saved = 0, 0, None
    if checkpoint_path is not None:
        state = _checkpoint.load(checkpoint_path, key)
        if state is not None:
            shard, batch, saved = state
    answer = Answer(run, nq, k, radius, saved, batch)

    def save_state(next_shard: int, next_batch: int) -> None:
        if checkpoint_path is not None:
            _checkpoint.save(checkpoint_path, key, next_shard, next_batch, answer.arrays())
            stages.done("checkpointing")

    total_units = float(n)
    done_units = sum(min(shard_rows, n - s * shard_rows) for s in range(shard)) + \
        (min(shard_rows, n - shard * shard_rows) * min(nq, batch * query_batch) / nq if shard < n_shards else 0)

    def search(index, qa: int, qb: int):
        return index.search(queries[qa:qb], k) if radius is None else index.range_search(queries[qa:qb], radius)

    spans = spans_of(shard * shard_rows, n, shard_rows, batch_rows)
    reader = Batches(base, [span for shard_spans in spans for span in shard_spans], read_ahead)
    batches = iter(reader)
    searches = Searches(search, concurrent=_searches_concurrently(overlapped, storage, shard_rows, row_bytes))
    stages.done("opening")
    try:
        for s in range(shard, n_shards):
            stage = f"shard {s + 1}/{n_shards}" if n_shards > 1 else "searching"
            index = _new_index(dim, metric, dtype, device, storage, client)
            try:
                for a, b, rows in itertools.islice(batches, len(spans[s - shard])):
                    index.add(rows, ids=np.arange(a, b, dtype=np.int64))
                    if progress is not None:
                        progress(done_units, total_units, f"adding {stage}" if n_shards > 1 else "adding rows")
            except BaseException:
                index.close()
                raise
            stages.done("reading and adding")
            first_batch = batch if s == shard else 0
            searches.hand((s, stage, spans[s - shard][-1][1] - spans[s - shard][0][0]), index,
                          [(t, t * query_batch, min(nq, (t + 1) * query_batch)) for t in range(first_batch, n_batches)])
            # the answers of the shards handed so far (concurrently: all but this one, searched meanwhile),
            # merged, saved and reported
            for (done_shard, done_stage, rows_done), t, qa, qb, found in \
                    searches.answers(keep=1 if searches.concurrent and s + 1 < n_shards else 0):
                stages.done("searching")
                answer.take(done_shard == 0, qa, qb, found)
                if radius is None:
                    stages.done("merging")
                done_units += rows_done * (qb - qa) / nq
                if t + 1 < n_batches:
                    save_state(done_shard, t + 1)
                else:
                    answer.shard_done()
                    save_state(done_shard + 1, 0)
                if progress is not None:
                    progress(done_units, total_units, done_stage)
    finally:
        searches.close()
        reader.close()

    result = answer.result()
    if radius is not None and len(answer.parts) > 1:
        stages.done("merging")
    if output is not None:
        write_output(run, result, output, format, k, radius, device, storage, base, n_shards,
                      time.perf_counter() - started, key, fingerprints, cluster=_cluster(client), stages=stages)
    if checkpoint_path is not None and not keep_checkpoint and os.path.exists(checkpoint_path):
        os.unlink(checkpoint_path)
    return result


