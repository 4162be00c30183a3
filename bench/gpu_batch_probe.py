#!/usr/bin/env python3
"""Where a large batch's time goes: the tiled kernel with real (zeroed) cross-slice bounds against the
same launch with the final bounds of the previous launch left in place (no insertions: the arithmetic
alone), per metric and dtype, plus end to end. 100,000 x 128 standard normal, 1,000 queries, k = 10.

    TINYKNN_CACHE_DIR=/tmp/tk PYTHONPATH=$PWD python3 bench/gpu_batch_probe.py [--out probe.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_ladder as ladder  # noqa: E402
from tinyknn.gpu import plan as plans  # noqa: E402
from tinyknn.gpu.memory import Event  # noqa: E402


def kernel_ms(index, nq: int, k: int, zero_bounds: bool, exact: bool = False):
    """(selection kernel, merge or rescore) milliseconds on the queries the last search left."""
    return ladder.kernel_times(index, nq, k, 20, zero_bounds, exact)[:2]


def probe(db, queries, label, metric="l2", dtype="float32", nq=1000, k=10, patch=None, value=None):
    restore = patch(value) if patch else (lambda: None)
    try:
        index = ladder.build(db, metric, dtype)
        e2e = ladder.end_to_end(index, queries[:nq], k, 30)      # also leaves the queries on the device
        real, merge = kernel_ms(index, nq, k, True)
        pruned = kernel_ms(index, nq, k, False)[0]
        plan = index._searcher._host_batch(nq, k).plan
        row = dict(what=label, value=str(value), metric=metric, dtype=dtype, nq=nq, k=k, variant=plan.variant,
                   filtered=plan.rescores, slices=plan.slices, main_real_ms=real, main_pruned_ms=pruned, merge_ms=merge, e2e_ms=e2e,
                   exact_reruns=index._searcher.exact_reruns)
        if plan.rescores:      # the exact kernel the filter replaces, on the same queries
            index._searcher._search_host_batch(queries[:nq], k, exact=True)
            row.update(exact_main_real_ms=kernel_ms(index, nq, k, True, exact=True)[0])
        ladder.record(**row)
        index.close()
    except Exception as exc:  # noqa: BLE001
        ladder.record(what=label, value=str(value), error=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        restore()


def breakdown(db, queries, k=10, repeats=50):
    """Each piece of a 1,000-query search alone: host copies (host clock) and device stages (events)."""
    index = ladder.build(db)
    searcher, nq = index._searcher, len(queries)
    for _ in range(3):                 # the second use captures the graph
        index.search(queries, k)
    batch = searcher._host_batch(nq, k)
    stream = searcher._stream
    distances, ids = np.empty((nq, k), np.float32), np.empty((nq, k), np.int64)

    def host_ms(function):                 # no warm-up: the searches above warmed everything
        return ladder.host_ms(function, repeats, warm_s=0.0)

    def device_ms(function):
        start, stop = Event(), Event()
        times = []
        for _ in range(repeats):
            start.record(stream)
            function()
            stop.record(stream)
            stop.synchronize()
            times.append(start.elapsed_ms(stop))
        return statistics.median(times)

    row = dict(what="breakdown", nq=nq, k=k)
    row["copy_in_ms"] = host_ms(lambda: np.copyto(batch.stage, queries))
    row["results_out_ms"] = host_ms(lambda: (distances.__setitem__(Ellipsis, batch.distances),
                                             ids.__setitem__(Ellipsis, batch.ids)))
    row["h2d_ms"] = device_ms(lambda: batch.queries.copy_from_host(batch.stage_buffer, batch.query_bytes, stream))
    row["d2h_ms"] = device_ms(lambda: batch.results.copy_to_host(batch.results_stage, batch.result_bytes, stream))
    row["kernels_ms"] = device_ms(lambda: batch.plan.launch(stream))
    row["graph_device_ms"] = device_ms(lambda: batch.graph.launch(stream))
    row["graph_host_ms"] = host_ms(lambda: (batch.graph.launch(stream), stream.synchronize()))
    row["search_ms"] = host_ms(lambda: index.search(queries, k))
    ladder.record(**row)
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        index.search(queries, k)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    index.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_batch_probe.json")
    args = parser.parse_args()
    ladder.OUT.append(Path(args.out))
    rng = np.random.default_rng(0)
    db = rng.standard_normal((100_000, 128)).astype(np.float32)
    queries = rng.standard_normal((1000, 128)).astype(np.float32)
    breakdown(db, queries)
    for metric, dtype in (("l2", "float32"), ("ip", "float32"), ("l2", "float16")):
        probe(db, queries, "config", metric, dtype)
    for k in (1, 100):
        probe(db, queries, "k", k=k)
    q = rng.standard_normal((10000, 128)).astype(np.float32)
    probe(db, q, "nq", nq=10000)
    waves, shape = ladder.setter(plans, "TILED_WAVES"), ladder.spec_override("tiled_spec")
    probe(db, queries, "shape", patch=shape, value=dict(depth=32))
    probe(db, queries, "shape", patch=shape, value=dict(depth=8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
