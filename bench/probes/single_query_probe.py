"""One query on the GPU: single_kernel (selection and verify in one launch) against the scan kernel +
verify_kernel pair it replaced, end to end (host NumPy in and out, host clock) and kernel time (CUDA
events), plus the single kernel's knobs (warps, rows per slice, lanes per row), on the issue-16 shapes.

    PYTHONPATH=$PWD python3 bench/probes/single_query_probe.py --out single.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import gpu_ladder as ladder  # noqa: E402
import tinyknn  # noqa: E402
from tinyknn.gpu import plan as plans  # noqa: E402


def measure(index, q, k, label, rows, repeats=200):
    index.search(q, k)
    e2e = ladder.host_ms(lambda: index.search(q, k), repeats, warm_s=0.3)
    main_ms, verify_ms, plan = ladder.kernel_times(index, len(q), k, 50)
    row = dict(what=label, n=index.ntotal, dim=index.dim, dtype=index.dtype, metric=index.metric, nq=len(q), k=k,
               e2e_ms=e2e, main_ms=main_ms, verify_ms=verify_ms, variant=plan.variant, slices=plan.slices,
               rows_per_slice=plan.rows_per_slice)
    rows.append(row)
    print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="single_query_probe.json")
    parser.add_argument("--big", action="store_true", help="also 1M x 768 float32 and float16")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    db = rng.standard_normal((100_000, 128)).astype(np.float32)
    q1 = rng.standard_normal((1, 128)).astype(np.float32)
    for metric in ("l2", "cosine"):
        with tinyknn.Index(128, metric, "float32", device="cuda") as index:
            index.add(db)
            for use_single in (True, False, True, False):
                plans.USE_SINGLE = use_single
                index._searcher._forget_plans()
                measure(index, q1, 10, "single" if use_single else "scan+verify", rows)
            if metric == "l2":
                for k in (32, 100):
                    for use_single in (True, False):
                        plans.USE_SINGLE = use_single
                        index._searcher._forget_plans()
                        measure(index, q1, k, f"{'single' if use_single else 'scan+verify'} k={k}", rows)
            plans.USE_SINGLE = True
            if metric == "l2":
                measure(index, rng.standard_normal((10, 128)).astype(np.float32), 10, "10 queries", rows, 100)
    from tinyknn.jit import render

    original = render.single_spec
    for knobs in ({"unroll": 1}, {"warps": 32}, {"warps": 8}, {"lanes": 8}, {"rmax": 1024}, {"cmax": 64}):
        render.single_spec = lambda *a, _k=knobs, **kw: original(*a, **dict(kw, **_k))
        try:
            with tinyknn.Index(128, "l2", "float32", device="cuda") as index:
                index.add(db)
                measure(index, q1, 10, f"single {knobs}", rows, 100)
        except Exception as exc:  # noqa: BLE001 - a knob that does not compile is a result too
            rows.append(dict(what=f"single {knobs}", error=str(exc)[:300]))
        finally:
            render.single_spec = original
    if args.big:
        big = rng.standard_normal((1_000_000, 768)).astype(np.float32)
        q768 = rng.standard_normal((1, 768)).astype(np.float32)
        for dtype in ("float32", "float16"):
            with tinyknn.Index(768, "l2", dtype, device="cuda") as index:
                index.add(big)
                for use_single in (True, False):
                    plans.USE_SINGLE = use_single
                    index._searcher._forget_plans()
                    measure(index, q768, 10, "single" if use_single else "scan+verify", rows, 50)
        plans.USE_SINGLE = True
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
