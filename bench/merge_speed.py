"""The exact merge of per-shard k-NN answers (tinyknn.index.merge.knn) against the lexsort of every candidate it
replaced (kept as the reference in tests/test_merge.py), on the shapes ground truth merges: 4,096 queries x
2 parts and 10,000 queries x 8 parts, k = 100, CPU only.

Parts are each query's sorted distances, drawn two ways: `float` (uniform float32: ties across parts rare)
and `integer` (integers in a window of ~1,500 values, as squared l2 distances of SIFT-like uint8 rows are:
ties across parts in most queries, each resolved in float64). The float64 distance the merge asks for is
the float32 one (exact for such integers), read from a table; both merges must give the same bits. The
integer parts are merged a third way, with `exact_below=2**24` (what ground truth of 8-bit files passes:
such distances are their float64 ones, so ties go by id and nothing is resolved), to the same bits.

    PYTHONPATH=$PWD python3 bench/merge_speed.py [--repeats 3] [--out bench/results]

Each time is the median of --repeats calls; the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]
import _common  # noqa: E402
from test_merge import reference_knn  # noqa: E402

from tinyknn.index import merge  # noqa: E402

SHAPES = ((4096, 2), (10_000, 8))
K = 100


def parts_of(rng, n_queries: int, n_parts: int, kind: str):
    """n_parts (distances, ids) of (n_queries, K), sorted per query; ids unique, so a table answers."""
    table, parts = [], []
    for p in range(n_parts):
        if kind == "float":
            d = np.sort(rng.random((n_queries, K), dtype=np.float32) * 100, axis=1)
        else:
            d = np.sort(rng.integers(10_000, 11_500, (n_queries, K)), axis=1).astype(np.float32)
        ids = (p * n_queries + np.arange(n_queries)[:, None]) * K + np.arange(K)
        parts.append((d, ids.astype(np.int64)))
        table.append(d.ravel())
    exact = np.concatenate(table).astype(np.float64)
    asked = [0]

    def resolve(_numbers, ids, _shard):
        asked[0] += len(ids)
        return exact[ids]
    return parts, resolve, asked


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)), out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=_common.RESULTS_DIR)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows, load_before = [], os.getloadavg()
    for n_queries, n_parts in SHAPES:
        for kind in ("float", "integer"):
            parts, resolve, asked = parts_of(rng, n_queries, n_parts, kind)
            old_s, old = timed(lambda: reference_knn(parts, K, "l2", resolve), args.repeats)
            old_pairs, asked[0] = asked[0] // args.repeats, 0
            new_s, new = timed(lambda: merge.knn(parts, K, "l2", resolve), args.repeats)
            same = np.array_equal(old[1], new[1]) and np.array_equal(old[0].view(np.uint32), new[0].view(np.uint32))
            row = {"queries": n_queries, "parts": n_parts, "k": K, "kind": kind, "lexsort_s": round(old_s, 4),
                   "merge_s": round(new_s, 4), "speedup": round(old_s / new_s, 1), "same_bits": bool(same),
                   "pairs_resolved_lexsort": old_pairs, "pairs_resolved": asked[0] // args.repeats}
            if kind == "integer":    # integer distances below 2**24: ties by id, nothing resolved (exact_below)
                asked[0] = 0
                ids_s, by_id = timed(lambda: merge.knn(parts, K, "l2", resolve, exact_below=2.0 ** 24), args.repeats)
                row.update(merge_exact_below_s=round(ids_s, 4), pairs_resolved_exact_below=asked[0] // args.repeats)
                row["same_bits"] &= bool(np.array_equal(old[1], by_id[1])
                                         and np.array_equal(old[0].view(np.uint32), by_id[0].view(np.uint32)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    payload = {"rows": rows, "repeats": args.repeats, "load_average_before": load_before,
               "load_average_after": os.getloadavg()}           # other work on the machine shows here
    paths = _common.write_results("merge_speed", payload, out_dir=args.out)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
