"""A pool of range-search hits (float64 key, id, query) turned into CSR on the device (kernels/select.cuh):
scatter_kernel groups the hits by query, segment_sort_kernel sorts each query's by (distance, id) and writes
them at the query's offset. range_kernel (gpu/ranges.py) and the screen's range step (gpu/range_screen.py)
fill the pool; both answer through here. Also the segments' sizes, and the merge of the screened queries'
answer with the handed-back ones' (tinyknn.csr puts them together).
"""

from __future__ import annotations

import math

import numpy as np

from ..csr import combine, offsets
from ..jit import render

HIT_BYTES = 8 + 8 + 4           # a pool entry: key (float64), id (int64), query (int32)
STAGED_BYTES = 64 << 20         # answers up to this size come back through a kept pinned buffer (grown by
                                # doubling, so at most twice this)


def segment_sizes(counts: np.ndarray) -> np.ndarray:
    """Each count rounded up to a power of two (0 stays 0): the bitonic sort's segment lengths."""
    counts = np.asarray(counts, dtype=np.int64)
    sizes = np.zeros(len(counts), dtype=np.int64)
    some = counts > 0
    sizes[some] = np.left_shift(1, np.ceil(np.log2(counts[some])).astype(np.int64))
    return sizes


def merge_answers(counts: np.ndarray, distances: np.ndarray, ids: np.ndarray, which: np.ndarray,
                  other_counts: np.ndarray, other_distances: np.ndarray, other_ids: np.ndarray):
    """(counts, distances, ids) in CSR order of every query: queries `which` (ascending, distinct) answered by
    the other answer, the rest by the first (whose counts for `which` are 0)."""
    counts = np.asarray(counts, dtype=np.int64).copy()
    which = np.asarray(which, dtype=np.int64)
    if len(which) == 0:
        return counts, distances, ids
    mine = np.ones(len(counts), dtype=bool)
    mine[which] = False
    first = np.flatnonzero(mine)
    lims, out_d, out_i = combine(len(counts), [(first, offsets(counts[first]), distances, ids),
                                               (which, offsets(other_counts), other_distances, other_ids)])
    return np.diff(lims), out_d, out_i


def sort_segments(searcher, n_segments: int, keys_ptr: int, ids_ptr: int, places, counts_ptr: int, larger: bool,
                  distances_ptr: int, out_ids_ptr: int) -> None:
    """segment_sort_kernel: places is the device buffer of [segment offsets (n_segments + 1), output offsets
    (n_segments + 1)], int64."""
    loaded, launch = searcher._packed(
        render.selection_spec("segment_sort", searcher._arch), keys_ptr, ids_ptr, places.ptr, counts_ptr,
        places.ptr + (n_segments + 1) * 8, int(larger), distances_ptr, out_ids_ptr)
    launch.launch(n_segments, loaded.threads, 0, searcher._stream)


def group_and_sort(searcher, pool_keys: int, pool_ids: int, pool_queries: int, n_hits: int,
                   counts_host: np.ndarray, counts: int, larger: bool) -> tuple[np.ndarray, np.ndarray]:
    """(distances, ids) of the pool's n_hits hits (device addresses of its keys, ids and queries), grouped by
    query (scatter_kernel), each query's sorted and written at its CSR offset. counts_host: hits per query
    (counts: the same on the device, uint32)."""
    stream, n_queries = searcher._stream, len(counts_host)
    distances, ids = np.empty(n_hits, np.float32), np.empty(n_hits, np.int64)
    if n_hits == 0:
        return distances, ids
    places = np.concatenate([offsets(segment_sizes(counts_host)), offsets(counts_host)])
    room = int(places[n_queries])
    buffers = searcher._scratch_slices("range search hits, grouped", places.nbytes, n_queries * 4, room * 8,
                                       room * 8, n_hits * 4, n_hits * 8)
    device_places, cursors, keys, group_ids, out_d, out_i = buffers
    try:
        device_places.copy_from_host(places, places.nbytes, stream)
        cursors.fill_bytes(0, n_queries * 4, stream)
        loaded, launch = searcher._packed(render.selection_spec("scatter", searcher._arch), pool_keys, pool_ids,
                                          pool_queries, n_hits, device_places.ptr, cursors.ptr, keys.ptr,
                                          group_ids.ptr)
        launch.launch(max(1, min(math.ceil(n_hits / loaded.threads), searcher._sm_count * 8)), loaded.threads, 0,
                      stream)
        sort_segments(searcher, n_queries, keys.ptr, group_ids.ptr, device_places, counts, larger, out_d.ptr,
                      out_i.ptr)
        span = out_i.ptr + n_hits * 8 - out_d.ptr         # both outputs and the alignment gap between them
        stage = _stage(searcher, span)
        if stage is None:
            out_d.copy_to_host(distances, n_hits * 4, stream)
            out_i.copy_to_host(ids, n_hits * 8, stream)
            stream.synchronize()
        else:                           # one copy into pinned memory: pageable copies ran at a few GB/s
            out_d.whole.copy_to_host(stage, span, stream, offset=out_d.ptr - out_d.whole.ptr)
            stream.synchronize()
            raw = stage.array(np.uint8, span)
            distances[:] = raw[:n_hits * 4].view(np.float32)
            ids[:] = raw[span - n_hits * 8:].view(np.int64)
    finally:
        for buffer in buffers:
            buffer.close()
    return distances, ids


def _stage(searcher, nbytes: int):
    """The kept pinned buffer for an answer of `nbytes`, or None (pageable copies) past STAGED_BYTES, so that
    no pinned buffer is kept at the size of a rare large answer, or when the host refuses the memory."""
    if nbytes > STAGED_BYTES:
        return None
    try:
        return searcher._pinned("range_results", nbytes)
    except MemoryError:
        return None
