"""What every format shares: the atomic write, the size checks made before anything large is read or
allocated, and messages that name the path as the user gave it.

Writes go to a uniquely named temporary file beside the target (same directory, so same file system), are
flushed and fsync'ed, then renamed over the target with os.replace and the directory is fsync'ed: a reader
sees the old file or the new one, never half of one, and a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from pathlib import Path

import numpy as np

CHUNK_BYTES = 64 << 20          # what one write or one validation read touches at a time
SAMPLE_ROWS = 1024              # rows whose per-row header a ragged-file check reads (plus the first and last)


def shown(path) -> str:
    """The path as the user gave it (a str or os.PathLike), for messages."""
    return os.fspath(path)


def file_size(path) -> int:
    """The size of a regular file; a missing file is FileNotFoundError, a directory a ValueError."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {shown(path)}") from None
    if not os.path.isfile(path):
        raise ValueError(f"{shown(path)} is not a regular file (a directory or a device?)")
    return info.st_size


def read_head(path, count: int) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(count)


def unpack(fmt: str, data: bytes) -> tuple:
    return struct.unpack(fmt, data[:struct.calcsize(fmt)])


def check_slice(path, n: int, start: int, stop: int | None, what: str = "rows") -> tuple[int, int]:
    """(start, stop) within 0 .. n; anything else is a ValueError naming the file and its row count."""
    stop = n if stop is None else stop
    for name, value in (("start", start), ("stop", stop)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer; got {value!r}")
    start, stop = int(start), int(stop)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"{what} {start}:{stop} asked of {shown(path)}, which holds {n:,} {what} "
                         f"(allowed: 0 <= start <= stop <= {n:,})")
    return start, stop


def sample_positions(n: int, count: int = SAMPLE_ROWS) -> np.ndarray:
    """The first, the last and up to `count` evenly spaced positions in 0 .. n - 1 (sorted, unique)."""
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    return np.unique(np.concatenate(([0, n - 1], np.linspace(0, n - 1, num=min(n, count)).astype(np.int64))))


def little(dtype) -> np.dtype:
    """The little-endian form of dtype (every format here is little-endian)."""
    return np.dtype(dtype).newbyteorder("<")


def write_rows(handle, array, dtype) -> None:
    """array's rows onto handle as contiguous little-endian `dtype`, CHUNK_BYTES at a time (a memory-mapped
    or strided source is never copied whole)."""
    dtype = little(dtype)
    array = array if hasattr(array, "shape") else np.asarray(array)
    if len(array.shape) < 2:
        chunk = np.ascontiguousarray(np.asarray(array), dtype=dtype)
        handle.write(chunk.data if chunk.size else b"")
        return
    row_bytes = max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * dtype.itemsize)
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, array.shape[0], step):
        chunk = np.ascontiguousarray(np.asarray(array[start:start + step]), dtype=dtype)
        if chunk.size:
            handle.write(chunk.data)


def _temporary(target: Path) -> Path:
    if target.is_dir():
        raise IsADirectoryError(f"cannot write {target}: it is a directory; pass a file name")
    directory = target.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"cannot write {target}: its directory {directory} does not exist")
    return target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:          # some platforms cannot open a directory; the rename is done either way
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_write(path):
    """A binary handle onto a temporary file beside `path`; when the block ends without an exception the
    file is flushed, fsync'ed and renamed onto `path`, else it is removed."""
    with atomic_path(path) as temporary, open(temporary, "xb") as handle:
        yield handle


@contextlib.contextmanager
def atomic_path(path):
    """A temporary path beside `path` for a writer that opens files itself (h5py, np.save); when the block
    ends without an exception the file is fsync'ed and renamed onto `path`, else it is removed."""
    target = Path(path)
    temporary = _temporary(target)
    try:
        yield temporary
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(target.parent)


def element_of(path, extension: str, elements: dict, family: str) -> np.dtype:
    """The element dtype a `family` file's extension names, or a ValueError naming the file and the choices."""
    try:
        return elements[extension]
    except KeyError:
        raise ValueError(f"{shown(path)}: unknown {family} extension {extension!r}; expected one of "
                         f"{', '.join(elements)}") from None
