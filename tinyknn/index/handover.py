"""Handover: how an add reaches the searcher, and how an unfiltered search sees only whole adds.

Host input in another dtype or layout is converted CHUNK_BYTES at a time into one reused buffer (never a
full copy; a fresh allocation per piece would page-fault its memory in again every time), each piece handed
over as it is ready. Input already in the storage dtype and C-contiguous, CUDA input, and any input to a
searcher without truncate (an older backend) go over in one piece: the searcher copies them straight from
where they are. A failed add is undone with the searcher's truncate.

Searcher calls are atomic, but an add in pieces is several of them, and an unfiltered search holds no lock
of the Index (it must not serialise searches). So a counter is odd while an add goes over in pieces (one
writer: the Index's add lock), and an unfiltered search reads it before and after its call, a seqlock: if
an add in pieces was under way or began meanwhile, the answer may hold part of it and the search is
answered again under the add lock, once that add is complete (bench/NOTES_INDEX_OPS.md, "The torn add").
"""

from __future__ import annotations

import threading

import numpy as np

from ..inputs import validate as _validate


class Handover:
    """The pieces counter of one Index, and the two operations that use it."""

    def __init__(self, add_lock: threading.Lock):
        self._add_lock = add_lock
        self.pieces_in_flight = 0

    def hand_over(self, searcher, vectors, ids: np.ndarray, n_before: int, storage: np.dtype, dim: int) -> None:
        """Give the rows to the searcher (call under the add lock); undo what it took if that fails part way."""
        n = len(ids)
        truncate = getattr(searcher, "truncate", None)
        convert = not isinstance(vectors, _validate.DeviceArray) and (
            vectors.dtype != storage or not vectors.flags.c_contiguous)
        step = max(1, _validate.CHUNK_BYTES // (dim * storage.itemsize))
        if not convert or truncate is None or n <= step:
            try:
                searcher.add(_validate.as_storage(vectors, storage) if convert else vectors, ids)
            except BaseException:
                if truncate is not None:
                    truncate(n_before)
                raise
            return
        buffer = np.empty((step, dim), dtype=storage)
        self.pieces_in_flight += 1          # odd: an unfiltered search that overlaps this is answered again
        try:
            for start in range(0, n, step):
                piece = buffer[:min(step, n - start)]
                _validate.to_storage(vectors[start:start + step], piece)
                searcher.add(piece, ids[start:start + step])
        except BaseException:
            truncate(n_before)
            raise
        finally:
            self.pieces_in_flight += 1

    def whole_adds_only(self, call, *args):
        """call(*args) (an unfiltered searcher call) as if no add were under way, or after it."""
        before = self.pieces_in_flight
        if not before % 2:
            answer = call(*args)
            if self.pieces_in_flight == before:
                return answer
        with self._add_lock:
            return call(*args)
