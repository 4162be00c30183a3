#!/usr/bin/env python3
"""How often the 8-bit l2 screen's group-minima test (GM, measured slower on the H200 and removed: NOTES_HOPPER)
passes a group, against how often the exact per-element test finds a survivor in it, on SIFT-like uint8 rows
(NumPy, no GPU); a thread's rate and a warp's (its branch is taken where any of its 32 lanes' groups pass).

A thread's group is the 8 rows it holds in 4 chunks of 8 (2 adjacent rows a chunk, the wgmma accumulator
layout); the threshold is the k-th key of every 16th row (the threshold step's sample, without the tile bound).
A warp's group is 16 queries (8 g, 2 h) by the 32 rows of 4 chunks (4 t4). Keys are l2's |x|^2 - 2 q.x in
integers. Rows in the order they were added (random) and sorted by |x|^2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datasets  # noqa: E402


def pass_rates(x: np.ndarray, queries: np.ndarray, k: int, step: int) -> tuple[float, ...]:
    """(survivors a row, a thread's groups the exact test passes, the group-minima test passes, and a warp's
    groups the group-minima test passes in any lane)."""
    norms = (x * x).sum(1)
    dots = queries @ x.T
    keys = norms[None, :] - 2 * dots
    threshold = np.sort(keys[:, ::step], axis=1)[:, k - 1]
    spans = np.arange(len(x)).reshape(-1, 32)
    exact = coarse = groups = 0
    lanes = []
    for t4 in range(4):
        rows = np.concatenate([spans[:, 8 * c + 2 * t4: 8 * c + 2 * t4 + 2] for c in range(4)], axis=1)
        least = norms[rows].min(axis=1)
        exact += (keys[:, rows] <= threshold[:, None, None]).any(axis=2).sum()
        passed = (2 * dots[:, rows] >= least[None, :, None] - threshold[:, None, None]).any(axis=2)
        coarse += passed.sum()
        lanes.append(passed)
        groups += len(queries) * len(rows)
    blocks = np.stack(lanes).reshape(4, len(queries) // 16, 16, -1)     # (t4, query block, its 16, span)
    warp = blocks.any(axis=(0, 2)).mean()
    return float((keys <= threshold[:, None]).mean()), exact / groups, coarse / groups, float(warp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=262_144, help="rows (a multiple of 32)")
    parser.add_argument("--queries", type=int, default=128, help="queries (a multiple of 16)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--step", type=int, default=16)
    args = parser.parse_args()
    db, queries = datasets.sift_like(args.n, args.queries, 128)
    x, q = db.astype(np.int64), queries.astype(np.int64)
    norms = (x * x).sum(1)
    for name, order in (("added (random)", np.random.default_rng(0).permutation(args.n)),
                        ("sorted by |x|^2", np.argsort(norms, kind="stable"))):
        survivors, exact, coarse, warp = pass_rates(x[order], q, args.k, args.step)
        print(f"rows {name}: survivors {survivors:.5f} of the rows; groups with a survivor {exact:.4f}, "
              f"groups the minima pass {coarse:.4f}, a warp's groups the minima pass in any lane {warp:.4f}")
    print(f"|x|^2: mean {norms.mean():.0f}, sd {norms.std():.0f}")


if __name__ == "__main__":
    main()
