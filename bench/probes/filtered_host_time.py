#!/usr/bin/env python3
"""Where a filtered search's time goes, against its ceiling: 1M x 128 float32 l2 (seeded normal rows, labels
uniform in 0..99), k = 10, 1 and --queries queries. For each of unfiltered, label 7 (~1 %), a random 1 %
allow-list and an index holding only label 7's rows (what no filter can beat): the median whole call over --reps
searches after warm-up, then one cProfile pass of --reps more, its functions by own time per search (the waits on
the stream are the device's share; the rest is the host's).

    PYTHONPATH=$PWD python3 bench/probes/filtered_host_time.py --out $OUT/filtered_host_time.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import tinyknn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--out")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    labels = rng.integers(0, 100, args.n)
    index = tinyknn.Index(args.dim, "l2", "float32", device="cuda")
    index.add(x, ids=np.arange(args.n), labels=labels)
    label_rows = np.flatnonzero(labels == 7)
    allow = np.sort(rng.choice(args.n, args.n // 100, replace=False))
    alone = tinyknn.Index(args.dim, "l2", "float32", device="cuda")
    alone.add(x[label_rows], ids=label_rows)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    result = {"environment": _common.environment(), "shape": vars(args), "cases": {}}
    for nq in (1, args.queries):
        q = queries[:nq]
        cases = {"unfiltered": lambda: index.search(q, 10),
                 "label": lambda: index.search(q, 10, labels=np.full(nq, 7)),
                 "allow-list": lambda: index.search(q, 10, filter=allow),
                 "label rows alone": lambda: alone.search(q, 10)}
        want = alone.search(q, 10)
        got = index.search(q, 10, labels=np.full(nq, 7))
        assert np.array_equal(want[1], got[1]) and np.array_equal(want[0], got[0]), "label != its rows alone"
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            reps = args.reps if nq == 1 else max(20, args.reps // 4)
            entry = {"whole_us_median": _common.median_us(_common.time_calls(fn, reps, warmup=0)),
                     "profile_top": _common.profile_per_call(fn, reps)[:args.top]}
            screen = (alone if name == "label rows alone" else index)._searcher._screen
            screen.timings = {}         # the screen's device steps (CUDA events), where it screens this batch
            for _ in range(7):
                fn()
            entry["screen_steps_us"] = {step: float(np.median(ms)) * 1e3 for step, ms in screen.timings.items()}
            screen.timings = None
            result["cases"][f"{name}, {nq} q"] = entry
            print(f"{name}, {nq} q: {entry['whole_us_median']:.1f} us; screen steps "
                  f"{', '.join(f'{step} {us:.1f}' for step, us in entry['screen_steps_us'].items()) or 'none'}")
            for r in entry["profile_top"][:12]:
                print(f"  {r['own_us_per_search']:8.1f} us own {r['cumulative_us_per_search']:8.1f} cum "
                      f"{r['calls_per_search']:6.1f} calls  {r['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
