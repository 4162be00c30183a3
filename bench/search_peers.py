"""The searchers bench/search.py times: tinyknn on each device and its peers, behind one small interface.

Each peer builds from a float32 database and a configuration (dim, dtype, metric, k) and then answers
host NumPy queries with NumPy (distances, ids), as a user would call it. GPU peers also answer
device-resident queries, with a CUDA-event clock of their framework. Every peer keeps what it can
precompute at build time (norms for l2), as tinyknn does.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np

from peer_base import CPU_BLOCK, GPU_BLOCK, Built, Peer, Unsupported, block_rows, to_numpy  # noqa: F401 - re-exported
from peers_torch import build_torch, torch_gpu


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


def prepare(xp, base, metric: str):
    """What a matmul peer precomputes from its stored rows: |x|^2 (l2), 1 / |x| (cosine, 0 for a zero row)."""
    if metric == "ip":
        return None
    norm2 = (base.astype(xp.float32) ** 2).sum(axis=1)
    if metric == "l2":
        return norm2
    norm = xp.sqrt(norm2)
    return xp.where(norm > 0, 1 / xp.where(norm > 0, norm, 1), 0).astype(xp.float32)


def matmul_topk(xp, q, base, aux, k: int, metric: str, rows: int):
    """k best rows of `base` per query with NumPy or CuPy (`xp`): a matmul per block of queries, then an
    argpartition of the keys and a sort of the k kept. l2 uses |x|^2 - 2 q.x (aux = |x|^2) and adds |q|^2
    to the k results; ip keeps the largest inner products; cosine scales them by aux = 1 / |x| and 1 / |q|."""
    q = q.astype(xp.float32, copy=False)
    out_d = xp.empty((len(q), k), dtype=xp.float32)
    out_i = xp.empty((len(q), k), dtype=xp.int64)
    for start in range(0, len(q), rows):
        qb = q[start:start + rows]
        scores = qb.astype(base.dtype, copy=False) @ base.T
        key = aux - 2 * scores if metric == "l2" else -scores if metric == "ip" else -scores * aux
        part = xp.argpartition(key, k - 1, axis=1)[:, :k]
        best = xp.take_along_axis(key, part, axis=1)
        order = xp.argsort(best, axis=1)
        best = xp.take_along_axis(best, order, axis=1).astype(xp.float32)
        out_i[start:start + len(qb)] = xp.take_along_axis(part, order, axis=1)
        q_norm2 = (qb * qb).sum(axis=1, keepdims=True)
        out_d[start:start + len(qb)] = (best + q_norm2 if metric == "l2" else -best if metric == "ip" else
                                        -best / xp.where(q_norm2 > 0, xp.sqrt(q_norm2), 1))
    return out_d, out_i


def stored_float(db, dtype: str) -> np.ndarray:
    """The rows as an index of `dtype` stores them, as float32 (exact: every storage dtype widens exactly)."""
    from oracle import bfloat16_bits

    if dtype == "bfloat16":
        return bfloat16_bits(db)
    return db.astype(dtype).astype(np.float32) if dtype == "float16" else db.astype(np.float32)


# -- CPU ------------------------------------------------------------------------------------------
def _build_numpy(db, config):
    native = config.dtype in ("float32", "bfloat16")   # bfloat16 values are kept as float32 (NumPy has no bfloat16)
    stored = stored_float(db, config.dtype) if native else db.astype(config.dtype)
    aux = prepare(np, stored_float(db, config.dtype), config.metric)
    rows = block_rows(len(db), CPU_BLOCK)

    def search(q, k=config.k):  # NumPy has no fast half or 8-bit matmul: such a database is widened per call
        base = stored if stored.dtype == np.float32 else stored.astype(np.float32)
        return matmul_topk(np, q, base, aux, k, config.metric, rows)

    return Built(search, lambda: None)


def _build_faiss(db, config):
    import faiss

    if config.metric == "cosine" or config.dtype not in ("float32", "float16"):
        raise Unsupported("the FAISS peer runs l2 and ip on float32 and float16 storage")
    metric = faiss.METRIC_L2 if config.metric == "l2" else faiss.METRIC_INNER_PRODUCT
    if config.dtype == "float32":
        index = faiss.IndexFlat(config.dim, metric)
    else:  # a flat scan over float16 storage, decoded to float32
        index = faiss.IndexScalarQuantizer(config.dim, faiss.ScalarQuantizer.QT_fp16, metric)
    index.add(db)
    return Built(lambda q, k=config.k: index.search(q, k), index.reset)


def _build_hnswlib(db, config):
    import hnswlib

    if config.dtype != "float32" or config.metric == "cosine":
        raise Unsupported("the hnswlib peer runs l2 and ip on float32 storage")
    index = hnswlib.BFIndex(space=config.metric, dim=config.dim)
    index.init_index(max_elements=len(db))
    index.add_items(db, np.arange(len(db)))

    def search(q, k=config.k):
        labels, dist = index.knn_query(q, k=k, num_threads=-1)
        dist = dist if config.metric == "l2" else 1 - dist  # hnswlib's 'ip' distance is 1 - q.x
        return dist.astype(np.float32, copy=False), labels.astype(np.int64)

    return Built(search, lambda: None)


def _build_tinyknn(device):
    def build(db, config):
        import tinyknn

        try:
            index = tinyknn.Index(config.dim, metric=config.metric, dtype=config.dtype, device=device)
        except Exception as exc:  # noqa: BLE001 - a dtype this checkout does not store yet is a skip
            raise Unsupported(f"tinyknn.Index(metric={config.metric!r}, dtype={config.dtype!r}, device={device!r}) "
                              f"refused: {type(exc).__name__}: {exc}") from exc
        try:
            index.add(db)
        except Exception:
            index.close()
            raise
        built = Built(None, index.close)

        def search(q, k=config.k):
            """Integer queries as they are (an 8-bit index takes its own dtype); where this checkout refuses
            them, as float32 (the same values), said in the rows' note."""
            if q.dtype.kind in "iu" and built.note:
                q = q.astype(np.float32)
            try:
                return index.search(q, k)
            except (TypeError, ValueError):
                if q.dtype.kind not in "iu":
                    raise
                built.note = f"{q.dtype} queries refused; searched as float32 (the same values)"
                return index.search(q.astype(np.float32), k)

        built.search = search
        if device == "cuda":
            built.resident, built.to_device, built.clock = search, _cupy_array, _cupy_clock
        return built

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

    if config.dtype not in ("float32", "float16"):
        raise Unsupported(f"CuPy has no {config.dtype} matmul through cuBLAS (float32 and float16 only)")
    base = cupy.asarray(db.astype(config.dtype, copy=False))
    aux = prepare(cupy, base, config.metric)
    rows = block_rows(len(db), GPU_BLOCK)

    def resident(q, k=config.k):  # CuPy's float16 matmul returns float16: the agreement shows what that costs
        return matmul_topk(cupy, q, base, aux, k, config.metric, rows)

    def search(q, k=config.k):
        dist, ids = resident(cupy.asarray(q), k)
        return cupy.asnumpy(dist), cupy.asnumpy(ids)

    def close():
        nonlocal base, aux
        base = aux = None
        cupy.get_default_memory_pool().free_all_blocks()

    return Built(search, close, resident=resident, to_device=_cupy_array, clock=_cupy_clock)


def _tinyknn_gpu() -> str | None:
    from tinyknn.gpu.device import has_gpu, why_no_gpu

    return None if has_gpu() else why_no_gpu()


PEERS = {
    "tinyknn-cuda": Peer("cuda", "tinyknn", "tinyknn.Index(device='cuda'): specialised kernels, float32 accumulation",
                         _build_tinyknn("cuda"), _tinyknn_gpu),
    "torch-fp32": Peer("cuda", "torch", "l2: torch.addmm(|x|^2, q, X^T, alpha=-2) (expansion, not cdist), ip: "
                       "torch.mm, cosine: torch.mm scaled by 1/|x|; then torch.topk; float32 storage, "
                       "torch.backends.cuda.matmul.allow_tf32 = False", build_torch("fp32"), torch_gpu),
    "torch-tf32": Peer("cuda", "torch", "as torch-fp32 with torch.backends.cuda.matmul.allow_tf32 = True "
                       "(float32 storage)", build_torch("tf32"), torch_gpu),
    "torch-fp16": Peer("cuda", "torch", "queries and database in float16 (bfloat16 for bfloat16 storage; 8-bit "
                       "values are exact in float16), torch.mm with out_dtype=float32 where available (each row's "
                       "note says), |x|^2 - 2 q.x in float32, torch.topk", build_torch("fp16"), torch_gpu),
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
