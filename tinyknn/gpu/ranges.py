"""Range search on the GPU: every row within a radius, under the exactness contract.

range_kernel (kernels/range.cuh) screens each row's float32 keys for a block of queries with the rounding
bound the verify step uses and decides every row that could be inside by its float64 distance; hits are
written to fixed-capacity regions per query, counted past the capacity (then the chunk is searched again
with room for the largest count), and sorted here by (distance, id). Queries go in chunks whose hit
regions stay under CHUNK_HIT_BYTES, so memory is bounded by chunking, not by a cap on hits.
"""

from __future__ import annotations

import math

import numpy as np

from ..inputs.validate import check_values
from ..jit import render

FIRST_CAPACITY = 256            # hits per query room at first
CHUNK_HIT_BYTES = 256 << 20     # hit regions of one chunk of queries (16 bytes a hit)


def range_search(searcher, queries: np.ndarray, radius: float):
    """(lims, distances, ids) over the searcher's current view (searcher._view), the lock held."""
    check_values(queries, "queries", "float32")
    if not math.isfinite(radius):
        raise ValueError(f"radius must be a finite number; got {radius!r}")
    larger = searcher.metric != "l2"
    radius_key = -radius if larger else radius
    n_queries = len(queries)
    hits_d, hits_i, counts = [], [], np.zeros(n_queries, dtype=np.int64)
    capacity = FIRST_CAPACITY
    start = 0
    while start < n_queries:
        chunk = max(1, min(n_queries - start, CHUNK_HIT_BYTES // (16 * capacity)))
        found, keys, ids = _launch(searcher, queries[start:start + chunk], radius_key, capacity)
        if int(found.max(initial=0)) > capacity:
            capacity = int(found.max())          # search this chunk again with room for every hit
            continue
        for i, count in enumerate(found.tolist()):
            order = np.lexsort((ids[i, :count], keys[i, :count]))
            chosen = keys[i, order]
            hits_d.append((-chosen if larger else chosen).astype(np.float32))
            hits_i.append(ids[i, order])
            counts[start + i] = count
        start += chunk
    lims = np.zeros(n_queries + 1, dtype=np.int64)
    np.cumsum(counts, out=lims[1:])
    distances = np.concatenate(hits_d) if hits_d else np.empty(0, np.float32)
    ids = np.concatenate(hits_i) if hits_i else np.empty(0, np.int64)
    return lims, distances, ids


def large_k_search(searcher, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k beyond what the selection kernels keep (spec.MAX_K): every row's contract distance from the GPU
    (range_kernel with an infinite radius), the k best by (distance, id) selected here on the host, chunk by
    chunk of queries. Correct for any k; it costs a copy of every distance (O(n) host work per query)."""
    check_values(queries, "queries", "float32")
    larger = searcher.metric != "l2"
    n, n_queries = searcher._view.n, len(queries)
    distances = np.full((n_queries, k), -np.inf if larger else np.inf, dtype=np.float32)
    ids = np.full((n_queries, k), -1, dtype=np.int64)
    take = min(k, n)
    chunk = max(1, CHUNK_HIT_BYTES // (16 * max(n, 1)))
    for start in range(0, n_queries if n else 0, chunk):
        part = queries[start:start + chunk]
        found, keys, row_ids = _launch(searcher, part, math.inf, n)
        for i in range(len(part)):
            kth = np.partition(keys[i], take - 1)[take - 1]
            inside = np.flatnonzero(keys[i] <= kth)             # every row tied with the k-th too
            order = inside[np.lexsort((row_ids[i, inside], keys[i, inside]))[:take]]
            chosen = keys[i, order]
            distances[start + i, :take] = (-chosen if larger else chosen).astype(np.float32)
            ids[start + i, :take] = row_ids[i, order]
    return distances, ids


def _launch(searcher, queries: np.ndarray, radius_key: float, capacity: int):
    """One chunk of queries: (counts, keys (nq, capacity) float64, ids (nq, capacity) int64) on the host."""
    view, stream = searcher._view, searcher._stream
    n_queries = len(queries)
    spec = render.range_spec(searcher.metric, searcher.dtype, searcher.dim, searcher._arch)
    loaded = searcher._kernel(spec)
    padded = np.zeros((n_queries, searcher._stride), dtype=np.float32)
    padded[:, :searcher.dim] = queries
    found = np.zeros(n_queries, dtype=np.uint32)
    keys = np.empty((n_queries, capacity))
    ids = np.empty((n_queries, capacity), dtype=np.int64)
    if view.n == 0 or n_queries == 0:
        return found, keys, ids
    staged, counts, out_keys, out_ids = searcher._scratch("range search hits", padded.nbytes, n_queries * 4,
                                                          keys.nbytes, ids.nbytes)
    with staged, counts, out_keys, out_ids:
        staged.copy_from_host(padded, padded.nbytes, stream)
        counts.fill_bytes(0, n_queries * 4, stream)
        norms = searcher._pointer(view.prefix + "norms") if searcher.metric == "cosine" else 0
        launch = loaded.prepare(searcher._pointer(view.prefix + "data"), norms, searcher._pointer(view.prefix + "ids"),
                                view.n, searcher._stride, searcher.dim, staged.ptr, n_queries, radius_key,
                                searcher._pointer("row_stats"), capacity, out_keys.ptr, out_ids.ptr, counts.ptr)
        qb = spec.param("qb")
        blocks = max(1, min(math.ceil(view.n / 256), searcher._sm_count * 4))
        launch.launch((blocks, math.ceil(n_queries / qb), 1), 256, spec.param("smem"), stream)
        counts.copy_to_host(found, n_queries * 4, stream)
        stream.synchronize()
        if int(found.max()) <= capacity:
            out_keys.copy_to_host(keys, keys.nbytes, stream)
            out_ids.copy_to_host(ids, ids.nbytes, stream)
            stream.synchronize()
    return found, keys, ids
