"""big-ann-benchmarks' binary files (benchmark/dataset_io.py) and cuVS's use of them (cuvs_bench).

Vectors: `.fbin` float32, `.f16bin`/`.hbin` float16, `.u8bin` uint8, `.i8bin` int8, `.ibin` int32, `.u64bin`
uint64: a header of `uint32 n, uint32 d` (8 bytes), or `uint64 n, uint64 d` (16 bytes, cuVS's extended
header for n or d beyond 2**32 - 1), then n * d little-endian values, row-major. As cuVS does, the header's
width is told by the file's size: the 8-byte reading must give exactly 8 + n * d * itemsize bytes, else the
16-byte one 16 + n * d * itemsize; anything else (a truncated file, a header that overstates n, the wrong
extension for the values) is a ValueError naming the file before anything is mapped.

k-NN ground truth (big-ann's `knn_result_read` / `usbin_write`): `uint32 nq, uint32 k`, then nq * k int32
ids, then nq * k float32 distances (8 + 8 * nq * k bytes). Ids beyond int32 cannot be written in it.

Range ground truth (big-ann's `range_result_read`): `int32 nq, int32 total`, then nq int32 counts (one per
query, summing to total), then total int32 ids, then total float32 distances, query by query.

cuVS's split ground-truth pair, two files of the vector format above, is in tinyknn.io.cuvs.
"""

from __future__ import annotations

import numpy as np

from ._files import atomic_write, check_slice, element_of, file_size, read_head, shown, unpack, write_rows

ELEMENTS = {".fbin": np.dtype("<f4"), ".f16bin": np.dtype("<f2"), ".hbin": np.dtype("<f2"),
            ".u8bin": np.dtype("u1"), ".i8bin": np.dtype("i1"), ".ibin": np.dtype("<i4"),
            ".u64bin": np.dtype("<u8")}
UINT32_MAX = (1 << 32) - 1
INT32_MAX = (1 << 31) - 1
NARROW, WIDE = 8, 16


def _element(path, extension: str) -> np.dtype:
    return element_of(path, extension, ELEMENTS, "big-ann")


def _other_sizes(size: int, count: int, extension: str) -> str:
    """Which other element size the file's size fits for `count` values (a file with the wrong extension)."""
    own = ELEMENTS[extension].itemsize
    for other in sorted({e.itemsize for e in ELEMENTS.values()} - {own}):
        if size == NARROW + count * other:
            names = "/".join(ext for ext, e in ELEMENTS.items() if e.itemsize == other)
            return f"; that size fits {other}-byte values ({names}): is the extension wrong?"
    return ""


def header(path, extension: str) -> tuple[int, int, int]:
    """(n, d, header bytes) of a vector file, after checking that the file's size agrees with it."""
    element = _element(path, extension)
    size = file_size(path)
    if size == 0:
        raise ValueError(f"{shown(path)} is empty (0 bytes); a {extension} file starts with an 8-byte header "
                         f"(uint32 n, uint32 d)")
    if size < NARROW:
        raise ValueError(f"{shown(path)} is {size} bytes: too short for the 8-byte header (uint32 n, uint32 d)")
    head = read_head(path, WIDE)
    n, d = unpack("<II", head)
    if size == NARROW + n * d * element.itemsize and (d > 0 or n == 0):
        return n, d, NARROW
    if len(head) == WIDE:
        n64, d64 = unpack("<QQ", head)
        if size == WIDE + n64 * d64 * element.itemsize and d64 > 0:
            return n64, d64, WIDE
    expected = NARROW + n * d * element.itemsize
    why = "truncated, or its header overstates the rows" if size < expected else "longer than its header says"
    if d == 0 and n:
        why = "a header of dimension 0"
    raise ValueError(f"{shown(path)}: its header says {n:,} rows x {d:,} columns of {element.name} "
                     f"({element.itemsize} bytes each), {expected:,} bytes with the 8-byte header, but the file "
                     f"is {size:,} bytes ({why}; the 16-byte uint64 header does not fit either)"
                     f"{_other_sizes(size, n * d, extension)}")


def open_vectors(path, extension: str) -> np.ndarray:
    """The (n, d) rows as a read-only memory map (nothing is read until used)."""
    element = _element(path, extension)
    n, d, offset = header(path, extension)
    if n == 0:
        return np.empty((0, d), dtype=element)
    return np.memmap(path, dtype=element, mode="r", offset=offset, shape=(n, d))


def read_vectors(path, extension: str, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start .. stop - 1 as an in-memory array; only those rows are read."""
    element = _element(path, extension)
    n, d, offset = header(path, extension)
    start, stop = check_slice(path, n, start, stop)
    with open(path, "rb") as handle:
        handle.seek(offset + start * d * element.itemsize)
        values = np.fromfile(handle, dtype=element, count=(stop - start) * d)
    return values.reshape(stop - start, d).astype(element.newbyteorder("="), copy=False)


def _shape2(path, array, what: str) -> tuple[int, int]:
    shape = tuple(getattr(array, "shape", np.shape(array)))
    if len(shape) != 2:
        raise ValueError(f"cannot write {shown(path)}: {what} must be a 2-D array; got shape {shape}")
    return int(shape[0]), int(shape[1])


def write_vectors(path, array, extension: str, wide_header: bool | None = None) -> None:
    """Write (n, d) rows atomically. The 16-byte header is used when n or d exceeds uint32 (or when
    wide_header=True). The array's dtype must convert to the extension's without loss."""
    element = _element(path, extension)
    if not hasattr(array, "dtype"):
        array = np.asarray(array)
    n, d = _shape2(path, array, f"a {extension} file's contents")
    dtype = np.dtype(array.dtype)
    if not np.can_cast(dtype, element, "safe"):
        raise ValueError(f"cannot write {shown(path)}: a {extension} file holds {element.name} values and "
                         f"{dtype.name} does not convert to it without loss; convert the array first "
                         "(or use the extension of its dtype)")
    if d == 0 and n:
        raise ValueError(f"cannot write {shown(path)}: rows of dimension 0")
    wide = bool(wide_header) or n > UINT32_MAX or d > UINT32_MAX
    with atomic_write(path) as handle:
        handle.write(np.array([n, d], dtype="<u8" if wide else "<u4").tobytes())
        write_rows(handle, array, element)


# -- big-ann k-NN ground truth ---------------------------------------------------------------------------
def knn_layout(path) -> tuple[int, int]:
    """(nq, k) of a big-ann k-NN ground-truth file, after checking its size."""
    size = file_size(path)
    if size == 0:
        raise ValueError(f"{shown(path)} is empty (0 bytes); a big-ann ground-truth file starts with "
                         "uint32 nq, uint32 k")
    if size < NARROW:
        raise ValueError(f"{shown(path)} is {size} bytes: too short for the 8-byte header (uint32 nq, uint32 k)")
    nq, k = unpack("<II", read_head(path, NARROW))
    expected = NARROW + nq * k * 8
    if size != expected or (nq and not k):
        hint = ""
        if size == NARROW + nq * k * 4:
            hint = "; that size fits ids alone (an .ibin file of neighbours, as cuVS writes, not big-ann's pair)"
        raise ValueError(f"{shown(path)}: its header says {nq:,} queries x k = {k:,}, which is {expected:,} bytes "
                         f"of big-ann ground truth (int32 ids, then float32 distances), but the file is "
                         f"{size:,} bytes{hint}")
    return nq, k


def read_knn(path, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, distances float32) of queries start .. stop - 1."""
    nq, k = knn_layout(path)
    start, stop = check_slice(path, nq, start, stop, "queries")
    count = (stop - start) * k
    with open(path, "rb") as handle:
        handle.seek(NARROW + start * k * 4)
        ids = np.fromfile(handle, dtype="<i4", count=count)
        handle.seek(NARROW + nq * k * 4 + start * k * 4)
        distances = np.fromfile(handle, dtype="<f4", count=count)
    return (ids.astype(np.int64).reshape(stop - start, k),
            distances.astype(np.float32, copy=False).reshape(stop - start, k))


def _int32_ids(path, ids: np.ndarray, format_name: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"cannot write {shown(path)}: ids must be integers; got dtype {ids.dtype}")
    if ids.size and (int(ids.max()) > INT32_MAX or int(ids.min()) < -1):
        raise ValueError(f"cannot write {shown(path)}: the {format_name} format stores ids as int32 "
                         f"(-1 .. {INT32_MAX:,}); got ids {int(ids.min()):,} .. {int(ids.max()):,}. Use the "
                         "cuvs format (uint64 ids in .neighbors.u64bin) or npy")
    return ids.astype("<i4")


def as_float32(path, distances, what: str = "distances") -> np.ndarray:
    distances = np.asarray(distances)
    if not np.can_cast(distances.dtype, np.float32, "safe"):
        raise ValueError(f"cannot write {shown(path)}: {what} must be float32 (or convert to it without loss); "
                         f"got dtype {distances.dtype}")
    return distances.astype("<f4")


def write_knn(path, ids, distances) -> None:
    """Write big-ann's k-NN ground truth atomically: (nq, k) ids (int32 range) and float32 distances."""
    nq, k = _shape2(path, ids, "the ids")
    if np.shape(distances) != (nq, k):
        raise ValueError(f"cannot write {shown(path)}: ids have shape {(nq, k)} but distances {np.shape(distances)}")
    if nq > UINT32_MAX or k > UINT32_MAX:
        raise ValueError(f"cannot write {shown(path)}: nq = {nq:,} or k = {k:,} exceeds the header's uint32")
    ids32, distances32 = _int32_ids(path, ids, "big-ann"), as_float32(path, distances)
    with atomic_write(path) as handle:
        handle.write(np.array([nq, k], dtype="<u4").tobytes())
        write_rows(handle, ids32, "<i4")
        write_rows(handle, distances32, "<f4")


# -- big-ann range ground truth ----------------------------------------------------------------------------
def range_layout(path) -> tuple[int, int]:
    """(nq, total hits) of a big-ann range ground-truth file, after checking its size."""
    size = file_size(path)
    if size < NARROW:
        raise ValueError(f"{shown(path)} is {size} bytes: too short for the range ground truth's 8-byte header "
                         "(int32 nq, int32 total)")
    nq, total = unpack("<ii", read_head(path, NARROW))
    if nq < 0 or total < 0:
        raise ValueError(f"{shown(path)}: its header says nq = {nq:,}, total = {total:,}; both must be >= 0")
    expected = NARROW + 4 * nq + 8 * total
    if size != expected:
        raise ValueError(f"{shown(path)}: its header says {nq:,} queries and {total:,} hits, which is "
                         f"{expected:,} bytes of range ground truth, but the file is {size:,} bytes")
    return nq, total


def read_range(path, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lims int64 (q + 1,), ids int64, distances float32) of queries start .. stop - 1, in FAISS's layout:
    query i's hits at lims[i]:lims[i + 1]."""
    nq, total = range_layout(path)
    start, stop = check_slice(path, nq, start, stop, "queries")
    with open(path, "rb") as handle:
        handle.seek(NARROW)
        counts = np.fromfile(handle, dtype="<i4", count=nq).astype(np.int64)
        if counts.size and (counts.min() < 0 or int(counts.sum()) != total):
            raise ValueError(f"{shown(path)}: the per-query counts sum to {int(counts.sum()):,} (smallest "
                             f"{int(counts.min()):,}) but the header says {total:,} hits")
        offsets = np.concatenate(([0], np.cumsum(counts)))
        first, last = int(offsets[start]), int(offsets[stop])
        handle.seek(NARROW + 4 * nq + 4 * first)
        ids = np.fromfile(handle, dtype="<i4", count=last - first).astype(np.int64)
        handle.seek(NARROW + 4 * nq + 4 * total + 4 * first)
        distances = np.fromfile(handle, dtype="<f4", count=last - first).astype(np.float32, copy=False)
    return offsets[start:stop + 1] - first, ids, distances


def write_range(path, lims, ids, distances) -> None:
    """Write big-ann's range ground truth atomically from FAISS's layout (lims, ids, distances)."""
    lims = np.asarray(lims, dtype=np.int64)
    if lims.ndim != 1 or not len(lims) or lims[0] != 0 or np.any(np.diff(lims) < 0) or lims[-1] != len(ids) \
            or np.shape(distances) != np.shape(ids):
        raise ValueError(f"cannot write {shown(path)}: lims must start at 0, never decrease and end at "
                         f"len(ids) = {len(ids):,}, with one distance per id; got lims of length {len(lims):,} "
                         f"ending at {int(lims[-1]) if len(lims) else None}, {np.shape(distances)} distances")
    nq, total = len(lims) - 1, int(lims[-1])
    if nq > INT32_MAX or total > INT32_MAX:
        raise ValueError(f"cannot write {shown(path)}: {nq:,} queries / {total:,} hits exceed the format's int32")
    ids32, distances32 = _int32_ids(path, ids, "big-ann range"), as_float32(path, distances)
    with atomic_write(path) as handle:
        handle.write(np.array([nq, total], dtype="<i4").tobytes())
        write_rows(handle, np.diff(lims), "<i4")
        write_rows(handle, ids32, "<i4")
        write_rows(handle, distances32, "<f4")
