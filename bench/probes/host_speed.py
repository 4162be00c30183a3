#!/usr/bin/env python3
"""Whether the host's speed, not the library, sets one search's end-to-end time from process to process.

One process, one line of JSON: the CPU it ran on, a pure-Python method call (ns; no library code), an empty
NumPy array (ns), and the median of 300 one-query searches (us) on 100k x 128 float32 (l2, k = 10) on the GPU.
Run it in many processes, pinned to each core and not, under several hash seeds: where the pure-Python call
and the search move together while the core and the seed do not, the host's CPU is what changed.

    for c in $(seq 0 15); do taskset -c $c python3 bench/probes/host_speed.py pin$c; done    # and unpinned
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import _common  # noqa: E402
import tinyknn  # noqa: E402


def method_call_ns() -> float:
    """The median over 15 rounds of one Python method call (20,000 a round)."""
    class Adder:
        def __init__(self):
            self.x = 1

        def add(self, y):
            return self.x + y

    adder, rounds = Adder(), []
    for _ in range(15):
        t0 = time.perf_counter_ns()
        for i in range(20_000):
            adder.add(i)
        rounds.append((time.perf_counter_ns() - t0) / 20_000)
    return statistics.median(rounds)


def current_cpu() -> int:
    """The CPU this process last ran on (/proc/self/stat's 39th field)."""
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])


def main(tag: str) -> None:
    rng = np.random.default_rng(0)
    db = rng.standard_normal((100_000, 128), dtype=np.float32)
    rows = list(rng.standard_normal((64, 128), dtype=np.float32)[:, None, :])
    with tinyknn.Index(128, "l2", "float32", device="cuda") as index:
        index.add(db)
        cycled = itertools.cycle(rows)
        searches = _common.time_calls(lambda: index.search(next(cycled), 10), 300, warmup=20)
    arrays = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        np.empty((1, 10), np.float32)
        arrays.append(time.perf_counter_ns() - t0)
    print(json.dumps({"tag": tag, "cpu": current_cpu(), "method_call_ns": round(method_call_ns(), 1),
                      "np_empty_ns": statistics.median(arrays), "search_us": round(_common.median_us(searches), 1),
                      "hashseed": os.environ.get("PYTHONHASHSEED")}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
