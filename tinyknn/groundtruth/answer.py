"""The running answer of a ground-truth run, one query batch of one shard at a time: k-NN answers merged into
one by tinyknn's exact merge as they come (so the answer is always whole for the shards done), range
answers kept shard by shard and merged once at the end; and what a checkpoint saves of it."""

from __future__ import annotations

import numpy as np

from . import conventions
from ._internal import merge_knn, merge_ranges
from .exact import Exact


def concat_ranges(pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """Consecutive query batches' (lims, distances, ids) as one."""
    if not pieces:
        return np.zeros(1, dtype=np.int64), np.empty(0, dtype=np.float32), np.empty(0, dtype=np.int64)
    lims, offset = [np.zeros(1, dtype=np.int64)], 0
    for piece_lims, _, _ in pieces:
        lims.append(np.asarray(piece_lims[1:], dtype=np.int64) + offset)
        offset += int(piece_lims[-1])
    return (np.concatenate(lims), np.concatenate([d for _, d, _ in pieces]).astype(np.float32),
            np.concatenate([i for _, _, i in pieces]).astype(np.int64))


class Answer:
    """k-NN: (distances, ids) of every query over the shards taken so far. Range: each finished shard's
    answer (`parts`) and the current shard's batches so far (`current`). `saved`: a checkpoint's arrays,
    `batch` the query batch it stopped before."""

    def __init__(self, run: Exact, nq: int, k: int | None, radius: float | None, saved: dict | None, batch: int):
        self.run, self.k, self.radius = run, k, radius
        if radius is None:
            larger = conventions.LARGER_IS_BETTER[run.metric]
            self.distances = np.full((nq, k), -np.inf if larger else np.inf, dtype=np.float32)
            self.ids = np.full((nq, k), -1, dtype=np.int64)
            if saved is not None:
                self.distances, self.ids = saved["distances"], saved["ids"]
            self.parts, self.current = [], []
        else:
            self.parts = [(saved[f"lims{i}"], saved[f"distances{i}"], saved[f"ids{i}"])
                          for i in range(int(saved["parts"]))] if saved is not None else []
            self.current = [(saved["lims_current"], saved["distances_current"], saved["ids_current"])] \
                if saved is not None and batch else []

    def take(self, first_shard: bool, qa: int, qb: int, found) -> None:
        """A shard's answer for queries qa..qb (`first_shard`: nothing was taken for them before)."""
        if self.radius is not None:
            self.current.append(found)
        elif first_shard:
            self.distances[qa:qb], self.ids[qa:qb] = found
        else:
            so_far = (self.distances[qa:qb], self.ids[qa:qb])
            self.distances[qa:qb], self.ids[qa:qb] = merge_knn(
                [so_far, found], self.k, self.run.metric, self.run.resolver(self.run.queries[qa:qb]),
                exact_below=self.run.exact_below)

    def shard_done(self) -> None:
        """The current shard's last batch was taken."""
        if self.radius is not None:
            self.parts.append(concat_ranges(self.current))
            self.current = []

    def arrays(self) -> dict[str, np.ndarray]:
        """What a checkpoint saves."""
        if self.radius is None:
            return {"distances": self.distances, "ids": self.ids}
        arrays = {"parts": np.array(len(self.parts))}
        for i, (lims_i, d_i, i_i) in enumerate(self.parts):
            arrays.update({f"lims{i}": lims_i, f"distances{i}": d_i, f"ids{i}": i_i})
        arrays.update(dict(zip(("lims_current", "distances_current", "ids_current"), concat_ranges(self.current))))
        return arrays

    def result(self):
        """(distances, ids), or range ground truth's (lims, distances, ids) merged over the shards."""
        if self.radius is None:
            return self.distances, self.ids
        if len(self.parts) == 1:
            return self.parts[0]
        return merge_ranges(self.parts, self.run.metric, self.run.resolver(self.run.queries))
