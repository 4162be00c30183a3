"""The worked example of docs/groundtruth.md: a float32 ground truth checked against tinyknn's exact one.

Run from the repository root: python3 docs/groundtruth_check_example.py [WORKDIR]
It writes base.fbin, queries.fbin, f32.bin (a float32 brute force's ground truth, in big-ann's format) and
exact.bin (tinyknn's) into WORKDIR, then runs `tinyknn groundtruth check f32.bin exact.bin ...`.
"""

import os
import sys

import numpy as np

import tinyknn.io as tio
from tinyknn.groundtruth.command import main

work = sys.argv[1] if len(sys.argv) > 1 else "groundtruth-example"
os.makedirs(work, exist_ok=True)
rng = np.random.default_rng(2026)
n, d, nq, k = 3000, 24, 120, 10
x = rng.standard_normal((n, d)).astype(np.float32)
x[1500:1800] = x[:300] + (rng.standard_normal((300, d)) * 2e-6).astype(np.float32)   # near-copies
x[2900:3000] = x[300:400]                                                              # exact copies
q = (x[np.r_[0:60, 300:360]] + rng.standard_normal((nq, d)) * 0.3).astype(np.float32)
tio.write_vectors(f"{work}/base.fbin", x)
tio.write_vectors(f"{work}/queries.fbin", q)

# A float32 brute force as cuVS's CPU fallback computes it: |q|^2 + |x|^2 - 2 q.x, argpartition, argsort.
dist = (q * q).sum(1, dtype=np.float32)[:, None] + (x * x).sum(1, dtype=np.float32)[None, :] \
    - np.float32(2) * (q @ x.T)
part = np.argpartition(dist, k - 1, axis=1)[:, :k]
part_d = np.take_along_axis(dist, part, 1)
order = np.argsort(part_d, axis=1)
tio.write_knn_groundtruth(f"{work}/f32.bin", np.take_along_axis(part, order, 1),
                          np.take_along_axis(part_d, order, 1), format="bigann")

assert main([f"{work}/base.fbin", f"{work}/queries.fbin", "-k", str(k), "-o", f"{work}/exact.bin"]) == 0
sys.exit(main(["check", f"{work}/f32.bin", f"{work}/exact.bin", "--base", f"{work}/base.fbin",
               "--queries", f"{work}/queries.fbin", "--metric", "l2"]))
