"""Exact ground truth at any scale: the base streamed from its (memory-mapped) file into tinyknn Indexes.

How: the base's first `rows` rows are cut into shards of `shard_rows` (default: one shard when it fits the
memory budget, which is most of the time). Each shard is added to one `tinyknn.Index`, `batch_rows` rows at a
time, with the rows' numbers as ids; the queries are searched in batches of `query_batch`. With one shard
the Index's answer is the answer. With several, each query batch's running answer is merged with the next
shard's by tinyknn's exact merge (float32 ties between shards ordered by their float64 distances, then by
the smaller id), so the result is bit for bit the answer one Index holding every row gives: the float64
oracle's ids, ties by the smaller id, distances its float32 roundings.

Resumable: with `checkpoint=PATH` the answer so far is saved atomically after every query batch; a run
with the same inputs and parameters resumes there and gives the same bits; a checkpoint of other inputs is
refused. With `output=PATH` the answer is written in `format`, its distances in that format's convention
(tinyknn.groundtruth.conventions), with a JSON record beside it (PATH.json).
"""

from __future__ import annotations

import datetime
import json
import os
import time

import numpy as np

from .. import io as tio
from .._version import __version__
from ..spec import numpy_dtype, parse_dtype, parse_metric
from . import checkpoint as _checkpoint
from . import conventions
from ._internal import as_storage, exact_distances, merge_knn, merge_ranges
from .inputs import FirstRows, Source, open_pair

DEFAULT_QUERY_BATCH = 4096
ADD_CHUNK_BYTES = 64 << 20
CUDA_INDEX_BYTES = 32 << 30          # default device-memory budget of one shard (override: shard_rows)
PAIR_CHUNK = 1 << 16                 # (query, id) pairs whose float64 distances are computed at a time


def _memory_budget(device: str) -> int:
    """Bytes one shard's Index may take: half the machine's memory on the CPU, CUDA_INDEX_BYTES on a GPU."""
    if device == "cuda":
        return CUDA_INDEX_BYTES
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):
        return 8 << 30


def _storage_dtype(source: Source, dtype) -> str:
    if dtype is not None:
        return parse_dtype(dtype)
    name = source.dtype.name
    if name in ("float32", "float16", "bfloat16", "uint8", "int8"):
        return name
    raise ValueError(f"the base {source.name} holds {name} values; tinyknn indexes float32, float16, bfloat16, "
                     "uint8 and int8. Pass dtype='float32' (or another) to search the values rounded to it")


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


class _Run:
    """One ground-truth computation: its inputs, plan and the helpers every step shares."""

    def __init__(self, base: Source, queries: np.ndarray, n: int, metric: str, dtype: str):
        self.base, self.queries, self.n, self.metric, self.dtype = base, queries, n, metric, dtype
        self.storage = numpy_dtype(dtype)

    def stored_rows(self, ids: np.ndarray) -> np.ndarray:
        """The base rows of `ids` as the Index stores them (rounded to its dtype as an add rounds)."""
        rows = self.base.take(ids)
        return rows if rows.dtype == self.storage else as_storage(rows, self.storage)

    def exact(self, query_rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """float64 contract distances of (query_rows[i], base row ids[i]), PAIR_CHUNK pairs at a time."""
        out = np.empty(len(ids), dtype=np.float64)
        for start in range(0, len(ids), PAIR_CHUNK):
            stop = start + PAIR_CHUNK
            out[start:stop] = exact_distances(query_rows[start:stop], self.stored_rows(ids[start:stop]), self.metric)
        return out

    def resolver(self, queries: np.ndarray):
        """resolve(query_numbers, ids, shard) for tinyknn's exact merge, query numbers into `queries`."""
        return lambda numbers, ids, _shard: self.exact(queries[numbers], ids)


def _concat_ranges(pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """Consecutive query batches' (lims, distances, ids) as one."""
    if not pieces:
        return np.zeros(1, dtype=np.int64), np.empty(0, dtype=np.float32), np.empty(0, dtype=np.int64)
    lims, offset = [np.zeros(1, dtype=np.int64)], 0
    for piece_lims, _, _ in pieces:
        lims.append(np.asarray(piece_lims[1:], dtype=np.int64) + offset)
        offset += int(piece_lims[-1])
    return (np.concatenate(lims), np.concatenate([d for _, d, _ in pieces]).astype(np.float32),
            np.concatenate([i for _, _, i in pieces]).astype(np.int64))


def groundtruth(base, queries, k: int | None = None, metric: str = "l2", device: str = "cpu", rows: int | None = None,
                queries_limit: int | None = None, batch_rows: int | None = None, checkpoint=None, progress=None, *,
                radius: float | None = None, dtype=None, query_batch: int = DEFAULT_QUERY_BATCH,
                shard_rows: int | None = None, storage: str = "device", output=None, format: str = "bigann",
                keep_checkpoint: bool = False):
    """Exact k-NN (or, with `radius`, range) ground truth of `queries` against `base`.

    base, queries: arrays (anything with shape, dtype and row slicing) or vector files (tinyknn.io: .fvecs,
    .bvecs, .fbin, .u8bin, .i8bin, .f16bin, .npy, FILE.hdf5 - its `train` for the base, its `test` for the
    queries). rows / queries_limit: use only the first N of each. metric 'l2' | 'ip' | 'cosine'; dtype: the
    Index's storage dtype (default: the base's own; a float64 base needs it said). device 'cpu' | 'cuda'
    (storage='host' streams a base larger than the GPU through it). batch_rows: rows added to an Index at a
    time (default: 64 MiB of them); query_batch: queries searched at a time (the checkpoint's step);
    shard_rows: rows per Index (default: all of them when they fit half the memory, 32 GiB on a GPU).
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
                        shard_rows, storage, checkpoint, progress, output, format, keep_checkpoint)
    finally:
        base_source.close()
        query_source.close()


def _compute(base, query_source, n, nq, k, radius, metric, device, dtype, batch_rows, query_batch, shard_rows,
             storage, checkpoint_path, progress, output, format, keep_checkpoint):
    from ..index import Index

    started = time.perf_counter()
    dtype = _storage_dtype(base, dtype)
    dim = base.shape[1]
    queries = query_source.rows(0, nq)
    run = _Run(base, queries, n, metric, dtype)
    row_bytes = dim * run.storage.itemsize
    query_batch = _positive(query_batch, "query_batch")
    batch_rows = max(1, ADD_CHUNK_BYTES // row_bytes) if batch_rows is None else _positive(batch_rows, "batch_rows")
    if shard_rows is None:
        shard_rows = max(1, _memory_budget(device) // (2 * (row_bytes + 16)))
    shard_rows = min(n, _positive(shard_rows, "shard_rows"))
    n_shards, n_batches = -(-n // shard_rows), -(-nq // query_batch)
    fingerprints = {"base": base.fingerprint(n), "queries": query_source.fingerprint(nq)}
    # the checkpoint's key: what the inputs hold, not where they are (a moved file still resumes)
    key = {**{name: {f: v for f, v in value.items() if f != "file"} for name, value in fingerprints.items()},
           "metric": metric, "dtype": dtype,
           "k": k, "radius": None if radius is None else float(radius), "shard_rows": shard_rows,
           "query_batch": query_batch}

    larger = conventions.LARGER_IS_BETTER[metric]
    shard, batch, saved = 0, 0, None
    if checkpoint_path is not None:
        state = _checkpoint.load(checkpoint_path, key)
        if state is not None:
            shard, batch, saved = state
    if radius is None:
        distances = np.full((nq, k), -np.inf if larger else np.inf, dtype=np.float32)
        ids = np.full((nq, k), -1, dtype=np.int64)
        if saved is not None:
            distances, ids = saved["distances"], saved["ids"]
        parts, current = [], []
    else:
        parts = [(saved[f"lims{i}"], saved[f"distances{i}"], saved[f"ids{i}"])
                 for i in range(int(saved["parts"]))] if saved is not None else []
        current = [(saved["lims_current"], saved["distances_current"], saved["ids_current"])] \
            if saved is not None and batch else []

    def save_state(next_shard: int, next_batch: int) -> None:
        if checkpoint_path is None:
            return
        if radius is None:
            arrays = {"distances": distances, "ids": ids}
        else:
            arrays = {"parts": np.array(len(parts))}
            for i, (lims_i, d_i, i_i) in enumerate(parts):
                arrays.update({f"lims{i}": lims_i, f"distances{i}": d_i, f"ids{i}": i_i})
            arrays.update(dict(zip(("lims_current", "distances_current", "ids_current"), _concat_ranges(current))))
        _checkpoint.save(checkpoint_path, key, next_shard, next_batch, arrays)

    total_units = float(n)
    done_units = sum(min(shard_rows, n - s * shard_rows) for s in range(shard)) + \
        (min(shard_rows, n - shard * shard_rows) * min(nq, batch * query_batch) / nq if shard < n_shards else 0)

    for s in range(shard, n_shards):
        first, last = s * shard_rows, min(n, (s + 1) * shard_rows)
        start_batch = batch if s == shard else 0
        stage = f"shard {s + 1}/{n_shards}" if n_shards > 1 else "searching"
        with Index(dim, metric=metric, dtype=dtype, device=device, storage=storage) as index:
            for a in range(first, last, batch_rows):
                b = min(last, a + batch_rows)
                index.add(base.rows(a, b), ids=np.arange(a, b, dtype=np.int64))
                if progress is not None:
                    progress(done_units, total_units, f"adding {stage}" if n_shards > 1 else "adding rows")
            for t in range(start_batch, n_batches):
                qa, qb = t * query_batch, min(nq, (t + 1) * query_batch)
                q = queries[qa:qb]
                if radius is None:
                    shard_d, shard_i = index.search(q, k)
                    if s == 0:
                        distances[qa:qb], ids[qa:qb] = shard_d, shard_i
                    else:
                        distances[qa:qb], ids[qa:qb] = merge_knn([(distances[qa:qb], ids[qa:qb]), (shard_d, shard_i)],
                                                                 k, metric, run.resolver(q))
                else:
                    current.append(index.range_search(q, radius))
                done_units += (last - first) * (qb - qa) / nq
                if t + 1 < n_batches:
                    save_state(s, t + 1)
                elif radius is not None:
                    parts.append(_concat_ranges(current))
                    current = []
                    save_state(s + 1, 0)
                else:
                    save_state(s + 1, 0)
                if progress is not None:
                    progress(done_units, total_units, stage)

    if radius is None:
        result = (distances, ids)
    elif len(parts) == 1:
        result = parts[0]
    else:
        result = merge_ranges(parts, metric, run.resolver(queries))
    if output is not None:
        _write_output(run, result, output, format, k, radius, device, storage, base, n_shards,
                      time.perf_counter() - started, key, fingerprints)
    if checkpoint_path is not None and not keep_checkpoint and os.path.exists(checkpoint_path):
        os.unlink(checkpoint_path)
    return result


def converted(run: _Run, result_d: np.ndarray, result_i: np.ndarray, name: str, query_of=None) -> np.ndarray:
    """The result's distances in convention `name`, each from its pair's float64 distance rounded once. As
    a check of the whole chain, the float64 distances must round to the float32 distances the Index gave."""
    if name == conventions.NATIVE[run.metric]:
        return result_d
    out = result_d.astype(np.float32).copy()
    valid = result_i >= 0
    if query_of is None:
        query_of = np.broadcast_to(np.arange(result_i.shape[0])[:, None], result_i.shape)[valid]
    d64 = run.exact(run.queries[query_of], result_i[valid])
    if not np.array_equal(d64.astype(np.float32).view(np.uint32), result_d[valid].astype(np.float32).view(np.uint32)):
        raise RuntimeError("internal error: the float64 distances recomputed for the output convention do not round to "
                           "the distances tinyknn returned; please report this")
    out[valid] = conventions.to_float32(d64, run.metric, name)
    return out


def _write_output(run, result, output, format, k, radius, device, storage, base, n_shards, seconds, key,
                  fingerprints) -> None:
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
    if radius is not None:
        record["hits"] = int(result[0][-1])
        record["radius_meaning"] = "l2: squared distance < radius" if run.metric == "l2" else "similarity > radius"
    with tio.atomic_write(record_path(output)) as handle:
        handle.write((json.dumps(record, indent=2) + "\n").encode())


def record_path(output) -> str:
    """Where the JSON record of a run writing `output` goes."""
    return os.fspath(output) + ".json"
