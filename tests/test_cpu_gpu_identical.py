"""The exactness contract across devices: the CPU and the GPU return bit-identical distances and ids,
both the float64 oracle's, for every metric, dtype, batch size and k (GPU machine only)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from reference import assert_exact


@pytest.fixture(scope="module")
def warm_kernels():
    from gpu_warm import warm

    warm([(m, t, d, k) for m in ("l2", "ip", "cosine") for t in ("float32", "float16") for d in (16, 32, 64)
          for k in (1, 10, 150)])


def both_devices(db, q, k, metric, dtype):
    answers = []
    for device in ("cpu", "cuda"):
        index = tinyknn.Index(db.shape[1], metric=metric, dtype=dtype, device=device)
        index.add(db)
        answers.append(index.search(q, k))
        index.close()
    return answers


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("kind", ["normal", "ties", "near-tie"])
def test_cpu_and_gpu_answers_are_bit_identical(warm_kernels, rng, metric, dtype, kind):
    if kind == "normal":
        db = rng.standard_normal((20000, 64)).astype(np.float32)
        q = rng.standard_normal((300, 64)).astype(np.float32)
    elif kind == "ties":
        db = rng.integers(-2, 3, size=(5000, 16)).astype(np.float32)
        db[2500:] = db[:2500]
        q = rng.integers(-2, 3, size=(100, 16)).astype(np.float32)
    else:                                   # FAISS's test_with_blas_reservoir shape
        db = rng.standard_normal((1000, 32)).astype(np.float32)
        q = rng.standard_normal((200, 32)).astype(np.float32)
    for n_queries in (1, 8, 9, len(q)):
        for k in (1, 10, 150):
            (cpu_d, cpu_i), (gpu_d, gpu_i) = both_devices(db, q[:n_queries], k, metric, dtype)
            assert_exact(cpu_d, cpu_i, db, q[:n_queries], k, metric, dtype)
            assert np.array_equal(cpu_i, gpu_i), (n_queries, k)
            assert np.array_equal(cpu_d.view(np.uint32), gpu_d.view(np.uint32)), (n_queries, k)
