"""Turns: one call at a time on a GPU index, and a change that waits goes ahead of the searches still waiting.

A GPU index's calls share its stream, staging and plans, so they take turns (GpuSearcher, HostTierSearcher).
With a plain threading.Lock a waiting add had no place in the line: whichever waiting thread the lock
happened to wake, or a search that came back for its next turn first, went ahead of it, so threads that
search in a loop kept an add waiting through a line of their searches. With Turns a change (add, remove,
truncate, reset, close: `with turns.change:`) that waits is the next to go: it waits for the call that holds
the turn now, and for nothing that arrives after it. Searches and reads (`with turns:`) go in the order
they arrived (Condition.notify wakes the longest waiting), one at a time as before.
"""

from __future__ import annotations

import threading

__all__ = ["Turns"]


class Turns:
    """Mutual exclusion in which waiting changes go before waiting searches (see the module doc)."""

    __slots__ = ("_mutex", "_searches", "_changes", "_held", "_changes_waiting", "_searches_waiting", "change")

    def __init__(self):
        self._mutex = threading.Lock()
        self._searches = threading.Condition(self._mutex)   # searches (and reads) waiting for their turn
        self._changes = threading.Condition(self._mutex)    # changes waiting for theirs
        self._held = False
        self._changes_waiting = 0
        self._searches_waiting = 0      # counted so that a turn handed back with nobody waiting notifies no one
        self.change = _Change(self)

    def __enter__(self) -> "Turns":
        """A search's turn: after the call holding it and after every change that waits."""
        with self._mutex:
            if self._held or self._changes_waiting:
                self._searches_waiting += 1
                try:
                    while self._held or self._changes_waiting:
                        self._searches.wait()
                except BaseException:
                    self._searches_waiting -= 1
                    self._pass_on()   # a wake-up meant for this thread goes to the next one
                    raise
                self._searches_waiting -= 1
            self._held = True
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
        """Wake who goes next, a waiting change first (call with _mutex held)."""
        if self._held:
            return
        if self._changes_waiting:
            self._changes.notify()
        elif self._searches_waiting:      # Condition.notify with no waiter still costs ~0.4 us a call
            self._searches.notify()


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
