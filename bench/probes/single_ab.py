#!/usr/bin/env python3
"""Variants of the single-query kernel (render_single.single_params knobs) in interleaved rounds: the kernel alone
(CUDA events, as bench/single_query.py times it) four rounds, then the search end to end (median of 300) two
rounds, each variant's answers checked bit for bit against the library default's.
  --knob stage         the staged verify chain, 1, 4 or 8 chunks loaded a step (stage=1/4/8);
  --knob shared_bound  the slices' shared bound off and on (shared_bound=False/True).
Shapes: 100k x 128 float32 (its float16 shadow), 1M x 768 float16, 1M x 768 float32 (shadow); --shapes adds
1M x 128 float32 and 2M x 768 float16 (two waves of slices). The JSON: shape -> variant -> {"kernel": [us a
round], "e2e": [us a round]}.

    PYTHONPATH=$PWD python3 bench/probes/single_ab.py OUT.json [--knob shared_bound]     # H200, minutes
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import single_query  # noqa: E402
import tinyknn  # noqa: E402

KNOBS = {"stage": {"1": {"stage": 1}, "4": {"stage": 4}, "8": {"stage": 8}},
         "shared_bound": {"off": {"shared_bound": False}, "on": {"shared_bound": True}}}
SHAPES = {"100k x 128 float32": (100_000, 128, "float32"), "1M x 768 float16": (1_000_000, 768, "float16"),
          "1M x 768 float32": (1_000_000, 768, "float32"), "1M x 128 float32": (1_000_000, 128, "float32"),
          "2M x 768 float16": (2_000_000, 768, "float16")}
DEFAULT_SHAPES = ("100k x 128 float32", "1M x 768 float16", "1M x 768 float32")


def measure(index, queries, variants: dict) -> dict:
    searcher = index._searcher
    reference = [index.search(queries[i:i + 1], 10) for i in range(len(queries))]
    result = {name: {"kernel": [], "e2e": []} for name in variants}
    for _ in range(4):
        for name, knobs in variants.items():
            ms = single_query._kernel_ms(searcher, 200, None, knobs)["kernel_ms"]
            result[name]["kernel"].append(round(ms * 1e3, 2))
    for _ in range(2):
        for name, knobs in variants.items():
            searcher.single_overrides = tuple(knobs.items())
            searcher._forget_plans()
            try:
                for q, (d0, i0) in enumerate(reference):
                    d1, i1 = index.search(queries[q:q + 1], 10)
                    if not (np.array_equal(i0, i1) and np.array_equal(d0.view(np.int32), d1.view(np.int32))):
                        raise AssertionError(f"{name}: query {q}'s answer differs from the default's")
                us = single_query._end_to_end(index, queries, 300)["default_us"]
                result[name]["e2e"].append(round(us, 1))
            finally:
                searcher.single_overrides = ()
                searcher._forget_plans()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--knob", choices=tuple(KNOBS), default="stage")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated labels of SHAPES")
    args = parser.parse_args()
    variants = KNOBS[args.knob]
    rng = np.random.default_rng(0)
    results = {}
    for label in args.shapes.split(","):
        n, dim, dtype = SHAPES[label.strip()]
        single_query._warm(dim, dtype, tuple((knobs, None) for knobs in variants.values()), n)
        db = rng.standard_normal((n, dim), dtype=np.float32)
        queries = rng.standard_normal((64, dim), dtype=np.float32)
        with tinyknn.Index(dim, "l2", dtype, device="cuda") as index:
            index.add(db)
            del db
            results[label] = measure(index, queries, variants)
        for name, row in results[label].items():
            print(label, args.knob, name, "kernel", row["kernel"], "median", statistics.median(row["kernel"]),
                  "e2e", row["e2e"], flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
