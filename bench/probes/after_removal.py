#!/usr/bin/env python3
"""What the first search after a removal pays that the same search before it did not (GPU).

bench/index_ops.py measures the first 1-query and 1,000-query searches after removing 1 % of 1M x 128 float32 rows
at 1.23x / 1.17x the searches before it, and the second ones at 1.01x / 1.03x: a one-time cost. This probe runs
the same sequence and, for the search before and the first one after, records the host time, the screen's step
times (CUDA events, 1,000 queries) and a profile of the Python calls; it prints the functions the first search
after the removal called that the one before did not (or called more often), with their time, and the device
steps that grew. Exactness is index_ops' business; this probe checks each answer against the one before the
removal for the rows that stayed.

    python3 bench/probes/after_removal.py --out results.json      # on a GPU machine; ~1 minute
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tinyknn  # noqa: E402

WARM = 5


def profile_of(call) -> tuple[dict, object]:
    """({function: (calls, cumulative s)} of one call under cProfile, its answer)."""
    profile = cProfile.Profile()
    answer = profile.runcall(call)
    return {f"{Path(f).name}:{line} {name}": (calls, cumulative)
            for (f, line, name), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items()}, answer


def wall_us(call) -> tuple[float, object]:
    start = time.perf_counter()
    answer = call()
    return (time.perf_counter() - start) * 1e6, answer


def new_work(before: dict, after: dict, top: int = 15) -> list[dict]:
    """Functions the later call ran more often than the earlier one, by cumulative time."""
    rows = []
    for name, (calls, cumulative) in after.items():
        if name.startswith(Path(__file__).name):
            continue                            # this probe's own lambdas
        was = before.get(name, (0, 0.0))[0]
        if calls > was:
            rows.append({"function": name, "calls": calls, "calls_before": was, "cumulative_us": cumulative * 1e6})
    return sorted(rows, key=lambda row: -row["cumulative_us"])[:top]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the probe itself")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
    queries = rng.standard_normal((1000, args.dim), dtype=np.float32)
    index = tinyknn.Index(args.dim, "l2", "float32", args.device)
    index.add(x)

    class NoScreen:
        timings = None
    screen = getattr(index._searcher, "_screen", None) or NoScreen()
    report = {"rows": args.rows, "dim": args.dim, "searches": {}}
    for nq in (1, 1000):
        q, other = queries[:nq], (queries if nq == 1 else queries[:1])
        rounds = {}
        for mode in ("timed", "profiled"):      # the profiler's own cost kept out of the timed round
            for _ in range(WARM):               # each shape warm, then searched after the other one, as index_ops
                index.search(queries, 10)
                index.search(q, 10)
            index.search(other, 10)
            measure = wall_us if mode == "timed" else profile_of
            screen.timings = {} if mode == "timed" else None
            before, answer_before = measure(lambda: index.search(q, 10))
            steps_before = {step: times[-1] for step, times in (screen.timings or {}).items()}
            gone = rng.choice(args.rows, args.rows // 100, replace=False)
            start = time.perf_counter()
            index.remove(gone)
            removal_ms = (time.perf_counter() - start) * 1e3
            screen.timings = {} if mode == "timed" else None
            first, answer_after = measure(lambda: index.search(q, 10))
            steps_after = {step: times[-1] for step, times in (screen.timings or {}).items()}
            screen.timings = None
            second = measure(lambda: index.search(q, 10))[0]
            kept = ~np.isin(answer_before[1][:, 0], gone)
            same = bool(np.array_equal(answer_after[1][kept, 0], answer_before[1][kept, 0]))
            rounds[mode] = (before, first, second, removal_ms, steps_before, steps_after, same)
            index.add(x[gone], ids=gone)
        before, first, second, removal_ms, steps_before, steps_after, same = rounds["timed"]
        calls_before, calls_first = rounds["profiled"][0], rounds["profiled"][1]
        report["searches"][nq] = {
            "wall_us": {"before": before, "first_after": first, "second_after": second}, "removal_ms": removal_ms,
            "screen_steps_ms": {"before": steps_before, "first_after": steps_after},
            "new_python_work": new_work(calls_before, calls_first),
            "nearest_kept_same": same and rounds["profiled"][6]}
        print(f"{nq} queries: before {before:.1f} us, first after {first:.1f}, second {second:.1f} "
              f"(removal {removal_ms:.2f} ms); screen steps before {steps_before} after {steps_after}")
        for row in report["searches"][nq]["new_python_work"]:
            print(f"    {row['cumulative_us']:9.1f} us  {row['calls']:4d} calls (was {row['calls_before']})  "
                  f"{row['function']}")
    index.close()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=float))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
