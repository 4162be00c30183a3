"""The searches of a ground-truth run's finished shards: on a thread of their own while the caller adds the
next shard's rows (a file on a GPU: the GPU searches one shard while the next one's rows are read and
copied to it, so the reads never wait for a search, and the adds only where a search takes longer than
the next shard's read), or in turn on the caller's thread (the CPU, whose adds and searches each keep
every core busy; arrays; a Dask cluster)."""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

SEARCH_NAME = "tinyknn-groundtruth-search"    # the search thread's name begins with it


class Searches:
    """Each handed shard's query batches, searched in order by `search(index, qa, qb)`; `answers(keep)`
    yields them in order as they are ready, each shard's Index closed after its last batch's search.

    With `concurrent`, one search thread works through the handed batches while the caller goes on. The
    caller takes a shard's answers (keep=1: all but the last shard handed) before it makes the shard after
    next, so at most two shards' Indexes are alive at once: the one searched and the one being filled (a
    run only searches concurrently where two shards fit its memory budget). Otherwise each batch is
    searched on the caller's thread when `answers` comes to it (merged and saved before the next one).
    close() stops and waits for the thread and closes every Index not yet closed (a run cut short)."""

    def __init__(self, search, concurrent: bool):
        self._search, self.concurrent = search, concurrent
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=SEARCH_NAME) if concurrent else None
        self._handed: collections.deque = collections.deque()     # (tag, index, [(t, qa, qb)], futures)

    def hand(self, tag, index, batches: list[tuple[int, int, int]]) -> None:
        """Search `index` for the query batches (t, qa, qb) in order; answers() gives them with `tag`."""
        futures = None
        if self._pool is not None:
            futures = [self._pool.submit(self._one, index, qa, qb, last=i + 1 == len(batches))
                       for i, (_, qa, qb) in enumerate(batches)]
        if not batches:
            index.close()
        self._handed.append((tag, index, batches, futures))

    def _one(self, index, qa: int, qb: int, last: bool):
        try:
            return self._search(index, qa, qb)
        finally:
            if last:
                index.close()     # before its answer is taken: the next shard's Index never meets it

    def answers(self, keep: int = 0):
        """(tag, t, qa, qb, answer) of every handed shard but the last `keep`, in order; a failed search's
        exception is raised here, in the caller's thread."""
        while len(self._handed) > keep:
            tag, index, batches, futures = self._handed[0]
            for i, (t, qa, qb) in enumerate(batches):
                if futures is not None:
                    found = futures[i].result()
                else:
                    found = self._one(index, qa, qb, last=i + 1 == len(batches))
                yield tag, t, qa, qb, found
            self._handed.popleft()

    def close(self) -> None:
        """Cancel the searches not begun, wait for the one running, and close every Index handed."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        while self._handed:
            self._handed.popleft()[1].close()
