"""tests/test_gpu_filters.py's searches-during-reorders test, which took a minute or more on the H200 (57 s and
110 s in whole-suite runs, then stalled: threads searching in a loop took tinyknn.gpu.turns' turn back before the
thread they had woken could run; fixed by handing the turn over): its scenario (4 threads searching a 3,000-row
labelled GPU index, the main thread reordering the rows 30 times under the Index's locks), each reorder's wait for
the add lock and for _view timed, the searches counted, and every thread's innermost frames sampled while a reorder
waits. Run twice: as the Index is, and with _view a first-come-first-served lock (which hands the lock to the
longest waiter).
  python3 bench/probes/reorder_contention.py [--deadline-s 60]"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import test_gpu_filters  # noqa: E402
import tinyknn  # noqa: E402


class QueueLock:
    """A lock handed to its waiters in arrival order (the experiment's alternative to threading.Lock)."""

    def __init__(self):
        self._mutex = threading.Lock()
        self._turn = threading.Condition(self._mutex)
        self._next = self._serving = 0

    def __enter__(self):
        with self._mutex:
            ticket, self._next = self._next, self._next + 1
            while ticket != self._serving:
                self._turn.wait()

    def __exit__(self, *exc):
        with self._mutex:
            self._serving += 1
            self._turn.notify_all()


def scenario(fair: bool, deadline_s: float, graphs: bool = True, kinds=(0, 0, 1, 2)) -> None:
    rng = np.random.default_rng(11)
    index, held = test_gpu_filters.labelled_index(rng, n=3000)
    index._searcher.use_graphs = graphs
    if fair:
        index._view = QueueLock()
    q = rng.standard_normal((20, 24)).astype(np.float32)
    allow = np.array(sorted(rng.choice(sorted(held), 300, replace=False).tolist()))
    calls = [{}, {"labels": np.full(20, 2)}, {"filter": allow}]
    counts, spent = collections.Counter(), collections.Counter()
    stop = threading.Event()

    def searching(which):
        while not stop.is_set():
            for size in (1, 20):
                extra = {key: (value[:size] if key == "labels" else value) for key, value in calls[which].items()}
                t0 = time.perf_counter()
                index.search(q[:size], 10, **extra)
                counts[(which, size)] += 1
                spent[(which, size)] += time.perf_counter() - t0

    threads = [threading.Thread(target=searching, args=(which,), daemon=True) for which in kinds]
    for thread in threads:
        thread.start()
    waits, inside = [], []
    start = time.perf_counter()
    order_rng = np.random.default_rng(5)
    for turn in range(30):
        order = order_rng.permutation(index.ntotal).astype(np.int64)
        t0 = time.perf_counter()

        def sample():       # once, where the reorder still waits after 2 s (the timer is cancelled once it ran)
            print(f"  reorder {turn} waits {time.perf_counter() - t0:.1f} s; the threads:\n"
                  f"{test_gpu_filters.thread_frames()}", flush=True)
        timer = threading.Timer(2.0, sample)
        timer.start()
        with index._add_lock:
            t1 = time.perf_counter()
            with index._view:
                t2 = time.perf_counter()
                index._searcher.permute_rows(order)
                index._ids.apply_permutation(order)
                index._labels.apply_permutation(order)
        timer.cancel()
        waits.append((t1 - t0, t2 - t1))
        inside.append(time.perf_counter() - t2)
        if time.perf_counter() - start > deadline_s:
            print(f"  deadline: {turn + 1} reorders in {deadline_s} s", flush=True)
            break
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    total = time.perf_counter() - start
    add_wait, view_wait = np.array(waits).T
    print(f"{'first-come lock' if fair else 'threading.Lock'} _view, graphs {graphs}, threads {kinds}: "
          f"{len(waits)} reorders in {total:.1f} s; "
          f"wait for the add lock median {np.median(add_wait) * 1e3:.2f} ms max {add_wait.max() * 1e3:.1f}; "
          f"for _view median {np.median(view_wait) * 1e3:.2f} ms max {view_wait.max() * 1e3:.1f}; "
          f"reorder itself median {np.median(inside) * 1e3:.2f} ms max {max(inside) * 1e3:.1f}", flush=True)
    for key in sorted(counts):
        print(f"  searches {key}: {counts[key]}, mean {spent[key] / counts[key] * 1e3:.3f} ms", flush=True)
    index.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--device", default="cuda", help="cpu: the same scenario on a CPU index (checks the script)")
    parser.add_argument("--only", choices=("no-graphs", "unfiltered", "one-thread"),
                        help="one scenario: graphs off; the two unfiltered threads alone; one unfiltered thread")
    args = parser.parse_args()
    if args.device != "cuda":     # the test module's helper makes CUDA indexes
        test_gpu_filters.tinyknn = type("Shim", (), {"Index": staticmethod(
            lambda *a, **kw: tinyknn.Index(*a, **{**kw, "device": args.device}))})
    if args.only:
        scenario(False, args.deadline_s, graphs=args.only != "no-graphs",
                 kinds={"no-graphs": (0, 0, 1, 2), "unfiltered": (0, 0), "one-thread": (0,)}[args.only])
        return 0
    for fair in (False, True):
        scenario(fair, args.deadline_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
