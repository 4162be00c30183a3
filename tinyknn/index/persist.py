"""Saving and loading an Index (format: docs/index-operations.md, 'File format'), and pickling through the same bytes.

The file is an uncompressed NumPy .npz (np.load reads it): header.npy (uint8, UTF-8 JSON: format,
version, dim, metric, dtype, ntotal, labels), vectors.npy ((ntotal, dim) in the storage dtype; bfloat16
as its uint16 bits, so that NumPy reads the file without ml_dtypes), ids.npy ((ntotal,) int64) and, when
the header's "labels" is true, labels.npy ((ntotal,) int64) and has_label.npy ((ntotal,) bool: which
rows have a label). Version 2; version 1 (no "labels", no label members) still loads. Rows are in the
index's row order; removals leave nothing behind (the searcher swap-removes), so there is no other state. Loading trusts nothing: every zip member, .npy header and header field is checked,
and array sizes are compared with the header before any large array is read; the vectors are then
streamed into the index CHUNK_BYTES at a time. Anything wrong is a ValueError naming the file.
Saving writes a uniquely named temporary file beside the target and renames it over the target, so
a failed save leaves no temporary file and the previous file intact.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import tokenize
import uuid
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..inputs.validate import CHUNK_BYTES
from ..spec import DTYPES, MAX_DIM, METRICS, numpy_dtype

FILE_FORMAT = "tinyknn.index"
FILE_VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_LIMIT = 1 << 16            # bytes; a real header is about 100
MEMBERS = ("header.npy", "vectors.npy", "ids.npy")
LABEL_MEMBERS = ("labels.npy", "has_label.npy")

# What a damaged file can make zipfile, NumPy's .npy parser (ast, tokenize) or json raise.
_DAMAGE = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, ValueError, KeyError, IndexError,
           TypeError, OverflowError, EOFError, OSError, SyntaxError, RecursionError, UnicodeDecodeError,
           struct.error, zlib.error, tokenize.TokenError)


class _Damaged(ValueError):
    """A check of ours failed: the message is already complete."""


# -- saving ------------------------------------------------------------------------------------------
def write(handle, dim: int, metric: str, dtype: str, vectors: np.ndarray, ids: np.ndarray,
          labels: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """The file's bytes onto a binary handle; `labels` is (int64 label, has-label bool) per row, or None."""
    header = {"format": FILE_FORMAT, "version": FILE_VERSION, "dim": dim, "metric": metric, "dtype": dtype,
              "ntotal": int(len(ids)), "labels": labels is not None}
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
              "vectors": vectors.view(np.uint16) if dtype == "bfloat16" else vectors, "ids": ids}
    if labels is not None:
        arrays["labels"], arrays["has_label"] = labels
    with zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)


def save(path, write_to) -> None:
    """Call write_to(handle) on a fresh temporary file beside `path`, then rename it onto `path`.

    The temporary name is unique (pid and a random part), so concurrent saves never collide; it is
    created with os.open(..., 0o666) so the saved file gets the usual umask permissions."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot save the index to {path}: it is a directory; pass a file name")
    temporary = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write_to(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


# -- loading -----------------------------------------------------------------------------------------
def load(source, make_index):
    """An index built by make_index(dim, metric, dtype) and filled from `source` (a path or a binary
    file object). Opening a path raises what open() raises (FileNotFoundError, PermissionError), and
    make_index its own errors (a dtype the device lacks); anything wrong with the contents is a ValueError."""
    if isinstance(source, (str, os.PathLike)):
        name, handle = str(source), open(source, "rb")
    else:
        name, handle = "the data", source
    try:
        with _as_value_errors(name):
            size = handle.seek(0, io.SEEK_END)
            handle.seek(0)
            archive = zipfile.ZipFile(handle)
        with archive:
            with _as_value_errors(name):
                header = _read_header(archive, size)
                ntotal, dim, dtype = header["ntotal"], header["dim"], numpy_dtype(header["dtype"])
                ids = _read_whole(*_open_array(archive, "ids.npy", size, np.dtype(np.int64), (ntotal,)))
                labels = None
                if header.get("labels"):
                    labels = (_read_whole(*_open_array(archive, "labels.npy", size, np.dtype(np.int64), (ntotal,))),
                              _read_whole(*_open_array(archive, "has_label.npy", size, np.dtype(bool), (ntotal,))))
            index = make_index(dim, header["metric"], header["dtype"])
            try:
                with _as_value_errors(name):
                    _stream_rows(archive, size, index, ids, dtype, labels)
            except BaseException:
                index.close()
                raise
        return index
    finally:
        if handle is not source:
            handle.close()


def _stream_rows(archive: zipfile.ZipFile, size: int, index, ids: np.ndarray, dtype: np.dtype,
                 labels: tuple[np.ndarray, np.ndarray] | None) -> None:
    """vectors.npy into the index CHUNK_BYTES at a time, with their ids and labels."""
    ntotal, dim = len(ids), index.dim
    step = max(1, CHUNK_BYTES // (dim * dtype.itemsize))
    file_dtype = np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype
    with _open_array(archive, "vectors.npy", size, file_dtype, (ntotal, dim))[0] as vectors:
        for start in range(0, ntotal, step):
            rows = min(step, ntotal - start)
            data = _read_exactly(vectors, rows * dim * dtype.itemsize)
            piece = slice(start, start + rows)
            values, has = (None, None) if labels is None else (labels[0][piece], labels[1][piece])
            index._add(np.frombuffer(data, dtype=dtype).reshape(rows, dim), ids[piece], values, has)
        _read_exactly(vectors, 0)


@contextlib.contextmanager
def _as_value_errors(name: str):
    """What a damaged file makes the readers raise, as a ValueError naming the file."""
    try:
        yield
    except _Damaged as exc:
        raise _Damaged(f"{name} is not a valid tinyknn index file: {exc}") from None
    except _DAMAGE as exc:
        raise ValueError(f"{name} is not a readable tinyknn index file ({type(exc).__name__}: {exc})") from None


def _read_header(archive: zipfile.ZipFile, size: int) -> dict:
    found = {info.filename: info for info in archive.infolist()}
    _check_members(found, MEMBERS, size)
    if found["header.npy"].file_size > HEADER_LIMIT:
        raise _Damaged(f"header.npy holds {found['header.npy'].file_size} bytes; a header is under {HEADER_LIMIT}")
    raw = _read_whole(*_open_array(archive, "header.npy", size, np.dtype(np.uint8)))
    header = _checked_header(json.loads(raw.tobytes().decode("utf-8")))
    if header.get("labels"):
        _check_members(found, LABEL_MEMBERS, size)
    return header


def _check_members(found: dict, members: tuple[str, ...], size: int) -> None:
    missing = [member for member in members if member not in found]
    if missing:
        raise _Damaged(f"it lacks {', '.join(missing)} (it holds {sorted(found)[:5]})")
    for member in members:
        info = found[member]
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            raise _Damaged(f"{member} is compressed or encrypted (zip method {info.compress_type}, flags "
                           f"{info.flag_bits:#x}); tinyknn writes its members stored as they are")
        if info.compress_size != info.file_size or info.header_offset + info.compress_size > size:
            raise _Damaged(f"{member} claims {info.file_size} bytes at offset {info.header_offset}, "
                           f"beyond the {size} bytes there are")


def _checked_header(header) -> dict:
    if not isinstance(header, dict):
        raise _Damaged(f"its header is a JSON {type(header).__name__}, not an object")
    if header.get("format") != FILE_FORMAT:
        raise _Damaged(f"its header names format {header.get('format')!r}, not {FILE_FORMAT!r}")
    if type(header.get("version")) is not int or header["version"] not in READABLE_VERSIONS:
        raise _Damaged(f"it is format version {header.get('version')!r}; this tinyknn reads versions "
                       f"{' and '.join(map(str, READABLE_VERSIONS))}")
    if header["version"] >= 2 and type(header.get("labels")) is not bool:
        raise _Damaged(f"its header's labels is {header.get('labels')!r}; expected true or false")
    missing = [key for key in ("dim", "metric", "dtype", "ntotal") if key not in header]
    if missing:
        raise _Damaged(f"its header lacks {', '.join(missing)}")
    dim, ntotal = header["dim"], header["ntotal"]
    if type(dim) is not int or not 1 <= dim <= MAX_DIM:
        raise _Damaged(f"its header's dim is {dim!r}; expected an integer in 1 .. {MAX_DIM}")
    if header["metric"] not in METRICS:
        raise _Damaged(f"its header's metric is {header['metric']!r}; expected one of {', '.join(METRICS)}")
    if header["dtype"] not in DTYPES:
        raise _Damaged(f"its header's dtype is {header['dtype']!r}; expected one of {', '.join(DTYPES)}")
    if type(ntotal) is not int or ntotal < 0:
        raise _Damaged(f"its header's ntotal is {ntotal!r}; expected an integer >= 0")
    return header


def _npy_header(member, name: str):
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(member)
    raise _Damaged(f"{name} is .npy format version {version}; tinyknn writes 1.0 or 2.0")


def _open_array(archive: zipfile.ZipFile, name: str, size: int, dtype: np.dtype, shape: tuple | None = None):
    """(the member opened just past its .npy header, its dtype and shape) after checking them and its
    byte count against what the header says (shape None: any 1-D shape), so nothing larger than the
    file itself is ever allocated."""
    info = archive.getinfo(name)
    member = archive.open(name)
    try:
        found_shape, fortran, found_dtype = _npy_header(member, name)
        found_shape = tuple(found_shape)
        if shape is None and len(found_shape) == 1:
            shape = found_shape
        if found_shape != shape or found_dtype != dtype or (fortran and len(shape) > 1):
            raise _Damaged(f"{name} holds a {'Fortran-order ' if fortran else ''}{found_dtype} array of shape "
                           f"{found_shape}; expected {dtype} of shape {shape if shape else '(n,)'}")
        expected = member.tell() + math.prod(shape) * dtype.itemsize
        if info.file_size != expected or expected > size:
            raise _Damaged(f"{name} holds {info.file_size} bytes; a {dtype} array of shape {shape} takes {expected}")
    except BaseException:
        member.close()
        raise
    return member, dtype, shape


def _read_exactly(member, nbytes: int) -> bytes:
    """nbytes from the member (0: check that it ends here, which also settles its CRC)."""
    data = member.read(nbytes) if nbytes else b""
    if len(data) != nbytes or (nbytes == 0 and member.read(1)):
        raise _Damaged(f"{member.name} ends after {len(data)} of {nbytes} bytes" if nbytes else
                       f"{member.name} holds more bytes than its .npy header says")
    return data


def _read_whole(member, dtype: np.dtype, shape: tuple) -> np.ndarray:
    with member:
        data = _read_exactly(member, math.prod(shape) * dtype.itemsize)
        _read_exactly(member, 0)
    return np.frombuffer(data, dtype=dtype).reshape(shape)
