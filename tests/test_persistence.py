"""save / load / pickle: round trips, every kind of damaged file a clear ValueError (never another
exception, never an allocation beyond the file), and failed saves that leave nothing behind."""

from __future__ import annotations

import copy
import errno
import io
import json
import os
import pickle
import struct
import threading
import tracemalloc
import zipfile

import numpy as np
import pytest

import tinyknn
from reference import check_search
from test_index_api import DTYPES, METRICS, index  # noqa: F401 - index is a fixture (8 dims, 50 rows, l2)


def contents(index):
    """Everything a saved file records, for equality checks."""
    vectors, ids = index._searcher.export()
    return (index.dim, index.metric, index.dtype, index.ntotal), vectors, ids


def assert_same(first, second):
    (meta_a, vectors_a, ids_a), (meta_b, vectors_b, ids_b) = contents(first), contents(second)
    assert meta_a == meta_b
    assert np.array_equal(vectors_a, vectors_b) and np.array_equal(ids_a, ids_b)


def leftovers(directory):
    return [path.name for path in directory.iterdir() if ".tmp" in path.name]


# -- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_save_load_round_trip(tmp_path, rng, metric, dtype):
    db = rng.standard_normal((70, 5)).astype(np.float32)
    user_ids = rng.choice(10**9, size=70, replace=False)
    built = tinyknn.Index(5, metric=metric, dtype=dtype)
    built.add(db[:30], ids=user_ids[:30])
    built.add(db[30:], ids=user_ids[30:])
    path = tmp_path / "index.tknn"
    built.save(path)
    again = tinyknn.Index.load(path)
    assert (again.dim, again.metric, again.dtype, again.ntotal) == (5, metric, dtype, 70)
    q = rng.standard_normal((4, 5)).astype(np.float32)
    before, after = built.search(q, 9), again.search(q, 9)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    check_search(*after, db, q, 9, metric, dtype, id_map=user_ids)
    with pytest.raises(ValueError, match="already in it"):
        again.add(db[:1], ids=user_ids[:1])            # loaded ids are known to the index
    again.add(db[:1])                                  # automatic ids continue after the largest loaded one
    assert again._searcher.export()[1][-1] == user_ids.max() + 1
    assert not leftovers(tmp_path)


def test_save_load_empty_index(tmp_path):
    tinyknn.Index(4, metric="cosine").save(tmp_path / "empty")
    again = tinyknn.Index.load(tmp_path / "empty")
    assert again.ntotal == 0 and again.metric == "cosine"


def test_the_file_is_a_plain_npz(tmp_path, index):
    """docs/index-operations.md promises np.load reads the file: the format is the .npz np.savez writes."""
    index.save(tmp_path / "saved")
    with np.load(tmp_path / "saved", allow_pickle=False) as archive:
        header = json.loads(bytes(archive["header"]).decode())
        assert header == {"format": "tinyknn.index", "version": 2, "dim": 8, "metric": "l2", "dtype": "float32",
                          "ntotal": 50, "labels": False}
        assert np.array_equal(archive["ids"], np.arange(50)) and archive["vectors"].shape == (50, 8)


def test_load_streams_large_files_in_chunks(tmp_path, rng, monkeypatch):
    """Loading hands the vectors over a chunk at a time (here 1 KiB), and the result is the same index."""
    built = tinyknn.Index(16, metric="ip")
    built.add(rng.standard_normal((300, 16)), ids=rng.choice(10**6, 300, replace=False))
    built.save(tmp_path / "big")
    monkeypatch.setattr(tinyknn.index.persist, "CHUNK_BYTES", 1024)
    assert_same(built, tinyknn.Index.load(tmp_path / "big"))


def test_save_to_and_load_from_a_file_object(index):
    buffer = io.BytesIO()
    index.save(buffer)
    buffer.seek(0)
    assert_same(index, tinyknn.Index.load(buffer))
    with pytest.raises(ValueError, match="the data is not a (readable|valid) tinyknn index file"):
        tinyknn.Index.load(io.BytesIO(b"not a zip file at all"))


# -- damaged files ---------------------------------------------------------------------------------
def _rewrite(path, header_bytes=None, **changes):
    """Rewrite a saved file with header fields or members changed (np.savez, as the format is)."""
    with np.load(path) as archive:
        header = json.loads(bytes(archive["header"]).decode())
        arrays = {"vectors": archive["vectors"], "ids": archive["ids"]}
    header.update(changes.pop("header", {}))
    for key in changes.pop("drop", ()):
        header.pop(key)
    arrays.update(changes)
    raw = json.dumps(header).encode() if header_bytes is None else header_bytes
    with open(path, "wb") as handle:
        np.savez(handle, header=np.frombuffer(raw, np.uint8), **arrays)


@pytest.fixture
def saved(tmp_path, index):
    path = tmp_path / "saved.tknn"
    index.save(path)
    return path


def test_load_refuses_another_version(saved):
    _rewrite(saved, header={"version": 99})
    with pytest.raises(ValueError, match="format version 99; this tinyknn reads versions 1 and 2"):
        tinyknn.Index.load(saved)


def test_load_refuses_another_format(saved):
    _rewrite(saved, header={"format": "something.else"})
    with pytest.raises(ValueError, match="not a valid tinyknn index file: its header names format 'something.else'"):
        tinyknn.Index.load(saved)


@pytest.mark.parametrize("change, text", [
    ({"drop": ["dim"]}, "its header lacks dim"),
    ({"drop": ["metric", "ntotal"]}, "its header lacks metric, ntotal"),
    ({"header": {"dim": 0}}, "dim is 0; expected an integer in 1 .. 65536"),
    ({"header": {"dim": "8"}}, "dim is '8'"),
    ({"header": {"dim": True}}, "dim is True"),
    ({"header": {"dim": 8.0}}, "dim is 8.0"),
    ({"header": {"metric": "L1"}}, "metric is 'L1'; expected one of l2, ip, cosine"),
    ({"header": {"metric": None}}, "metric is None"),
    ({"header": {"dtype": "float64"}}, "dtype is 'float64'; expected one of float32, float16"),
    ({"header": {"dtype": ["float32"]}}, "dtype is \\['float32'\\]"),
    ({"header": {"ntotal": -1}}, "ntotal is -1; expected an integer >= 0"),
    ({"header": {"ntotal": 49}}, "ids.npy holds .* shape \\(50,\\); expected int64 of shape \\(49,\\)"),
    ({"vectors": np.zeros((50, 7), np.float32)},
     "vectors.npy holds .* shape \\(50, 7\\); expected float32 of shape \\(50, 8\\)"),
    ({"header": {"ntotal": 10**15}}, "expected int64 of shape \\(1000000000000000,\\)"),
    ({"header": {"version": True}}, "format version True"),
    ({"header_bytes": b"[1, 2, 3]"}, "its header is a JSON list, not an object"),
    ({"header_bytes": b'"text"'}, "its header is a JSON str"),
    ({"header_bytes": b"{not json"}, "JSONDecodeError"),
    ({"header_bytes": b"\xff\xfe"}, "UnicodeDecodeError"),
    ({"vectors": np.zeros((50, 8), np.float16)}, "vectors.npy holds a float16 array"),
    ({"vectors": np.zeros((50, 8), ">f4")}, "vectors.npy holds a >f4 array"),
    ({"vectors": np.zeros((50, 8), object)}, "vectors.npy holds a object array"),
    ({"vectors": np.full((50, 8), np.nan, np.float32)}, "contains NaN"),
    ({"ids": np.zeros(50, np.int64)}, "ids passed repeat \\[0\\]"),
    ({"ids": np.full(50, -4, np.int64) - np.arange(50)}, "ids must be >= 0"),
    ({"ids": np.arange(50, dtype=np.int32)}, "ids.npy holds a int32 array"),
])
def test_load_refuses_bad_headers_and_members(saved, change, text):
    _rewrite(saved, **change)
    with pytest.raises(ValueError, match=text):
        tinyknn.Index.load(saved)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing-member", "empty"])
def test_load_refuses_damaged_files(saved, damage):
    data = saved.read_bytes()
    if damage == "truncate":
        saved.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        saved.write_bytes(bytes(range(256)) * 10)
    elif damage == "empty":
        saved.write_bytes(b"")
    else:
        with zipfile.ZipFile(saved, "w") as archive:
            archive.writestr("vectors.npy", b"nothing")
    with pytest.raises(ValueError, match=f"{saved.name} is not a (readable|valid) tinyknn index file"):
        tinyknn.Index.load(saved)


def _patch_central_directory(data: bytes, offset: int, value: int) -> bytes:
    """Set a 16-bit field of every member's central directory entry (8: flags, 10: compression method)."""
    patched, start = bytearray(data), data.find(b"PK\x01\x02")
    while start >= 0:
        patched[start + offset:start + offset + 2] = value.to_bytes(2, "little")
        start = data.find(b"PK\x01\x02", start + 4)
    return bytes(patched)


@pytest.mark.parametrize("offset, value, text", [
    (10, 99, "zip method 99"),            # zipfile: NotImplementedError "That compression method is not supported"
    (10, 12, "zip method 12"),            # bzip2: zipfile would decompress whatever follows
    (8, 1, "flags 0x1"),                  # encrypted: zipfile would ask for a password (RuntimeError)
])
def test_load_refuses_compressed_and_encrypted_members(saved, offset, value, text):
    saved.write_bytes(_patch_central_directory(saved.read_bytes(), offset, value))
    with pytest.raises(ValueError, match=f"compressed or encrypted .*{text}"):
        tinyknn.Index.load(saved)


def test_load_missing_file_or_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        tinyknn.Index.load(tmp_path / "nothing-here")
    with pytest.raises(IsADirectoryError):
        tinyknn.Index.load(tmp_path)


def _load_or_refuse(data: bytes, original) -> str:
    """'same' when the bytes load as the original index, 'refused' for a ValueError; anything else fails."""
    try:
        loaded = tinyknn.Index.load(io.BytesIO(data))
    except ValueError:
        return "refused"
    try:
        assert_same(original, loaded)
    finally:
        loaded.close()
    return "same"


def test_every_single_byte_flip_loads_the_same_index_or_is_a_value_error(rng):
    """The audit's corruption sweep: every offset of a small file, each flipped two ways."""
    original = tinyknn.Index(3, metric="cosine", dtype="float16")
    original.add(rng.standard_normal((4, 3)), ids=[7, 3, 10**12, 0])
    buffer = io.BytesIO()
    original._write(buffer)
    data = buffer.getvalue()
    outcomes = {"same": 0, "refused": 0}
    for offset in range(len(data)):
        for mask in (0xFF, 1 << int(rng.integers(8))):
            damaged = bytearray(data)
            damaged[offset] ^= mask
            outcomes[_load_or_refuse(bytes(damaged), original)] += 1
    assert outcomes["refused"] > len(data)          # most flips are caught (CRC, sizes, headers) ...
    assert outcomes["same"] > 0                      # ... and some hit bytes nobody reads (timestamps)


def test_files_that_disagree_with_their_header_are_refused_before_reading(tmp_path):
    """Row 6: vectors of 40 MB under a header that says 3 rows: refused without allocating them,
    whether the member is stored (physically there) or deflated (a few KB on disk)."""
    big = np.zeros((10_000, 1000), np.float32)
    header = {"format": "tinyknn.index", "version": 1, "dim": 1000, "metric": "l2", "dtype": "float32", "ntotal": 3}
    raw = np.frombuffer(json.dumps(header).encode(), np.uint8)
    stored, deflated = tmp_path / "stored", tmp_path / "deflated"
    with open(stored, "wb") as handle:
        np.savez(handle, header=raw, vectors=big, ids=np.arange(3))
    with open(deflated, "wb") as handle:
        np.savez_compressed(handle, header=raw, vectors=big, ids=np.arange(3))
    del big
    assert deflated.stat().st_size < 1 << 20
    for path, text in ((stored, "vectors.npy holds a float32 array of shape \\(10000, 1000\\)"),
                       (deflated, "compressed or encrypted")):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match=text):
                tinyknn.Index.load(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"{path.name}: {peak} bytes allocated to refuse it"


def test_an_npy_header_claiming_more_rows_than_the_file_holds_allocates_nothing(saved):
    with np.load(saved) as archive:
        members = {name: archive[name] for name in ("header", "vectors", "ids")}
    header = json.loads(bytes(members["header"]).decode())
    header["ntotal"] = 2**40
    members["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    lying = io.BytesIO()          # ids.npy: a .npy header for 2**40 ids, followed by 400 bytes
    np.lib.format.write_array_header_1_0(lying, {"descr": "<i8", "fortran_order": False, "shape": (2**40,)})
    lying.write(members["ids"].tobytes())
    with zipfile.ZipFile(saved, "w") as archive:
        for name in ("header", "vectors"):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, members[name])
            archive.writestr(f"{name}.npy", buffer.getvalue())
        archive.writestr("ids.npy", lying.getvalue())
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="ids.npy holds 528 bytes; a int64 array of shape \\(1099511627776,\\)"):
            tinyknn.Index.load(saved)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


# -- saves that fail ---------------------------------------------------------------------------------
def test_a_save_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path, index, monkeypatch):
    path = tmp_path / "kept.tknn"
    index.save(path)
    before = path.read_bytes()
    real_write_array = np.lib.format.write_array
    calls = []

    def full_disk(handle, array, **kwargs):
        calls.append(array.shape)
        if len(calls) == 2:                                      # the vectors: half of them, then ENOSPC
            handle.write(array.tobytes()[: array.nbytes // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_array(handle, array, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", full_disk)
    index.add(np.ones((5, 8), np.float32))
    with pytest.raises(OSError, match="No space left"):
        index.save(path)
    assert len(calls) == 2 and path.read_bytes() == before and not leftovers(tmp_path)
    monkeypatch.setattr(np.lib.format, "write_array", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        index.save(path)
    assert path.read_bytes() == before and not leftovers(tmp_path)


def test_save_onto_a_directory_or_an_unwritable_place(tmp_path, index, monkeypatch):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        index.save(tmp_path)
    with pytest.raises(FileNotFoundError):
        index.save(tmp_path / "no-such-dir" / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    def refused(source, target):
        raise PermissionError(errno.EACCES, "Permission denied", str(target))

    monkeypatch.setattr(os, "replace", refused)                  # e.g. a read-only target directory
    with pytest.raises(PermissionError):
        index.save(tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_save_into_a_read_only_directory(tmp_path, index):
    index.save(tmp_path / "file")
    before = (tmp_path / "file").read_bytes()
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            index.save(tmp_path / "file")
    finally:
        tmp_path.chmod(0o755)
    assert (tmp_path / "file").read_bytes() == before and not leftovers(tmp_path)


def test_the_saved_file_has_ordinary_permissions(tmp_path, index):
    old = os.umask(0o022)
    try:
        index.save(tmp_path / "file")
    finally:
        os.umask(old)
    assert (tmp_path / "file").stat().st_mode & 0o777 == 0o644


def test_concurrent_saves_to_one_path_never_collide(tmp_path, rng):
    indexes = []
    for i in range(4):
        built = tinyknn.Index(8)
        built.add(rng.standard_normal((20 + i, 8)))
        indexes.append(built)
    path, errors = tmp_path / "shared", []

    def save_many(built):
        try:
            for _ in range(5):
                built.save(path)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=save_many, args=(built,)) for built in indexes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and not leftovers(tmp_path)
    assert tinyknn.Index.load(path).ntotal in (20, 21, 22, 23)


# -- pickling and copies -----------------------------------------------------------------------------
@pytest.mark.parametrize("metric", METRICS)
def test_pickle_and_copies_restore_the_same_index(rng, metric):
    built = tinyknn.Index(6, metric=metric, dtype="float16")
    built.add(rng.standard_normal((40, 6)), ids=rng.choice(10**9, 40, replace=False))
    q = rng.standard_normal((3, 6)).astype(np.float32)
    for clone in (pickle.loads(pickle.dumps(built)), copy.deepcopy(built), copy.copy(built)):
        assert clone is not built and clone._searcher is not built._searcher
        assert_same(built, clone)
        for got, expected in zip(clone.search(q, 5), built.search(q, 5)):
            assert np.array_equal(got, expected)
        clone.add(np.zeros((1, 6)))                                # independent of the original
        assert clone.ntotal == 41 and built.ntotal == 40


def test_a_closed_index_refuses_to_pickle(index):
    index.close()
    with pytest.raises(ValueError, match="cannot pickle or copy a closed tinyknn Index"):
        pickle.dumps(index)
    with pytest.raises(ValueError, match="closed"):
        copy.deepcopy(index)


@pytest.mark.gpu
def test_pickle_restores_a_cuda_index_on_cuda(rng):
    built = tinyknn.Index(8, metric="l2", device="cuda")
    db = rng.standard_normal((100, 8)).astype(np.float32)
    built.add(db)
    clone = pickle.loads(pickle.dumps(built))
    assert clone.device == "cuda" and clone.ntotal == 100
    q = rng.standard_normal((4, 8)).astype(np.float32)
    for got, expected in zip(clone.search(q, 7), built.search(q, 7)):
        assert np.array_equal(got, expected)
    assert copy.deepcopy(built).device == "cuda"


def test_a_file_of_a_dtype_the_device_lacks_says_so(saved, monkeypatch):
    from tinyknn.cpu import library

    monkeypatch.setattr(library, "DTYPE_CODES", {"float16": 1})               # a CPU without float32
    with pytest.raises(ValueError, match="dtype 'float32' is not available on device='cpu'") as caught:
        tinyknn.Index.load(saved)
    assert "not a readable" not in str(caught.value)


# -- format version 2: labels, removals, every storage dtype -----------------------------------------
def test_labels_survive_save_load_and_pickle(tmp_path, rng):
    built = tinyknn.Index(4, metric="ip")
    built.add(rng.standard_normal((30, 4)), labels=np.arange(30) % 3)
    built.add(rng.standard_normal((5, 4)))                          # no labels
    built.add(rng.standard_normal((5, 4)), labels=[-7] * 5, ids=np.arange(100, 105))
    built.save(tmp_path / "labelled")
    with np.load(tmp_path / "labelled") as archive:
        assert json.loads(bytes(archive["header"]).decode())["labels"] is True
        assert archive["labels"].tolist() == (np.arange(30) % 3).tolist() + [0] * 5 + [-7] * 5
        assert archive["has_label"].tolist() == [True] * 30 + [False] * 5 + [True] * 5
    for again in (tinyknn.Index.load(tmp_path / "labelled"), pickle.loads(pickle.dumps(built))):
        assert_same(built, again)
        assert again._labels.column()[0].tolist() == built._labels.column()[0].tolist()
        assert again._labels.column()[1].tolist() == built._labels.column()[1].tolist()
        assert again._labels.rows_of(-7).tolist() == list(range(35, 40))
        assert again._labels.rows_of(1).tolist() == list(range(1, 30, 3))


def test_a_version_1_file_still_loads(tmp_path, rng):
    """Version 1, as the first version wrote it (np.savez of header, vectors, ids; no labels)."""
    vectors = rng.standard_normal((6, 3)).astype(np.float16)
    header = {"format": "tinyknn.index", "version": 1, "dim": 3, "metric": "cosine", "dtype": "float16", "ntotal": 6}
    with open(tmp_path / "v1", "wb") as handle:
        np.savez(handle, header=np.frombuffer(json.dumps(header).encode(), np.uint8), vectors=vectors,
                 ids=np.arange(10, 16))
    again = tinyknn.Index.load(tmp_path / "v1")
    assert (again.dim, again.metric, again.dtype, again.ntotal) == (3, "cosine", "float16", 6)
    exported, ids = again._searcher.export()
    assert np.array_equal(exported, vectors) and ids.tolist() == list(range(10, 16))
    assert again._labels.column() is None
    again.add(np.ones((1, 3)))
    assert again._searcher.export()[1][-1] == 16


@pytest.mark.parametrize("changes, text", [
    ({"header": {"labels": "yes"}}, "its header's labels is 'yes'; expected true or false"),
    ({"header": {"labels": True}}, "it lacks labels.npy, has_label.npy"),
    ({"header": {"labels": True}, "labels": np.zeros(50, np.float64), "has_label": np.ones(50, bool)},
     "labels.npy holds a float64 array of shape \\(50,\\); expected int64 of shape \\(50,\\)"),
    ({"header": {"labels": True}, "labels": np.zeros(50, np.int64), "has_label": np.ones(49, bool)},
     "has_label.npy holds a bool array of shape \\(49,\\)"),
])
def test_damaged_label_members_are_refused(saved, changes, text):
    _rewrite(saved, **changes)
    with pytest.raises(ValueError, match=text):
        tinyknn.Index.load(saved)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "uint8", "float16", "float32"])
def test_every_storage_dtype_round_trips_bit_for_bit(tmp_path, monkeypatch, dtype):
    """bfloat16 is saved as its uint16 bits (NumPy reads the file without ml_dtypes), the header naming
    bfloat16; removals leave nothing but the rows. The model searcher stands in for the device."""
    from model_searcher import use_model

    use_model(monkeypatch)
    values = np.arange(-40, 40, dtype=np.float64).reshape(20, 4) * (1 if dtype in ("int8", "uint8") else 1.37)
    built = tinyknn.Index(4, dtype=dtype)
    built.add(values + 40 if dtype == "uint8" else values, labels=np.arange(20) % 2)
    assert built.remove([3, 17]) == 2
    built.save(tmp_path / "saved")
    with np.load(tmp_path / "saved") as archive:
        header = json.loads(bytes(archive["header"]).decode())
        assert header["dtype"] == dtype and header["ntotal"] == 18
        assert archive["vectors"].dtype == (np.uint16 if dtype == "bfloat16" else np.dtype(dtype))
    again = tinyknn.Index.load(tmp_path / "saved")
    assert again.dtype == dtype
    (a, a_ids), (b, b_ids) = built._searcher.export(), again._searcher.export()
    assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)) and np.array_equal(a_ids, b_ids)
    assert again._labels.rows_of(1).tolist() == built._labels.rows_of(1).tolist()
    assert again.get([4, 19]).tobytes() == built.get([4, 19]).tobytes()


# -- what load accepts: special files, other objects, streams holding several indexes ------------------
def _load_in_a_child(program: str, *args: str) -> str:
    """Run `program` (which loads something) in a child with 2 GiB of address space and a time limit, so that
    a load that reads without end fails the test instead of taking the machine's memory or hanging it."""
    import subprocess
    import sys

    checkout = os.path.dirname(os.path.dirname(tinyknn.__file__))
    prologue = ("import resource, sys, tinyknn\n"
                "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n")
    try:
        done = subprocess.run([sys.executable, "-c", prologue + program, *args], capture_output=True, text=True,
                              timeout=60, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  [checkout, os.environ.get("PYTHONPATH", "")])))
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {args} did not return within 60 s")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/null", "fifo"])
def test_load_refuses_special_files_without_reading_them(tmp_path, special):
    """/dev/zero used to be read without limit (memory grew until the process was killed) and a FIFO
    hung forever; both are refused from os.stat, before anything is opened or read."""
    if special == "fifo":
        special = str(tmp_path / "pipe")
        os.mkfifo(special)
    elif not os.path.exists(special):
        pytest.skip(f"{special} does not exist here")
    said = _load_in_a_child("try:\n    tinyknn.Index.load(sys.argv[1])\n"
                            "except ValueError as exc:\n    print('ValueError:', exc)\n", special)
    kind = "a FIFO" if special.endswith("pipe") else "a character device"
    assert said == f"ValueError: {special} is not a regular file ({kind}); an index file is a regular file " \
                   "written by Index.save", said


def test_load_refuses_a_file_object_of_a_special_file():
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    said = _load_in_a_child("with open('/dev/zero', 'rb') as handle:\n"
                            "    try:\n        tinyknn.Index.load(handle)\n"
                            "    except ValueError as exc:\n        print('ValueError:', exc)\n"
                            "    print('position', handle.tell())\n")
    assert said == "ValueError: /dev/zero is not a regular file (a character device); an index file is a regular " \
                   "file written by Index.save\nposition 0", said


def test_load_refuses_an_unseekable_file_object(saved):
    read, write = os.pipe()
    with open(read, "rb") as handle, open(write, "wb") as writer:
        writer.write(saved.read_bytes()[:100])
        writer.flush()
        with pytest.raises(ValueError, match="not a regular file \\(a FIFO\\)"):
            tinyknn.Index.load(handle)


@pytest.mark.parametrize("source, text", [
    (3, "got int: 3"), (None, "got NoneType: None"), (3.5, "got float: 3.5"), (object(), "got object"),
    (b"PK\x03\x04", "got bytes: to load an index held in memory, pass io.BytesIO\\(data\\)"),
])
def test_load_of_something_that_is_neither_a_path_nor_a_binary_file_is_a_type_error(source, text):
    with pytest.raises(TypeError, match=f"Index.load takes a path \\(str or os.PathLike\\) or a binary file object "
                                        f"open for reading \\(read, seek, tell\\); {text}"):
        tinyknn.Index.load(source)


def test_load_of_a_text_file_or_a_write_only_file_says_how_to_open_it(saved, tmp_path):
    with open(saved, "r", encoding="latin-1") as text:
        with pytest.raises(TypeError, match="got a text file \\(TextIOWrapper\\); open it in binary mode \\('rb'\\)"):
            tinyknn.Index.load(text)
    with open(tmp_path / "w", "wb") as written:
        with pytest.raises(TypeError, match="not open for reading; open it with mode 'rb'"):
            tinyknn.Index.load(written)


def test_a_stream_of_several_indexes_loads_them_one_after_another(rng):
    """Two indexes saved one after the other into one stream: load reads the one at the stream's position
    (it used to read the zip directory at the end, i.e. the last index, whatever the position) and leaves
    the stream just after it."""
    first, second = tinyknn.Index(3, metric="ip"), tinyknn.Index(5, dtype="float16")
    first.add(rng.standard_normal((7, 3)), ids=np.arange(100, 107), labels=np.arange(7) % 2)
    second.add(rng.standard_normal((11, 5)))
    stream = io.BytesIO()
    stream.write(b"leading bytes, not an index")
    start = stream.tell()
    first.save(stream)
    middle = stream.tell()
    second.save(stream)
    end = stream.tell()
    stream.write(b"trailing bytes")
    stream.seek(start)
    loaded = tinyknn.Index.load(stream)
    assert stream.tell() == middle
    assert_same(first, loaded)
    assert loaded._labels.column()[0].tolist() == (np.arange(7) % 2).tolist()
    loaded = tinyknn.Index.load(stream)
    assert stream.tell() == end
    assert_same(second, loaded)
    with pytest.raises(ValueError, match="the data is not a valid tinyknn index file: no zip member starts at "
                                         f"byte {end}"):
        tinyknn.Index.load(stream)
    assert stream.tell() == end                                        # a refused load leaves it in place


def test_a_file_with_another_index_appended_is_refused_by_path_and_read_in_turn_when_opened(tmp_path, rng):
    first, second = tinyknn.Index(4), tinyknn.Index(4)
    first.add(rng.standard_normal((6, 4)))
    second.add(rng.standard_normal((9, 4)))
    path = tmp_path / "two.tknn"
    with open(path, "wb") as handle:
        first.save(handle)
        size = handle.tell()
        second.save(handle)
    with pytest.raises(ValueError, match=f"{path} is not a valid tinyknn index file: it holds "
                                         f"{path.stat().st_size - size} bytes after the index's end \\(byte {size}\\)"):
        tinyknn.Index.load(path)
    with open(path, "rb") as handle:
        assert_same(first, tinyknn.Index.load(handle))
        assert_same(second, tinyknn.Index.load(handle))
        assert handle.read() == b""


def test_an_index_written_to_an_unseekable_stream_still_loads(rng, tmp_path):
    """Written through a pipe, zipfile puts each member's sizes after its data (data descriptors): the
    end of the archive is then found from the end of the file, which must hold this index only."""
    built = tinyknn.Index(3)
    built.add(rng.standard_normal((5, 3)))

    class Unseekable(io.RawIOBase):
        def __init__(self):
            self.data = bytearray()

        def writable(self):
            return True

        def write(self, data):
            self.data += data
            return len(data)

    sink = Unseekable()
    built.save(sink)
    assert zipfile.ZipFile(io.BytesIO(bytes(sink.data))).infolist()[0].flag_bits & 0x08
    (tmp_path / "piped").write_bytes(bytes(sink.data))
    assert_same(built, tinyknn.Index.load(tmp_path / "piped"))
    twice = io.BytesIO(bytes(sink.data) * 2)
    with pytest.raises(ValueError, match="cannot tell where the index at byte 0 ends"):
        tinyknn.Index.load(twice)
    assert twice.tell() == 0


# -- saves: long names, symbolic links, errors that name the path given ---------------------------------
def test_save_to_the_longest_file_name_the_file_system_takes(tmp_path, index):
    """The temporary file's name used to be the target's name plus ~25 characters: ENAMETOOLONG."""
    path = tmp_path / ("a" * 240 + ".tknn")
    index.save(path)
    assert_same(index, tinyknn.Index.load(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_save_over_a_symbolic_link_updates_its_target(tmp_path, index, rng):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "index.tknn"
    tinyknn.Index(8).save(target)
    link = tmp_path / "link.tknn"
    link.symlink_to(os.path.join("real", "index.tknn"))
    index.save(link)
    assert link.is_symlink() and os.readlink(link) == os.path.join("real", "index.tknn")
    assert_same(index, tinyknn.Index.load(target))
    assert not leftovers(tmp_path) and not leftovers(tmp_path / "real")
    dangling = tmp_path / "dangling.tknn"
    dangling.symlink_to(tmp_path / "real" / "new.tknn")
    index.save(dangling)
    assert dangling.is_symlink() and (tmp_path / "real" / "new.tknn").is_file()


def _raise_on(monkeypatch, name, error_number):
    real = getattr(os, name)

    def failing(first, *args, **kwargs):
        raise OSError(error_number, os.strerror(error_number), str(first))

    monkeypatch.setattr(os, name, failing)
    return real


@pytest.mark.parametrize("case", ["missing-directory", "under-a-file", "read-only-fs", "replace-refused"])
def test_a_failed_save_names_the_path_given(tmp_path, index, monkeypatch, case):
    given = os.path.join(str(tmp_path), "no-such-dir", "x.tknn")
    expected = FileNotFoundError
    if case == "under-a-file":
        (tmp_path / "file").write_bytes(b"x")
        given, expected = os.path.join(str(tmp_path), "file", "x.tknn"), NotADirectoryError
    elif case == "read-only-fs":
        given, expected = str(tmp_path / "x.tknn"), OSError
        _raise_on(monkeypatch, "open", errno.EROFS)
    elif case == "replace-refused":
        given, expected = str(tmp_path / "x.tknn"), PermissionError
        _raise_on(monkeypatch, "replace", errno.EACCES)
    with pytest.raises(expected) as caught:
        index.save(given)
    message = str(caught.value)
    assert caught.value.filename == given and repr(given) in message and ".tmp" not in message, message
    assert "cannot save the index" in message
    assert not leftovers(tmp_path)


def test_indexes_with_zip64_end_records_load_one_after_another(rng, monkeypatch):
    """Past 4 GiB zipfile writes zip64 end records; a small limit makes it write them here, and the walk
    to each index's end crosses them."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 64)
    indexes = [tinyknn.Index(4), tinyknn.Index(2, metric="cosine")]
    indexes[0].add(rng.standard_normal((20, 4)))
    indexes[1].add(rng.standard_normal((3, 2)), labels=[1, 2, 3])
    stream = io.BytesIO()
    for built in indexes:
        built.save(stream)
    assert stream.getvalue().count(b"PK\x06\x06") == 2
    stream.seek(0)
    for built in indexes:
        assert_same(built, tinyknn.Index.load(stream))
    assert stream.tell() == len(stream.getvalue())


def _strict_zip64_reader(monkeypatch) -> list:
    """zipfile made to read zip64 end records as newer CPython does (3.13.9, 3.14, patched 3.12): the
    locator's offset, taken as it stands in the file zipfile reads, may not pass the place just before the
    locator, and there (or, failing that, just before the locator) must be a zip64 end record whose central
    directory ends at that offset. Older readers (3.11) read the record just before the locator whatever
    the offset says, so without this a test passes there on code the newer ones refuse; the list returned
    collects the offsets checked."""
    real, checked = zipfile._EndRecData64, []

    def strict(fpin, offset, endrec):
        end_at = offset if offset >= 0 else fpin.seek(0, io.SEEK_END) + offset    # 3.11 counts from the end
        locator_at = end_at - zipfile.sizeEndCentDir64Locator
        before = locator_at - zipfile.sizeEndCentDir64
        fpin.seek(max(locator_at, 0))
        locator = fpin.read(zipfile.sizeEndCentDir64Locator)
        if before >= 0 and locator[:4] == zipfile.stringEndArchive64Locator:
            reloff = struct.unpack(zipfile.structEndArchive64Locator, locator)[2]
            checked.append(reloff)
            if reloff > before:
                raise zipfile.BadZipFile("Corrupt zip64 end of central directory locator")
            fpin.seek(reloff)
            record = fpin.read(zipfile.sizeEndCentDir64)
            if record[:4] != zipfile.stringEndArchive64 and reloff != before:
                fpin.seek(before)
                record = fpin.read(zipfile.sizeEndCentDir64)
            if record[:4] != zipfile.stringEndArchive64:
                raise zipfile.BadZipFile("Zip64 end of central directory record not found")
            directory_size, directory_offset = struct.unpack(zipfile.structEndArchive64, record)[8:]
            if directory_offset + directory_size != reloff:
                raise zipfile.BadZipFile("Corrupt zip64 end of central directory record")
        return real(fpin, offset, endrec)

    monkeypatch.setattr(zipfile, "_EndRecData64", strict)
    return checked


def _two_zip64_indexes(rng, monkeypatch):
    """Two indexes saved one after the other into one stream, with zip64 end records; and where the second
    starts."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 64)
    indexes = [tinyknn.Index(4), tinyknn.Index(2, metric="cosine")]
    indexes[0].add(rng.standard_normal((20, 4)))
    indexes[1].add(rng.standard_normal((3, 2)), labels=[1, 2, 3])
    stream = io.BytesIO()
    indexes[0].save(stream)
    start = stream.tell()
    indexes[1].save(stream)
    return indexes, stream, start


def test_indexes_with_zip64_end_records_load_one_after_another_under_the_strict_zip64_reader(rng, monkeypatch):
    """The second index's zip64 locator gives its zip64 end record's stream position (zipfile writes
    positions in the stream): read through a window that began at the index, a newer zipfile found that
    offset past the record and refused the file ("Corrupt zip64 end of central directory locator")."""
    indexes, stream, start = _two_zip64_indexes(rng, monkeypatch)
    checked = _strict_zip64_reader(monkeypatch)
    stream.seek(0)
    for built in indexes:
        assert_same(built, tinyknn.Index.load(stream))
    assert stream.tell() == len(stream.getvalue())
    assert checked == [stream.getvalue().rfind(b"PK\x06\x06", 0, start), stream.getvalue().rfind(b"PK\x06\x06")]


@pytest.mark.parametrize("zip64", [True, False])
def test_an_index_copied_whole_after_other_bytes_loads(rng, monkeypatch, zip64):
    """An index saved alone and its bytes then copied after others: its offsets count from its own start
    (not from the stream's), and it loads, followed by one saved in place (offsets from the stream's)."""
    if zip64:
        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 64)
    checked = _strict_zip64_reader(monkeypatch)
    copied, in_place = tinyknn.Index(3, metric="ip"), tinyknn.Index(2)
    copied.add(rng.standard_normal((9, 3)), labels=np.arange(9))
    in_place.add(rng.standard_normal((4, 2)))
    alone = io.BytesIO()
    copied.save(alone)
    stream = io.BytesIO()
    stream.write(b"other bytes" * 7)
    start = stream.tell()
    stream.write(alone.getvalue())
    middle = stream.tell()
    in_place.save(stream)
    assert stream.getvalue().count(b"PK\x06\x06") == (2 if zip64 else 0)
    stream.seek(start)
    assert_same(copied, tinyknn.Index.load(stream))
    assert stream.tell() == middle
    assert_same(in_place, tinyknn.Index.load(stream))
    assert stream.tell() == len(stream.getvalue())
    assert len(checked) == (2 if zip64 else 0)


@pytest.mark.parametrize("lie, text", [
    (lambda at, start: at + 1, "locator gives offset {lie} for the zip64 end record at byte {at}: offsets counted "
                               "from byte -1, before the data's start"),
    (lambda at, start: at - start - 1, "locator gives offset {lie} for the zip64 end record at byte {at}: offsets "
                                       "counted from byte {start1}, after the index's start \\(byte {start}\\)"),
    (lambda at, start: at - 5, "puts the central directory at byte {directory5} \\(offset {directory} from byte 5, "
                               "where its locator counts from\\); it is at byte {directory}"),
], ids=["before-the-data", "after-the-index-start", "directory-elsewhere"])
def test_a_zip64_locator_that_lies_is_refused_and_the_stream_stays(rng, monkeypatch, lie, text):
    """The locator's offset says where the archive's offsets count from: not before the stream's first
    byte, not after the index's start, and the zip64 end record's directory offset counting from there
    too (newer zipfile readers require it; older ones would read the archive shifted)."""
    indexes, stream, start = _two_zip64_indexes(rng, monkeypatch)
    data = bytearray(stream.getvalue())
    record_at, locator_at = data.rfind(b"PK\x06\x06"), data.rfind(b"PK\x06\x07")
    assert struct.unpack_from("<Q", data, locator_at + 8)[0] == record_at
    struct.pack_into("<Q", data, locator_at + 8, lie(record_at, start))
    directory = struct.unpack_from("<Q", data, record_at + 48)[0]
    stream = io.BytesIO(bytes(data))
    stream.seek(start)
    text = text.format(lie=lie(record_at, start), at=record_at, start=start, start1=start + 1, directory=directory,
                       directory5=directory + 5)
    with pytest.raises(ValueError, match=f"the data is not a valid tinyknn index file: its zip64 end record {text}"):
        tinyknn.Index.load(stream)
    assert stream.tell() == start


def test_a_central_directory_pointing_before_the_index_is_refused(rng, monkeypatch):
    """A member's offset that points into the index before it (whose header.npy zipfile would read and
    find named as asked) is refused, and the stream stays where it was."""
    indexes, stream, start = _two_zip64_indexes(rng, monkeypatch)
    data = bytearray(stream.getvalue())
    entry = data.find(b"PK\x01\x02", start)
    name_length, extra_length = struct.unpack_from("<HH", data, entry + 28)
    assert data[entry + 46:entry + 46 + name_length] == b"header.npy"
    offset_at = entry + 46 + name_length + extra_length - 8          # the zip64 extra field's local header offset
    assert struct.unpack_from("<Q", data, offset_at)[0] == start
    struct.pack_into("<Q", data, offset_at, 0)                       # the first index's header.npy
    stream = io.BytesIO(bytes(data))
    stream.seek(start)
    with pytest.raises(ValueError, match=f"its central directory puts header.npy at byte 0, before the index's "
                                         f"start \\(byte {start}\\)"):
        tinyknn.Index.load(stream)
    assert stream.tell() == start


_MEMORY_PROGRAM = """
import copy, gc, json, pickle, sys
import numpy as np
import tinyknn

def rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))

def peak():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

def measured(step):
    gc.collect()
    base = rss()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")                      # VmHWM := VmRSS
    kept = step()
    gc.collect()
    return peak() - base, rss() - base, kept

tinyknn.inputs.validate.CHUNK_BYTES = tinyknn.index.persist.CHUNK_BYTES = 1 << 20
n, dim = int(sys.argv[1]), 256
index = tinyknn.Index(dim, metric="ip")
index.add(np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32), labels=np.arange(n) % 7)
index.search(np.ones((1, dim), np.float32), 1)
out = {}
out["deepcopy"] = measured(lambda: copy.deepcopy(index))[:2]
with open(sys.argv[2], "wb") as handle:
    out["dump"] = measured(lambda: pickle.dump(index, handle))[:2]
data = pickle.dumps(index)
out["dumps"] = measured(lambda: pickle.dumps(index))[:2]
out["loads"] = measured(lambda: pickle.loads(data))[:2]
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
def test_what_copies_and_pickles_cost_in_memory(tmp_path):
    """Peak memory (VmHWM of a child process) beyond what the process held before, for a 100,000 x 256
    float32 index (102 MB of vectors; chunks of 1 MiB). deepcopy costs the copy itself and a chunk (it
    copies from searcher to searcher; through the save format in memory it cost ~1.2x the vectors more
    than the copy). pickle.dump to a file costs the format's bytes once, plus io.BytesIO's 1/8 of room to
    grow (the rows are written a chunk at a time; it used to export the whole database first: ~2.1x).
    pickle.dumps costs those bytes and the pickle (2x: nothing to gain without out-of-band buffers), and
    pickle.loads the new index and the bytes it is read from (1x beyond the new index)."""
    import subprocess
    import sys

    n = 100_000
    vectors = n * 256 * 4
    checkout = os.path.dirname(os.path.dirname(tinyknn.__file__))
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROGRAM, str(n), str(tmp_path / "pickled")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stderr[-3000:]
    cost = json.loads(done.stdout)
    slack = 8 << 20                                     # chunks, ids, labels, allocator rounding
    shown = {name: (round(high / vectors, 2), round(kept / vectors, 2)) for name, (high, kept) in cost.items()}
    copy_high, copy_kept = cost["deepcopy"]
    assert copy_high <= copy_kept + slack, shown
    assert cost["dump"][0] <= 1.125 * vectors + slack, shown
    assert cost["dumps"][0] <= 2.125 * vectors + slack, shown
    loads_high, loads_kept = cost["loads"]
    assert loads_high <= loads_kept + 1.0 * vectors + slack, shown
