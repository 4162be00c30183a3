"""The float64 contract distance of (query, base row) pairs on a run's inputs: what tinyknn's exact merge asks
for float32 ties between shards, what an output convention is converted from, what recall and compare
judge by. Rows are read from the (memory-mapped) base and rounded to the index's storage dtype exactly as
an add rounds them; the arithmetic is tinyknn's own (`exact_distances`, the same bits as the kernels).
"""

from __future__ import annotations

import functools

import numpy as np

from ..spec import numpy_dtype, parse_dtype
from . import conventions
from ._internal import as_storage, exact_distances
from .inputs import Source

PAIR_CHUNK = 1 << 16                 # (query, id) pairs whose float64 distances are computed at a time
INTEGER_EXACT = float(1 << 24)       # float32 holds every integer below it exactly


def storage_dtype(source: Source, dtype) -> str:
    if dtype is not None:
        return parse_dtype(dtype)
    name = source.dtype.name
    if name in ("float32", "float16", "bfloat16", "uint8", "int8"):
        return name
    raise ValueError(f"the base {source.name} holds {name} values; tinyknn indexes float32, float16, bfloat16, "
                     "uint8 and int8. Pass dtype='float32' (or another) to search the values rounded to it")


class Exact:
    """The base (its first n rows), the queries as searched, the metric and the storage dtype."""

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

    @functools.cached_property
    def exact_below(self) -> float:
        """INTEGER_EXACT where every float64 distance of the run is an integer (8-bit rows, integer queries,
        l2 or ip, every sum below 2**53): a float32 distance below it is then its float64 distance, so
        float32 ties there are exact ties, ordered by the smaller id without reading rows (tinyknn's merge,
        `exact_below`); else 0.0 (every tie between shards is resolved in float64)."""
        if self.dtype not in ("uint8", "int8") or self.metric not in ("l2", "ip") or not len(self.queries):
            return 0.0
        q = np.asarray(self.queries, dtype=np.float32)
        if not np.array_equal(q, np.rint(q)):
            return 0.0
        largest = float(np.abs(q).max()) + 256.0           # |query - row| and |row| are below it
        return INTEGER_EXACT if q.shape[1] * largest * largest < 2.0 ** 53 else 0.0

    def resolver(self, queries: np.ndarray):
        """resolve(query_numbers, ids, shard) for tinyknn's exact merge, query numbers into `queries`."""
        return lambda numbers, ids, _shard: self.exact(queries[numbers], ids)


def converted(run: Exact, result_d: np.ndarray, result_i: np.ndarray, name: str, query_of=None) -> np.ndarray:
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
