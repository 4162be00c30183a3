#!/usr/bin/env python3
"""One query on the GPU is a scan of the whole database, bound by memory bandwidth: how close the scan
kernel gets to the H200's 4.8 TB/s for its queries-per-block, warps and lanes-per-row settings, on
100,000 x 128 and 1M x 768 (float32, l2, k = 10). Kernel milliseconds by CUDA events on the index's
stream, end to end on the host clock, PyTorch (matmul + topk, TF32 off) in the same run.

    TINYKNN_CACHE_DIR=/tmp/tk PYTHONPATH=$PWD python3 bench/gpu_scan_probe.py [--out probe.json]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_ladder as ladder  # noqa: E402
from gpu_small_batch_probe import probe_args, torch_ms  # noqa: E402
from tinyknn.jit import render  # noqa: E402

CONFIGS = [(100_000, 128, (None, 1, 2, 4)), (1_000_000, 768, (None, 1, 2))]   # n, dim, query blocks
SHAPES = [dict(), dict(warps=4), dict(warps=16)]


def main() -> int:
    args = probe_args(__doc__, 50)
    import torch
    rng = np.random.default_rng(0)
    for n, dim, blocks in CONFIGS:
        db = rng.standard_normal((n, dim), dtype=np.float32)
        q = rng.standard_normal((1, dim), dtype=np.float32)
        db_gpu = torch.as_tensor(db, device="cuda")
        ladder.record(what=f"{n}x{dim}", plan="torch", e2e_ms=torch_ms(db_gpu, (db_gpu * db_gpu).sum(1), q, 10, args.repeats))
        del db_gpu
        torch.cuda.empty_cache()
        for qb in blocks:
            for shape in SHAPES:
                fixed = dict(shape, **({} if qb is None else {"qb": qb}))
                restore = ladder.spec_override("scan_spec", **fixed)({})
                try:
                    index = ladder.build(db)
                    e2e = ladder.end_to_end(index, q, 10, args.repeats)
                    main_ms, merge_ms, plan = ladder.kernel_times(index, 1, 10, args.repeats)
                    params = dict(index._searcher._main_spec(1, 10, False).params)     # what the search ran
                    ladder.record(what=f"{n}x{dim}", plan=str(fixed or "default"), params=str(params), slices=plan.slices,
                                  e2e_ms=e2e, main_ms=main_ms, merge_ms=merge_ms,
                                  tb_per_s=n * dim * 4 / (main_ms * 1e-3) / 1e12)
                    index.close()
                except Exception as exc:  # noqa: BLE001 - a setting that cannot run is a result too
                    ladder.record(what=f"{n}x{dim}", plan=str(fixed), error=f"{type(exc).__name__}: {exc}"[:300])
                finally:
                    restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
