"""A dask.array added to a DaskIndex without its rows visiting the client: each block checked and converted on
the worker that computes it (Index.add's checks and messages), then handed to a shard by a task on the shard's
worker (tinyknn.dask.shard's checked_block and add_block)."""

from __future__ import annotations

import numpy as np

from ..inputs import validate as _validate
from .shard import add_block, checked_block


def is_dask_array(x) -> bool:
    return type(x).__module__.startswith("dask.array") and hasattr(x, "chunks")


def checked_blocks(client, x, dim: int, dtype: str):
    """(x with whole rows per block, its blocks checked and converted where they are computed): Index.add's
    checks on the workers, the first bad block's error raised before anything else happens."""
    from dask import delayed

    if any(np.isnan(size) for size in x.shape) or any(np.isnan(c) for c in x.chunks[0]):
        raise ValueError("a dask.array of unknown chunk sizes cannot be added (its ids are numbered by row); "
                         "call x.compute_chunk_sizes() first")
    _validate.check_matrix_shape(x.shape, dim, "vectors to add")
    x = x.rechunk({1: -1}) if len(x.chunks[1]) > 1 else x
    check = delayed(checked_block, pure=False)        # fresh keys: a failed add's blocks never come back
    blocks = client.compute([check(block, dim, dtype) for block in x.to_delayed().ravel()])
    wait_blocks(blocks)
    return x, blocks


def send_blocks(client, shards, x, blocks: list, new: np.ndarray, row_labels):
    """Each checked block handed to a shard (one on the block's worker where the sizes allow) by a task on
    the shard's worker, which gives it to the shard in process: ({(shard, block): ids}, {(shard, block): task})."""
    bounds = np.concatenate(([0], np.cumsum(x.chunks[0]))).astype(np.int64)
    ids_of, running = {}, {}
    for j, (block, shard) in enumerate(zip(blocks, shards.place(blocks, np.diff(bounds)))):
        part = slice(int(bounds[j]), int(bounds[j + 1]))
        if part.stop > part.start:
            ids_of[shard, j] = new[part]
            running[shard, j] = client.submit(
                add_block, shards.futures[shard].key, block, new[part],
                None if row_labels is None else row_labels[part], workers=[shards.workers[shard]],
                allow_other_workers=False, pure=False)
    return ids_of, running


def wait_blocks(blocks: list) -> None:
    """Every block checked (Index's checks, on the workers); the first bad one's error, nothing added."""
    from distributed import wait

    wait(blocks)
    for block in blocks:
        if block.status == "error":
            raise block.exception().with_traceback(block.traceback())
