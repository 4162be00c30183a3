"""The benchmark file formats: memory-mapped readers and atomic writers.

Vectors (the format by the extension; `tinyknn.io.vectors` has the table): TEXMEX `.fvecs`/`.bvecs`/`.ivecs`,
big-ann `.fbin`/`.f16bin`/`.u8bin`/`.i8bin`/`.ibin`/`.u64bin` (8- or 16-byte header), `.npy`, ann-benchmarks
HDF5 (`FILE.hdf5:test`). Ground truth (`tinyknn.io.neighbors`): big-ann's k-NN and range files, cuVS's
`.neighbors.ibin` + `.distances.fbin` pair, TEXMEX `.ivecs`, ann-benchmarks HDF5, `.npy`.

Every reader checks a file's size against its header (or its rows' dimension prefixes) before it maps or
allocates anything large; a damaged, truncated, ragged or mislabelled file is a ValueError naming the
path as given, what was found and what was expected. Every writer writes a temporary file beside the
target, fsyncs it and renames it over the target. A leaf: imports only NumPy, the standard library and,
for HDF5 and only when used, h5py (`pip install tinyknn[hdf5]`).
"""

from .neighbors import (FORMATS, RANGE_FORMATS, KnnGroundTruth, RangeGroundTruth, guess_format, output_paths,
                        read_knn_groundtruth, read_range_groundtruth, write_knn_groundtruth, write_range_groundtruth)
from ._files import atomic_path, atomic_write
from .vectors import EXTENSIONS, extension_of, open_vectors, read_vectors, split_dataset, write_vectors

__all__ = ["open_vectors", "read_vectors", "write_vectors", "extension_of", "split_dataset", "EXTENSIONS",
           "read_knn_groundtruth", "write_knn_groundtruth", "read_range_groundtruth", "write_range_groundtruth",
           "KnnGroundTruth", "RangeGroundTruth", "guess_format", "output_paths", "FORMATS", "RANGE_FORMATS",
           "atomic_write", "atomic_path"]
