"""Shard: one tinyknn.Index held in a Dask worker's memory between calls (a Dask actor), for tinyknn.dask.

Every method runs on the worker; arguments and results travel through Dask's own serialisation. The
Index does the validation and keeps the exactness contract for the shard's rows; tinyknn.index.merge
merges the shards' answers. `add_block` is the task that hands a dask.array chunk already on the shard's
worker to the shard in process (no copy through the client, no second trip through the network).
"""

from __future__ import annotations

import numpy as np

from ..index.merge import exact_distances
from ..index import Index


class Shard:
    """A tinyknn.Index on a worker: Index(dim, metric, dtype, device), or Index.load(path, device)."""

    def __init__(self, dim: int, metric: str, dtype: str, device: str, path: str | None = None):
        self.index = Index.load(path, device=device) if path is not None else Index(dim, metric, dtype, device)

    def describe(self) -> dict:
        """What the client checks a (re)loaded shard against, and the state it tracks."""
        index = self.index
        return {"dim": index.dim, "metric": index.metric, "dtype": index.dtype, "ntotal": index.ntotal,
                # the next automatic id of this shard's Index: 1 + the largest id it held since created/loaded
                "next_auto": index._ids.next_auto}

    def ids(self) -> np.ndarray:
        """Every id the shard holds (to check a reloaded shard against the others)."""
        return self.index._ids.ids_of_rows()

    def add(self, vectors, ids: np.ndarray, labels) -> int:
        self.index.add(vectors, ids=ids, labels=labels)
        return self.index.ntotal

    def remove(self, ids: np.ndarray) -> int:
        return self.index.remove(ids)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.index.contains(ids)

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of ids the shard holds, their stored vectors)."""
        held = self.index.contains(ids)
        return held, self.index.get(ids[held])

    def search(self, queries: np.ndarray, k: int, filter, labels):
        return self.index.search(queries, k, filter=filter, labels=labels)

    def range_search(self, queries: np.ndarray, radius: float, filter, labels):
        return self.index.range_search(queries, radius, filter=filter, labels=labels)

    def exact(self, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The contract's float64 distance of queries[i] and the stored row of ids[i]."""
        return exact_distances(queries, self.index.get(ids), self.index.metric)

    def save(self, path: str) -> int:
        self.index.save(path)
        return self.index.ntotal

    def close(self) -> None:
        self.index.close()


def add_block(actor_key: str, block: np.ndarray, ids: np.ndarray, labels) -> int:
    """A task on the shard's worker: add a (validated) dask.array block to the shard held there."""
    from distributed import get_worker

    shard = get_worker().state.actors.get(actor_key)
    if shard is None:
        raise RuntimeError(f"the shard {actor_key} is not on this worker ({get_worker().address})")
    return shard.add(block, ids, labels)


def checked_block(block, dim: int, dtype: str) -> np.ndarray:
    """A task where a dask.array block is: Index.add's checks, then the block in the storage dtype, so that a
    bad value anywhere fails the add before any shard has changed."""
    from ..inputs import validate as _validate
    from ..spec import numpy_dtype

    return _validate.as_storage(_validate.host_rows(block, dim, dtype), numpy_dtype(dtype))
