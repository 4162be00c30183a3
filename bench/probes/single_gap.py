#!/usr/bin/env python3
"""Where one query's search spends the time its kernel does not: search_trace.stage_breakdown (host clock
around each runtime call; CUDA events around each asynchronous call in a second pass) on 100k x 128 float32
and 1M x 768 float16, graphs on (the default), off, and on with the context's CU_CTX_SCHED_SPIN (single_io's
set_spin; the driver's AUTO policy may yield during a 360 us wait), in rounds. The question: at 1M x 768 the
search ran 16-32 us over its kernel, at 100k x 128 12-18; is that host time, the wait's wake-up, or device work
around the kernel? Output: JSON shape -> mode -> [one stage_breakdown a round].

    PYTHONPATH=$PWD python3 bench/probes/single_gap.py OUT.json [--rounds 3] [--reps 300]     # H200
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "cpp")]
import search_trace  # noqa: E402
import tinyknn  # noqa: E402
from single_io import set_spin  # noqa: E402

SHAPES = {"100k x 128 float32": (100_000, 128, "float32"), "1M x 768 float16": (1_000_000, 768, "float16")}
MODES = (("graphs on", True, False), ("graphs off", False, False), ("graphs on, spin wait", True, True))
SHOWN = ("total", "validation", "packing", "graph_call", "launch_call", "h2d_call", "sync_call", "results")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {}
    for label, (n, dim, dtype) in SHAPES.items():
        db = rng.standard_normal((n, dim), dtype=np.float32)
        queries = rng.standard_normal((1, dim), dtype=np.float32)
        with tinyknn.Index(dim, "l2", dtype, device="cuda") as index:
            index.add(db)
            del db
            for _ in range(20):
                index.search(queries, 10)
            modes = results[label] = {mode: [] for mode, _, _ in MODES}
            for _ in range(args.rounds):
                for mode, enabled, spin in MODES:
                    set_spin(spin)
                    try:
                        with search_trace.graphs(index, enabled):
                            row = search_trace.stage_breakdown(index, queries, 10, args.reps)
                    finally:
                        set_spin(False)
                    modes[mode].append(row)
                    host, device = row["host_us_median"], row["device_us_median"]
                    shown = "  ".join(f"{key} {host[key]:.1f}" for key in SHOWN if key in host)
                    span = device.get("device_span", 0.0)
                    print(f"{label:20s} {mode:20s} {shown}  device_span {span:.1f}  "
                          f"total-span {host.get('total', 0.0) - span:.1f}", flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
