"""`tinyknn demo`: build an index on a built-in data set, search it, print recall and time per query.

The data set is synthetic and seeded (points around random cluster centres, like embeddings), so the
demo needs no download and gives the same numbers on every run. Recall is measured against an exact
float64 search of a sample of the queries; a returned id counts as correct when its exact distance is
as good as the k-th best within float32 rounding, so ties broken either way both count.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

LARGER_IS_BETTER = {"l2": False, "ip": True, "cosine": True}


def add_demo_arguments(parser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU if there is one, else the CPU")
    parser.add_argument("--n", type=int, default=100_000, help="database vectors (default 100,000)")
    parser.add_argument("--dim", type=int, default=128, help="dimension (default 128)")
    parser.add_argument("--k", type=int, default=10, help="neighbours per query (default 10)")
    parser.add_argument("--metric", choices=tuple(LARGER_IS_BETTER), default="l2")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--queries", type=int, default=1000, help="queries (default 1,000)")
    parser.add_argument("--check", type=int, default=200, help="queries checked against float64 (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def clustered_data(n: int, n_queries: int, dim: int, seed: int, clusters: int = 100):
    """(database (n, dim), queries (n_queries, dim)) float32 around `clusters` random centres."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim), dtype=np.float32) * 3.0

    def draw(count: int) -> np.ndarray:
        return centres[rng.integers(0, clusters, count)] + rng.standard_normal((count, dim), dtype=np.float32)

    return draw(n), draw(n_queries)


def exact_distances(db: np.ndarray, q: np.ndarray, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(nq, n) float64 distances and a per-query bound on float32 rounding, computed in blocks."""
    db64, q64 = db.astype(np.float64), q.astype(np.float64)
    if metric == "cosine":
        db64 = db64 / np.maximum(np.linalg.norm(db64, axis=1, keepdims=True), 1e-300)
        q64 = q64 / np.maximum(np.linalg.norm(q64, axis=1, keepdims=True), 1e-300)
    dot = q64 @ db64.T
    if metric == "l2":
        dist = (q64 ** 2).sum(1)[:, None] - 2 * dot + (db64 ** 2).sum(1)[None, :]
        scale = (q64 ** 2).sum(1) + (db64 ** 2).sum(1).max()
    else:
        dist = dot
        scale = np.linalg.norm(q64, axis=1) * np.linalg.norm(db64, axis=1).max()
    return dist, 1e-6 * max(db.shape[1], 8) * scale + 1e-12


BATCH_REPEATS = 5   # the batch's time is the median of this many searches after its warm-up


def recall(ids: np.ndarray, db: np.ndarray, q: np.ndarray, k: int, metric: str, block: int = 16) -> float:
    """Fraction of returned ids (over all checked queries) that belong to the exact k nearest."""
    larger = LARGER_IS_BETTER[metric]
    take = min(k, db.shape[0])
    hits = 0
    for first in range(0, q.shape[0], block):   # blocks keep the float64 matrix small
        dist, tolerance = exact_distances(db, q[first:first + block], metric)
        kth = (-np.partition(-dist, take - 1, axis=1) if larger else np.partition(dist, take - 1, axis=1))[:, take - 1]
        for row in range(dist.shape[0]):
            found = np.unique(ids[first + row][ids[first + row] >= 0])
            got = dist[row, found]
            good = got >= kth[row] - tolerance[row] if larger else got <= kth[row] + tolerance[row]
            hits += int(good.sum())
    return hits / (take * q.shape[0])


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        from ..gpu.device import has_gpu

        return "cuda" if has_gpu() else "cpu"
    except ImportError:
        return "cpu"


def run_demo(args) -> dict:
    from ..index import Index

    device = _device(args.device)
    db, queries = clustered_data(args.n, args.queries, args.dim, args.seed)
    with Index(dim=args.dim, metric=args.metric, dtype=args.dtype, device=device) as index:
        start = time.perf_counter()
        index.add(db)
        add_seconds = time.perf_counter() - start
        # Each path is warmed before it is timed: a first call loads (or compiles) its kernels, and the batch
        # and the single query take different ones (the tensor-core screen, the single-query kernel).
        _, ids = index.search(queries, args.k)
        index.search(queries[:1], args.k)
        batches = []
        for _ in range(BATCH_REPEATS):
            start = time.perf_counter()
            index.search(queries, args.k)
            batches.append(time.perf_counter() - start)
        batch_seconds = statistics.median(batches)
        singles = []
        for row in queries[: min(200, len(queries))]:
            start = time.perf_counter()
            index.search(row[None, :], args.k)
            singles.append(time.perf_counter() - start)
    checked = min(args.check, len(queries))
    return {
        "device": device, "n": args.n, "dim": args.dim, "k": args.k, "metric": args.metric, "dtype": args.dtype,
        "seed": args.seed, "queries": len(queries), "add_seconds": add_seconds,
        "batch_ms": 1e3 * batch_seconds, "batch_ms_per_query": 1e3 * batch_seconds / len(queries),
        "single_query_median_ms": 1e3 * statistics.median(singles),
        # the reference searches what the index stores: the database rounded to its dtype
        "recall": recall(ids[:checked], db.astype(args.dtype), queries[:checked], args.k, args.metric),
        "recall_queries": checked,
    }


def cmd_demo(args) -> int:
    for name in ("n", "dim", "k", "queries", "check"):
        if getattr(args, name) < 1:
            print(f"tinyknn: error: --{name} must be a positive integer; got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        result = run_demo(args)
    except Exception as exc:  # noqa: BLE001 - the demo reports any failure in one line
        print(f"tinyknn demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    r = result
    print(f"tinyknn demo: {r['n']:,} x {r['dim']} {r['dtype']} (synthetic clusters, seed {r['seed']}), "
          f"metric {r['metric']}, k={r['k']}, device {r['device']}")
    lines = [("add", f"{r['add_seconds']:.3f} s"),
             (f"recall@{r['k']} vs float64", f"{r['recall']:.4f} ({r['recall_queries']} queries checked)"),
             ("median time, 1 query", f"{r['single_query_median_ms']:.3f} ms"),
             (f"{r['queries']:,} queries at once", f"{r['batch_ms']:.3f} ms ({r['batch_ms_per_query']:.4f} ms per query)")]
    for label, value in lines:
        print(f"  {label + ':':26s}{value}")
    return 0
