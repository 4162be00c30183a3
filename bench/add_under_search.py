#!/usr/bin/env python3
"""An add while threads search, against the same add with no search running, in one run.

A --rows x --dim float32 l2 index (default 200,000 x 128, standard normal, seeded); --threads (8) threads
each search --queries (1) host queries, k = 10, in a loop. An add of --add-rows (2,000) rows is timed with
every searching thread parked (idle) and with all of them searching (loaded: each loaded add starts once
the threads have done as many searches as there are threads since the add before it), round after round,
alternately, so that a change in the machine's load meets both sides alike; each added batch is removed
again, untimed, so the index keeps its size. The target (tests/test_cpu_reliability.py): the loaded
median at most 5x the idle median. Also kept: each side's spread, the searches done during the loaded adds,
the threads' rate with no add, and one search's idle time (what an add may wait for: the searches already
running finish first).

    PYTHONPATH=$PWD python3 bench/add_under_search.py --device cpu|cuda [--rounds 15] [--quick]

bench/results/add_under_search_<date>_<device>.json. The GPU run wants TINYKNN_CACHE_DIR set (the cubin
cache) and takes host NumPy in and out, so every call returns synchronised.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, then the checkout's tinyknn

import _common  # noqa: E402

import tinyknn  # noqa: E402

TARGET_RATIO = 5.0


def parse_args(argv=None):
    parser = _common.common_parser(__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rows", type=int, default=200_000)
    add("--dim", type=int, default=128)
    add("--add-rows", type=int, default=2_000)
    add("--threads", type=int, default=8, help="searching threads (default 8)")
    add("--queries", type=int, default=1, help="queries per search (default 1)")
    add("--k", type=int, default=10)
    add("--rounds", type=int, default=15, help="rounds of idle then loaded adds (default 15)")
    add("--adds", type=int, default=3, help="adds timed on each side of a round (default 3)")
    add("--settle-s", type=float, default=0.05, help="searching before a round's loaded adds (default 0.05 s)")
    add("--throughput-s", type=float, default=1.0,
        help="the searching threads' rate with no add, measured this long first (default 1 s)")
    add("--seed", type=int, default=0)
    add("--note", default="", help="free text stored in the results")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = min(args.rows, 50_000), min(args.rounds, 5)
    if args.device == "auto":
        from tinyknn.gpu.device import has_gpu

        args.device = "cuda" if has_gpu() else "cpu"
    return args


class Searchers:
    """`count` threads searching `queries` in a loop while resumed; parked (waiting, not searching) while paused."""

    def __init__(self, index, queries: np.ndarray, k: int, count: int):
        self._index, self._queries, self._k = index, queries, k
        self._state = threading.Condition()
        self._running = self._stopping = False
        self._parked = 0
        self.searches = [0] * count
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()
        self.pause()

    def _loop(self, me: int) -> None:
        try:
            while True:
                if not self._running:                    # (read without the lock: the lock is taken to park)
                    with self._state:
                        self._parked += 1
                        self._state.notify_all()
                        self._state.wait_for(lambda: self._running or self._stopping)
                        self._parked -= 1
                        if self._stopping:
                            return
                self._index.search(self._queries, self._k)
                self.searches[me] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.errors.append(exc)
            with self._state:
                self._parked += 1
                self._state.notify_all()

    def pause(self) -> None:
        """Returns once every thread has finished its search and waits."""
        with self._state:
            self._running = False
            self._state.wait_for(lambda: self._parked == len(self._threads))

    def wait_for_searches(self, count: int, timeout_s: float = 10.0) -> None:
        """Returns once `count` more searches have finished (or after timeout_s), sleeping meanwhile."""
        target, deadline = sum(self.searches) + count, time.perf_counter() + timeout_s
        while sum(self.searches) < target and time.perf_counter() < deadline and not self.errors:
            time.sleep(0.0005)

    def resume(self) -> None:
        with self._state:
            self._running = True
            self._state.notify_all()

    def stop(self) -> None:
        with self._state:
            self._running, self._stopping = False, True
            self._state.notify_all()
        for thread in self._threads:
            thread.join()


def timed_add(index, batch: np.ndarray, first_id: int) -> float:
    """Seconds of index.add(batch); the rows are removed again afterwards (not timed)."""
    ids = np.arange(first_id, first_id + len(batch), dtype=np.int64)
    start = time.perf_counter()
    index.add(batch, ids=ids)
    elapsed = time.perf_counter() - start
    index.remove(ids)
    return elapsed


def measure(index, batch: np.ndarray, searchers: Searchers, rounds: int, adds: int, settle_s: float,
            first_id: int) -> dict:
    """Idle and loaded add times, alternating round by round (see the module doc). Each loaded add starts once
    every thread is searching again: after as many searches as threads since the add before it (back to
    back, the threads could still be waiting for the GIL, and the add would meet no search at all)."""
    idle, loaded, searches, loaded_s = [], [], 0, 0.0
    next_id = first_id
    for _ in range(rounds):
        searchers.pause()
        for _ in range(adds):
            idle.append(timed_add(index, batch, next_id))
            next_id += len(batch)
        searchers.resume()
        time.sleep(settle_s)
        for _ in range(adds):
            searchers.wait_for_searches(len(searchers.searches))
            before, start = sum(searchers.searches), time.perf_counter()
            loaded.append(timed_add(index, batch, next_id))
            next_id += len(batch)
            loaded_s += time.perf_counter() - start
            searches += sum(searchers.searches) - before
    searchers.pause()
    if searchers.errors:
        raise searchers.errors[0]
    return {"idle": idle, "loaded": loaded, "searches_while_loaded": searches, "loaded_s": loaded_s}


def figure(got: dict, args, ratio: float):
    """Every add's time, idle and loaded, in the order taken (None without matplotlib)."""
    try:
        plt = _common.pyplot()
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for side, colour in (("idle", "tab:blue"), ("loaded", "tab:red")):
        ms = np.array(got[side]) * 1e3
        ax.plot(ms, "o", ms=3, color=colour, label=f"{side}: median {np.median(ms):.2f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("add, in the order taken (rounds alternate idle and loaded)")
    ax.set_ylabel("ms")
    ax.set_title(f"add of {args.add_rows:,} rows to {args.rows:,} x {args.dim} ({args.device}), "
                 f"{args.threads} searching threads: {ratio:.1f}x", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    args = parse_args(argv)
    env = _common.environment()
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
    batch = rng.standard_normal((args.add_rows, args.dim), dtype=np.float32)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    index = tinyknn.Index(args.dim, "l2", "float32", device=args.device)
    index.add(x, ids=np.arange(args.rows))
    for _ in range(3):                               # first calls: kernels, staging, pages
        index.search(queries, args.k)
        timed_add(index, batch, args.rows)
    search_s = statistics.median(_common.time_calls(lambda: index.search(queries, args.k), 20, warmup=2))

    searchers = Searchers(index, queries, args.k, args.threads)
    try:
        searchers.resume()
        time.sleep(args.settle_s)
        before, start = sum(searchers.searches), time.perf_counter()
        time.sleep(args.throughput_s)
        searches_per_s = (sum(searchers.searches) - before) / (time.perf_counter() - start)
        got = measure(index, batch, searchers, args.rounds, args.adds, args.settle_s, args.rows)
    finally:
        searchers.stop()
    idle, loaded = statistics.median(got["idle"]), statistics.median(got["loaded"])
    ratio = loaded / idle
    payload = {
        "settings": {key: value for key, value in vars(args).items() if key != "out_dir"},
        "what": f"add of {args.add_rows:,} x {args.dim} float32 rows to a {args.rows:,}-row l2 index, idle and "
                f"while {args.threads} threads search {args.queries} quer{'y' if args.queries == 1 else 'ies'} "
                f"k={args.k} in a loop; rounds alternate idle and loaded; medians",
        "idle_add": _common.summary_us(got["idle"]),
        "loaded_add": _common.summary_us(got["loaded"]),
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
        "one_search_idle_us": search_s * 1e6,
        "searches_per_s_no_add": searches_per_s,
        "searches_during_loaded_adds": got["searches_while_loaded"],
        "searches_per_s_during_loaded_adds": got["searches_while_loaded"] / max(got["loaded_s"], 1e-9),
        "samples_s": {"idle": got["idle"], "loaded": got["loaded"]},
    }
    label = _common.device_label(env) if args.device == "cuda" else "cpu-" + _common._slug(env["cpu"])[:40]
    paths = _common.write_results("add_under_search", payload, figure(got, args, ratio), env=env,
                                  out_dir=args.out_dir, label=label)
    print(f"device {args.device}: add of {args.add_rows:,} rows to {args.rows:,} x {args.dim}: idle "
          f"{idle * 1e3:.2f} ms, under {args.threads} searching threads {loaded * 1e3:.2f} ms "
          f"(p90 {payload['loaded_add']['p90_us'] / 1e3:.2f} ms): {ratio:.1f}x, target <= {TARGET_RATIO:g}x "
          f"{'met' if payload['met'] else 'MISSED'}; one search idle {search_s * 1e3:.2f} ms; "
          f"{args.threads} threads search {searches_per_s:.0f}/s with no add, "
          f"{payload['searches_per_s_during_loaded_adds']:.0f}/s during the loaded adds")
    print(f"wrote {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
