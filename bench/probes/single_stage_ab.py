#!/usr/bin/env python3
"""The staged verify step's chain, 1, 4 or 8 chunks loaded a step (render.single_params stage=1/4/8), in
interleaved rounds: the single-query kernel alone (CUDA events, as bench/single_query.py times it) four rounds,
then the search end to end (median of 300) two rounds, each stage's answers checked bit for bit against the
library default's. Shapes: 100k x 128 float32 (its float16 shadow), 1M x 768 float16, 1M x 768 float32 (shadow).
The JSON: shape -> stage -> {"kernel": [us a round], "e2e": [us a round]}.

    PYTHONPATH=$PWD python3 bench/probes/single_stage_ab.py OUT.json        # H200, about two minutes
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import single_query  # noqa: E402
import tinyknn  # noqa: E402

STAGES = (1, 4, 8)
SHAPES = (("100k x 128 float32", 100_000, 128, "float32"), ("1M x 768 float16", 1_000_000, 768, "float16"),
          ("1M x 768 float32", 1_000_000, 768, "float32"))


def measure(index, queries) -> dict:
    searcher = index._searcher
    reference = [index.search(queries[i:i + 1], 10) for i in range(len(queries))]
    result = {stage: {"kernel": [], "e2e": []} for stage in STAGES}
    for _ in range(4):
        for stage in STAGES:
            ms = single_query._kernel_ms(searcher, 200, None, {"stage": stage})["kernel_ms"]
            result[stage]["kernel"].append(round(ms * 1e3, 2))
    for _ in range(2):
        for stage in STAGES:
            searcher.single_overrides = (("stage", stage),)
            searcher._forget_plans()
            try:
                for q, (d0, i0) in enumerate(reference):
                    d1, i1 = index.search(queries[q:q + 1], 10)
                    if not (np.array_equal(i0, i1) and np.array_equal(d0.view(np.int32), d1.view(np.int32))):
                        raise AssertionError(f"stage {stage}: query {q}'s answer differs from the default's")
                us = single_query._end_to_end(index, queries, 300)["default_us"]
                result[stage]["e2e"].append(round(us, 1))
            finally:
                searcher.single_overrides = ()
                searcher._forget_plans()
    return result


def main(out: str) -> None:
    rng = np.random.default_rng(0)
    results = {}
    for label, n, dim, dtype in SHAPES:
        single_query._warm(dim, dtype, tuple(({"stage": s}, None) for s in STAGES))
        db = rng.standard_normal((n, dim), dtype=np.float32)
        queries = rng.standard_normal((64, dim), dtype=np.float32)
        with tinyknn.Index(dim, "l2", dtype, device="cuda") as index:
            index.add(db)
            del db
            results[label] = measure(index, queries)
        for stage, row in results[label].items():
            print(label, "stage", stage, "kernel", row["kernel"], "median", statistics.median(row["kernel"]),
                  "e2e", row["e2e"], flush=True)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
