"""Ground-truth files of every format: k-NN (ids and distances per query, nearest first) and range.

| format | k-NN files | range files |
| --- | --- | --- |
| bigann | OUT: uint32 nq, k; int32 ids; float32 distances | OUT: int32 nq, total; int32 counts; int32 ids; float32 distances |
| cuvs | STEM.neighbors.ibin (.u64bin past int32) + STEM.distances.fbin | - |
| ivecs | OUT.ivecs (ids, TEXMEX) + STEM.distances.fvecs (tinyknn's; TEXMEX publishes ids only) | - |
| hdf5 | OUT.hdf5: neighbors, distances (+ train, test), attribute distance | - |
| npy | STEM.neighbors.npy (int64) + STEM.distances.npy (float32) | + STEM.lims.npy |

Which distances a file holds (squared L2, Euclidean, 1 - cos, similarity) is the format's convention,
which tinyknn.groundtruth decides; this module moves the numbers.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from . import binfmt, cuvs, hdf5, npy, texmex
from ._files import check_slice, shown

FORMATS = ("bigann", "cuvs", "ivecs", "hdf5", "npy")
RANGE_FORMATS = ("bigann", "npy")


@dataclasses.dataclass
class KnnGroundTruth:
    """ids int64 (nq, k) nearest first (-1: no neighbour), distances float32 (nq, k) or None (a TEXMEX
    .ivecs without distances), the format, the HDF5 `distance` attribute if any, and the files read."""
    ids: np.ndarray
    distances: np.ndarray | None
    format: str
    distance: str | None = None
    paths: tuple[str, ...] = ()

    @property
    def k(self) -> int:
        return self.ids.shape[1]

    def __len__(self) -> int:
        return self.ids.shape[0]


@dataclasses.dataclass
class RangeGroundTruth:
    """FAISS's layout: query i's hits are ids[lims[i]:lims[i + 1]] with their distances, nearest first."""
    lims: np.ndarray
    ids: np.ndarray
    distances: np.ndarray
    format: str
    paths: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.lims) - 1


def _strip(path, suffixes) -> str:
    text = os.fspath(path)
    for suffix in suffixes:
        if text.endswith(suffix):
            return text[:-len(suffix)]
    return text


NPY_SUFFIXES = (".neighbors.npy", ".distances.npy", ".lims.npy", ".npy")
IVECS_SUFFIXES = (".distances.fvecs", ".ivecs")


def npy_paths(path) -> dict[str, str]:
    stem = _strip(path, NPY_SUFFIXES)
    return {name: f"{stem}.{name}.npy" for name in ("neighbors", "distances", "lims")}


def ivecs_paths(path) -> tuple[str, str]:
    stem = _strip(path, IVECS_SUFFIXES)
    return stem + ".ivecs", stem + ".distances.fvecs"


def guess_format(path) -> str:
    """The format of an existing ground-truth file by its name (see the table above); bigann otherwise."""
    text = os.fspath(path)
    lower = text.lower()
    if lower.endswith((".hdf5", ".h5")):
        return "hdf5"
    if lower.endswith(".npy") or os.path.exists(npy_paths(text)["neighbors"]):
        return "npy"
    if lower.endswith((".ivecs", ".fvecs")):
        return "ivecs"
    if lower.endswith(cuvs.SUFFIXES) or any(os.path.exists(cuvs.stem_of(text) + s)
                                                   for s in (".neighbors.ibin", ".neighbors.u64bin")):
        return "cuvs"
    return "bigann"


def _check_format(format: str | None, path, allowed=FORMATS) -> str:
    format = guess_format(path) if format is None else format
    if format not in allowed:
        raise ValueError(f"ground-truth format must be one of {', '.join(allowed)}; got {format!r}")
    return format


def output_paths(path, format: str, ids=None, radius: bool = False) -> tuple[str, ...]:
    """The files a write of `format` to `path` creates."""
    format = _check_format(format, path, RANGE_FORMATS if radius else FORMATS)
    if format == "cuvs":
        return cuvs.paths(path, np.zeros(0, dtype=np.int64) if ids is None else ids)
    if format == "ivecs":
        return ivecs_paths(path)
    if format == "npy":
        names = npy_paths(path)
        kinds = ("lims", "neighbors", "distances") if radius else ("neighbors", "distances")
        return tuple(names[kind] for kind in kinds)
    return (os.fspath(path),)


def read_knn_groundtruth(path, format: str | None = None, start: int = 0,
                         stop: int | None = None) -> KnnGroundTruth:
    """Queries start .. stop - 1 of a k-NN ground truth (format: guessed from the name when None)."""
    format = _check_format(format, path)
    if format == "bigann":
        ids, distances = binfmt.read_knn(path, start, stop)
        return KnnGroundTruth(ids, distances, format, paths=(os.fspath(path),))
    if format == "cuvs":
        ids, distances = cuvs.read(path, start, stop)
        return KnnGroundTruth(ids, distances, format, paths=cuvs.paths(path))
    if format == "hdf5":
        ids, distances, distance = hdf5.read_knn(path, start, stop)
        return KnnGroundTruth(ids, distances, format, distance, (os.fspath(path),))
    if format == "ivecs":
        ids_path, distances_path = ivecs_paths(path)
        ids = texmex.read_vectors(ids_path, ".ivecs", start, stop).astype(np.int64)
        distances = None
        if os.path.exists(distances_path):
            distances = texmex.read_vectors(distances_path, ".fvecs", start, stop)
            if distances.shape != ids.shape:
                raise ValueError(f"{distances_path} holds distances of shape {distances.shape} but {ids_path} "
                                 f"ids of shape {ids.shape}")
        files = (ids_path,) + ((distances_path,) if distances is not None else ())
        return KnnGroundTruth(ids, distances, format, paths=files)
    names = npy_paths(path)
    ids_all = npy.open_array(names["neighbors"])
    start, stop = check_slice(names["neighbors"], ids_all.shape[0], start, stop, "queries")
    ids = np.array(ids_all[start:stop]).astype(np.int64)
    distances = None
    if os.path.exists(names["distances"]):
        distances_all = npy.open_array(names["distances"])
        if distances_all.shape != ids_all.shape:
            raise ValueError(f"{names['distances']} holds distances of shape {distances_all.shape} but "
                             f"{names['neighbors']} ids of shape {ids_all.shape}")
        distances = np.array(distances_all[start:stop]).astype(np.float32)
    files = (names["neighbors"],) + ((names["distances"],) if distances is not None else ())
    return KnnGroundTruth(ids, distances, format, paths=files)


def write_knn_groundtruth(path, ids, distances, format: str = "bigann", distance: str | None = None,
                          train=None, test=None) -> tuple[str, ...]:
    """Write (nq, k) ids and float32 distances as `format` (each file atomically); returns the paths written.
    hdf5 takes the `distance` attribute ('euclidean', 'angular', 'ip') and optionally `train` and `test`."""
    format = _check_format(format, path)
    ids = np.asarray(ids)
    if ids.ndim != 2 or np.shape(distances) != ids.shape:
        raise ValueError(f"cannot write {shown(path)}: ids and distances must be 2-D of one shape; got "
                         f"{ids.shape} and {np.shape(distances)}")
    if format == "bigann":
        binfmt.write_knn(path, ids, distances)
        return (os.fspath(path),)
    if format == "cuvs":
        return cuvs.write(path, ids, distances)
    if format == "hdf5":
        if distance is None:
            raise ValueError(f"cannot write {shown(path)}: an ann-benchmarks file needs its `distance` attribute "
                             "('euclidean', 'angular', 'ip')")
        hdf5.write(path, ids, distances, distance, train=train, test=test)
        return (os.fspath(path),)
    if format == "ivecs":
        ids_path, distances_path = ivecs_paths(path)
        if ids.size and (int(ids.max()) > binfmt.INT32_MAX or int(ids.min()) < -1):
            raise ValueError(f"cannot write {ids_path}: .ivecs stores int32 ids; got {int(ids.min()):,} .. "
                             f"{int(ids.max()):,}")
        texmex.write_vectors(distances_path, binfmt.as_float32(distances_path, distances), ".fvecs")
        texmex.write_vectors(ids_path, ids.astype(np.int32), ".ivecs")
        return ids_path, distances_path
    names = npy_paths(path)
    npy.write_array(names["distances"], binfmt.as_float32(names["distances"], distances))
    npy.write_array(names["neighbors"], ids.astype(np.int64))
    return names["neighbors"], names["distances"]


def read_range_groundtruth(path, format: str | None = None, start: int = 0,
                           stop: int | None = None) -> RangeGroundTruth:
    format = "npy" if format is None and os.fspath(path).endswith(".npy") else (format or "bigann")
    format = _check_format(format, path, RANGE_FORMATS)
    if format == "bigann":
        lims, ids, distances = binfmt.read_range(path, start, stop)
        return RangeGroundTruth(lims, ids, distances, format, (os.fspath(path),))
    names = npy_paths(path)
    lims_all = npy.open_array(names["lims"], ndim=1).astype(np.int64)
    ids_all = npy.open_array(names["neighbors"], ndim=1)
    distances_all = npy.open_array(names["distances"], ndim=1)
    if len(lims_all) < 1 or lims_all[0] != 0 or lims_all[-1] != len(ids_all) or len(distances_all) != len(ids_all) \
            or np.any(np.diff(lims_all) < 0):
        raise ValueError(f"{names['lims']}: lims must start at 0, never decrease and end at the {len(ids_all):,} "
                         f"ids of {names['neighbors']} ({len(distances_all):,} distances)")
    start, stop = check_slice(names["lims"], len(lims_all) - 1, start, stop, "queries")
    first, last = int(lims_all[start]), int(lims_all[stop])
    return RangeGroundTruth(lims_all[start:stop + 1] - first, np.array(ids_all[first:last]).astype(np.int64),
                            np.array(distances_all[first:last]).astype(np.float32), format,
                            (names["lims"], names["neighbors"], names["distances"]))


def write_range_groundtruth(path, lims, ids, distances, format: str = "bigann") -> tuple[str, ...]:
    format = _check_format(format, path, RANGE_FORMATS)
    if format == "bigann":
        binfmt.write_range(path, lims, ids, distances)
        return (os.fspath(path),)
    names = npy_paths(path)
    lims = np.asarray(lims, dtype=np.int64)
    if lims.ndim != 1 or not len(lims) or lims[0] != 0 or lims[-1] != len(ids) or np.shape(distances) != np.shape(ids):
        raise ValueError(f"cannot write {shown(path)}: lims must start at 0 and end at len(ids), one distance per id")
    npy.write_array(names["distances"], binfmt.as_float32(names["distances"], distances))
    npy.write_array(names["neighbors"], np.asarray(ids, dtype=np.int64))
    npy.write_array(names["lims"], lims)
    return names["lims"], names["neighbors"], names["distances"]
