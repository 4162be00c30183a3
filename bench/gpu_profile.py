#!/usr/bin/env python3
"""One single-query launch (1 query) and one tiled launch (1,000 queries) of the headline search, then the
same tiled launch twice more, the second with the first one's bounds left in place (no insertions: the
arithmetic alone), for Nsight Compute:

    ncu --clock-control none -k regex:'single_kernel|tiled_kernel' --launch-skip 4 -c 4 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats python3 bench/gpu_profile.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tinyknn  # noqa: E402

rng = np.random.default_rng(0)
db = rng.standard_normal((100_000, 128)).astype(np.float32)
with tinyknn.Index(128, "l2", "float32", device="cuda") as index:
    index.add(db)
    for nq in (1, 1, 1, 1, 1, 1000):      # warm: the first launches compile, load and fill the caches
        index.search(rng.standard_normal((nq, 128)).astype(np.float32), 10)
    searcher = index._searcher
    with searcher._lock, searcher._reading(None):
        plan = searcher._host_batch(1000, 10).plan
    for _ in range(2):     # the first sets the bounds (the verify step of the search zeroed them), the second is profiled
        plan.main.launch(plan.main_grid, plan.main_block, plan.main_shared, searcher._stream)
    searcher._stream.synchronize()
print("profiled")
