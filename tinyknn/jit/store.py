"""The on-disk form of one cache entry, and the atomic write every cache file goes through.

One file per cubin (`<key>.cubin`):

    magic "TKNNCUBN" | u32 format | u32 header bytes | u64 image bytes | sha256(header + image) | header | image

The header is JSON: the key, the spec, arch, NVRTC and tinyknn versions, NVRTC options, name
expressions -> lowered names, the ptxas report per kernel, and the creation time (what `tinyknn cache
list` shows without reading the image). The checksum covers header and image, so a truncated,
corrupted or hand-edited file is caught before a cubin is handed to the driver; a file whose magic,
format or key differ is "foreign". Files are written to a temporary name in the same folder and
renamed with os.replace, so a reader sees the old file, the new file or none, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import time
from pathlib import Path

from .._version import __version__
from ..spec import KernelSpec
from .compiler import Cubin, KernelReport

MAGIC = b"TKNNCUBN"
FORMAT_VERSION = 1
SUFFIX = ".cubin"
_PREFIX = struct.Struct("<8sIIQ32s")


class EntryError(ValueError):
    """A cache file that cannot be used; the message says why (truncated, checksum, foreign...)."""


def spec_to_dict(spec: KernelSpec) -> dict:
    return {"metric": spec.metric, "dtype": spec.dtype, "dim": spec.dim, "k": spec.k,
            "variant": spec.variant, "arch": spec.arch, "params": [list(p) for p in spec.params]}


def spec_from_dict(data: dict) -> KernelSpec:
    return KernelSpec(data["metric"], data["dtype"], data["dim"], data["k"], data["variant"], data["arch"],
                      tuple((name, value) for name, value in data["params"]))


def encode_entry(key: str, spec: KernelSpec, cubin: Cubin, options, name_expressions) -> bytes:
    header = {
        "key": key,
        "spec": spec_to_dict(spec),
        "arch": cubin.arch,
        "nvrtc_version": list(cubin.nvrtc_version),
        "tinyknn_version": __version__,
        "options": list(options),
        "name_expressions": list(name_expressions),
        "lowered_names": cubin.lowered_names,
        "reports": {name: vars(report) for name, report in cubin.reports.items()},
        "created": time.time(),
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    digest = hashlib.sha256(header_bytes + cubin.image).digest()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes), len(cubin.image), digest) + header_bytes + cubin.image


def _split(data: bytes, *, check: bool) -> tuple[dict, bytes]:
    if len(data) < _PREFIX.size:
        raise EntryError(f"truncated ({len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix)")
    magic, version, header_size, image_size, digest = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise EntryError(f"foreign (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise EntryError(f"of another format version ({version}, this tinyknn reads {FORMAT_VERSION})")
    body = data[_PREFIX.size:]
    expected = header_size + image_size
    if check and len(body) != expected:
        raise EntryError(f"truncated ({len(data)} bytes, expected {_PREFIX.size + expected})")
    if check and hashlib.sha256(body).digest() != digest:
        raise EntryError("corrupt (checksum mismatch)")
    try:
        header = json.loads(body[:header_size])
    except (UnicodeDecodeError, ValueError) as exc:
        raise EntryError(f"corrupt (unreadable header: {exc})") from None
    return header, body[header_size:expected]


def decode_entry(data: bytes, expected_key: str | None = None) -> tuple[dict, Cubin]:
    """A whole file -> (header, Cubin), checksum verified; EntryError says what is wrong."""
    header, image = _split(data, check=True)
    if expected_key is not None and header.get("key") != expected_key:
        raise EntryError(f"foreign (holds key {str(header.get('key'))[:16]}..., expected {expected_key[:16]}...)")
    try:
        cubin = Cubin(
            image=image,
            lowered_names=dict(header["lowered_names"]),
            reports={name: KernelReport(**fields) for name, fields in header["reports"].items()},
            arch=header["arch"],
            nvrtc_version=tuple(header["nvrtc_version"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EntryError(f"corrupt (header lacks or mangles {exc})") from None
    return header, cubin


def read_header(path: Path) -> dict:
    """Only the prefix and header of a file (no checksum): what listing needs, cheaply."""
    with open(path, "rb") as handle:
        prefix = handle.read(_PREFIX.size)
        if len(prefix) == _PREFIX.size and prefix.startswith(MAGIC):
            header_size = _PREFIX.unpack(prefix)[2]
            prefix += handle.read(header_size)
    return _split(prefix, check=False)[0]


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o644)   # mkstemp makes 0600; a shared cache must be readable by its users
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
