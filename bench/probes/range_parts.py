#!/usr/bin/env python3
"""Where a GPU range search's time goes, on `bench/index_ops.py`'s range row: 1M x 128 float32 l2 (its data,
seed 0), 1,000 queries, ~100 hits a query (mean 121, median 12, max 12,333 at its radius), against
search(k = 100). Parts, each timed alone (median of --reps after a warm-up; every call returns on the host):
- `thresholds`: the radius as each query's float32 screen threshold (host, range_screen.radius_thresholds);
- `screen_within`: steps 1 and 3 of the screen (queries rounded, every row screened against its threshold);
- `screened`: the whole screened half (the above, the survivors' float64 verify into the hit pool, the
  pool grouped and sorted into CSR, copied back; the queries whose survivors overflowed screened again with
  room for all of them), how many it screened again and which queries it hands back;
- `handed_back`: range_kernel over every row for those queries alone;
- `merge`: their answers merged into the screened ones (host);
- `whole`: Index.range_search, and `knn`: Index.search(q, 100).
The parts put together must equal the whole bit for bit (checked; exit 1 if not).

    PYTHONPATH=$PWD python3 bench/probes/range_parts.py --out $OUT/range_parts.json
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import tinyknn  # noqa: E402
from tinyknn.gpu import range_screen, ranges  # noqa: E402
from tinyknn.jit import render_screen  # noqa: E402
from tinyknn.csr import offsets  # noqa: E402
from tinyknn.gpu.hit_pool import merge_answers  # noqa: E402

RADIUS = 153.06541620612143     # index_ops's radius_for on this data (its 2026-12-02 H200 run): mean 121 hits


def median_ms(fn, reps: int) -> float:
    return statistics.median(_common.time_calls(fn, reps, warmup=1)) * 1e3


def profile(fn, reps: int) -> list:
    """[(function, calls a search, own ms a search, cumulative ms a search)], the 25 largest own times."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(((f"{Path(file).name}:{line}:{name}", calls / reps, own / reps * 1e3, cum / reps * 1e3)
                   for (file, line, name), (_, calls, own, cum, _) in stats.items()), key=lambda r: -r[2])[:25]
    for name, calls, own, cum in rows:
        print(f"  {own:8.3f} ms own {cum:8.3f} cum {calls:6.1f} calls  {name}")
    return [list(row) for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--radius", type=float, default=RADIUS)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", action="store_true",
                        help="also one cProfile pass over --reps whole range searches: the top functions by own "
                             "time a search (a driver call's own time includes what it waits for)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)              # index_ops's Bench draws x, labels, queries in this order
    x = rng.standard_normal((args.rows, 128), dtype=np.float32)
    rng.integers(0, 100, args.rows)
    q = rng.standard_normal((1000, 128), dtype=np.float32)
    out = {"rows": args.rows, "dim": 128, "queries": len(q), "radius": args.radius, "ms": {}}
    ms = out["ms"]
    with tinyknn.Index(128, "l2", "float32", device="cuda") as index:
        index.add(x, ids=np.arange(args.rows))
        s = index._searcher
        ms["knn"] = median_ms(lambda: index.search(q, 100), args.reps)
        ms["whole"] = median_ms(lambda: index.range_search(q, args.radius), args.reps)
        whole = index.range_search(q, args.radius)
        if args.profile:
            out["profile"] = profile(lambda: index.range_search(q, args.radius), args.reps)
        with s._lock, s._reading(None, gather=True):
            thresholds = range_screen.radius_thresholds(s.metric, q, args.radius, 0.0)
            ms["thresholds"] = median_ms(lambda: range_screen.radius_thresholds(s.metric, q, args.radius, 0.0),
                                         args.reps)
            ms["screen_within"] = median_ms(lambda: (
                s._screen.screen_within(q, thresholds, render_screen.SURVIVOR_CAPACITY), s._stream.synchronize()),
                args.reps)
            ms["screened"] = median_ms(lambda: range_screen.screened(s, q, args.radius), args.reps)
            again = s._screen.range_rescreens
            counts, distances, ids, back = range_screen.screened(s, q, args.radius)
            out["screened_again"] = s._screen.range_rescreens - again
            out["handed_back"] = back.tolist()
            if len(back):
                ms["handed_back"] = median_ms(lambda: ranges._range_rows(s, q[back], args.radius), args.reps)
                other = ranges._range_rows(s, q[back], args.radius)
                ms["merge"] = median_ms(lambda: merge_answers(counts, distances, ids, back, *other), args.reps)
                counts, distances, ids = merge_answers(counts, distances, ids, back, *other)
    parts = (offsets(counts), distances, ids)
    out["equal_to_whole"] = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(parts, whole))
    hits = np.diff(whole[0])
    out["hits"] = {"mean": float(hits.mean()), "median": float(np.median(hits)), "max": int(hits.max()),
                   "handed_back_hits": [int(hits[i]) for i in out["handed_back"]]}
    for name, value in ms.items():
        print(f"{name:<14} {value:9.3f} ms")
    print(json.dumps({k: v for k, v in out.items() if k != "ms"}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["equal_to_whole"] else 1


if __name__ == "__main__":
    sys.exit(main())
