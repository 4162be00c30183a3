#!/usr/bin/env python3
"""The batch screen on an H200, mma.sync against the Hopper screen (wgmma + TMA), end to end and by step.

For each workload (database, dtype, queries, k): Index.search with host NumPy in and out, median of --reps
calls after warm-up, once with TINYKNN_SCREEN=mma and once with wgmma (the switch tinyknn reads; a new
Screen per switch, whose row terms are computed in the warm-up); the ids of the first --check queries
compared exactly with the float64 oracle (bench/oracle.py); queries the screen handed back counted; then
the screen's four steps timed by CUDA events (queries rounded, threshold over the sample, the screen over
every row, the float64 verify of survivors). Stops starting workloads after --budget-s. Writes
hopper_screen_check.json to --out and prints a table. Fails (exit 1) on any id that differs.

    PYTHONPATH=$PWD TINYKNN_CACHE_DIR=/tmp/tkcache python3 bench/hopper_screen_check.py --out DIR
    python3 bench/hopper_screen_check.py --compile-only       # no GPU: the kernels it launches, for sm_90
    compute-sanitizer --tool memcheck python3 bench/hopper_screen_check.py --sanitize   # (and racecheck)
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
import datasets  # noqa: E402
import oracle  # noqa: E402

METRIC = "l2"
WORKLOADS = [  # name, rows, dim, dtype, data, queries, ks (in this order: consecutive ones share their data)
    ("1M x 768 float16, 1,000 q", 1_000_000, 768, "float16", "random", 1000, (10, 100)),
    ("1M x 768 float32, 1,000 q", 1_000_000, 768, "float32", "random", 1000, (10,)),
    ("1M x 768 float32, 100 q", 1_000_000, 768, "float32", "random", 100, (10, 100)),
    ("10M x 128 float16, 2,048 q", 10_000_000, 128, "float16", "random", 2048, (10,)),
    ("10M x 128 uint8, 2,048 q", 10_000_000, 128, "uint8", "sift-like", 2048, (10, 100)),
    ("100k x 128 float32, 1,000 q", 100_000, 128, "float32", "random", 1000, (10,)),
]
SCREENS = ("mma", "wgmma")


def make_data(kind: str, n: int, dim: int, n_queries: int):
    if kind == "sift-like":
        return datasets.sift_like(n, n_queries, dim, seed=1)
    return datasets.random_data(n, n_queries, dim, seed=1)


def use_screen(index, kind: str) -> None:
    """Switch the index's screen kernel: the setting, then a new Screen (row terms again on its first use)."""
    from tinyknn.config import reset_config
    from tinyknn.gpu.screen import Screen

    os.environ["TINYKNN_SCREEN"] = kind
    reset_config()
    searcher = index._searcher
    searcher._screen = Screen(searcher)


def kernels_for(arch: str) -> list:
    from tinyknn.jit import render_screen, search_kernels

    specs = []
    for _, _, dim, dtype, _, _, ks in WORKLOADS:
        for k in ks:
            specs += search_kernels.specs_for_search(METRIC, dtype, dim, k, arch)
            specs += render_screen.specs_for_screen(METRIC, dtype, k, arch)
        specs += search_kernels.hopper_specs(METRIC, dtype, dim, arch)
    return list(dict.fromkeys(specs))


def warm(arch: str) -> dict:
    from tinyknn.config import get_config
    from tinyknn.jit.cache import CubinCache
    from tinyknn.jit.warm import warm_specs

    start = time.perf_counter()
    specs = kernels_for(arch)
    outcomes = warm_specs(CubinCache(get_config().cache_dir / "cubins"), specs, jobs=os.cpu_count() or 2)
    failed = [f"{o.spec}: {o.error}" for o in outcomes if o.status == "failed"]
    if failed:
        raise SystemExit("kernels failed to compile:\n" + "\n".join(failed))
    counts = {status: sum(o.status == status for o in outcomes) for status in ("compiled", "cached")}
    return {"kernels": len(specs), **counts, "seconds": round(time.perf_counter() - start, 1)}


def median_ms(samples) -> float:
    return float(np.median(samples)) * 1e3


def run_workload(workload, data, reps: int, check: int, hopper: bool) -> list[dict]:
    import tinyknn

    name, n, dim, dtype, _, n_queries, ks = workload
    db, queries = data
    queries = np.ascontiguousarray(queries[:n_queries], dtype=np.float32)
    start = time.perf_counter()
    index = tinyknn.Index(dim, METRIC, dtype, device="cuda")
    index.add(db if dtype in ("int8", "uint8") else db.astype(np.float32, copy=False))
    added = time.perf_counter() - start
    best = oracle.exact_neighbours(db, dtype, queries[:check], max(ks), METRIC).ids   # k = 10: the first 10 of 100
    rows = []
    for kind in SCREENS if hopper else ("mma",):
        use_screen(index, kind)
        screen = index._searcher._screen
        for k in ks:
            index.search(queries, k)                          # row terms, kernels loaded
            distances, ids = index.search(queries, k)
            agree = bool(np.array_equal(ids[:check], best[:, :k]))
            before = (screen.queries, screen.fallbacks)
            samples = _common.time_calls(lambda: index.search(queries, k), repeats=reps, warmup=2)
            screened = screen.queries - before[0]
            screen.timings = {}
            for _ in range(5):
                index.search(queries, k)
            steps = {step: round(float(np.median(ms)), 3) for step, ms in screen.timings.items()}
            screen.timings = None
            row = {"workload": name, "rows": n, "dim": dim, "dtype": dtype, "queries": n_queries, "k": k,
                   "screen": kind, "hopper_used": screen.hopper, "median_ms": round(median_ms(samples), 3),
                   "min_ms": round(min(samples) * 1e3, 3), "reps": reps, "screened_queries": screened,
                   "handed_back": screen.fallbacks - before[1], "steps_ms": steps,
                   "ids_exact_first": check, "ids_exact": agree, "add_s": round(added, 2)}
            rows.append(row)
            print(f"{name:30s} k={k:<4d} {kind:6s} {row['median_ms']:9.3f} ms  steps {steps}  exact={agree}  "
                  f"handed back {row['handed_back']}/{screened}", flush=True)
    index.close()
    return rows


def sanitize() -> None:
    """A small case of each Hopper screen element (float16, uint8 exact and rounded up), checked exactly."""
    import tinyknn
    from reference import assert_exact

    rng = np.random.default_rng(3)
    for dtype, dim in (("float16", 300), ("uint8", 72), ("uint8", 300), ("int8", 40)):
        if dtype == "float16":
            db = rng.standard_normal((20000, dim)).astype(np.float16)
            q = db[:100].astype(np.float32) + rng.standard_normal((100, dim)).astype(np.float32) * 0.1
        else:
            db = rng.integers(0, 256 if dtype == "uint8" else 128, (20000, dim)).astype(dtype)
            q = db[:100].astype(np.float32)
        index = tinyknn.Index(dim, METRIC, dtype, device="cuda")
        index.add(db)
        assert index._searcher._screen.hopper, "the Hopper screen is not in use (TINYKNN_SCREEN, device)"
        d, i = index.search(q, 10)
        assert_exact(d, i, db, q, 10, METRIC, dtype)
        assert index._searcher._screen.queries == 100
        print(f"sanitize {dtype} dim {dim}: exact", flush=True)
        index.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for hopper_screen_check.json")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--check", type=int, default=32, help="queries whose ids are compared with float64")
    parser.add_argument("--budget-s", type=float, default=260.0, help="start no workload after this many seconds")
    parser.add_argument("--only", default="", help="workloads whose name contains this")
    parser.add_argument("--compile-only", action="store_true", help="only compile its kernels for sm_90 (and sm_90a)")
    parser.add_argument("--sanitize", action="store_true", help="small exact cases of the Hopper screen only")
    args = parser.parse_args()
    start = time.perf_counter()
    from tinyknn.jit.compiler import nvrtc_version

    if args.compile_only:
        print(json.dumps(warm("sm_90")))
        return 0
    if args.sanitize:
        sanitize()
        return 0
    from tinyknn.gpu.device import current_device

    arch = current_device().arch
    hopper = arch in ("sm_90", "sm_90a")
    compiled = warm(arch)            # on sm_90 the Hopper screen's sm_90a kernels too
    print(f"device {current_device().name} ({arch}), NVRTC {nvrtc_version()}, kernels {compiled}", flush=True)
    results, skipped, data, data_key = [], [], None, None
    for workload in WORKLOADS:
        if args.only not in workload[0]:
            continue
        if time.perf_counter() - start > args.budget_s:
            skipped.append(workload[0])
            continue
        key = (workload[4], workload[1], workload[2])
        if key != data_key:
            data = None                                   # free the last workload's data first
            data, data_key = make_data(workload[4], workload[1], workload[2], 2048), key
        results += run_workload(workload, data, args.reps, args.check, hopper)
    env = _common.environment()
    payload = {"environment": env, "nvrtc": nvrtc_version(), "kernels": compiled, "results": results,
               "skipped_for_budget": skipped, "seconds": round(time.perf_counter() - start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hopper_screen_check.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\n{'workload':30s} {'k':>4s} " + " ".join(f"{s:>10s}" for s in SCREENS))
    for name, _, _, _, _, _, ks in WORKLOADS:
        for k in ks:
            cells = {r["screen"]: r for r in results if r["workload"] == name and r["k"] == k}
            if cells:
                print(f"{name:30s} {k:4d} " + " ".join(f"{cells[s]['median_ms']:10.3f}" if s in cells else f"{'-':>10s}"
                                                   for s in SCREENS))
    wrong = [f"{r['workload']} k={r['k']} {r['screen']}" for r in results if not r["ids_exact"]]
    unused = [f"{r['workload']} {r['screen']}" for r in results if r["hopper_used"] != (r["screen"] == "wgmma")]
    if wrong or unused or skipped:
        print(f"FAILED: ids differ from float64: {wrong}; screen not as asked: {unused}; skipped: {skipped}")
        return 1
    print(f"all ids exact; {payload['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
