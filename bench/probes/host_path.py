#!/usr/bin/env python3
"""What one GPU search costs in Python alone: Index.search, a prepared search and the searcher's own search of
one query on a GpuSearcher whose host batch does no driver call (no copy, no launch, no wait), so the time
left is the library's Python between the caller and the driver: checks, the plan lookup, the query into the
(here ordinary) staging array, the results copied out. Runs on any machine, no GPU needed; with
bench/launch_overhead.py's C++ replay of the same calls on the H200 it says how far under C++ a whole search
can get: C++ replaying the graph pays the graph launch and the wait only, Python pays these too.

    PYTHONPATH=$PWD python3 bench/probes/host_path.py            # writes bench/results/host_path_<date>_<cpu>.json
"""
from __future__ import annotations

import argparse
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import tinyknn  # noqa: E402


class _Batch:
    """A host batch (tinyknn.gpu.plan.HostBatch) without a device: staging and results arrays, no driver calls."""

    def __init__(self, n: int, k: int, dim: int):
        self.stage = np.zeros((n, dim), np.float32)
        self.distances, self.ids = np.zeros((n, k), np.float32), np.zeros((n, k), np.int64)
        self.status = np.zeros(n, np.int32)

    def run(self, stream, use_graphs) -> None:
        pass

    def close(self) -> None:
        pass


def offline_searcher(n: int, dim: int):
    """A GpuSearcher whose search path is the real one (search, _search_host_batch, the views, the value
    checks) over _Batch host batches looked up as _host_batch does."""
    from tinyknn.gpu.searcher import GpuSearcher
    from tinyknn.gpu.views import EveryRow

    class Offline(GpuSearcher):
        use_screen = False

        def __init__(self):                 # no device, no buffers
            self.dim, self.metric, self.dtype = dim, "l2", "float32"
            self._n, self._stride = n, dim
            self._lock, self._closed, self._view = threading.Lock(), False, None
            self._every_row = EveryRow(self)
            self._plans, self._buffers = OrderedDict(), {}
            self._stream = type("Stream", (), {"synchronize": lambda self: None})()

        def _host_batch(self, n_queries, k, exact=False):
            key = (n_queries, k, "host", exact, self._view)
            batch = self._plans.get(key)
            if batch is None:
                batch = self._plans[key] = _Batch(n_queries, k, self.dim)
            self._plans.move_to_end(key)
            return batch

    return Offline()


def median_us(fn, calls: int) -> float:
    return round(_common.median_us(_common.time_calls(fn, calls, warmup=1000)), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args()
    index = tinyknn.Index(args.dim, "l2", "float32", "cpu")
    index._searcher.close()
    index._searcher, index.device = offline_searcher(100_000, args.dim), "cuda"   # the GPU's checks and path
    q = np.random.default_rng(0).standard_normal((1, args.dim)).astype(np.float32)
    out = np.empty((1, args.k), np.float32), np.empty((1, args.k), np.int64)
    prepared = index.prepare_search(k=args.k, n_queries=1)
    searcher = index._searcher
    rows = {"Index.search": median_us(lambda: index.search(q, args.k), args.calls),
            "prepared search": median_us(lambda: prepared(q), args.calls),
            "prepared search, out=": median_us(lambda: prepared(q, out=out), args.calls),
            "searcher.search": median_us(lambda: searcher.search(q, args.k), args.calls),
            "empty Python call": median_us(lambda: None, args.calls)}
    for name, us in rows.items():
        print(f"{name:28s} {us:7.3f} us")
    paths = _common.write_results("host_path", {"dim": args.dim, "k": args.k, "calls": args.calls,
                                                "median_us": rows}, out_dir=args.out_dir)
    print(f"wrote {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
