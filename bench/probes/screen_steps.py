#!/usr/bin/env python3
"""Where a screened batch of 100k x 128 float32 spends its time: each step's CUDA-event milliseconds, the
survivors per query, for the threshold step's kept bounds per tile (KT) and sample step as knobs.

    PYTHONPATH=$PWD python3 bench/probes/screen_steps.py --out $OUT/screen_steps.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import tinyknn  # noqa: E402
from tinyknn.gpu import screen as screen_module  # noqa: E402
from tinyknn.jit import render_screen  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    db = rng.standard_normal((args.n, args.dim)).astype(np.float32)
    queries = rng.standard_normal((1000, args.dim)).astype(np.float32)
    original_step = screen_module.sample_step
    rows = []
    with tinyknn.Index(args.dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        screen = index._searcher._screen
        for keep in (2, 10):
            for step in (None, 8, 32):
                render_screen.THRESHOLD_KEEP = keep
                screen_module.sample_step = original_step if step is None else (lambda n, k, s=step: s)
                for nq in (100, 1000):
                    q = queries[:nq]
                    for _ in range(3):
                        index.search(q, 10)
                    samples = _common.time_calls(lambda: index.search(q, 10), repeats=50, warmup=3)
                    screen.timings = {}
                    for _ in range(7):
                        index.search(q, 10)
                    steps = {name: round(float(np.median(ms)), 4) for name, ms in screen.timings.items()}
                    screen.timings = None
                    counts = np.zeros(nq, np.int32)
                    index._searcher._buffers["screen_counts"].copy_to_host(counts, nq * 4)
                    row = {"keep": keep, "step": step or original_step(args.n, 10), "queries": nq,
                           "median_ms": round(float(np.median(samples)) * 1e3, 4), "steps_ms": steps,
                           "survivors_mean": float(counts.mean()), "survivors_max": int(counts.max())}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
