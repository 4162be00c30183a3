"""Turns: one call at a time on a GPU index, and a change that waits goes ahead of the searches still waiting.

A GPU index's calls share its stream, staging and plans, so they take turns (GpuSearcher, HostTierSearcher).
With a plain threading.Lock a waiting add had no place in the line: whichever waiting thread the lock
happened to wake, or a search that came back for its next turn first, went ahead of it, so threads that
search in a loop kept an add waiting through a line of their searches. With Turns a change (add, remove,
truncate, reset, close: `with turns.change:`) that waits is the next to go: it waits for the call that holds
the turn now and the changes that came before it, and for nothing that arrives after it. Searches and reads
(`with turns:`) go in the order they arrived, one at a time.

The order is kept by handing the turn over: a released turn is given by name to the oldest waiting change,
else to the oldest waiting search (it stays held while that thread wakes), and a call that arrives while
others of its kind wait queues behind them. Merely waking the next waiter is not enough under the GIL: the
releasing thread keeps running and, calling in a loop, took the turn again before the woken one could, every
time; its GPU calls release the GIL only once it holds the turn, so the others never got one (four threads
searching a GPU index: one made tens of thousands of searches, three none, and a reorder waiting behind them
never ran).
"""

from __future__ import annotations

import collections
import threading

__all__ = ["Turns"]


class Turns:
    """Mutual exclusion in which waiting changes go before waiting searches (see the module doc)."""

    __slots__ = ("_mutex", "_held", "_changes", "_searches", "_granted", "change")

    def __init__(self):
        self._mutex = threading.Lock()
        self._held = False              # a call holds the turn, or it is on its way to the waiter granted it
        self._changes: collections.deque = collections.deque()    # waiting changes, a Condition each, oldest first
        self._searches: collections.deque = collections.deque()   # waiting searches (and reads), likewise
        self._granted = None            # the waiter the turn was handed to, until it wakes and takes it
        self.change = _Change(self)

    @property
    def _changes_waiting(self) -> int:
        return len(self._changes)

    @property
    def _searches_waiting(self) -> int:
        return len(self._searches)

    def __enter__(self) -> "Turns":
        """A search's turn: after the call holding it, every change that waits and every search queued."""
        with self._mutex:
            if self._held or self._changes or self._searches:
                self._wait_in(self._searches)
            else:
                self._held = True
        return self

    def __exit__(self, *exc) -> None:
        with self._mutex:
            self._held = False
            self._pass_on()

    def _take_for_change(self) -> None:
        """A change's turn: after the call holding it and the changes queued before it."""
        with self._mutex:
            if self._held or self._changes:
                self._wait_in(self._changes)
            else:
                self._held = True

    def _wait_in(self, queue: collections.deque) -> None:
        """Queue the calling thread and wait until the turn is handed to it (call with _mutex held)."""
        mine = threading.Condition(self._mutex)
        queue.append(mine)
        try:
            while self._granted is not mine:
                mine.wait()
        except BaseException:
            if self._granted is mine:           # handed over meanwhile: it goes to the next one
                self._granted, self._held = None, False
                self._pass_on()
            else:
                queue.remove(mine)
            raise
        self._granted = None                    # ours now (_held stayed True)

    def _pass_on(self) -> None:
        """The free turn handed to the oldest waiting change, else to the oldest waiting search (call with
        _mutex held)."""
        if self._held:
            return
        queue = self._changes or self._searches
        if queue:
            self._held = True
            self._granted = queue.popleft()
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
