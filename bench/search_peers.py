"""The searchers bench/search.py times: tinyknn on each device and its peers, behind one small interface.

Each peer builds from a float32 database and a configuration (dim, dtype, metric, k) and then answers
host NumPy queries with NumPy (distances, ids), as a user would call it. GPU peers also answer
device-resident queries, with a CUDA-event clock of their framework. Every peer keeps what it can
precompute at build time (norms for l2), as tinyknn does.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from dataclasses import dataclass
from typing import Callable

import numpy as np

GPU_BLOCK = 1 << 28   # elements of one query block's distance matrix on the GPU (1 GiB of float32)
CPU_BLOCK = 1 << 24   # ... on the CPU (64 MiB)


class Unsupported(Exception):
    """This peer cannot run this configuration; the message says why."""


@dataclass
class Built:
    search: Callable                   # host float32 (nq, dim) -> NumPy (distances, ids)
    close: Callable[[], None]
    resident: Callable | None = None   # device queries -> device (distances, ids)
    to_device: Callable | None = None  # host queries -> what `resident` takes
    clock: Callable | None = None      # clock(call) -> seconds, by CUDA events on the current stream


@dataclass(frozen=True)
class Peer:
    device: str                        # "cpu" or "cuda"
    module: str                        # the import that must work
    method: str                        # what it computes, for the results file
    build: Callable                    # (db float32, config) -> Built
    gpu_probe: Callable | None = None  # () -> None when its GPU is usable, else why not

    def probe(self) -> str | None:
        """None when the peer can run here, else why not (printed, never raised)."""
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # noqa: BLE001 - a missing or broken package is a note
            return f"cannot import {self.module} ({type(exc).__name__}: {exc})"
        try:
            return self.gpu_probe() if self.gpu_probe else None
        except Exception as exc:  # noqa: BLE001
            return f"no usable GPU ({type(exc).__name__}: {exc})"

    def describe(self) -> dict:
        return {"device": self.device, "module": self.module, "method": self.method, "version": _version(self.module)}


def _version(module: str) -> str | None:
    try:
        return str(getattr(importlib.import_module(module), "__version__", None))
    except Exception:  # noqa: BLE001
        return None


def settings() -> dict:
    """What changes the numbers: the checkout measured, thread counts, CuPy's TF32 switch (off unless CUPY_TF32=1)."""
    found = {"cupy_tf32": os.environ.get("CUPY_TF32", "unset (off)"),
             "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset")}
    try:
        from tinyknn.config import get_config

        found["tinyknn_cpu_threads"] = get_config().cpu_threads
    except Exception as exc:  # noqa: BLE001
        found["tinyknn_cpu_threads"] = f"unknown ({exc})"
    try:
        git = ["git", "-C", os.path.dirname(os.path.abspath(__file__))]
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout
        found["checkout"] = commit.strip() + (" with uncommitted changes" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        found["checkout"] = "unknown (no git)"
    try:
        import faiss

        found["faiss_omp_threads"] = faiss.omp_get_max_threads()
    except ImportError:
        pass
    return found


def to_numpy(x) -> np.ndarray:
    """A NumPy copy of a NumPy, CuPy or torch array."""
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def block_rows(n_data: int, elements: int) -> int:
    """Queries per block so that one block's (queries, n_data) distance matrix has about `elements`."""
    return max(1, elements // max(1, n_data))


def matmul_topk(xp, q, base, norms, k: int, metric: str, rows: int):
    """k best rows of `base` per query with NumPy or CuPy (`xp`): a matmul per block of queries, then an
    argpartition of the keys and a sort of the k kept. l2 uses |x|^2 - 2 q.x (norms precomputed) and
    adds |q|^2 to the k results; ip keeps the largest inner products."""
    out_d = xp.empty((len(q), k), dtype=xp.float32)
    out_i = xp.empty((len(q), k), dtype=xp.int64)
    for start in range(0, len(q), rows):
        qb = q[start:start + rows]
        scores = qb.astype(base.dtype, copy=False) @ base.T
        key = norms - 2 * scores if metric == "l2" else -scores
        part = xp.argpartition(key, k - 1, axis=1)[:, :k]
        best = xp.take_along_axis(key, part, axis=1)
        order = xp.argsort(best, axis=1)
        best = xp.take_along_axis(best, order, axis=1).astype(xp.float32)
        out_i[start:start + len(qb)] = xp.take_along_axis(part, order, axis=1)
        out_d[start:start + len(qb)] = best + (qb * qb).sum(axis=1, keepdims=True) if metric == "l2" else -best
    return out_d, out_i


# -- CPU ------------------------------------------------------------------------------------------
def _build_numpy(db, config):
    stored = db.astype(config.dtype)
    norms = np.einsum("ij,ij->i", stored, stored, dtype=np.float32)
    rows = block_rows(len(db), CPU_BLOCK)

    def search(q):  # NumPy has no fast float16 matmul: a float16 database is widened per call
        base = stored if stored.dtype == np.float32 else stored.astype(np.float32)
        return matmul_topk(np, q, base, norms, config.k, config.metric, rows)

    return Built(search, lambda: None)


def _build_faiss(db, config):
    import faiss

    metric = faiss.METRIC_L2 if config.metric == "l2" else faiss.METRIC_INNER_PRODUCT
    if config.dtype == "float32":
        index = faiss.IndexFlat(config.dim, metric)
    else:  # a flat scan over float16 storage, decoded to float32
        index = faiss.IndexScalarQuantizer(config.dim, faiss.ScalarQuantizer.QT_fp16, metric)
    index.add(db)
    return Built(lambda q: index.search(q, config.k), index.reset)


def _build_hnswlib(db, config):
    import hnswlib

    if config.dtype != "float32":
        raise Unsupported("hnswlib stores float32 only")
    index = hnswlib.BFIndex(space=config.metric, dim=config.dim)
    index.init_index(max_elements=len(db))
    index.add_items(db, np.arange(len(db)))

    def search(q):
        labels, dist = index.knn_query(q, k=config.k, num_threads=-1)
        dist = dist if config.metric == "l2" else 1 - dist  # hnswlib's 'ip' distance is 1 - q.x
        return dist.astype(np.float32, copy=False), labels.astype(np.int64)

    return Built(search, lambda: None)


def _build_tinyknn(device):
    def build(db, config):
        import tinyknn

        index = tinyknn.Index(config.dim, metric=config.metric, dtype=config.dtype, device=device)
        index.add(db)
        search = lambda q: index.search(q, config.k)  # noqa: E731
        if device == "cpu":
            return Built(search, index.close)
        return Built(search, index.close, resident=search, to_device=_cupy_array, clock=_cupy_clock)

    return build


# -- GPU ------------------------------------------------------------------------------------------
def _cupy_gpu() -> str | None:
    import cupy

    return None if cupy.cuda.runtime.getDeviceCount() > 0 else "CuPy sees no CUDA device"


def _cupy_array(host):
    import cupy

    return cupy.asarray(host)


def _cupy_clock(call) -> float:
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    call()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3


def _build_cupy(db, config):
    import cupy

    base = cupy.asarray(db.astype(config.dtype))
    norms = (base.astype(cupy.float32) ** 2).sum(axis=1)
    rows = block_rows(len(db), GPU_BLOCK)

    def resident(q):  # CuPy's float16 matmul returns float16: its recall shows what that costs
        return matmul_topk(cupy, q, base, norms, config.k, config.metric, rows)

    def search(q):
        dist, ids = resident(cupy.asarray(q))
        return cupy.asnumpy(dist), cupy.asnumpy(ids)

    def close():
        nonlocal base, norms
        base = norms = None
        cupy.get_default_memory_pool().free_all_blocks()

    return Built(search, close, resident=resident, to_device=_cupy_array, clock=_cupy_clock)


def _torch_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "torch.cuda.is_available() is False"


def _torch_clock(call) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _torch_half_mm(torch, device):
    """mm of float16 matrices with float32 accumulation and output (out_dtype, PyTorch >= 2.8 on CUDA),
    else float16 output widened afterwards; returns (function, what it does)."""
    probe = torch.ones((2, 8), dtype=torch.float16, device=device)
    try:
        torch.mm(probe, probe.T, out_dtype=torch.float32)
        return (lambda a, b: torch.mm(a, b, out_dtype=torch.float32)), "float16 in, float32 accumulate and out"
    except (TypeError, RuntimeError):
        return (lambda a, b: torch.mm(a, b).float()), "float16 in and out (no out_dtype here), widened"


def _build_torch(db, config, device="cuda"):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = {"float32": torch.float32, "float16": torch.float16}[config.dtype]
    base = torch.from_numpy(db).to(device).to(dtype)
    norms = base.float().pow(2).sum(dim=1)
    rows = block_rows(len(db), GPU_BLOCK)
    half_mm = _torch_half_mm(torch, device)[0] if dtype == torch.float16 else None
    larger = config.metric == "ip"

    @torch.inference_mode()
    def resident(q):
        out_d = torch.empty((len(q), config.k), dtype=torch.float32, device=q.device)
        out_i = torch.empty((len(q), config.k), dtype=torch.int64, device=q.device)
        for start in range(0, len(q), rows):
            qb = q[start:start + rows]
            if half_mm is None and not larger:   # l2 by the expansion, fused: |x|^2 - 2 q.x
                key = torch.addmm(norms, qb, base.T, alpha=-2)
            else:
                key = torch.mm(qb, base.T) if half_mm is None else half_mm(qb.to(dtype), base.T)
                key = key if larger else key.mul_(-2).add_(norms)
            best, ids = torch.topk(key, config.k, dim=1, largest=larger, sorted=True)
            out_d[start:start + len(qb)] = best if larger else best + (qb * qb).sum(dim=1, keepdim=True)
            out_i[start:start + len(qb)] = ids
        return out_d, out_i

    def search(q):
        dist, ids = resident(torch.from_numpy(q).to(device))
        return dist.cpu().numpy(), ids.cpu().numpy()

    def close():
        nonlocal base, norms
        base = norms = None
        if device == "cuda":
            torch.cuda.empty_cache()

    to_device = lambda q: torch.from_numpy(q).to(device)  # noqa: E731
    return Built(search, close, resident=resident, to_device=to_device, clock=_torch_clock)


def _tinyknn_gpu() -> str | None:
    from tinyknn.gpu.device import has_gpu, why_no_gpu

    return None if has_gpu() else why_no_gpu()


PEERS = {
    "tinyknn-cuda": Peer("cuda", "tinyknn", "tinyknn.Index(device='cuda'): specialised kernels, float32 accumulation",
                         _build_tinyknn("cuda"), _tinyknn_gpu),
    "torch": Peer("cuda", "torch", "l2: torch.addmm(|x|^2, q, X^T, alpha=-2) (expansion, not cdist), ip: torch.mm; "
                  "then torch.topk; float32 with TF32 off; float16: torch.mm(out_dtype=float32)",
                  _build_torch, _torch_gpu),
    "cupy": Peer("cuda", "cupy", "q @ X^T (cuBLAS; float16 storage: float16 matmul and output), |x|^2 - 2 q.x, "
                 "cupy.argpartition, sort of the k", _build_cupy, _cupy_gpu),
    "tinyknn-cpu": Peer("cpu", "tinyknn", "tinyknn.Index(device='cpu'): C++ library through ctypes",
                        _build_tinyknn("cpu")),
    "faiss": Peer("cpu", "faiss", "IndexFlat (L2 or inner product); float16: IndexScalarQuantizer QT_fp16",
                  _build_faiss),
    "hnswlib": Peer("cpu", "hnswlib", "hnswlib.BFIndex brute force, num_threads=-1; float32 only", _build_hnswlib),
    "numpy": Peer("cpu", "numpy", "q @ X^T (BLAS; a float16 database widened per call), argpartition, sort of the k",
                  _build_numpy),
}
