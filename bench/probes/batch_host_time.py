#!/usr/bin/env python3
"""Where a screened batch's host time goes: 1M x 768 float16 l2 (seeded normal rows), 1,000 float32 queries,
k = 10 by default. Medians over --reps searches after warm-up of: the whole call (host clock), the screen's
device steps (CUDA events between them, Screen.timings), and the host time of the screen's query upload
(pinned staging copy + DMA issue); then one cProfile pass over --reps more searches, its functions by own time
per search. Whole minus the steps' sum is the host's share and the gaps between steps.

    PYTHONPATH=$PWD python3 bench/probes/batch_host_time.py --out $OUT/batch_host_time.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
from tinyknn.gpu import screen as screen_module  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    index = _common.normal_index(rng, args.n, args.dim, "l2", args.dtype)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    for _ in range(5):
        index.search(q, args.k)
    screen = index._searcher._screen

    uploads = []
    original = screen_module.Screen._upload

    def timed_upload(self, queries):
        t0 = time.perf_counter_ns()
        original(self, queries)
        uploads.append((time.perf_counter_ns() - t0) / 1e3)

    walls = []
    screen.timings = {}
    screen_module.Screen._upload = timed_upload
    try:
        for _ in range(args.reps):
            t0 = time.perf_counter_ns()
            index.search(q, args.k)
            walls.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        screen_module.Screen._upload = original
    steps = {name: statistics.median(ms) * 1e3 for name, ms in screen.timings.items()}
    screen.timings = None
    plain = []
    for _ in range(args.reps):
        t0 = time.perf_counter_ns()
        index.search(q, args.k)
        plain.append((time.perf_counter_ns() - t0) / 1e3)
    rows = _common.profile_per_call(lambda: index.search(q, args.k), args.reps)
    result = {"environment": _common.environment(), "shape": vars(args), "whole_us_median": statistics.median(plain),
              "whole_with_step_events_us_median": statistics.median(walls), "steps_us_median": steps,
              "steps_sum_us": sum(steps.values()), "upload_host_us_median": statistics.median(uploads),
              "profile_top": rows[:40]}
    print(f"whole {result['whole_us_median']:.1f} us (with step events {result['whole_with_step_events_us_median']:.1f}); "
          f"steps {', '.join(f'{k} {v:.1f}' for k, v in steps.items())} = {result['steps_sum_us']:.1f} us; "
          f"upload on the host {result['upload_host_us_median']:.1f} us")
    for r in rows[:25]:
        print(f"  {r['own_us_per_search']:8.1f} us own {r['cumulative_us_per_search']:8.1f} cum {r['calls_per_search']:6.1f} calls  {r['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
