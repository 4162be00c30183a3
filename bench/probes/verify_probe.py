"""Where a search's time goes after the exactness contract: selection kernel vs verify kernel, per batch
size, on 100,000 x 128 float32 l2 k = 10 (kernel times by CUDA events; end to end on the host clock).

    PYTHONPATH=$PWD python3 bench/probes/verify_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_ladder as ladder  # noqa: E402
import tinyknn  # noqa: E402
from tinyknn.jit import render  # noqa: E402


def main() -> int:
    ladder.args_warm_s[0] = 0.5
    rng = np.random.default_rng(0)
    db = rng.standard_normal((100_000, 128)).astype(np.float32)
    for metric in ("l2", "cosine"):
        index = tinyknn.Index(128, metric, "float32", device="cuda")
        index.add(db)
        for nq in (1, 10, 100, 1000):
            q = rng.standard_normal((nq, 128)).astype(np.float32)
            index.search(q, 10)
            e2e = ladder.host_ms(lambda: index.search(q, 10), 30, warm_s=0.3)
            main_ms, verify_ms, plan = ladder.kernel_times(index, nq, 10, 30)
            print(f"{metric} nq={nq}: e2e {e2e:.4f} ms, {plan.variant} {main_ms:.4f} ms (slices {plan.slices}), "
                  f"verify {verify_ms:.4f} ms (block {plan.verify_block})", flush=True)
        index.close()
    q = rng.standard_normal((1, 128)).astype(np.float32)
    for warps in (8, 16, 24):     # verify block width after the scan, one query
        render.VERIFY_WARPS = warps
        with tinyknn.Index(128, "l2", "float32", device="cuda") as index:
            index.add(db)
            index.search(q, 10)
            e2e = ladder.host_ms(lambda: index.search(q, 10), 30, warm_s=0.3)
            main_ms, verify_ms, plan = ladder.kernel_times(index, 1, 10, 30)
            print(f"verify warps {warps}: e2e {e2e:.4f} ms, scan {main_ms:.4f} ms, verify {verify_ms:.4f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
