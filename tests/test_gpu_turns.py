"""tinyknn.gpu.turns (plain Python, no GPU needed): one holder at a time; a waiting change goes ahead of every
search still waiting, searches go in the order they arrived, and an interrupted wait hands its turn on."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from tinyknn.gpu.turns import Turns

POLL = 0.001     # seconds between looks at the line while a new thread joins it


def _start(turns: Turns, name: str, order: list, change: bool = False) -> threading.Thread:
    """A thread taking a turn (a change's or a search's), returned once it waits in line."""
    def run():
        with (turns.change if change else turns):
            order.append(name)
            time.sleep(0.002)
    waiting = turns._changes_waiting + turns._searches_waiting
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    while turns._changes_waiting + turns._searches_waiting == waiting and time.monotonic() < deadline:
        time.sleep(POLL)
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


@contextlib.contextmanager
def _looping(n: int, take):
    """n threads calling `with take():` in a loop, each call releasing the GIL for 20 us as a GPU call does;
    yields their calls' counts, stops and joins them at the end."""
    stop, counts = threading.Event(), [0] * n

    def calling(slot: int):
        while not stop.is_set():
            with take():
                time.sleep(20e-6)                       # the GPU call, without the GIL
                counts[slot] += 1

    threads = [threading.Thread(target=calling, args=(slot,), daemon=True) for slot in range(n)]
    for thread in threads:
        thread.start()
    try:
        yield counts
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)


def test_threads_searching_in_a_loop_all_get_turns_and_let_a_change_in():
    """Four threads search in a loop, each call releasing the GIL as cuGraphLaunch and cuStreamSynchronize do:
    they take turns in arrival order (about as many each), and a change waiting behind them gets its turn at
    once. Waking the next waiter was not enough: the releasing thread took the turn back before the woken one
    ran, nearly every time (here two threads made ~2,000 searches each and two made 1; on a GPU index one thread
    made tens of thousands, the others none, and a reorder waiting behind them never ran)."""
    turns = Turns()
    with _looping(4, lambda: turns) as counts:
        time.sleep(0.3)
        waited = time.perf_counter()
        with turns.change:
            waited = time.perf_counter() - waited
        time.sleep(0.3)
    assert 4 * min(counts) >= max(counts) > 0 and waited < 1.0, (counts, waited)
    assert (turns._searches_waiting, turns._changes_waiting, turns._held, turns._granted) == (0, 0, False, None)


def test_changes_in_a_loop_take_turns_too():
    """Two threads changing in a loop (a reorder beside a loop of adds): each gets turns, in arrival order; the
    turn is handed to a waiting change as it is to a search (a woken change lost it to the looping one)."""
    turns = Turns()
    with _looping(2, lambda: turns.change) as counts:
        time.sleep(0.5)
    assert 4 * min(counts) >= max(counts) > 0, counts
    assert (turns._searches_waiting, turns._changes_waiting, turns._held, turns._granted) == (0, 0, False, None)
