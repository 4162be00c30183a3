#!/usr/bin/env python3
"""Small batches (9-100 queries) on the GPU, where PyTorch beat tinyknn in the search benchmark
(1M x 768 at 10 and 100 queries, k = 100 at 10-1,000 queries): end-to-end host time of the default
plan against the same search forced through the scan kernel, through tiled kernels of 16, 32 and 64
queries per block, and (k = 100) with fewer database slices; PyTorch (matmul + topk, TF32 off, host
arrays in and out) in the same run.

    TINYKNN_CACHE_DIR=/tmp/tk PYTHONPATH=$PWD python3 bench/gpu_small_batch_probe.py [--out probe.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_ladder as ladder  # noqa: E402
from tinyknn.gpu import plan as plans  # noqa: E402

CONFIGS = [  # (label, n_data, dim, k, query counts)
    ("random 1Mx768 k=10", 1_000_000, 768, 10, (10, 16, 32, 64, 100)),
    ("random 100kx128 k=10", 100_000, 128, 10, (10, 16, 32, 100)),
    ("random 60kx784 k=100", 60_000, 784, 100, (10, 100, 1000)),
    ("random 100kx128 k=100", 100_000, 128, 100, (10, 100, 1000)),
]


def probe_args(doc: str, repeats: int) -> argparse.Namespace:
    """--out (JSON rewritten after every row) and --repeats; PyTorch's TF32 off for its peer rows."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args()
    if args.out:
        ladder.OUT.append(args.out)
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    return args


def torch_ms(db_gpu, norms, q_host, k, repeats):
    import torch

    def call():
        q = torch.as_tensor(q_host).cuda()
        d = torch.addmm(norms, q, db_gpu.T, alpha=-2)
        v, i = torch.topk(d, k, largest=False)
        return v.cpu().numpy(), i.cpu().numpy()
    return ladder.host_ms(call, repeats)


def variants(k):
    """(name, patch or None, value): the default plan and the forced alternatives."""
    out = [("default", None, None),
           ("scan", ladder.setter(plans, "SCAN_MAX_QUERIES"), 10**6)]
    for bq in (16, 32, 64):
        out.append((f"tiled bq={bq}", ladder.spec_override("tiled_spec", bq=bq), {}))
    if k >= 100:
        for slices in (8, 32, 128):
            out.append((f"slices={slices}", ladder.slices_patch, slices))
    return out


def main() -> int:
    args = probe_args(__doc__, 30)
    import torch
    rng = np.random.default_rng(0)
    for label, n, dim, k, counts in CONFIGS:
        db = rng.standard_normal((n, dim), dtype=np.float32)
        queries = rng.standard_normal((max(counts), dim), dtype=np.float32)
        db_gpu = torch.as_tensor(db, device="cuda")
        norms = (db_gpu * db_gpu).sum(1)
        for nq in counts:
            ladder.record(what=label, nq=nq, k=k, plan="torch", ms=torch_ms(db_gpu, norms, queries[:nq], k, args.repeats))
        del db_gpu, norms
        torch.cuda.empty_cache()
        for name, patch, value in variants(k):
            restore = patch(value) if patch else (lambda: None)
            try:
                index = ladder.build(db)
                for nq in counts:
                    ms = ladder.end_to_end(index, queries[:nq], k, args.repeats)
                    batch = index._searcher._host_batch(nq, k)
                    ladder.record(what=label, nq=nq, k=k, plan=name, ms=ms, variant=batch.plan.variant,
                                  slices=batch.plan.slices, filtered=bool(batch.plan.main_spec_filter) if hasattr(batch.plan, "main_spec_filter") else None)
                index.close()
            except Exception as exc:  # noqa: BLE001 - a plan that cannot run is a result too
                ladder.record(what=label, k=k, plan=name, error=f"{type(exc).__name__}: {exc}"[:300])
            finally:
                restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
