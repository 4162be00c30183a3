"""End to end: a search through the tensor-core screen against the same index with the screen off, host NumPy
queries in and out, k = 10, medians of host-clock timings after warm-up; survivors handed back counted.

    PYTHONPATH=$PWD python3 bench/probes/screen_e2e.py [--out screen_e2e.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import tinyknn

CASES = [  # rows, dim, dtype, metric, queries
    (100_000, 128, "float32", "l2", 1000), (100_000, 128, "float16", "l2", 1000),
    (1_000_000, 768, "float16", "l2", 1000), (1_000_000, 768, "float16", "ip", 1000),
    (1_000_000, 768, "bfloat16", "l2", 1000), (1_000_000, 768, "float32", "l2", 1000),
    (1_000_000, 768, "float32", "l2", 100), (10_000_000, 128, "float16", "l2", 2048),
    (10_000_000, 128, "uint8", "l2", 2048),
]


def timed(call, repeats=10):
    for _ in range(2):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--budget-s", type=float, default=150)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, began = [], time.perf_counter()
    for n, dim, dtype, metric, nq in CASES:
        if time.perf_counter() - began > args.budget_s:
            break
        if dtype == "uint8":
            db = rng.integers(0, 256, (n, dim), dtype=np.uint8)
            q = db[rng.choice(n, nq)].astype(np.float32)
        else:
            db = rng.standard_normal((n, dim), dtype=np.float32)
            if dtype == "bfloat16":
                from tinyknn.spec import numpy_dtype
                db = db.astype(numpy_dtype("bfloat16"))
            else:
                db = db.astype(dtype)
            q = rng.standard_normal((nq, dim), dtype=np.float32)
        index = tinyknn.Index(dim, metric, dtype, device="cuda")
        index._searcher.add(db, np.arange(n))
        searcher = index._searcher
        searcher.use_screen = True
        on = timed(lambda: searcher.search(q, 10))
        screened, back = searcher._screen.queries, searcher._screen.fallbacks
        searcher.use_screen = False
        off = timed(lambda: searcher.search(q, 10), repeats=5)
        searcher.use_screen = True
        d_on = searcher.search(q, 10)
        searcher.use_screen = False
        d_off = searcher.search(q, 10)
        same = bool(np.array_equal(d_on[1], d_off[1]) and np.array_equal(d_on[0].view(np.uint32), d_off[0].view(np.uint32)))
        row = dict(n=n, dim=dim, dtype=dtype, metric=metric, queries=nq, screen_ms=on, other_kernels_ms=off,
                   screened=screened, handed_back=back, identical_answers=same)
        rows.append(row)
        print(row, flush=True)
        index.close()
        del db
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
