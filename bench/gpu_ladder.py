#!/usr/bin/env python3
"""The GPU tuning ladder behind bench/NOTES_GPU.md: kernel times (CUDA events on the index's stream)
and end-to-end host times of tinyknn's GPU search, with the plan knobs swept one at a time.

    TINYKNN_CACHE_DIR=/tmp/tk PYTHONPATH=$PWD python3 bench/gpu_ladder.py [--out results.json] [--quick]

Headline data: 100,000 x 128 float32 standard normal, k = 10. Prints one line per measurement and
writes all of them as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyknn  # noqa: E402
import tinyknn.gpu.searcher  # noqa: E402,F401
from tinyknn.gpu import plan as plans  # noqa: E402
from tinyknn.gpu.device import current_device  # noqa: E402
from tinyknn.gpu.memory import Event  # noqa: E402
from tinyknn.jit import render  # noqa: E402

ROWS: list[dict] = []
OUT: list[Path] = []
args_warm_s = [0.3]
FP32_LANES_PER_SM = 128


def record(**row):
    """Print the row and rewrite the JSON file, so that a run cut short keeps what it measured."""
    ROWS.append(row)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if OUT:
        OUT[0].write_text(json.dumps(ROWS, indent=1, default=str))


def kernel_times(index, nq: int, k: int, repeats: int, zero_bounds: bool = True,
                 exact: bool = False) -> tuple[float, float, plans.SearchPlan]:
    """Median (main, merge) kernel milliseconds of the plan for (nq, k), by events on the stream.
    zero_bounds=False launches the selection kernel alone, so each launch starts from the previous
    one's final bounds (the merge would zero them): no insertions, the arithmetic alone, merge 0.
    exact: the exact l2 kernel instead of the filter key."""
    searcher = index._searcher
    with searcher._lock, searcher._reading(None):      # every row (a plan belongs to the rows it reads)
        batch = searcher._host_batch(nq, k, exact)
    plan, stream = batch.plan, searcher._stream
    events = [Event() for _ in range(3)]
    mains, merges = [], []
    warm_until = time.perf_counter() + args_warm_s[0]      # clocks ramp up under sustained load first
    while time.perf_counter() < warm_until:
        plan.launch(stream)
        stream.synchronize()
    for i in range(repeats + 2):
        if zero_bounds:    # as a search does: slices start unpruned
            plan.bounds.fill_bytes(0, plan.n_queries * 4, stream)
        events[0].record(stream)
        plan.main.launch(plan.main_grid, plan.main_block, plan.main_shared, stream)
        events[1].record(stream)
        if zero_bounds and plan.verify is not None:     # (the single-query kernel verifies in its last block)
            plan.verify.launch(plan.n_queries, plan.verify_block, plan.verify_shared, stream)
        events[2].record(stream)
        events[2].synchronize()
        if i >= 2:
            mains.append(events[0].elapsed_ms(events[1]))
            merges.append(events[1].elapsed_ms(events[2]))
    for e in events:
        e.close()
    return statistics.median(mains), statistics.median(merges), plan


def host_ms(call, repeats: int, warm_s: float | None = None) -> float:
    """Median milliseconds of `call()` on the host clock, after warm_s (default args_warm_s) of
    warm-up calls."""
    warm_until = time.perf_counter() + (args_warm_s[0] if warm_s is None else warm_s)
    while time.perf_counter() < warm_until:
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def end_to_end(index, q, k, repeats: int) -> float:
    return host_ms(lambda: index.search(q, k), repeats)


def build(db, metric="l2", dtype="float32"):
    index = tinyknn.Index(db.shape[1], metric, dtype, device="cuda")
    index.add(db)
    return index


def headline(db, queries, args, info):
    peak_bw = info.peak_memory_bandwidth_gbs * 1e9
    n, dim = db.shape
    for graphs in (True, False):
        plans_before = tinyknn.gpu.searcher.GpuSearcher.use_graphs
        tinyknn.gpu.searcher.GpuSearcher.use_graphs = graphs
        index = build(db)
        for nq, repeats in ((1, args.repeats_one), (1000, args.repeats_many)):
            ms = end_to_end(index, queries[:nq], 10, repeats)
            record(what="e2e", metric="l2", dtype="float32", nq=nq, k=10, graphs=graphs, ms=ms)
        index.close()
        tinyknn.gpu.searcher.GpuSearcher.use_graphs = plans_before
    index = build(db)
    for nq in (1, 1000):
        main, merge, plan = kernel_times(index, nq, 10, args.repeats_kernel)
        row = dict(what="kernels", metric="l2", dtype="float32", nq=nq, k=10, variant=plan.variant,
                   slices=plan.slices, main_ms=main, merge_ms=merge)
        if nq == 1:
            row["bandwidth_fraction"] = n * dim * 4 / (main * 1e-3) / peak_bw
        else:
            lanes = info.sm_count * FP32_LANES_PER_SM * args.clock_ghz * 1e9
            row["fp32_issue_fraction_l2"] = nq * n * dim * 2 / (main * 1e-3) / lanes    # sub + fma per element
            row["tflops_as_fma"] = 2 * nq * n * dim / (main * 1e-3) / 1e12
        record(**row)
    index.close()


def sweep(db, queries, args, name, values, patch, nq, k=10, metric="l2", dtype="float32"):
    for value in values:
        restore = patch(value)
        try:
            index = build(db, metric, dtype)
            main, merge, plan = kernel_times(index, nq, k, args.repeats_kernel)
            record(what=name, value=str(value), metric=metric, dtype=dtype, nq=nq, k=k, variant=plan.variant,
                   slices=plan.slices, main_ms=main, merge_ms=merge, total_ms=main + merge)
            index.close()
        except Exception as exc:  # noqa: BLE001 - a failing knob value is a result too
            record(what=name, value=str(value), nq=nq, k=k, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            restore()


def setter(module, attribute):
    def patch(value):
        old = getattr(module, attribute)
        setattr(module, attribute, value)
        return lambda: setattr(module, attribute, old)
    return patch


def spec_override(function_name, **fixed):
    def patch(value):
        original = getattr(render, function_name)
        setattr(render, function_name, functools.partial(original, **dict(fixed, **value)))
        return lambda: setattr(render, function_name, original)
    return patch


def slices_patch(value):
    old = tinyknn.gpu.searcher.GpuSearcher.slices_override
    tinyknn.gpu.searcher.GpuSearcher.slices_override = value
    return lambda: setattr(tinyknn.gpu.searcher.GpuSearcher, "slices_override", old)


def torch_peer(db, queries, args):
    try:
        import torch
    except ImportError:
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.as_tensor(db, device="cuda")
    norms = (x * x).sum(1)
    for nq, repeats in ((1, args.repeats_one), (1000, args.repeats_many)):
        q_host = queries[:nq]

        def call():
            q = torch.as_tensor(q_host).cuda()
            d = torch.addmm(norms, q, x.T, alpha=-2)
            v, i = torch.topk(d, 10, largest=False)
            return v.cpu().numpy(), i.cpu().numpy()
        record(what="peer_torch_e2e", nq=nq, k=10, ms=host_ms(call, repeats))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_ladder.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clock-ghz", type=float, default=1.98)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--warm-s", type=float, default=0.3)
    args = parser.parse_args()
    args.repeats_one, args.repeats_many, args.repeats_kernel = (200, 30, 20) if not args.quick else (30, 5, 5)
    OUT.append(Path(args.out))
    args_warm_s[0] = args.warm_s
    info = current_device()
    record(what="device", name=info.name, sm_count=info.sm_count, peak_bw_gbs=info.peak_memory_bandwidth_gbs)
    rng = np.random.default_rng(0)
    db = rng.standard_normal((args.n, 128)).astype(np.float32)
    queries = rng.standard_normal((1000, 128)).astype(np.float32)
    start = time.time()
    headline(db, queries, args, info)
    torch_peer(db, queries, args)
    force_scan, force_tiled = setter(plans, "SCAN_MAX_QUERIES"), setter(plans, "SCAN_MAX_QUERIES")
    for nq in (1, 8, 32, 64, 128, 256):
        sweep(db, queries[:nq], args, "variant_scan", [10**9], force_scan, nq)
        if nq > 1:
            sweep(db, queries[:nq], args, "variant_tiled", [0], force_tiled, nq)
    sweep(db, queries, args, "scan_slices", [132, 264, 528, 1056, None], slices_patch, 1)
    sweep(db, queries, args, "scan_lanes_warps", [dict(lanes=g, warps=w) for g in (2, 4) for w in (4, 8)] + [dict(qb=1)],
          spec_override("scan_spec"), 1)
    sweep(db, queries, args, "tiled_waves", [1, 2, 4], setter(plans, "TILED_WAVES"), 1000)
    sweep(db, queries, args, "tiled_shape", [dict(bq=32, bn=128), dict(bq=64, bn=128), dict(bq=16, bn=128),
                                             dict(bq=32, bn=256), dict(bq=32, bn=128, reglists=True)],
          spec_override("tiled_spec"), 1000)
    for metric, dtype in (("ip", "float32"), ("cosine", "float32"), ("l2", "float16")):
        for nq in (1, 1000):
            sweep(db, queries[:nq], args, "config", [None], lambda v: (lambda: None), nq, 10, metric, dtype)
    for k, nq in ((100, 1), (100, 1000), (1000, 1), (1000, 100), (2048, 1), (2048, 100)):
        sweep(db, queries[:nq], args, "large_k", [None], lambda v: (lambda: None), nq, k)
    headline(db, queries, args, info)          # again at the end: clocks settled, same process
    record(what="elapsed_s", s=time.time() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
