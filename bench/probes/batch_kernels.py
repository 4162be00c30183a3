#!/usr/bin/env python3
"""One screened batch's kernels for a profiler: an index of --n x --dim rows (seeded normal), --warm searches
of --queries queries, then --profiled more between cuProfilerStart and cuProfilerStop, so that a profiler
started with its capture off sees only those (every kernel of a screened batch: query rounding, the threshold
mode, the threshold, the screen, the verify):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section LaunchStats python3 bench/probes/batch_kernels.py
    nsys profile --capture-range=cudaProfilerApi --stats=true -o $OUT/batch python3 bench/probes/batch_kernels.py

--sift-like: SIFT-like uint8 rows and queries (bench/datasets.py) in place of normal ones, as screen_steps takes
for uint8. --filtered label / allow: the same for a filtered batch (a 1 % label, a 1 % random allow-list), whose
kernels are not the screen's. --range-radius R: range searches of radius R in place of k-NN ones (index_ops's range
row: 1M rows, R = 153.07, ~121 hits a query).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from cuda.bindings import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import datasets  # noqa: E402
import tinyknn  # noqa: E402
from tinyknn.jit import render_screen  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--metric", default="l2")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--profiled", type=int, default=1)
    parser.add_argument("--filtered", choices=("none", "label", "allow"), default="none",
                        help="a filtered batch (bench/index_ops.py's rows): 'label' one label of 100 (1 %% of the "
                             "rows), 'allow' a random allow-list of 1 %% of the ids")
    parser.add_argument("--sift-like", action="store_true",
                        help="SIFT-like uint8 rows and queries (bench/datasets.py; the index of --dtype)")
    parser.add_argument("--range-radius", type=float, default=None,
                        help="profile range_search(q, R) in place of search(q, k)")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=INT",
                        help="a render_screen knob set before the index is made (e.g. HOPPER_LEAN_TILES=1)")
    args = parser.parse_args()
    for knob in args.knob:
        name, value = knob.split("=")
        if not hasattr(render_screen, name):
            parser.error(f"render_screen has no knob {name}")
        setattr(render_screen, name, type(getattr(render_screen, name))(int(value)))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    labels = rng.integers(0, 100, args.n) if args.filtered == "label" else None
    allow = np.sort(rng.choice(args.n, max(1, args.n // 100), replace=False))
    more = {"none": {}, "label": {"labels": np.full(args.queries, 7)}, "allow": {"filter": allow}}[args.filtered]
    if args.sift_like:
        db, q = datasets.sift_like(args.n, args.queries, args.dim)
        index = tinyknn.Index(args.dim, args.metric, args.dtype, device="cuda")
        index.add(datasets.for_dtype(db, args.dtype), labels=labels)
        q = datasets.for_dtype(q, args.dtype)
    else:
        index = _common.normal_index(rng, args.n, args.dim, args.metric, args.dtype, labels=labels)
    with index:
        def call():
            if args.range_radius is None:
                return index.search(q, args.k, **more)
            return index.range_search(q, args.range_radius, **more)

        for _ in range(args.warm):
            call()
        before = index._searcher._screen.queries + index._searcher._screen.range_queries
        driver.cuProfilerStart()
        for _ in range(args.profiled):
            call()
        driver.cuProfilerStop()
        screened = index._searcher._screen.queries + index._searcher._screen.range_queries - before
    print(f"{args.profiled} searches of {args.queries} queries profiled, {screened} queries screened")


if __name__ == "__main__":
    main()
