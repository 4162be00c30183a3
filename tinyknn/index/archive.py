"""Where an index's bytes are: only regular files are opened (os.stat first: a device or a FIFO would be
read without end or block); a file object is read through a window from where it stands to the end of the
archive that starts there, found by walking the zip headers forward, never by reading the zip directory at
the end of the stream, which is the last index's (so indexes saved one after another load in turn). The
window begins where the archive's zip offsets count from: zipfile writes stream positions into an archive
written at a nonzero position, and newer zipfile readers take a zip64 locator's offset as it stands."""

from __future__ import annotations

import errno
import io
import os
import stat
import struct
import zipfile
from typing import NamedTuple


class Damaged(ValueError):
    """A check of ours failed: the message is already complete."""


_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
            (stat.S_ISSOCK, "a socket"))


def _not_regular(name, mode: int) -> ValueError | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((what for test, what in _SPECIAL if test(mode)), f"file type {stat.S_IFMT(mode):#o}")
    return ValueError(f"{name} is not a regular file ({kind}); an index file is a regular file written by Index.save")


def open_regular(name):
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


def check_file_object(source) -> str:
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


class Window:
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


# The zip records walked by archive_end (zipfile's own layouts) and how many members an index may have.
_LOCAL, _CENTRAL = zipfile.structFileHeader, zipfile.structCentralDir
_END64_LOCATOR = zipfile.structEndArchive64Locator
_END = zipfile.structEndArchive
MAX_MEMBERS = 16                   # tinyknn writes 3 or 5
_FULL = 0xFFFFFFFF                 # a 32-bit zip field whose value is in the zip64 extra field


class Extent(NamedTuple):
    """Where an archive ends, and the stream byte its zip offsets count from (zipfile reads it through a
    window that begins there)."""
    end: int
    base: int


def archive_end(handle, start: int, size: int) -> Extent | None:
    """Where the zip archive that starts at byte `start` ends: its local headers (each member's data
    skipped by the size its header gives), central directory and end records are walked forward, reading
    only those headers. None when a member's sizes follow its data (a data descriptor: the archive was
    written to an unseekable stream); the caller then takes the archive to run to the end of the stream.
    The end record must agree with the central directory walked (so zipfile reads exactly that one).

    The base is the stream byte the archive's zip offsets count from: `start`, unless it has zip64 end
    records. Their locator gives the zip64 end record's offset: its stream position when the archive was
    written where it stands (zipfile counts from the stream's byte 0), its position in the archive when the
    archive was copied there whole. Newer zipfile readers (3.13.9, 3.14, patched 3.12) take that offset,
    and the zip64 end record's directory offset, as they stand in the file they read; so both must count
    from one base between byte 0 and `start` (then every zipfile reads the same archive)."""
    at = start

    def record(layout: str, signature: bytes | None, what: str) -> tuple:
        nonlocal at
        length = struct.calcsize(layout)
        handle.seek(at)
        raw = handle.read(length)
        if not isinstance(raw, bytes):
            raise TypeError(f"the file object's read() returned {type(raw).__name__}, not bytes")
        if len(raw) < length or (signature is not None and raw[:4] != signature):
            raise Damaged(f"no {what} starts at byte {at}" + (f" (the data ends at byte {size})" if len(raw) < length
                                                                else ""))
        at += length
        return struct.unpack(layout, raw)

    def skip(count: int, what: str) -> None:
        nonlocal at
        if at + count > size:
            raise Damaged(f"{what} at byte {at} claims {count} bytes, beyond the {size} bytes there are")
        at += count

    members = 0
    while True:
        handle.seek(at)
        signature = handle.read(4)
        if signature != zipfile.stringFileHeader:
            break
        if members == MAX_MEMBERS:
            raise Damaged(f"it holds more than {MAX_MEMBERS} zip members; a tinyknn index holds 3 or 5")
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
        raise Damaged(f"no zip member starts at byte {start}" + ("" if start < size else
                                                                    f" (the data ends at byte {size})"))
    directory_start, entries = at, 0
    while True:
        handle.seek(at)
        if handle.read(4) != zipfile.stringCentralDir:
            break
        entry = record(_CENTRAL, zipfile.stringCentralDir, "central directory entry")
        entries += 1
        if entries > MAX_MEMBERS:
            raise Damaged(f"its central directory lists more than {MAX_MEMBERS} members")
        skip(entry[12] + entry[13] + entry[14], "a central directory entry")
    directory = (at - directory_start, entries)
    base, directory_offset = start, None
    handle.seek(at)
    if handle.read(4) == zipfile.stringEndArchive64:
        record_at = at
        end64 = record(zipfile.structEndArchive64, zipfile.stringEndArchive64, "zip64 end record")
        skip(end64[1] + 12 - struct.calcsize(zipfile.structEndArchive64), "the zip64 end record")
        located = record(_END64_LOCATOR, zipfile.stringEndArchive64Locator, "zip64 end record locator")[2]
        base = record_at - located
        if not 0 <= base <= start:
            raise Damaged(f"its zip64 end record locator gives offset {located} for the zip64 end record at byte "
                          f"{record_at}: offsets counted from byte {base}, " +
                          ("before the data's start" if base < 0 else f"after the index's start (byte {start})"))
        claimed, directory_offset = (end64[8], end64[7]), end64[9]
        end = record(_END, zipfile.stringEndArchive, "zip end record")
    else:
        end = record(_END, zipfile.stringEndArchive, "zip end record")
        claimed = (end[5], end[4])
    # (zipfile finds the central directory just before the end records, as walked here; without zip64
    # records the offset the end record gives only shifts every member's offset, which zipfile then checks
    # against each local header: it is absolute in a stream an index was written into at another position)
    if claimed != directory:
        raise Damaged(f"its zip end record gives a central directory of {claimed[1]} entries in {claimed[0]} bytes; "
                       f"the one before it holds {directory[1]} entries in {directory[0]} bytes")
    if directory_offset is not None and directory_offset != directory_start - base:
        raise Damaged(f"its zip64 end record puts the central directory at byte {base + directory_offset} (offset "
                      f"{directory_offset} from byte {base}, where its locator counts from); it is at byte "
                      f"{directory_start}")
    skip(end[7], "the zip comment")
    return Extent(at, base)


def _zip64_size(extra: bytes, after_uncompressed: bool, at: int) -> int:
    """A member's compressed size from its local header's zip64 extra field (after the uncompressed size
    where that field is full too)."""
    while len(extra) >= 4:
        kind, length = struct.unpack("<HH", extra[:4])
        if kind == 1 and length >= 8 * (1 + after_uncompressed):
            return struct.unpack_from("<Q", extra, 4 + 8 * after_uncompressed)[0]
        extra = extra[4 + length:]
    raise Damaged(f"the zip member that ends its header at byte {at} lacks the zip64 size its header announces")
