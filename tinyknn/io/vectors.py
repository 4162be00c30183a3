"""The front door for vector files: the format is chosen by the extension.

| extension | format | values |
| --- | --- | --- |
| .fvecs / .bvecs / .ivecs | TEXMEX (int32 dimension before every row) | float32 / uint8 / int32 |
| .fbin / .f16bin (.hbin) / .u8bin / .i8bin / .ibin / .u64bin | big-ann / cuVS (8- or 16-byte header) | float32 / float16 / uint8 / int8 / int32 / uint64 |
| .npy | NumPy | any numeric dtype, 2-D |
| .hdf5 / .h5 | ann-benchmarks (`FILE.hdf5:test` picks a dataset; default `train`) | the dataset's |

`open_vectors` maps the file (an array-like of shape (n, d) whose slices read only their rows),
`read_vectors(path, start, stop)` reads rows start .. stop - 1 into memory, `write_vectors` writes
atomically.
"""

from __future__ import annotations

import os

import numpy as np

from . import binfmt, hdf5, npy, texmex
from ._files import shown

HDF5_EXTENSIONS = (".hdf5", ".h5")
EXTENSIONS = tuple(texmex.ELEMENTS) + tuple(binfmt.ELEMENTS) + (".npy",) + HDF5_EXTENSIONS


def split_dataset(path) -> tuple[str, str | None]:
    """("file.hdf5", "test") from "file.hdf5:test"; (path, None) for anything else."""
    text = os.fspath(path)
    head, sep, tail = text.rpartition(":")
    if sep and tail in hdf5.DATASETS and head.lower().endswith(HDF5_EXTENSIONS):
        return head, tail
    return text, None


def extension_of(path) -> str:
    """The format-deciding extension of `path` (lower case), or a ValueError listing those known."""
    name = os.path.basename(split_dataset(path)[0]).lower()
    for extension in sorted(EXTENSIONS, key=len, reverse=True):
        if name.endswith(extension):
            return extension
    raise ValueError(f"{shown(path)}: unknown vector file extension; expected one of {', '.join(EXTENSIONS)}")


def open_vectors(path, dataset: str | None = None):
    """A read-only (n, d) array-like over the file's rows (a memory map; an HDF5Vectors for HDF5)."""
    extension = extension_of(path)
    if extension in HDF5_EXTENSIONS:
        file, name = split_dataset(path)
        return hdf5.open_vectors(file, dataset or name or "train")
    if extension in texmex.ELEMENTS:
        return texmex.open_vectors(path, extension)
    if extension in binfmt.ELEMENTS:
        return binfmt.open_vectors(path, extension)
    return npy.open_array(path)


def read_vectors(path, start: int = 0, stop: int | None = None, dataset: str | None = None) -> np.ndarray:
    """Rows start .. stop - 1 (default: all) as an in-memory (stop - start, d) array; nothing else is read."""
    extension = extension_of(path)
    if extension in HDF5_EXTENSIONS:
        file, name = split_dataset(path)
        return hdf5.read_vectors(file, dataset or name or "train", start, stop)
    if extension in texmex.ELEMENTS:
        return texmex.read_vectors(path, extension, start, stop)
    if extension in binfmt.ELEMENTS:
        return binfmt.read_vectors(path, extension, start, stop)
    return npy.read_rows(path, start, stop)


def write_vectors(path, array, dataset: str | None = None, wide_header: bool | None = None) -> None:
    """Write (n, d) rows atomically in the format of the extension. The array's dtype must convert to the
    format's without loss (a float64 array cannot become an .fbin: convert it first). `wide_header` forces
    the 16-byte uint64 header of a big-ann file (it is used anyway when n or d exceeds uint32)."""
    extension = extension_of(path)
    if extension in HDF5_EXTENSIONS:
        file, name = split_dataset(path)
        return hdf5.write_vectors(file, array, dataset or name or "train")
    if extension in texmex.ELEMENTS:
        return texmex.write_vectors(path, array, extension)
    if extension in binfmt.ELEMENTS:
        return binfmt.write_vectors(path, array, extension, wide_header)
    if len(getattr(array, "shape", np.shape(array))) != 2:
        raise ValueError(f"cannot write {shown(path)}: vectors must be a 2-D array; got shape {np.shape(array)}")
    return npy.write_array(path, array)
