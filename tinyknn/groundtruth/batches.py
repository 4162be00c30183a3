"""The add batches of a ground-truth run: spans of base rows cut at the shards' boundaries, and their rows,
read when asked for or ahead of the caller by a thread of their own."""

from __future__ import annotations

import queue
import threading

from .inputs import Source


def spans_of(first: int, last: int, shard_rows: int, batch_rows: int) -> list[list[tuple[int, int]]]:
    """The add batches (a, b) of each shard of rows first..last (first a shard boundary), none crossing one."""
    shards = []
    for start in range(first, last, shard_rows):
        stop = min(last, start + shard_rows)
        shards.append([(a, min(stop, a + batch_rows)) for a in range(start, stop, batch_rows)])
    return shards


class Batches:
    """(a, b, rows a..b) of every span in order (iterate once; close() when done). With `read_ahead` > 0 (a
    file on a GPU), a second thread, started at once, reads the spans (one pread each) up to `read_ahead`
    batches ahead of the caller, whatever the caller is doing (starting CUDA, adding, searching, merging);
    else each is read when asked for. Not on the CPU, whose add and search keep the cores busy (on the 2-core
    VM a reader thread made the adds of 1M x 128 float32 from a file slower: 1.7-3.2 s against 1.4-2.3 s,
    four runs each)."""

    def __init__(self, base: Source, spans: list[tuple[int, int]], read_ahead: int):
        self._base, self._spans, self._thread = base, spans, None
        if read_ahead >= 1 and base.path is not None:
            self._ready, self._stop = queue.Queue(maxsize=read_ahead), threading.Event()
            self._thread = threading.Thread(target=self._read, name="tinyknn-groundtruth-reader", daemon=True)
            self._thread.start()

    def _hand_over(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _read(self) -> None:
        try:
            for a, b in self._spans:
                if self._stop.is_set():
                    return
                self._hand_over((a, b, self._base.read(a, b)))
        except BaseException as exc:   # noqa: BLE001 - raised again in the caller's thread
            self._hand_over(exc)

    def __iter__(self):
        for a, b in self._spans:
            if self._thread is None:
                yield a, b, self._base.rows(a, b)
                continue
            item = self._ready.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the reader (a run finished, cut short or failed) and wait for it."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
