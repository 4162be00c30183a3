#!/usr/bin/env python3
"""What a one-query GPU search pays after a pause, and whether a removal leaves more than a pause does.

1M x 128 float32 l2 (seeded normal rows), k = 10, host NumPy in and out, rounds of: a 1-query search after a
batch, after another 1-query search, after an idle pause (time.sleep), after the searcher's plans and graphs
are rebuilt without a removal, and first and second after a removal of 1 % (re-added each round). Host time
and the device's span (events recorded on the index's stream before and after the call). Then the captured
graph of the 1-query search alone, replayed after pauses of 0, 2 and 10 ms: host time of launch + wait and
the device span between events recorded around the launch, to tell a host wake-up from a device one.
The index_ops removal row (bench/index_ops.py) compares the first search after a removal with the same search
after a pause as long as the removal, because of what this measures."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import tinyknn
from tinyknn.gpu.memory import Event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="a JSON file for the medians")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, 128), dtype=np.float32)
    index = tinyknn.Index(dim=128, metric="l2", dtype="float32", device="cuda")
    index.add(x)
    q = rng.standard_normal((1000, 128), dtype=np.float32)
    searcher = index._searcher
    start, end = Event(), Event()
    rows: dict[str, list[tuple[float, float]]] = {}

    def timed(name: str, nq: int = 1) -> None:
        start.record(searcher._stream)
        t0 = time.perf_counter_ns()
        index.search(q[:nq], 10)
        host = (time.perf_counter_ns() - t0) / 1e3
        end.record(searcher._stream)
        end.synchronize()
        rows.setdefault(name, []).append((host, start.elapsed_ms(end) * 1e3))

    def warm() -> None:
        for nq in (1, 1000):
            for _ in range(4):
                index.search(q[:nq], 10)
        index.search(q[:1000], 10)

    for _ in range(args.rounds):
        warm()
        timed("1q after a batch")
        timed("1q after a 1q")
        warm()
        time.sleep(0.01)
        timed("1q after 10 ms idle")
        warm()
        with searcher._lock.change:
            searcher._rebuild_host_batches()
            searcher._stream.synchronize()
        timed("1q after plans rebuilt (no removal)")
        timed("1q second after rebuild")
        warm()
        gone = rng.choice(args.rows, args.rows // 100, replace=False)
        index.remove(gone)
        timed("1q first after removal")
        timed("1q second after removal")
        timed("1000q after 2 1q (after removal)", 1000)
        index.add(x[gone], ids=gone)

    token = searcher.prepare_search(1, 10)
    for _ in range(3):
        searcher.search(q[:1], 10, prepared=token)
    graph, stream = token.batch.graph, searcher._stream
    for pause in (0.0, 0.002, 0.01):
        for _ in range(50):
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter_ns()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            host = (time.perf_counter_ns() - t0) / 1e3
            rows.setdefault(f"graph alone after {pause * 1e3:g} ms idle", []).append((host, start.elapsed_ms(end) * 1e3))

    medians = {}
    for name, values in rows.items():
        host, device = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        medians[name] = {"host_us": host, "device_span_us": device, "n": len(values)}
        print(f"{name:42s} host {host:8.1f} us  device span {device:8.1f} us  (n {len(values)})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": args.rows, "rounds": args.rounds, "medians": medians}, f, indent=1)


if __name__ == "__main__":
    main()
