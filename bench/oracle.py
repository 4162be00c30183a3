"""The float64 oracle of the exactness contract on benchmark-sized data, and strict id agreement with it.

The definition is tests/reference.py's (contract_distances, exact_search): the database as the index stores
it (rounded to its dtype) and the queries rounded to float32, both widened to float64; l2 sums (q - x)^2 over
the dimensions in order, ip sums q * x, cosine divides the dot product by sqrt(sum q^2) * sqrt(sum x^2)
(0 for a zero vector); every product and every sum is one elementwise operation, rounded on its own (no
fused multiply-add); nearest first, equal float64 distances by the smaller id. tests/reference.py builds the
whole (queries, rows) matrix; this computes the same numbers in blocks of rows, with torch on the GPU when
there is one (100 queries against 10M x 128: about a second) and NumPy threads otherwise.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

LARGER_IS_BETTER = {"l2": False, "ip": True, "cosine": True}
WORK_ELEMENTS = 1 << 25   # float64 elements of one block's (queries, rows) matrix: 256 MiB
CHUNK_BYTES = 1 << 31     # float64 bytes of one block of stored rows


@dataclass(frozen=True)
class Exact:
    """The oracle's answer for the first len(ids) queries: ids and float64 distances, best first."""

    ids: np.ndarray        # (rows, k) int64
    distances: np.ndarray  # (rows, k) float64, the contract's distances
    max_norm2: float       # largest squared norm of a stored row (for the float32 tolerance of `recall`)
    backend: str           # "torch cuda" or "numpy"
    seconds: float = 0.0


def bfloat16_bits(x32: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float32: what ml_dtypes and torch
    give, without needing ml_dtypes (finite values only, which is all the benchmark makes)."""
    bits = np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def stored64(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Rows of the benchmark's source data (float32, or integers for 8-bit storage) as the index stores
    them, widened exactly to float64."""
    if dtype in ("int8", "uint8"):
        if rows.dtype.kind not in "iu":
            raise ValueError(f"{dtype} storage needs integer data (e.g. --data sift-like); got {rows.dtype}")
        return rows.astype(np.float64)
    if dtype == "bfloat16":
        return bfloat16_bits(rows).astype(np.float64)
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be float32, float16, bfloat16, int8 or uint8; got {dtype!r}")
    return rows.astype(dtype).astype(np.float64)


def _contract(q64, xT, metric, ops):
    """(nq, rows) contract distances of queries q64 (nq, dim) to stored rows given transposed (dim, rows),
    one elementwise operation per step, dimensions in order (tests/reference.py contract_distances)."""
    total, term = ops.zeros((q64.shape[0], xT.shape[1])), ops.empty((q64.shape[0], xT.shape[1]))
    for d in range(q64.shape[1]):
        if metric == "l2":
            ops.sub(q64[:, d:d + 1], xT[d:d + 1, :], out=term)
            ops.mul(term, term, out=term)
        else:
            ops.mul(q64[:, d:d + 1], xT[d:d + 1, :], out=term)
        ops.add(total, term, out=total)
    if metric != "cosine":
        return total
    qq, xx = ops.zeros((q64.shape[0], 1)), ops.zeros((1, xT.shape[1]))
    for d in range(q64.shape[1]):
        qq = qq + q64[:, d:d + 1] * q64[:, d:d + 1]
        xx = xx + xT[d:d + 1, :] * xT[d:d + 1, :]
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero vector's 0/0 is replaced by 0
        return ops.where((qq == 0) | (xx == 0), 0.0, total / (ops.sqrt(qq) * ops.sqrt(xx)))


def _best(dist, first_id, k, larger, ops):
    """The k best of one block by (key, id): a stable sort keeps equal keys in id order."""
    key = -dist if larger else dist
    order = ops.argsort_stable(key)[:, :k]
    return ops.take(key, order), order + first_id


def _merge(parts, k, ops):
    """Blocks' (keys, ids) in increasing id order -> the k best by (key, id)."""
    keys, ids = ops.cat([p[0] for p in parts]), ops.cat([p[1] for p in parts])
    order = ops.argsort_stable(keys)[:, :k]
    return ops.take(keys, order), ops.take(ids, order)


class _NumpyOps:
    name = "numpy"
    work = 1 << 23   # elements of one block's matrix per thread (64 MiB)
    sub, mul, add, sqrt = np.subtract, np.multiply, np.add, np.sqrt
    where = staticmethod(np.where)

    @staticmethod
    def zeros(shape):
        return np.zeros(shape)

    @staticmethod
    def empty(shape):
        return np.empty(shape)

    @staticmethod
    def argsort_stable(key):
        return np.argsort(key, axis=1, kind="stable")

    @staticmethod
    def take(values, order):
        return np.take_along_axis(values, order, axis=1)

    @staticmethod
    def cat(parts):
        return np.concatenate(parts, axis=1)


class _TorchOps:
    name = "torch cuda"
    work = WORK_ELEMENTS

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.sub, self.mul, self.add, self.sqrt, self.where = torch.sub, torch.mul, torch.add, torch.sqrt, torch.where

    def zeros(self, shape):
        return self.torch.zeros(shape, dtype=self.torch.float64, device=self.device)

    def empty(self, shape):
        return self.torch.empty(shape, dtype=self.torch.float64, device=self.device)

    def argsort_stable(self, key):
        return self.torch.sort(key, dim=1, stable=True).indices

    def take(self, values, order):
        return self.torch.gather(values, 1, order)

    def cat(self, parts):
        return self.torch.cat(parts, dim=1)


def _torch_ops():
    """torch on a CUDA device, or None (no torch, no GPU)."""
    try:
        import torch
    except ImportError:
        return None
    return _TorchOps(torch, "cuda") if torch.cuda.is_available() else None


def _chunk_rows(n_queries: int, dim: int, n: int, work: int) -> int:
    return max(1, min(n, work // max(1, n_queries), CHUNK_BYTES // (8 * dim)))


def exact_neighbours(source: np.ndarray, dtype: str, queries: np.ndarray, k: int, metric: str,
                     backend: str = "auto") -> Exact:
    """The contract's k best ids (and float64 distances) of every row of `queries` against `source`
    stored as `dtype`; backend "auto" (torch on CUDA when usable), "torch" or "numpy"."""
    start = time.perf_counter()
    ops = _torch_ops() if backend in ("auto", "torch") else None
    if backend == "torch" and ops is None:
        raise RuntimeError("the torch oracle needs torch with a CUDA device")
    ops = ops or _NumpyOps()
    q32 = np.ascontiguousarray(queries, dtype=np.float32)
    n, dim, larger = len(source), source.shape[1], LARGER_IS_BETTER[metric]
    k = min(k, n)
    step = _chunk_rows(len(q32), dim, n, ops.work)
    starts = range(0, n, step)
    if isinstance(ops, _NumpyOps):
        q64 = q32.astype(np.float64)

        def block(first):
            x64 = stored64(source[first:first + step], dtype)
            dist = _contract(q64, np.ascontiguousarray(x64.T), metric, ops)
            return (*_best(dist, first, k, larger, ops), float(np.einsum("ij,ij->i", x64, x64).max()))

        workers = min(len(starts), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # NumPy releases the GIL on big arrays
            parts = list(pool.map(block, starts))
        keys, ids = _merge([p[:2] for p in parts], k, ops)
        max_norm2 = max(p[2] for p in parts)
    else:
        torch = ops.torch
        q64 = torch.from_numpy(q32).to(ops.device).double()
        parts, max_norm2 = [], 0.0
        with torch.inference_mode():
            for first in starts:
                x64 = _torch_stored64(torch, source[first:first + step], dtype, ops.device)
                max_norm2 = max(max_norm2, float((x64 * x64).sum(dim=1).max()))
                dist = _contract(q64, x64.T.contiguous(), metric, ops)
                parts.append(_best(dist, first, k, larger, ops))
                del x64, dist
                if len(parts) > 1:   # keep memory flat: fold into one running best
                    parts = [_merge(parts, k, ops)]
            keys, ids = _merge(parts, k, ops)
            keys, ids = keys.cpu().numpy(), ids.cpu().numpy()
        torch.cuda.empty_cache()   # leave the device to the searchers measured next
    distances = -keys if larger else keys
    return Exact(ids=np.asarray(ids, dtype=np.int64), distances=np.asarray(distances, dtype=np.float64),
                 max_norm2=max_norm2, backend=ops.name, seconds=time.perf_counter() - start)


def _torch_stored64(torch, rows: np.ndarray, dtype: str, device):
    """Rows as stored, widened to float64 on the device (torch rounds to float16/bfloat16 to nearest even,
    as NumPy and ml_dtypes do)."""
    if dtype in ("int8", "uint8") and rows.dtype.kind not in "iu":
        raise ValueError(f"{dtype} storage needs integer data (e.g. --data sift-like); got {rows.dtype}")
    x = torch.from_numpy(np.ascontiguousarray(rows)).to(device)
    if dtype in ("float16", "bfloat16"):
        x = x.float().to(getattr(torch, dtype))
    return x.double()


def agreement(ids: np.ndarray, exact: Exact, k: int) -> float:
    """Strict id agreement: the share of the first rows' ids equal, position by position, to the oracle's."""
    rows = min(len(exact.ids), len(ids))
    got = np.asarray(ids)[:rows, :k].astype(np.int64)
    return float(np.count_nonzero(got == exact.ids[:rows, :k])) / got.size
