"""A drop-in for FAISS's flat indexes, over tinyknn.Index: `import tinyknn.faiss as faiss`.

IndexFlat / IndexFlatL2 / IndexFlatIP, IndexIDMap / IndexIDMap2, index_factory for the flat strings,
knn, normalize_L2, SearchParameters with the IDSelectors, and index_cpu_to_gpu-style helpers, with
FAISS's conventions: METRIC_INNER_PRODUCT = 0 and METRIC_L2 = 1 (squared distances); a missing result
is id -1 with distance +FLT_MAX (l2) or -FLT_MAX (inner product), not infinity; range_search returns
(lims uint64, D float32, I int64) with l2 hits where distance < radius and inner-product hits where
similarity > radius, each query's hits in storage (insertion) order as FAISS's flat indexes return them
(FAISS documents the order as unspecified; its own tests rely on this one). Answers are exact (tinyknn's exactness contract), so they can differ from FAISS's BLAS
path in the last bit and in the order of exact ties.

Differences, on purpose: bad shapes are ValueError (FAISS: AssertionError); ids within one index are
unique (FAISS's IndexIDMap accepts duplicates); k is limited as tinyknn.Index limits it; errors FAISS
raises as RuntimeError (a missing key, add on an IndexIDMap) are FaissError, a RuntimeError.
Every index takes `device="cpu" | "cuda"` (default "cpu").
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from .index import (FLT_MAX, METRIC_INNER_PRODUCT, METRIC_L2, FaissError, IndexFlat, IndexFlatIP,
                           IndexFlatL2, IndexIDMap, IndexIDMap2)
from .selectors import *  # noqa: F401,F403 - the selectors are part of this module's surface
from .selectors import __all__ as _selector_names
from ..config import get_config, set_cpu_threads
from ..index import Index

__all__ = ["METRIC_L2", "METRIC_INNER_PRODUCT", "FLT_MAX", "FaissError", "IndexFlat", "IndexFlatL2", "IndexFlatIP",
           "IndexIDMap", "IndexIDMap2", "index_factory", "knn", "normalize_L2", "StandardGpuResources",
           "GpuIndexFlatL2", "GpuIndexFlatIP", "index_cpu_to_gpu", "index_gpu_to_cpu", "index_cpu_to_all_gpus",
           "omp_set_num_threads", "omp_get_max_threads", *_selector_names]


# -- functions -------------------------------------------------------------------------------
def omp_set_num_threads(n: int) -> None:
    """FAISS's thread setting, mapped to the CPU library's thread count (TINYKNN_CPU_THREADS) for every
    index of this process from the next call on."""
    set_cpu_threads(n)


def omp_get_max_threads() -> int:
    """The CPU library's thread count (TINYKNN_CPU_THREADS, else the usable cores)."""
    return get_config().cpu_threads


_FACTORY = {"flat": None, "idmap,flat": IndexIDMap, "flat,idmap": IndexIDMap,
            "idmap2,flat": IndexIDMap2, "flat,idmap2": IndexIDMap2}


def index_factory(d: int, description: str, metric: int = METRIC_L2, *, device: str = "cpu"):
    """The flat descriptions: "Flat", "IDMap,Flat", "Flat,IDMap", "IDMap2,Flat", "Flat,IDMap2"."""
    key = str(description).replace(" ", "").lower()
    if key not in _FACTORY:
        raise ValueError(f"tinyknn.faiss.index_factory knows the exact flat indexes "
                         f"'Flat', 'IDMap,Flat', 'Flat,IDMap', 'IDMap2,Flat', 'Flat,IDMap2'; got {description!r}")
    flat = IndexFlat(d, metric, device=device)
    wrapper = _FACTORY[key]
    return flat if wrapper is None else wrapper(flat)


def knn(xq, xb, k: int, metric: int = METRIC_L2, *, device: str = "cpu"):
    """(D, I) of the k nearest rows of xb for each row of xq, as faiss.knn."""
    shape = np.shape(xb)
    if len(shape) != 2:
        raise ValueError(f"xb (the database) must be a 2-D array of shape (n, d); got shape {shape}")
    index = IndexFlat(shape[1], metric, device=device)
    index.add(xb)
    try:
        return index.search(xq, k)
    finally:
        index._index.close()


def normalize_L2(x: np.ndarray) -> None:
    """Scale each row of a float32 C-contiguous array to unit L2 norm in place (zero rows stay zero)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous or x.ndim != 2:
        raise TypeError("normalize_L2 works in place on a 2-D C-contiguous float32 NumPy array; got "
                        + (f"{x.dtype} of shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__))
    norms = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float32))
    np.divide(x, norms[:, None], out=x, where=norms[:, None] > 0)


# -- GPU helpers ---------------------------------------------------------------------------
class StandardGpuResources:
    """Accepted where FAISS wants GPU resources; tinyknn manages its own streams and memory."""


def _copy_to(index: IndexFlat, device: str) -> IndexFlat:
    """The same index on another device, through tinyknn's own save format (ids and positions kept)."""
    if not isinstance(index, IndexFlat):
        raise TypeError(f"expected a tinyknn.faiss index; got {type(index).__name__}")
    with tempfile.TemporaryDirectory(prefix="tinyknn-faiss-") as folder:
        path = os.path.join(folder, "index.tknn")
        index._index.save(path)
        loaded = Index.load(path, device=device)
    copy = type(index).__new__(type(index))
    copy._setup(loaded, index.metric_type, index._rows.view.copy(), index._next_id)
    if isinstance(index, IndexIDMap):
        copy.index = type(index.index).__new__(type(index.index))
        copy.index._setup(loaded, index.metric_type)
        copy._wrap(copy.index)
    return copy


def index_cpu_to_gpu(res, device: int, index: IndexFlat, co=None) -> IndexFlat:
    """The index copied onto the GPU (tinyknn uses the current CUDA device; `device` must be 0)."""
    if int(device) != 0:
        raise ValueError(f"tinyknn uses the current CUDA device; select it with CUDA_VISIBLE_DEVICES and pass 0; "
                         f"got device {device}")
    return _copy_to(index, "cuda")


def index_cpu_to_all_gpus(index: IndexFlat, co=None, ngpu: int = -1) -> IndexFlat:
    return _copy_to(index, "cuda")


def index_gpu_to_cpu(index: IndexFlat) -> IndexFlat:
    return _copy_to(index, "cpu")


def GpuIndexFlatL2(res, d: int, config=None) -> IndexFlat:
    """FAISS's GPU flat index: here an IndexFlat on device='cuda'."""
    return IndexFlatL2(d, device="cuda")


def GpuIndexFlatIP(res, d: int, config=None) -> IndexFlat:
    return IndexFlatIP(d, device="cuda")
