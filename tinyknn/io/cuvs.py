"""cuVS's split ground-truth pair (cuvs_bench.generate_groundtruth): `STEM.neighbors.ibin` (ids) and
`STEM.distances.fbin`, each an ordinary (nq, k) file of big-ann's vector format (tinyknn.io.binfmt).

cuVS writes its ids as uint32 into the .ibin, which an int32 reading sees as negative beyond 2**31 - 1: such
ids are read back as uint32 here. Ids past int32 are written to `STEM.neighbors.u64bin` (uint64; -1, no
neighbour, stored as 2**64 - 1). Each file is written atomically, the distances first.
"""

from __future__ import annotations

import os

import numpy as np

from ._files import shown
from .binfmt import INT32_MAX, as_float32, header, read_vectors, write_vectors

SUFFIXES = (".neighbors.ibin", ".neighbors.u64bin", ".distances.fbin")


def stem_of(path) -> str:
    """STEM of a cuVS pair from STEM, STEM.neighbors.ibin, STEM.neighbors.u64bin or STEM.distances.fbin."""
    text = os.fspath(path)
    for suffix in SUFFIXES:
        if text.endswith(suffix):
            return text[:-len(suffix)]
    return text


def paths(path, ids=None) -> tuple[str, str]:
    """(neighbours file, distances file) of a pair: for reading the one that exists, for writing (`ids`
    given) .ibin when the ids fit int32, else .u64bin."""
    stem = stem_of(path)
    if ids is not None:
        ids = np.asarray(ids)
        fits = not ids.size or (int(ids.max()) <= INT32_MAX and int(ids.min()) >= -1)
        return stem + (".neighbors.ibin" if fits else ".neighbors.u64bin"), stem + ".distances.fbin"
    for suffix in (".neighbors.ibin", ".neighbors.u64bin"):
        if os.path.exists(stem + suffix):
            return stem + suffix, stem + ".distances.fbin"
    raise FileNotFoundError(f"no cuVS ground truth at {shown(path)}: neither {stem}.neighbors.ibin nor "
                            f"{stem}.neighbors.u64bin exists")


def read(path, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, distances float32) of queries start .. stop - 1 of a cuVS pair."""
    neighbors, distances_path = paths(path)
    extension = ".u64bin" if neighbors.endswith(".u64bin") else ".ibin"
    n_ids, k_ids, _ = header(neighbors, extension)
    n_d, k_d, _ = header(distances_path, ".fbin")
    if (n_ids, k_ids) != (n_d, k_d):
        raise ValueError(f"the cuVS pair disagrees: {neighbors} holds {n_ids:,} x {k_ids:,} ids but "
                         f"{distances_path} {n_d:,} x {k_d:,} distances")
    ids = read_vectors(neighbors, extension, start, stop)
    if extension == ".u64bin":
        ids = ids.view(np.int64)                                 # 2**64 - 1 (padding) reads as -1
    elif ids.size and (ids < -1).any():                          # cuVS wrote uint32 ids past int32
        wide = ids.view(np.uint32).astype(np.int64)
        ids = np.where(ids == -1, -1, wide)
    return ids.astype(np.int64, copy=False), read_vectors(distances_path, ".fbin", start, stop)


def write(path, ids, distances) -> tuple[str, str]:
    """Write a cuVS pair (each file atomically); returns the two paths written."""
    neighbors, distances_path = paths(path, ids)
    nq, k = np.shape(ids) if np.ndim(ids) == 2 else (None, None)
    if nq is None or np.shape(distances) != (nq, k):
        raise ValueError(f"cannot write {shown(path)}: ids have shape {np.shape(ids)} but distances "
                         f"{np.shape(distances)}; both must be (nq, k)")
    distances32 = as_float32(path, distances)
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"cannot write {shown(path)}: ids must be integers; got dtype {ids.dtype}")
    write_vectors(distances_path, distances32, ".fbin")
    if neighbors.endswith(".ibin"):
        write_vectors(neighbors, ids.astype("<i4"), ".ibin")
    else:
        write_vectors(neighbors, ids.astype(np.int64).view(np.uint64), ".u64bin")
    return neighbors, distances_path
