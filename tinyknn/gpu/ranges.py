"""Range search and k beyond the selection kernels on the GPU, exact, selected and sorted on the device.

Both start from range_kernel (kernels/range.cuh), which screens each row's float32 keys with the verify step's
rounding bound and decides what it cannot rule out by the contract's float64 distance; select.cuh does the rest:
- range search: the hits go to one pool (key, id, query) and are counted per query; the host turns the counts
  into the CSR offsets, then scatter_kernel groups the hits by query and segment_sort_kernel sorts each query's
  hits by (distance, id) and writes them at the query's offset (gpu/hit_pool.py). A chunk of queries whose hits
  overflow the pool is searched again with room for all of them (or split, past POOL_MAX_BYTES). Where a batch
  search would be screened, range search is too (gpu/range_screen.py: the tensor-core screen with the radius
  as its threshold, the survivors decided in float64, the hits into the same pool); range_kernel then
  answers only the queries the screen handed back.
- k beyond spec.MAX_K: every row's float64 key (range_kernel with no radius), select_kernel's radix select of
  each query's k best by (key, id), segment_sort_kernel's sort. No host selection: the host sees the k results.
Memory is bounded by chunks of queries, not by a cap on hits or on k.
"""

from __future__ import annotations

import math

import numpy as np

from ..csr import offsets
from ..inputs.validate import check_values
from ..jit import render
from . import range_screen
from .hit_pool import HIT_BYTES, group_and_sort, merge_answers, segment_sizes, sort_segments

POOL_FIRST = 1 << 16            # hits the pool holds at first, at the least (grown to the count when a chunk
POOL_PER_QUERY = 1024           # overflows it), or this many a query (a second pass costs a whole search)
POOL_MAX_BYTES = 256 << 20      # a chunk of queries with more hits than this is split
KEY_CHUNK_BYTES = 512 << 20     # k beyond the lists: every row's key and the k best, per chunk of queries
MAX_GRID_Y = 65535              # range_kernel's grid.y is queries / QB
MAX_SEGMENT = 1 << 30           # segment_sort_kernel's sizes are int
QUERIES_PER_BLOCK: int | None = None   # range_kernel's QB; None: render.range_spec's choice (benchmarks sweep it)


def range_search(searcher, queries: np.ndarray, radius: float):
    """(lims, distances, ids) over the searcher's current view (searcher._view), the lock held."""
    check_values(queries, "queries", "float32")
    if not math.isfinite(radius):
        raise ValueError(f"radius must be a finite number; got {radius!r}")
    screened = range_screen.screened(searcher, queries, radius) if range_screen.applies(searcher, len(queries)) \
        else None
    if screened is None:
        counts, distances, ids = _range_rows(searcher, queries, radius)
        return offsets(counts), distances, ids
    counts, distances, ids, handed_back = screened
    if len(handed_back):
        counts, distances, ids = merge_answers(counts, distances, ids, handed_back,
                                               *_range_rows(searcher, queries[handed_back], radius))
    return offsets(counts), distances, ids


def _range_rows(searcher, queries: np.ndarray, radius: float):
    """(counts, distances, ids) of range_kernel over every row, chunk by chunk of queries."""
    larger = searcher.metric != "l2"
    radius_key = -radius if larger else radius
    n_queries = len(queries)
    counts, distances, ids = [], [], []
    chunk = max(1, min(n_queries, MAX_GRID_Y * _queries_per_block(searcher)))
    limit = POOL_MAX_BYTES // HIT_BYTES           # the most hits one pool holds; halved when the device refuses
    refused = False                               # (a device-memory cap, a full device)
    capacity = min(limit, max(POOL_FIRST, POOL_PER_QUERY * chunk))
    start = 0
    while start < n_queries:
        chunk = min(chunk, n_queries - start)
        try:
            found = _range_chunk(searcher, queries[start:start + chunk], radius_key, capacity, larger)
        except MemoryError:
            if capacity <= 1:
                raise
            limit = capacity = capacity // 2
            refused = True
            continue
        if isinstance(found, int):                    # more hits than the pool holds
            if found <= limit or (chunk == 1 and not refused):
                capacity = found
            elif chunk > 1:
                capacity = limit
                chunk = max(1, chunk * limit // found)
            else:
                raise MemoryError(f"range search: one query has {found:,} hits within the radius; the device "
                                  f"memory left holds {limit:,} at a time")
            continue
        for kept, value in zip((counts, distances, ids), found):
            kept.append(value)
        start += chunk
    return (np.concatenate(counts) if counts else np.zeros(0, np.int64),
            np.concatenate(distances) if distances else np.empty(0, np.float32),
            np.concatenate(ids) if ids else np.empty(0, np.int64))


def large_k_search(searcher, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k beyond what the selection kernels keep (spec.MAX_K): every row's contract key, the k best by
    (distance, id) selected and sorted on the device, chunk by chunk of queries. Rows past ntotal are
    (+inf or -inf, -1), as the other paths pad them."""
    check_values(queries, "queries", "float32")
    larger = searcher.metric != "l2"
    n, n_queries = searcher._view.n, len(queries)
    distances = np.full((n_queries, k), -np.inf if larger else np.inf, dtype=np.float32)
    ids = np.full((n_queries, k), -1, dtype=np.int64)
    take = min(k, n)
    if take == 0 or n_queries == 0:
        return distances, ids
    segment = int(segment_sizes(np.array([take]))[0])
    if segment > MAX_SEGMENT:
        raise ValueError(f"k = {k:,} over {n:,} rows: the GPU selects at most {MAX_SEGMENT:,} results a query")
    chunk = max(1, min(n_queries, MAX_GRID_Y * _queries_per_block(searcher), KEY_CHUNK_BYTES // (8 * n + 16 * segment)))
    start = 0
    while start < n_queries:
        stop = min(n_queries, start + chunk)
        try:
            part_d, part_i = _select_chunk(searcher, queries[start:stop], take, segment, larger)
        except MemoryError:
            if chunk == 1:
                raise
            chunk //= 2                               # the device holds less than a chunk's keys: halve it
            continue
        distances[start:stop, :take], ids[start:stop, :take] = part_d, part_i
        start = stop
    return distances, ids


def _range_spec(searcher):
    return render.range_spec(searcher.metric, searcher.dtype, searcher.dim, searcher._arch, QUERIES_PER_BLOCK)


def _queries_per_block(searcher) -> int:
    return _range_spec(searcher).param("qb")


def _padded(searcher, queries: np.ndarray) -> np.ndarray:
    padded = np.zeros((len(queries), searcher._stride), dtype=np.float32)
    padded[:, :searcher.dim] = queries
    return padded


def _launch_range(searcher, queries_ptr: int, n_queries: int, radius_key: float, capacity: int, keys_ptr: int,
                  ids_ptr: int, pool_queries_ptr: int, counts_ptr: int, total_ptr: int) -> None:
    """range_kernel over the current view: a pool of hits (pool_queries_ptr given) or every row's key."""
    view = searcher._view
    spec = _range_spec(searcher)
    loaded = searcher._kernel(spec)
    norms = searcher._pointer(view.prefix + "norms") if searcher.metric == "cosine" else 0
    launch = loaded.prepare(searcher._pointer(view.prefix + "data"), norms, searcher._pointer(view.prefix + "ids"),
                            view.n, searcher._stride, searcher.dim, queries_ptr, n_queries, radius_key,
                            searcher._pointer("row_stats"), capacity, keys_ptr, ids_ptr, pool_queries_ptr, counts_ptr,
                            total_ptr)
    blocks = max(1, min(math.ceil(view.n / 256), searcher._sm_count * 4))
    launch.launch((blocks, math.ceil(n_queries / spec.param("qb")), 1), 256, spec.param("smem"), searcher._stream)


def _range_chunk(searcher, queries: np.ndarray, radius_key: float, capacity: int, larger: bool):
    """One chunk of queries: (counts, distances, ids) on the host, or the number of hits when they are more
    than `capacity` (nothing else done)."""
    view, stream = searcher._view, searcher._stream
    n_queries = len(queries)
    if view.n == 0 or n_queries == 0:
        return np.zeros(n_queries, np.int64), np.empty(0, np.float32), np.empty(0, np.int64)
    padded = _padded(searcher, queries)
    buffers = searcher._scratch("range search hits", padded.nbytes, n_queries * 4, 8, capacity * 8, capacity * 8,
                                capacity * 4)
    staged, counts, total, pool_keys, pool_ids, pool_queries = buffers
    try:
        staged.copy_from_host(padded, padded.nbytes, stream)
        counts.fill_bytes(0, n_queries * 4, stream)
        total.fill_bytes(0, 8, stream)
        _launch_range(searcher, staged.ptr, n_queries, radius_key, capacity, pool_keys.ptr, pool_ids.ptr,
                      pool_queries.ptr, counts.ptr, total.ptr)
        found, hits = np.empty(n_queries, dtype=np.uint32), np.empty(1, dtype=np.uint64)
        counts.copy_to_host(found, n_queries * 4, stream)
        total.copy_to_host(hits, 8, stream)
        stream.synchronize()
        n_hits = int(hits[0])
        if n_hits > capacity:
            return n_hits
        distances, ids = group_and_sort(searcher, pool_keys.ptr, pool_ids.ptr, pool_queries.ptr, n_hits, found,
                                        counts.ptr, larger)
        return found.astype(np.int64), distances, ids
    finally:
        for buffer in buffers:
            buffer.close()


def _select_chunk(searcher, queries: np.ndarray, take: int, segment: int, larger: bool):
    """One chunk of queries' `take` best: (distances, ids), (len(queries), take) on the host."""
    view, stream = searcher._view, searcher._stream
    n_queries, n = len(queries), searcher._view.n
    padded = _padded(searcher, queries)
    places = np.concatenate([np.arange(n_queries + 1, dtype=np.int64) * segment,
                             np.arange(n_queries + 1, dtype=np.int64) * take])
    takes = np.full(n_queries, take, dtype=np.uint32)
    buffers = searcher._scratch("the k best of every row", padded.nbytes, n_queries * n * 8,
                                n_queries * segment * 8, n_queries * segment * 8, places.nbytes, takes.nbytes,
                                n_queries * take * 4, n_queries * take * 8)
    staged, keys, best_keys, best_ids, device_places, device_takes, out_d, out_i = buffers
    distances = np.empty((n_queries, take), np.float32)
    ids = np.empty((n_queries, take), np.int64)
    try:
        staged.copy_from_host(padded, padded.nbytes, stream)
        device_places.copy_from_host(places, places.nbytes, stream)
        device_takes.copy_from_host(takes, takes.nbytes, stream)
        _launch_range(searcher, staged.ptr, n_queries, math.inf, 0, keys.ptr, 0, 0, 0, 0)
        select = searcher._kernel(render.selection_spec("select", searcher._arch))
        select.prepare(keys.ptr, searcher._pointer(view.prefix + "ids"), n, take, segment, best_keys.ptr,
                       best_ids.ptr).launch(n_queries, select.threads, 0, stream)
        sort_segments(searcher, n_queries, best_keys.ptr, best_ids.ptr, device_places, device_takes.ptr, larger,
                      out_d.ptr, out_i.ptr)
        out_d.copy_to_host(distances, distances.nbytes, stream)
        out_i.copy_to_host(ids, ids.nbytes, stream)
        stream.synchronize()
    finally:
        for buffer in buffers:
            buffer.close()
    return distances, ids
