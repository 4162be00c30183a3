"""tinyknn.gpu.turns (plain Python, no GPU needed): one holder at a time; a waiting change goes ahead of every
search still waiting, searches go in the order they arrived, and an interrupted wait hands its turn on."""

from __future__ import annotations

import threading
import time

import pytest

from tinyknn.gpu.turns import Turns

STEP = 0.05      # seconds between arrivals: enough for a thread to be waiting before the next one comes


def _start(turns: Turns, name: str, order: list, change: bool = False) -> threading.Thread:
    def run():
        with (turns.change if change else turns):
            order.append(name)
            time.sleep(0.002)
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(STEP)
    return thread


def test_a_waiting_change_goes_before_the_searches_that_wait():
    turns, order = Turns(), []
    turns.__enter__()                                   # a search holds the turn
    threads = [_start(turns, "search 1", order), _start(turns, "search 2", order),
               _start(turns, "change", order, change=True), _start(turns, "search 3", order)]
    turns.__exit__()
    for thread in threads:
        thread.join(5)
    assert order == ["change", "search 1", "search 2", "search 3"]


def test_changes_and_searches_exclude_each_other():
    turns, inside, worst = Turns(), [0], [0]
    lock = threading.Lock()

    def run(change: bool):
        for _ in range(200):
            with (turns.change if change else turns):
                with lock:
                    inside[0] += 1
                    worst[0] = max(worst[0], inside[0])
                time.sleep(0)
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=run, args=(i % 3 == 0,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert worst[0] == 1
    assert (turns._searches_waiting, turns._changes_waiting) == (0, 0)    # every wait counted out again


def test_an_exception_inside_gives_the_turn_back():
    turns = Turns()
    with pytest.raises(RuntimeError):
        with turns.change:
            raise RuntimeError("inside")
    done = threading.Event()
    threading.Thread(target=lambda: (turns.__enter__(), turns.__exit__(), done.set())).start()
    assert done.wait(5)
