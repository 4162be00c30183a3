"""What the distances in each ground-truth format mean, and how tinyknn's float64 values become them.

tinyknn's own distances (README "Exactness"): `l2` the squared Euclidean distance, `ip` the inner product,
`cosine` the cosine similarity; ip and cosine are similarities (larger is better). A format's convention:

| format | l2 | ip | cosine |
| --- | --- | --- | --- |
| bigann (big-ann-benchmarks, FAISS) | squared L2 | inner product (larger first) | cosine similarity (larger first) |
| cuvs (cuvs_bench) | squared L2 (sqeuclidean) | inner product (larger first) | 1 - cos (CosineExpanded) |
| ivecs (TEXMEX ids; distances .fvecs) | squared L2 | inner product (larger first) | cosine similarity (larger first) |
| hdf5 (ann-benchmarks) | Euclidean, sqrt ('euclidean') | inner product ('ip', larger first) | 1 - cos ('angular') |
| npy (tinyknn's own) | squared L2 | inner product (larger first) | cosine similarity (larger first) |

Every converted value is computed from the pair's float64 contract distance and rounded to float32 once
(float32(sqrt(d64)), float32(1 - cos64)); the order of the ids is always the contract's (float64, ties by
the smaller id), whatever the convention.
"""

from __future__ import annotations

import numpy as np

LARGER_IS_BETTER = {"l2": False, "ip": True, "cosine": True}

# name -> (description, larger is better)
CONVENTIONS = {
    "squared_l2": ("squared Euclidean distance, sum of (q - x)^2 (smaller first)", False),
    "euclidean": ("Euclidean distance, sqrt of the squared distance (smaller first)", False),
    "inner_product": ("inner product q . x, a similarity (larger first)", True),
    "cosine_similarity": ("cosine similarity q . x / (|q| |x|), 0 for a zero vector (larger first)", True),
    "cosine_distance": ("1 - cosine similarity (smaller first)", False),
}

NATIVE = {"l2": "squared_l2", "ip": "inner_product", "cosine": "cosine_similarity"}
BY_FORMAT = {
    "bigann": NATIVE,
    "ivecs": NATIVE,
    "npy": NATIVE,
    "cuvs": {"l2": "squared_l2", "ip": "inner_product", "cosine": "cosine_distance"},
    "hdf5": {"l2": "euclidean", "ip": "inner_product", "cosine": "cosine_distance"},
}
HDF5_DISTANCE = {"l2": "euclidean", "ip": "ip", "cosine": "angular"}
_HDF5_METRIC = {"euclidean": "l2", "l2": "l2", "angular": "cosine", "cosine": "cosine", "ip": "ip", "dot": "ip",
                "inner_product": "ip", "innerproduct": "ip"}


def convention(format: str, metric: str) -> str:
    """The convention name of `format`'s distances for `metric` (tinyknn's own for unknown formats)."""
    return BY_FORMAT.get(format, NATIVE)[metric]


def larger_is_better(name: str) -> bool:
    return CONVENTIONS[name][1]


def describe(name: str) -> str:
    return CONVENTIONS[name][0]


def metric_of_hdf5(distance: str | None, path="") -> str:
    """tinyknn's metric for an ann-benchmarks `distance` attribute; hamming and jaccard have none."""
    key = (distance or "").strip().lower()
    if key not in _HDF5_METRIC:
        raise ValueError(f"{path}: the ann-benchmarks distance {distance!r} has no tinyknn metric; tinyknn "
                         f"searches euclidean (l2), angular (cosine) and ip/dot (ip)")
    return _HDF5_METRIC[key]


def from_contract(d64: np.ndarray, metric: str, name: str) -> np.ndarray:
    """float64 contract distances of `metric` in convention `name`, still float64 (round once after)."""
    if name == NATIVE[metric]:
        return d64
    if metric == "l2" and name == "euclidean":
        return np.sqrt(d64)
    if metric == "cosine" and name == "cosine_distance":
        return 1.0 - d64
    raise ValueError(f"no conversion from tinyknn's {metric} distances to {name}")


def to_float32(d64: np.ndarray, metric: str, name: str) -> np.ndarray:
    return from_contract(np.asarray(d64, dtype=np.float64), metric, name).astype(np.float32)
