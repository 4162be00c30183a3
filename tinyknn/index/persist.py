"""Saving and loading an Index (format: docs/index-operations.md, 'File format'), and pickling through the same bytes.

The file is an uncompressed NumPy .npz (np.load reads it): header.npy (uint8, UTF-8 JSON: format,
version, dim, metric, dtype, ntotal, labels), vectors.npy ((ntotal, dim) in the storage dtype; bfloat16
as its uint16 bits, so that NumPy reads the file without ml_dtypes), ids.npy ((ntotal,) int64) and, when
the header's "labels" is true, labels.npy ((ntotal,) int64) and has_label.npy ((ntotal,) bool: which
rows have a label). Version 2; version 1 (no "labels", no label members) still loads. Rows are in the
index's row order; removals leave nothing behind (the searcher swap-removes), so there is no other state. Loading trusts nothing: every zip member, .npy header and header field is checked,
and array sizes are compared with the header before any large array is read; the vectors are then
streamed into the index CHUNK_BYTES at a time. Anything wrong is a ValueError naming the file.
Only regular files are opened (os.stat first: a device or a FIFO would be read without end or block).
An index is read from where a file object stands and the object is left just after it, so indexes saved
one after another into one stream load one after another: the archive's end is found by walking its
headers forward (_archive_end), never by reading the zip directory at the end of the stream, which is
the last index's. A path must hold exactly one index.
(This module is past 300 lines because the zip walk and window belong with the format they read.)
Saving writes a uniquely (and shortly) named temporary file beside the target, or beside a symbolic
link's target, and renames it over the target, so a failed save leaves no temporary file and the
previous file intact; its errors name the path the caller gave, never the temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import stat
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
        handle = _open_regular(name)
        start, whole = 0, True
    else:
        name = _check_file_object(source)
        handle, whole = source, False
        start = handle.tell()
    try:
        with _as_value_errors(name):
            size = handle.seek(0, io.SEEK_END)
            end = _archive_end(handle, start, size)
            if whole and end is not None and end != size:
                raise _Damaged(f"it holds {size - end} bytes after the index's end (byte {end}); a path holds one "
                               "index: to read indexes saved one after another into one file, open it and call "
                               "Index.load on the open file once for each")
            window = _Window(handle, start, size if end is None else end)
            archive = zipfile.ZipFile(window)
        with archive:
            with _as_value_errors(name):
                if end is None and min((info.header_offset for info in archive.infolist()), default=0) != 0:
                    raise _Damaged(f"cannot tell where the index at byte {start} ends: its members' sizes follow "
                                   "their data (it was written to an unseekable stream) and another archive "
                                   "follows it; such an index loads from a file that holds it alone")
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
            handle.seek(start + window.size)
        return index
    except BaseException:
        if not whole:
            with contextlib.suppress(Exception):
                handle.seek(start)
        raise
    finally:
        if whole:
            handle.close()


_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
            (stat.S_ISSOCK, "a socket"))


def _not_regular(name, mode: int) -> ValueError | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((what for test, what in _SPECIAL if test(mode)), f"file type {stat.S_IFMT(mode):#o}")
    return ValueError(f"{name} is not a regular file ({kind}); an index file is a regular file written by Index.save")


def _open_regular(name):
    """The path opened for reading after os.stat said it is a regular file (a device would be read without
    end, a FIFO would block the open); O_NONBLOCK and a second fstat close the gap between the two."""
    mode = os.stat(name).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory; pass the path of an index file", name)
    problem = _not_regular(name, mode)
    if problem is not None:
        raise problem
    descriptor = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        problem = _not_regular(name, os.fstat(descriptor).st_mode)
        if problem is not None:
            raise problem
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def _check_file_object(source) -> str:
    """The name to use in messages for a file object, after checking that it is one load can read: binary,
    readable, seekable, and (where it has a descriptor) a regular file."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        raise TypeError(f"Index.load takes a path (str or os.PathLike) or a binary file object open for reading "
                        f"(read, seek, tell); got {type(source).__name__}: to load an index held in memory, pass "
                        "io.BytesIO(data)")
    if isinstance(source, io.TextIOBase):
        raise TypeError(f"Index.load needs a binary file; got a text file ({type(source).__name__}); open it in "
                        "binary mode ('rb')")
    if not all(callable(getattr(source, method, None)) for method in ("read", "seek", "tell")):
        raise TypeError(f"Index.load takes a path (str or os.PathLike) or a binary file object open for reading "
                        f"(read, seek, tell); got {type(source).__name__}: {source!r:.60}")
    name = getattr(source, "name", None)
    name = name if isinstance(name, str) else "the data"
    readable = getattr(source, "readable", None)
    if callable(readable) and not readable():
        raise TypeError(f"{name} is not open for reading; open it with mode 'rb'")
    try:
        descriptor = source.fileno()
    except (AttributeError, OSError, ValueError):
        descriptor = None                               # io.BytesIO and the like: in memory
    if isinstance(descriptor, int):
        problem = _not_regular(name, os.fstat(descriptor).st_mode)
        if problem is not None:
            raise problem
    seekable = getattr(source, "seekable", None)
    if callable(seekable) and not seekable():
        raise ValueError(f"{name} cannot be read as an index: it is not seekable; save the index to a file or "
                         "an io.BytesIO and load it from there")
    return name


class _Window:
    """Bytes start .. end of a seekable binary file, as a file of its own (what zipfile reads)."""

    def __init__(self, handle, start: int, end: int):
        self._handle, self._start, self.size, self._at = handle, start, end - start, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "seek before the start of the index")
        self._at = base + offset
        return self._at

    def read(self, n: int = -1) -> bytes:
        n = self.size - self._at if n is None or n < 0 else min(n, self.size - self._at)
        if n <= 0:
            return b""
        self._handle.seek(self._start + self._at)
        data = self._handle.read(n)
        if not isinstance(data, bytes):
            raise TypeError(f"the file object's read() returned {type(data).__name__}, not bytes")
        self._at += len(data)
        return data


# The zip records walked by _archive_end (zipfile's own layouts) and how many members an index may have.
_LOCAL, _CENTRAL = zipfile.structFileHeader, zipfile.structCentralDir
_END64_LOCATOR = zipfile.structEndArchive64Locator
_END = zipfile.structEndArchive
MAX_MEMBERS = 16                   # tinyknn writes 3 or 5
_FULL = 0xFFFFFFFF                 # a 32-bit zip field whose value is in the zip64 extra field


def _archive_end(handle, start: int, size: int) -> int | None:
    """Where the zip archive that starts at byte `start` ends: its local headers (each member's data
    skipped by the size its header gives), central directory and end records are walked forward, reading
    only those headers. None when a member's sizes follow its data (a data descriptor: the archive was
    written to an unseekable stream); the caller then takes the archive to run to the end of the stream.
    The end record must agree with the central directory walked (so zipfile reads exactly that one)."""
    at = start

    def record(layout: str, signature: bytes | None, what: str) -> tuple:
        nonlocal at
        length = struct.calcsize(layout)
        handle.seek(at)
        raw = handle.read(length)
        if not isinstance(raw, bytes):
            raise TypeError(f"the file object's read() returned {type(raw).__name__}, not bytes")
        if len(raw) < length or (signature is not None and raw[:4] != signature):
            raise _Damaged(f"no {what} starts at byte {at}" + (f" (the data ends at byte {size})" if len(raw) < length
                                                                else ""))
        at += length
        return struct.unpack(layout, raw)

    def skip(count: int, what: str) -> None:
        nonlocal at
        if at + count > size:
            raise _Damaged(f"{what} at byte {at} claims {count} bytes, beyond the {size} bytes there are")
        at += count

    members = 0
    while True:
        handle.seek(at)
        signature = handle.read(4)
        if signature != zipfile.stringFileHeader:
            break
        if members == MAX_MEMBERS:
            raise _Damaged(f"it holds more than {MAX_MEMBERS} zip members; a tinyknn index holds 3 or 5")
        members += 1
        local = record(_LOCAL, zipfile.stringFileHeader, "zip member")
        flags, compressed, uncompressed, name_length, extra_length = local[3], local[8], local[9], local[10], local[11]
        handle.seek(at + name_length)
        extra = handle.read(extra_length)
        if flags & 0x08:
            return None                                  # its sizes follow its data
        if compressed == _FULL:
            compressed = _zip64_size(extra, uncompressed == _FULL, at)
        skip(name_length + extra_length + compressed, "a zip member")
    if members == 0:
        raise _Damaged(f"no zip member starts at byte {start}" + ("" if start < size else
                                                                    f" (the data ends at byte {size})"))
    directory_start, entries = at, 0
    while True:
        handle.seek(at)
        if handle.read(4) != zipfile.stringCentralDir:
            break
        entry = record(_CENTRAL, zipfile.stringCentralDir, "central directory entry")
        entries += 1
        if entries > MAX_MEMBERS:
            raise _Damaged(f"its central directory lists more than {MAX_MEMBERS} members")
        skip(entry[12] + entry[13] + entry[14], "a central directory entry")
    directory = (at - directory_start, entries)
    handle.seek(at)
    if handle.read(4) == zipfile.stringEndArchive64:
        end64 = record(zipfile.structEndArchive64, zipfile.stringEndArchive64, "zip64 end record")
        skip(end64[1] + 12 - struct.calcsize(zipfile.structEndArchive64), "the zip64 end record")
        record(_END64_LOCATOR, zipfile.stringEndArchive64Locator, "zip64 end record locator")
        claimed = (end64[8], end64[7])
        end = record(_END, zipfile.stringEndArchive, "zip end record")
    else:
        end = record(_END, zipfile.stringEndArchive, "zip end record")
        claimed = (end[5], end[4])
    # (zipfile finds the central directory just before the end records, as walked here; the offset the end
    # record gives only shifts every member's offset, which zipfile then checks against each local header:
    # it is absolute in a stream an index was written into at another position)
    if claimed != directory:
        raise _Damaged(f"its zip end record gives a central directory of {claimed[1]} entries in {claimed[0]} bytes; "
                       f"the one before it holds {directory[1]} entries in {directory[0]} bytes")
    skip(end[7], "the zip comment")
    return at


def _zip64_size(extra: bytes, after_uncompressed: bool, at: int) -> int:
    """A member's compressed size from its local header's zip64 extra field (after the uncompressed size
    where that field is full too)."""
    while len(extra) >= 4:
        kind, length = struct.unpack("<HH", extra[:4])
        if kind == 1 and length >= 8 * (1 + after_uncompressed):
            return struct.unpack_from("<Q", extra, 4 + 8 * after_uncompressed)[0]
        extra = extra[4 + length:]
    raise _Damaged(f"the zip member that ends its header at byte {at} lacks the zip64 size its header announces")


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
