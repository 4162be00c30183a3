#!/usr/bin/env python3
"""DaskIndex.search over local worker processes against one Index in one process on the same cores.

Target: 2 local CPU workers, 1M x 128 float32 l2, 1,000 queries, k = 10: DaskIndex.search
<= 1.3x one Index. The single Index gets TINYKNN_CPU_THREADS = --cores, each of the --workers worker
processes --cores / --workers threads and one shard. Rounds alternate (single, dask, dask shards only) so
that the machine's other load falls on all three alike; medians after warm-up; the Dask answer is checked
bit for bit against the single Index's. "shards only" is the shards' own searches called at once and
waited for, without the merge: the difference to "dask" is the merge's cost, the difference to "single"
is the transport's and the split's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, then the checkout's tinyknn

import numpy as np  # noqa: E402

import _common  # noqa: E402


def parse(argv):
    parser = _common.common_parser(__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rows", type=int, default=1_000_000, help="database rows (default 1,000,000)")
    add("--dim", type=int, default=128)
    add("--queries", type=int, default=1000)
    add("--k", type=int, default=10)
    add("--metric", choices=("l2", "ip", "cosine"), default="l2")
    add("--workers", type=int, default=2, help="local worker processes, one shard each")
    add("--cores", type=int, default=2, help="threads of the single Index; the workers share them")
    add("--repeats", type=int, default=7, help="timed rounds (each times all three)")
    add("--warmup", type=int, default=2)
    add("--seed", type=int, default=0)
    add("--note", default="", help="free text stored in the results (e.g. what else ran on the machine)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.queries, args.repeats, args.warmup = min(args.rows, 100_000), 200, 3, 1
    return args


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - start) * 1e-9, out


def main(argv=None) -> int:
    args = parse(argv)
    os.environ["TINYKNN_CPU_THREADS"] = str(args.cores)      # before tinyknn reads its configuration
    import distributed

    import tinyknn
    from tinyknn.dask import DaskIndex

    device = "cuda" if args.device == "cuda" else "cpu"
    env = _common.environment()
    env["load_average_before"] = os.getloadavg()
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)

    single = tinyknn.Index(args.dim, args.metric, device=device)
    build_single, _ = timed(lambda: single.add(x))
    per_worker = max(1, args.cores // args.workers)
    cluster = distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                                       dashboard_address=None, env={"TINYKNN_CPU_THREADS": str(per_worker)})
    client = distributed.Client(cluster)
    try:
        sharded = DaskIndex(client, args.dim, args.metric, device=device, n_shards=args.workers)
        build_dask, _ = timed(lambda: sharded.add(x))
        calls = {"single": lambda: single.search(q, args.k),
                 "dask": lambda: sharded.search(q, args.k),
                 "dask shards only": lambda: sharded._shards.each("search", q, args.k, None, None)}
        answers = {name: call() for name, call in calls.items()}
        identical = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))      # bit for bit
                        for a, b in zip(answers["dask"], answers["single"]))
        for _ in range(args.warmup):
            for call in calls.values():
                call()
        samples = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                samples[name].append(timed(call)[0])
    finally:
        client.close()
        cluster.close()
    env["load_average_after"] = os.getloadavg()
    summary = {name: _common.summary_us(values) for name, values in samples.items()}
    ratio = summary["dask"]["median_us"] / summary["single"]["median_us"]
    payload = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "device": device, "threads_per_worker": per_worker, "identical_to_single_index": identical,
               "build_s": {"single": build_single, "dask": build_dask}, "search": summary,
               "samples_s": samples, "dask_over_single": ratio, "target_ratio": 1.3, "meets_target": ratio <= 1.3}

    plt = _common.pyplot()
    figure, axes = plt.subplots(figsize=(6, 3.5))
    names = list(summary)
    medians = [summary[n]["median_us"] / 1e3 for n in names]
    low = [m - summary[n]["p10_us"] / 1e3 for m, n in zip(medians, names)]
    high = [summary[n]["p90_us"] / 1e3 - m for m, n in zip(medians, names)]
    axes.bar(names, medians, yerr=[low, high], capsize=4, color=["#777777", "#3b75af", "#9ecae1"])
    axes.set_ylabel("search time, ms (median, p10-p90)")
    axes.set_title(f"{args.rows:,} x {args.dim} {args.metric}, {args.queries:,} queries, k={args.k}: "
                   f"{args.workers} workers / {args.cores} cores; dask/single = {ratio:.2f}", fontsize=8)
    paths = _common.write_results("dask_search", payload, figure, env=env, out_dir=args.out_dir)

    print(f"{args.rows:,} x {args.dim} {args.metric}, {args.queries} queries, k={args.k}, {device}; "
          f"load average before {env['load_average_before'][0]:.2f}, after {env['load_average_after'][0]:.2f}")
    for name in names:
        s = summary[name]
        print(f"  {name:18s} median {s['median_us'] / 1e3:9.1f} ms   p10 {s['p10_us'] / 1e3:9.1f}   "
              f"p90 {s['p90_us'] / 1e3:9.1f}")
    print(f"  dask / single = {ratio:.3f} (target <= 1.3); answers identical: {identical}")
    print(f"  wrote {', '.join(str(p) for p in paths.values())}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
