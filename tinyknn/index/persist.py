"""Saving and loading an Index (format: docs/index-operations.md, 'File format'), and pickling through the
same bytes.

The file is an uncompressed NumPy .npz (np.load reads it): header.npy (uint8, UTF-8 JSON: format,
version, dim, metric, dtype, ntotal, labels), vectors.npy ((ntotal, dim) in the storage dtype; bfloat16
as its uint16 bits, so that NumPy reads the file without ml_dtypes), ids.npy ((ntotal,) int64) and, when
the header's "labels" is true, labels.npy ((ntotal,) int64) and has_label.npy ((ntotal,) bool: which
rows have a label). Version 2; version 1 (no "labels", no label members) still loads. Rows are in the
index's row order; removals leave nothing behind (the searcher swap-removes), so there is no other state.
Loading trusts nothing: every zip member, .npy header and header field is checked,
and array sizes are compared with the header before any large array is read; the vectors are then
streamed into the index CHUNK_BYTES at a time. Anything wrong is a ValueError naming the file.
Only regular files are opened, and an index is read from where a file object stands, the object left
just after it (archive.py), so indexes saved one after another into one stream load one after another.
A path must hold exactly one index.
Saving writes a uniquely (and shortly) named temporary file beside the target, or beside a symbolic
link's target, and renames it over the target, so a failed save leaves no temporary file and the
previous file intact; its errors name the path the caller gave, never the temporary file.

Length: the writer and the checking reader of one format, kept together so that they change together.
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
from .archive import Damaged, Window, archive_end, check_file_object, open_regular
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


# -- saving ------------------------------------------------------------------------------------------
def write(handle, dim: int, metric: str, dtype: str, vectors, ids: np.ndarray,
          labels: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """The file's bytes onto a binary handle; `labels` is (int64 label, has-label bool) per row, or None.
    `vectors` is the (ntotal, dim) array in the storage dtype, or an iterable of consecutive blocks of its
    rows, written as they come (so that the whole database is never copied at once)."""
    header = {"format": FILE_FORMAT, "version": FILE_VERSION, "dim": dim, "metric": metric, "dtype": dtype,
              "ntotal": int(len(ids)), "labels": labels is not None}
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), "vectors": vectors, "ids": ids}
    if labels is not None:
        arrays["labels"], arrays["has_label"] = labels
    file_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else numpy_dtype(dtype)
    with zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                if name == "vectors":
                    _write_rows(member, array, (len(ids), dim), file_dtype)
                else:
                    np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)


def _write_rows(member, vectors, shape: tuple[int, int], file_dtype: np.dtype) -> None:
    """vectors.npy: the .npy header write_array would write, then the rows block by block."""
    blocks = (vectors,) if isinstance(vectors, np.ndarray) else vectors
    np.lib.format.write_array_header_1_0(member, {"descr": np.lib.format.dtype_to_descr(file_dtype),
                                                  "fortran_order": False, "shape": shape})
    written = 0
    for block in blocks:
        block = np.ascontiguousarray(block)
        member.write(memoryview(block.view(file_dtype).reshape(-1)).cast("B"))   # bytes: len() is the size
        written += len(block)
    if written != shape[0]:
        raise RuntimeError(f"tinyknn wrote {written} rows of an index of {shape[0]}; the file is incomplete")


def save(path, write_to) -> None:
    """Call write_to(handle) on a fresh temporary file beside `path`, then rename it onto `path`.

    A symbolic link at `path` stays: its target is written (the temporary file goes beside the target).
    The temporary name is short (the target's may already be as long as the file system allows) and
    unique (pid and a random part), so concurrent saves never collide; it is created with
    os.open(..., 0o666) so the saved file gets the usual umask permissions. An OSError names `path` as
    given (FileNotFoundError, NotADirectoryError, PermissionError, a read-only or full file system)."""
    given = os.fspath(path)
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"cannot save the index to {given}: it is a directory; pass a file name")
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    temporary = target.with_name(f".tknn-{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    created = False
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        created = True
        with os.fdopen(descriptor, "wb") as handle:
            write_to(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException as exc:
        if created:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise _naming(exc, given) from None
        raise


def _naming(exc: OSError, given) -> OSError:
    """The error of a failed save, naming the path the caller gave (not the temporary file): the same
    OSError subclass, errno and reason."""
    if exc.errno is None:
        return OSError(f"cannot save the index to {given!r}: {exc}")
    return OSError(exc.errno, f"{exc.strerror or os.strerror(exc.errno)}; cannot save the index", given)


# -- loading -----------------------------------------------------------------------------------------
def load(source, make_index):
    """An index built by make_index(dim, metric, dtype) and filled from `source`: a path, or a binary file
    object, read from its current position and left just after the index. Opening a path raises what
    open() raises (FileNotFoundError, PermissionError, IsADirectoryError), and make_index its own errors (a
    dtype the device lacks); a source of another type is a TypeError; anything that is not a regular file
    and anything wrong with the contents is a ValueError, with the stream left where it was."""
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        handle = open_regular(name)
        start, whole = 0, True
    else:
        name = check_file_object(source)
        handle, whole = source, False
        start = handle.tell()
    try:
        with _as_value_errors(name):
            size = handle.seek(0, io.SEEK_END)
            extent = archive_end(handle, start, size)
            end, base = (size, start) if extent is None else extent
            if whole and end != size:
                raise Damaged(f"it holds {size - end} bytes after the index's end (byte {end}); a path holds one "
                               "index: to read indexes saved one after another into one file, open it and call "
                               "Index.load on the open file once for each")
            window = Window(handle, base, end)
            archive = zipfile.ZipFile(window)
        with archive:
            with _as_value_errors(name):
                first = min(archive.infolist(), key=lambda info: info.header_offset, default=None)
                if extent is None and first is not None and first.header_offset != start - base:
                    raise Damaged(f"cannot tell where the index at byte {start} ends: its members' sizes follow "
                                   "their data (it was written to an unseekable stream) and another archive "
                                   "follows it; such an index loads from a file that holds it alone")
                if first is not None and first.header_offset < start - base:     # zipfile would read it there
                    raise Damaged(f"its central directory puts {first.filename} at byte {base + first.header_offset}, "
                                  f"before the index's start (byte {start})")
                size = window.size
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
        if not whole:
            handle.seek(end)
        return index
    except BaseException:
        if not whole:
            with contextlib.suppress(Exception):
                handle.seek(start)
        raise
    finally:
        if whole:
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
    except Damaged as exc:
        raise Damaged(f"{name} is not a valid tinyknn index file: {exc}") from None
    except _DAMAGE as exc:
        raise ValueError(f"{name} is not a readable tinyknn index file ({type(exc).__name__}: {exc})") from None


def _read_header(archive: zipfile.ZipFile, size: int) -> dict:
    found = {info.filename: info for info in archive.infolist()}
    _check_members(found, MEMBERS, size)
    if found["header.npy"].file_size > HEADER_LIMIT:
        raise Damaged(f"header.npy holds {found['header.npy'].file_size} bytes; a header is under {HEADER_LIMIT}")
    raw = _read_whole(*_open_array(archive, "header.npy", size, np.dtype(np.uint8)))
    header = _checked_header(json.loads(raw.tobytes().decode("utf-8")))
    if header.get("labels"):
        _check_members(found, LABEL_MEMBERS, size)
    return header


def _check_members(found: dict, members: tuple[str, ...], size: int) -> None:
    missing = [member for member in members if member not in found]
    if missing:
        raise Damaged(f"it lacks {', '.join(missing)} (it holds {sorted(found)[:5]})")
    for member in members:
        info = found[member]
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            raise Damaged(f"{member} is compressed or encrypted (zip method {info.compress_type}, flags "
                           f"{info.flag_bits:#x}); tinyknn writes its members stored as they are")
        if info.compress_size != info.file_size or info.header_offset + info.compress_size > size:
            raise Damaged(f"{member} claims {info.file_size} bytes at offset {info.header_offset}, "
                           f"beyond the {size} bytes there are")


def _checked_header(header) -> dict:
    if not isinstance(header, dict):
        raise Damaged(f"its header is a JSON {type(header).__name__}, not an object")
    if header.get("format") != FILE_FORMAT:
        raise Damaged(f"its header names format {header.get('format')!r}, not {FILE_FORMAT!r}")
    if type(header.get("version")) is not int or header["version"] not in READABLE_VERSIONS:
        raise Damaged(f"it is format version {header.get('version')!r}; this tinyknn reads versions "
                       f"{' and '.join(map(str, READABLE_VERSIONS))}")
    if header["version"] >= 2 and type(header.get("labels")) is not bool:
        raise Damaged(f"its header's labels is {header.get('labels')!r}; expected true or false")
    missing = [key for key in ("dim", "metric", "dtype", "ntotal") if key not in header]
    if missing:
        raise Damaged(f"its header lacks {', '.join(missing)}")
    dim, ntotal = header["dim"], header["ntotal"]
    if type(dim) is not int or not 1 <= dim <= MAX_DIM:
        raise Damaged(f"its header's dim is {dim!r}; expected an integer in 1 .. {MAX_DIM}")
    if header["metric"] not in METRICS:
        raise Damaged(f"its header's metric is {header['metric']!r}; expected one of {', '.join(METRICS)}")
    if header["dtype"] not in DTYPES:
        raise Damaged(f"its header's dtype is {header['dtype']!r}; expected one of {', '.join(DTYPES)}")
    if type(ntotal) is not int or ntotal < 0:
        raise Damaged(f"its header's ntotal is {ntotal!r}; expected an integer >= 0")
    return header


def _npy_header(member, name: str):
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(member)
    raise Damaged(f"{name} is .npy format version {version}; tinyknn writes 1.0 or 2.0")


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
            raise Damaged(f"{name} holds a {'Fortran-order ' if fortran else ''}{found_dtype} array of shape "
                           f"{found_shape}; expected {dtype} of shape {shape if shape else '(n,)'}")
        expected = member.tell() + math.prod(shape) * dtype.itemsize
        if info.file_size != expected or expected > size:
            raise Damaged(f"{name} holds {info.file_size} bytes; a {dtype} array of shape {shape} takes {expected}")
    except BaseException:
        member.close()
        raise
    return member, dtype, shape


def _read_exactly(member, nbytes: int) -> bytes:
    """nbytes from the member (0: check that it ends here, which also settles its CRC)."""
    data = member.read(nbytes) if nbytes else b""
    if len(data) != nbytes or (nbytes == 0 and member.read(1)):
        raise Damaged(f"{member.name} ends after {len(data)} of {nbytes} bytes" if nbytes else
                       f"{member.name} holds more bytes than its .npy header says")
    return data


def _read_whole(member, dtype: np.dtype, shape: tuple) -> np.ndarray:
    with member:
        data = _read_exactly(member, math.prod(shape) * dtype.itemsize)
        _read_exactly(member, 0)
    return np.frombuffer(data, dtype=dtype).reshape(shape)
