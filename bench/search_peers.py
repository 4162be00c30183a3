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
    search: Callable                   # (host queries (nq, dim)[, k]) -> NumPy (distances, ids); k: config.k
    close: Callable[[], None]
    resident: Callable | None = None   # device queries -> device (distances, ids)
    to_device: Callable | None = None  # host queries -> what `resident` takes
    clock: Callable | None = None      # clock(call) -> seconds, by CUDA events on the current stream
    note: str = ""                     # how this build computes (e.g. which half-precision matmul), for the rows


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


TORCH_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8")


def _torch_set_tf32(torch, enabled: bool) -> None:
    """TF32 for float32 matmuls on or off (torch.backends.cuda.matmul.allow_tf32, as PyTorch users set it)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled


def _torch_half_mm(torch, dtype, device):
    """(mm of `dtype` matrices with float32 accumulation and output, what it does): torch.mm(out_dtype=float32)
    where this PyTorch has it (2.8 and later, CUDA), else the half-precision product widened afterwards."""
    probe = torch.ones((2, 8), dtype=dtype, device=device)
    name = str(dtype).replace("torch.", "")
    try:
        torch.mm(probe, probe.T, out_dtype=torch.float32)
        return (lambda a, b: torch.mm(a, b, out_dtype=torch.float32)), \
            f"torch.mm(out_dtype=float32): {name} in, float32 accumulate and out"
    except (TypeError, RuntimeError, NotImplementedError):
        return (lambda a, b: torch.mm(a, b).float()), f"torch.mm: {name} in and out (no out_dtype here), then .float()"


def _torch_aux(torch, base, metric: str):
    """prepare()'s |x|^2 (l2) or 1 / |x| (cosine) for a torch database, in float32."""
    if metric == "ip":
        return None
    norm2 = base.float().pow(2).sum(dim=1)
    if metric == "l2":
        return norm2
    norm = norm2.sqrt()
    return torch.where(norm > 0, 1 / torch.where(norm > 0, norm, 1.0), 0.0)


def _build_torch(mode: str):
    """mode "fp32" (TF32 off), "tf32" (torch.backends.cuda.matmul.allow_tf32 = True): float32 storage only;
    "fp16": half-precision GEMM on every storage dtype (float16; bfloat16 storage multiplies in bfloat16;
    8-bit values are exact in float16; float32 storage is rounded to float16)."""
    def build(db, config, device="cuda"):
        import torch

        if config.dtype not in TORCH_DTYPES:
            raise Unsupported(f"no PyTorch path for dtype {config.dtype!r}")
        if mode != "fp16" and config.dtype != "float32":
            raise Unsupported(f"torch-{mode} runs on float32 storage; torch-fp16 is the half-precision peer")
        gemm = torch.float32 if mode != "fp16" else torch.bfloat16 if config.dtype == "bfloat16" else torch.float16
        base = torch.from_numpy(db).to(device)
        base = (base.float() if base.dtype != torch.float32 else base).to(gemm)
        half_mm, note = _torch_half_mm(torch, gemm, device) if mode == "fp16" else \
            (None, f"torch.addmm / torch.mm in float32, allow_tf32={mode == 'tf32'}")
        aux = _torch_aux(torch, base, config.metric)
        if mode != "fp16":
            _torch_set_tf32(torch, mode == "tf32")
            note += f" (read back: {torch.backends.cuda.matmul.allow_tf32})"
        rows = block_rows(len(db), GPU_BLOCK)
        metric = config.metric
        larger = metric != "l2"

        @torch.inference_mode()
        def resident(q, k=config.k):
            _torch_set_tf32(torch, mode == "tf32")
            q = q.float()
            out_d = torch.empty((len(q), k), dtype=torch.float32, device=q.device)
            out_i = torch.empty((len(q), k), dtype=torch.int64, device=q.device)
            for start in range(0, len(q), rows):
                qb = q[start:start + rows]
                if half_mm is None and metric == "l2":   # l2 by the expansion, fused: |x|^2 - 2 q.x
                    key = torch.addmm(aux, qb, base.T, alpha=-2)
                else:
                    key = torch.mm(qb, base.T) if half_mm is None else half_mm(qb.to(gemm), base.T)
                    key = key.mul_(-2).add_(aux) if metric == "l2" else key.mul_(aux) if metric == "cosine" else key
                best, ids = torch.topk(key, k, dim=1, largest=larger, sorted=True)
                q_norm2 = (qb * qb).sum(dim=1, keepdim=True)
                out_d[start:start + len(qb)] = (best + q_norm2 if metric == "l2" else best if metric == "ip" else
                                                best / torch.where(q_norm2 > 0, q_norm2.sqrt(), 1.0))
                out_i[start:start + len(qb)] = ids
            return out_d, out_i

        def search(q, k=config.k):
            dist, ids = resident(torch.from_numpy(q).to(device), k)
            return dist.cpu().numpy(), ids.cpu().numpy()

        def close():
            nonlocal base, aux
            base = aux = None
            if device == "cuda":
                torch.cuda.empty_cache()

        to_device = lambda q: torch.from_numpy(q).to(device)  # noqa: E731
        return Built(search, close, resident=resident, to_device=to_device, clock=_torch_clock, note=note)

    return build


def _tinyknn_gpu() -> str | None:
    from tinyknn.gpu.device import has_gpu, why_no_gpu

    return None if has_gpu() else why_no_gpu()


PEERS = {
    "tinyknn-cuda": Peer("cuda", "tinyknn", "tinyknn.Index(device='cuda'): specialised kernels, float32 accumulation",
                         _build_tinyknn("cuda"), _tinyknn_gpu),
    "torch-fp32": Peer("cuda", "torch", "l2: torch.addmm(|x|^2, q, X^T, alpha=-2) (expansion, not cdist), ip: "
                       "torch.mm, cosine: torch.mm scaled by 1/|x|; then torch.topk; float32 storage, "
                       "torch.backends.cuda.matmul.allow_tf32 = False", _build_torch("fp32"), _torch_gpu),
    "torch-tf32": Peer("cuda", "torch", "as torch-fp32 with torch.backends.cuda.matmul.allow_tf32 = True "
                       "(float32 storage)", _build_torch("tf32"), _torch_gpu),
    "torch-fp16": Peer("cuda", "torch", "queries and database in float16 (bfloat16 for bfloat16 storage; 8-bit "
                       "values are exact in float16), torch.mm with out_dtype=float32 where available (each row's "
                       "note says), |x|^2 - 2 q.x in float32, torch.topk", _build_torch("fp16"), _torch_gpu),
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
