"""The add batches of a ground-truth run: spans of base rows cut at the shards' boundaries, and their rows,
read when asked for or ahead of the caller by reader threads of their own."""

from __future__ import annotations

import collections
import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .inputs import Source

READER_NAME = "tinyknn-groundtruth-reader"    # the reader threads' names begin with it


def spans_of(first: int, last: int, shard_rows: int, batch_rows: int) -> list[list[tuple[int, int]]]:
    """The add batches (a, b) of each shard of rows first..last (first a shard boundary), none crossing one."""
    shards = []
    for start in range(first, last, shard_rows):
        stop = min(last, start + shard_rows)
        shards.append([(a, min(stop, a + batch_rows)) for a in range(start, stop, batch_rows)])
    return shards


# Reads in flight at once (benchmarks may set it): more keep more of a disk's queue busy. A cold 12.8 GB file
# on the H200's host: the API's whole run 9.36 s with 1, 8.50 with 2, 7.99 with 4 (bench/groundtruth_scale.py).
READERS = 4


class Batches:
    """(a, b, rows a..b) of every span in order (iterate once; close() when done). With `read_ahead` > 0 (a
    file on a GPU), reader threads (READERS), started at once, read the spans (one pread each) up to
    `read_ahead` batches ahead of the caller, whatever the caller is doing (starting CUDA, adding, waiting
    for a search, merging): the host memory they hold is at most `read_ahead` batches besides the one the
    caller has (compute.py: at most READ_AHEAD_BYTES of them, and never more than one shard's). Else each
    batch is read when asked for. Not on the CPU, whose add and search keep the cores busy (on the 2-core
    VM a reader thread made the adds of 1M x 128 float32 from a file slower: 1.7-3.2 s against 1.4-2.3 s,
    four runs each).

    The readers read into buffers used again: a batch's rows are valid until the caller asks for the next
    batch (the caller adds them to an Index, which copies them), then its buffer goes back to the readers. A
    fresh 64 MiB array a batch cost its page faults and zeroing in the reader, ~3-10 ms of the ~15 ms a warm
    64 MiB pread took on the 2-core VM; on the H200's host the reads of a 100M x 128 uint8 file ran at 1.3 GB/s
    against the 1.7 GB/s of one reused buffer."""

    def __init__(self, base: Source, spans: list[tuple[int, int]], read_ahead: int):
        self._base, self._spans, self._pool = base, spans, None
        if read_ahead >= 1 and base.path is not None:
            self._ahead, self._next = read_ahead, iter(spans)
            self._pending: collections.deque = collections.deque()
            self._free: queue.SimpleQueue = queue.SimpleQueue()     # buffers the caller is done with
            self._rows = max((b - a for a, b in spans), default=0)
            self._pool = ThreadPoolExecutor(max_workers=max(1, min(READERS, read_ahead)),
                                            thread_name_prefix=READER_NAME)
            self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self._ahead:
            span = next(self._next, None)
            if span is None:
                return
            self._pending.append((span, self._pool.submit(self._read, *span)))

    def _read(self, a: int, b: int) -> np.ndarray:
        """(In a reader thread.) Rows a..b, in a buffer the caller gave back or, at first, a new one."""
        try:
            buffer = self._free.get_nowait()
        except queue.Empty:
            buffer = np.empty((self._rows, self._base.shape[1]), dtype=self._base.dtype)
        return self._base.read(a, b, into=buffer)

    def __iter__(self):
        if self._pool is None:
            for a, b in self._spans:
                yield a, b, self._base.rows(a, b)
            return
        while self._pending:
            (a, b), read = self._pending.popleft()
            rows = read.result()        # the reader's exception, if it failed, raised in the caller's thread
            self._fill()
            yield a, b, rows
            self._free.put(rows.base if rows.base is not None else rows)   # the caller is done with them

    def close(self) -> None:
        """Stop the readers (a run finished, cut short or failed) and wait for them."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pending.clear()
