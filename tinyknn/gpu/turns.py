"""Turns: one call at a time on a GPU index, and a change that waits goes ahead of the searches still waiting.

A GPU index's calls share its stream, staging and plans, so they take turns (GpuSearcher, HostTierSearcher).
With a plain threading.Lock a waiting add had no place in the line: whichever waiting thread the lock
happened to wake, or a search that came back for its next turn first, went ahead of it, so threads that
search in a loop kept an add waiting through a line of their searches. With Turns a change (add, remove,
truncate, reset, close: `with turns.change:`) that waits is the next to go: it waits for the call that holds
the turn now, and for nothing that arrives after it. Searches and reads (`with turns:`) go in the order
they arrived, one at a time.

The order is kept by handing the turn over: a released turn is given to the longest-waiting search by name
(it stays held while that thread wakes), and a search that arrives while others wait queues behind them.
Merely waking the next waiter is not enough under the GIL: the releasing thread keeps running and, searching
in a loop, took the turn again before the woken one could, every time; its GPU calls release the GIL only
once it holds the turn, so the others never got one (four threads searching a GPU index: one made tens of
thousands of searches, three none, and a reorder waiting behind them never ran).
"""

from __future__ import annotations

import collections
import threading

__all__ = ["Turns"]


class Turns:
    """Mutual exclusion in which waiting changes go before waiting searches (see the module doc)."""

    __slots__ = ("_mutex", "_changes", "_held", "_changes_waiting", "_queue", "_granted", "change")

    def __init__(self):
        self._mutex = threading.Lock()
        self._changes = threading.Condition(self._mutex)    # changes waiting for their turn
        self._held = False              # a call holds the turn, or it is on its way to the search granted it
        self._changes_waiting = 0
        self._queue: collections.deque = collections.deque()   # waiting searches, a Condition each, oldest first
        self._granted = None            # the queued search the turn was handed to, until it wakes and takes it
        self.change = _Change(self)

    @property
    def _searches_waiting(self) -> int:
        return len(self._queue) + (self._granted is not None)

    def __enter__(self) -> "Turns":
        """A search's turn: after the call holding it, every change that waits and every search queued."""
        with self._mutex:
            if not (self._held or self._changes_waiting or self._queue):
                self._held = True
                return self
            mine = threading.Condition(self._mutex)
            self._queue.append(mine)
            try:
                while self._granted is not mine:
                    mine.wait()
            except BaseException:
                if self._granted is mine:       # handed over meanwhile: it goes to the next one
                    self._granted, self._held = None, False
                    self._pass_on()
                else:
                    self._queue.remove(mine)
                raise
            self._granted = None                # ours now (_held stayed True)
        return self

    def __exit__(self, *exc) -> None:
        with self._mutex:
            self._held = False
            self._pass_on()

    def _take_for_change(self) -> None:
        with self._mutex:
            self._changes_waiting += 1
            try:
                while self._held:
                    self._changes.wait()
            except BaseException:
                self._changes_waiting -= 1
                self._pass_on()
                raise
            self._changes_waiting -= 1
            self._held = True

    def _pass_on(self) -> None:
        """The free turn to who goes next, a waiting change first, else the oldest queued search, handed
        to it (call with _mutex held)."""
        if self._held:
            return
        if self._changes_waiting:
            self._changes.notify()
        elif self._queue:
            self._held = True
            self._granted = self._queue.popleft()
            self._granted.notify()


class _Change:
    """`with turns.change:` (see Turns)."""

    __slots__ = ("_turns",)

    def __init__(self, turns: Turns):
        self._turns = turns

    def __enter__(self) -> Turns:
        self._turns._take_for_change()
        return self._turns

    def __exit__(self, *exc) -> None:
        self._turns.__exit__()
