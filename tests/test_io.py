"""tinyknn.io: every format round-trips (whole and in slices), the peers' readers read what we write (FAISS's
contrib.vecs_io, h5py, NumPy by hand following big-ann's and cuVS's layouts), and damaged files are
ValueErrors naming the file, found before anything large is allocated."""

from __future__ import annotations

import os
import struct
import sys
import tracemalloc

import numpy as np
import pytest

import tinyknn.io as tio
from tinyknn.io import binfmt

VECTOR_CASES = [(".fvecs", np.float32), (".bvecs", np.uint8), (".ivecs", np.int32), (".fbin", np.float32),
                (".f16bin", np.float16), (".u8bin", np.uint8), (".i8bin", np.int8), (".ibin", np.int32),
                (".u64bin", np.uint64), (".npy", np.float32), (".npy", np.uint8), (".hdf5", np.float32)]


def _values(rng, dtype, shape=(37, 5)):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape, endpoint=True).astype(dtype)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """Work in tmp_path with relative paths, so messages can be checked for the path as given."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("extension,dtype", VECTOR_CASES)
def test_vectors_round_trip_and_slices(here, rng, extension, dtype):
    if extension == ".hdf5":
        pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    x = _values(rng, dtype)
    path = "v" + extension
    tio.write_vectors(path, x)
    whole = tio.read_vectors(path)
    assert whole.dtype == np.dtype(dtype) and np.array_equal(whole, x)
    for start, stop in ((0, 0), (3, 11), (36, 37), (0, 37)):
        assert np.array_equal(tio.read_vectors(path, start, stop), x[start:stop])
    mapped = tio.open_vectors(path)
    assert tuple(mapped.shape) == x.shape and np.array_equal(np.asarray(mapped[5:9]), x[5:9])
    with pytest.raises(ValueError, match=r"v\.\w+.*37"):
        tio.read_vectors(path, 10, 38)


def test_wide_header_round_trip_and_detection(here, rng):
    x = _values(rng, np.float32)
    tio.write_vectors("w.fbin", x, wide_header=True)
    raw = open("w.fbin", "rb").read()
    assert struct.unpack("<QQ", raw[:16]) == x.shape and len(raw) == 16 + x.nbytes
    assert np.array_equal(tio.read_vectors("w.fbin", 2, 7), x[2:7])
    assert binfmt.header("w.fbin", ".fbin") == (37, 5, 16)
    tio.write_vectors("n.fbin", x)
    assert binfmt.header("n.fbin", ".fbin") == (37, 5, 8)


def test_faiss_reads_our_texmex_files_and_we_read_theirs(here, rng):
    vecs_io = pytest.importorskip("faiss.contrib.vecs_io", reason="faiss (the bench extra) is not installed")
    x, b, i = _values(rng, np.float32), _values(rng, np.uint8), _values(rng, np.int32)
    tio.write_vectors("x.fvecs", x)
    tio.write_vectors("b.bvecs", b)
    tio.write_vectors("i.ivecs", i)
    assert np.array_equal(vecs_io.fvecs_read("x.fvecs"), x)
    assert np.array_equal(vecs_io.ivecs_read("i.ivecs"), i)
    assert np.array_equal(np.asarray(vecs_io.bvecs_mmap("b.bvecs")), b)
    vecs_io.fvecs_write("theirs.fvecs", x)
    vecs_io.ivecs_write("theirs.ivecs", i)
    assert np.array_equal(tio.read_vectors("theirs.fvecs"), x)
    assert np.array_equal(tio.read_vectors("theirs.ivecs", 4, 9), i[4:9])


def test_bigann_binaries_read_by_hand(here, rng):
    """The layouts as big-ann's dataset_io and cuVS document them, read with plain NumPy."""
    x = _values(rng, np.uint8)
    tio.write_vectors("x.u8bin", x)
    n, d = np.fromfile("x.u8bin", dtype="<u4", count=2)
    assert (n, d) == x.shape and os.path.getsize("x.u8bin") == 8 + x.size
    assert np.array_equal(np.fromfile("x.u8bin", dtype=np.uint8, offset=8).reshape(n, d), x)
    ids, dist = rng.integers(0, 10_000, (6, 4)), rng.random((6, 4)).astype(np.float32)
    tio.write_knn_groundtruth("gt.bin", ids, dist, format="bigann")
    nq, k = np.fromfile("gt.bin", dtype="<u4", count=2)
    body = np.fromfile("gt.bin", dtype="<i4", offset=8)
    assert (nq, k) == (6, 4) and np.array_equal(body[:24].reshape(6, 4), ids)
    assert np.array_equal(body[24:].view("<f4").reshape(6, 4), dist)
    tio.write_knn_groundtruth("pair", ids, dist, format="cuvs")
    assert np.array_equal(np.fromfile("pair.neighbors.ibin", dtype="<i4", offset=8).reshape(6, 4), ids)
    assert np.array_equal(np.fromfile("pair.distances.fbin", dtype="<f4", offset=8).reshape(6, 4), dist)


def test_range_groundtruth_layout_and_round_trip(here, rng):
    lims = np.array([0, 3, 3, 7, 8])
    ids, dist = rng.integers(0, 1000, 8), rng.random(8).astype(np.float32)
    tio.write_range_groundtruth("r.bin", lims, ids, dist)
    nq, total = np.fromfile("r.bin", dtype="<i4", count=2)
    counts = np.fromfile("r.bin", dtype="<i4", count=4, offset=8)
    assert (nq, total) == (4, 8) and np.array_equal(counts, [3, 0, 4, 1])
    assert np.array_equal(np.fromfile("r.bin", dtype="<i4", count=8, offset=24), ids)
    assert np.array_equal(np.fromfile("r.bin", dtype="<f4", count=8, offset=56), dist)
    whole = tio.read_range_groundtruth("r.bin")
    assert np.array_equal(whole.lims, lims) and np.array_equal(whole.ids, ids) and np.array_equal(whole.distances, dist)
    part = tio.read_range_groundtruth("r.bin", start=1, stop=3)
    assert np.array_equal(part.lims, [0, 0, 4]) and np.array_equal(part.ids, ids[3:7])
    tio.write_range_groundtruth("r.npy", lims, ids, dist, format="npy")
    back = tio.read_range_groundtruth("r.npy")
    assert np.array_equal(back.lims, lims) and np.array_equal(back.ids, ids) and back.format == "npy"


@pytest.mark.parametrize("format", ["bigann", "cuvs", "ivecs", "npy", "hdf5"])
def test_knn_groundtruth_round_trip(here, rng, format):
    if format == "hdf5":
        pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    ids, dist = rng.integers(-1, 50_000, (9, 7)), rng.random((9, 7)).astype(np.float32)
    out = {"hdf5": "gt.hdf5", "ivecs": "gt.ivecs", "npy": "gt.npy"}.get(format, "gt")
    paths = tio.write_knn_groundtruth(out, ids, dist, format=format, distance="euclidean")
    assert all(os.path.exists(p) for p in paths)
    truth = tio.read_knn_groundtruth(paths[0])
    assert truth.format == format and np.array_equal(truth.ids, ids) and np.array_equal(truth.distances, dist)
    part = tio.read_knn_groundtruth(paths[0], start=2, stop=5)
    assert np.array_equal(part.ids, ids[2:5]) and np.array_equal(part.distances, dist[2:5])
    if format == "hdf5":
        assert truth.distance == "euclidean"


def test_h5py_reads_our_ann_benchmarks_file(here, rng):
    h5py = pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    train, test = _values(rng, np.float32, (20, 4)), _values(rng, np.float32, (3, 4))
    ids, dist = rng.integers(0, 20, (3, 5)), rng.random((3, 5)).astype(np.float32)
    tio.write_knn_groundtruth("a.hdf5", ids, dist, format="hdf5", distance="angular", train=train, test=test)
    with h5py.File("a.hdf5", "r") as f:
        assert f.attrs["distance"] == "angular" and f.attrs["point_type"] == "float"
        assert f["neighbors"].dtype == np.int32 and f["distances"].dtype == np.float32
        assert np.array_equal(f["train"][()], train) and np.array_equal(f["test"][()], test)
        assert np.array_equal(f["neighbors"][()], ids)
    assert np.array_equal(tio.read_vectors("a.hdf5:test"), test)
    assert np.array_equal(tio.read_vectors("a.hdf5", 3, 6), train[3:6])


def test_missing_h5py_names_the_extra(here, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(ImportError, match=r"pip install tinyknn\[hdf5\]"):
        tio.write_vectors("x.hdf5", np.zeros((2, 2), np.float32))


def test_uint32_cuvs_ids_and_u64bin_for_ids_past_int32(here):
    big = np.array([[3, (1 << 31) + 5], [(1 << 32) - 2, -1]], dtype=np.int64)
    dist = np.zeros((2, 2), np.float32)
    tio.write_vectors("c.neighbors.ibin", big.astype(np.uint32).view(np.int32))   # cuVS writes uint32 into .ibin
    tio.write_vectors("c.distances.fbin", dist)
    assert np.array_equal(tio.read_knn_groundtruth("c.neighbors.ibin").ids[0], big[0])
    huge = np.array([[1 << 40, 7], [-1, 2]], dtype=np.int64)
    paths = tio.write_knn_groundtruth("u", huge, dist, format="cuvs")
    assert paths[0] == "u.neighbors.u64bin"
    assert np.array_equal(tio.read_knn_groundtruth("u").ids, huge)
    with pytest.raises(ValueError, match=r"gt\.bin.*int32.*cuvs"):
        tio.write_knn_groundtruth("gt.bin", huge, dist, format="bigann")


def test_writes_are_atomic(here, monkeypatch, rng):
    x = _values(rng, np.float32)
    tio.write_vectors("keep.fbin", x)
    before = open("keep.fbin", "rb").read()

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(binfmt, "write_rows", broken)
    with pytest.raises(OSError, match="simulated"):
        tio.write_vectors("keep.fbin", x * 2)
    assert open("keep.fbin", "rb").read() == before
    assert sorted(os.listdir(".")) == ["keep.fbin"]


def test_writers_refuse_lossy_dtypes_and_bad_shapes(here):
    with pytest.raises(ValueError, match=r"x\.fbin.*float64"):
        tio.write_vectors("x.fbin", np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"x\.u8bin.*int16"):
        tio.write_vectors("x.u8bin", np.zeros((2, 3), np.int16))
    with pytest.raises(ValueError, match=r"x\.fvecs.*2-D"):
        tio.write_vectors("x.fvecs", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="unknown vector file extension"):
        tio.write_vectors("x.txt", np.zeros((2, 3), np.float32))
    assert not os.listdir(".")


# -- damaged files ------------------------------------------------------------------------------------------
def _fvecs(path, x):
    tio.write_vectors(path, x)
    return bytearray(open(path, "rb").read())


def test_empty_and_truncated_files(here, rng):
    for name in ("e.fvecs", "e.fbin", "e.u8bin", "e.npy", "gt.bin"):
        open(name, "wb").close()
        read = tio.read_knn_groundtruth if name == "gt.bin" else tio.read_vectors
        with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')} is empty"):
            read(name)
    raw = _fvecs("t.fvecs", _values(rng, np.float32))
    open("t.fvecs", "wb").write(raw[:-3])
    with pytest.raises(ValueError, match=r"t\.fvecs is 885 bytes, not a whole number .* truncated or ragged"):
        tio.read_vectors("t.fvecs")
    tio.write_vectors("t.fbin", _values(rng, np.float32))
    raw = open("t.fbin", "rb").read()
    open("t.fbin", "wb").write(raw[:-1])
    with pytest.raises(ValueError, match=r"t\.fbin: its header says 37 rows x 5 columns .* 748 bytes .* 747 bytes"):
        tio.open_vectors("t.fbin")
    np.save("t.npy", _values(rng, np.float32))
    raw = open("t.npy", "rb").read()
    open("t.npy", "wb").write(raw[:-8])
    with pytest.raises(ValueError, match=r"t\.npy"):
        tio.read_vectors("t.npy")


def test_ragged_fvecs_found_by_sampled_rows_and_by_slices(here, rng):
    x = _values(rng, np.float32, (3000, 4))
    raw = _fvecs("r.fvecs", x)
    row = 4 + 4 * 4
    last = bytearray(raw)
    last[(2999) * row:(2999) * row + 4] = struct.pack("<i", 3)
    open("r.fvecs", "wb").write(last)
    with pytest.raises(ValueError, match=r"r\.fvecs is ragged: row 2,999 has dimension prefix 3"):
        tio.open_vectors("r.fvecs")
    # a row that the sample skips is still caught when a slice reads it
    middle = bytearray(raw)
    sampled = set(np.linspace(0, 2999, num=1024).astype(int)) | {0, 2999}
    hidden = next(i for i in range(1, 2999) if i not in sampled)
    middle[hidden * row:hidden * row + 4] = struct.pack("<i", 9)
    open("r.fvecs", "wb").write(middle)
    assert tio.open_vectors("r.fvecs").shape == (3000, 4)
    with pytest.raises(ValueError, match=rf"r\.fvecs is ragged: row {hidden:,} has dimension prefix 9"):
        tio.read_vectors("r.fvecs", hidden - 1, hidden + 2)
    # a genuinely ragged file whose total size still divides: caught by the size or the sample
    a, b = _fvecs("a.fvecs", _values(rng, np.float32, (2, 6))), _fvecs("b.fvecs", _values(rng, np.float32, (2, 2)))
    open("mixed.fvecs", "wb").write(a + b + b + b)
    with pytest.raises(ValueError, match=r"mixed\.fvecs"):
        tio.read_vectors("mixed.fvecs")


def test_wrong_extension_for_the_values(here, rng):
    tio.write_vectors("x.u8bin", _values(rng, np.uint8))
    os.rename("x.u8bin", "x.fbin")
    with pytest.raises(ValueError, match=r"x\.fbin: .* fits 1-byte values \(\.u8bin/\.i8bin\)"):
        tio.read_vectors("x.fbin")
    tio.write_vectors("y.fvecs", _values(rng, np.float32))
    os.rename("y.fvecs", "y.bvecs")
    with pytest.raises(ValueError, match=r"y\.bvecs .* is it a \.fvecs file\?"):
        tio.read_vectors("y.bvecs")
    tio.write_vectors("z.ibin", _values(rng, np.int32))
    with pytest.raises(ValueError, match=r"gt\.bin: its header says .* fits ids alone"):
        open("gt.bin", "wb").write(open("z.ibin", "rb").read())
        tio.read_knn_groundtruth("gt.bin", format="bigann")


@pytest.mark.parametrize("name,header", [
    ("huge.fbin", struct.pack("<II", 0xFFFFFFFF, 4096)),
    ("huge.u8bin", struct.pack("<QQ", 1 << 40, 1 << 20)),
    ("huge.fvecs", struct.pack("<i", 1 << 23)),
    ("huge.gt", struct.pack("<II", 1 << 31, 1000)),
    ("huge.range", struct.pack("<ii", (1 << 31) - 1, (1 << 31) - 1)),
])
def test_lying_headers_fail_before_any_large_allocation(here, name, header):
    open(name, "wb").write(header + bytes(64))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=name.replace(".", "[.]")):
            if name.endswith(".gt"):
                tio.read_knn_groundtruth(name, format="bigann")
            elif name.endswith(".range"):
                tio.read_range_groundtruth(name)
            else:
                tio.read_vectors(name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak:,} bytes allocated while refusing {name}"


def test_range_counts_that_disagree_with_the_header(here):
    open("r.bin", "wb").write(struct.pack("<ii", 2, 3) + struct.pack("<ii", 1, 1) + bytes(24))
    with pytest.raises(ValueError, match=r"r\.bin: the per-query counts sum to 2 .* header says 3"):
        tio.read_range_groundtruth("r.bin")


def test_cuvs_pair_that_disagrees(here, rng):
    tio.write_vectors("p.neighbors.ibin", _values(rng, np.int32, (4, 3)))
    tio.write_vectors("p.distances.fbin", _values(rng, np.float32, (4, 2)))
    with pytest.raises(ValueError, match=r"p\.neighbors\.ibin holds 4 x 3 ids but p\.distances\.fbin 4 x 2"):
        tio.read_knn_groundtruth("p")
    with pytest.raises(FileNotFoundError, match="nothing"):
        tio.read_knn_groundtruth("nothing", format="cuvs")


def test_not_an_hdf5_file(here):
    pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    open("x.hdf5", "wb").write(b"not hdf5 at all" * 10)
    with pytest.raises(ValueError, match=r"x\.hdf5 is not a readable HDF5 file"):
        tio.read_vectors("x.hdf5")
    tio.write_vectors("y.hdf5", np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match=r"y\.hdf5 has no dataset 'test'"):
        tio.read_vectors("y.hdf5:test")


def _peer_read_vectors(path: str, extension: str, dtype) -> np.ndarray:
    """A vector file as the benchmarks' own readers read it: FAISS's contrib.vecs_io for TEXMEX, big-ann's
    `xbin_mmap` (an 8-byte header, then the values) for the binaries, np.load, h5py."""
    if extension in (".fvecs", ".ivecs", ".bvecs"):
        vecs_io = pytest.importorskip("faiss.contrib.vecs_io", reason="faiss (the bench extra) is not installed")
        read = {".fvecs": vecs_io.fvecs_read, ".ivecs": vecs_io.ivecs_read, ".bvecs": vecs_io.bvecs_mmap}[extension]
        return np.asarray(read(path))
    if extension == ".npy":
        return np.load(path)
    if extension == ".hdf5":
        h5py = pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
        with h5py.File(path, "r") as f:
            return f["train"][()]
    n, d = np.fromfile(path, dtype="<u4", count=2)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=8, shape=(int(n), int(d)))


@pytest.mark.parametrize("extension,dtype", VECTOR_CASES)
def test_every_vector_writer_is_read_by_the_peers_readers(here, rng, extension, dtype):
    x = _values(rng, dtype)
    tio.write_vectors("v" + extension, x)
    got = _peer_read_vectors("v" + extension, extension, dtype)
    assert got.shape == x.shape and np.array_equal(got, x)


def _peer_read_knn(paths: tuple, format: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, distances) of a k-NN ground truth as its benchmark reads it: big-ann's `knn_result_read`, cuVS's
    .ibin/.fbin pair by hand, FAISS's ivecs_read/fvecs_read, np.load, h5py."""
    if format == "bigann":
        nq, k = np.fromfile(paths[0], dtype="<u4", count=2)
        ids = np.fromfile(paths[0], dtype="<i4", count=nq * k, offset=8).reshape(nq, k)
        return ids, np.fromfile(paths[0], dtype="<f4", count=nq * k, offset=8 + 4 * nq * k).reshape(nq, k)
    if format == "cuvs":
        pair = [np.fromfile(p, dtype=t, offset=8).reshape(np.fromfile(p, dtype="<u4", count=2))
                for p, t in zip(paths, ("<i4", "<f4"))]
        return pair[0], pair[1]
    if format == "ivecs":
        vecs_io = pytest.importorskip("faiss.contrib.vecs_io", reason="faiss (the bench extra) is not installed")
        return vecs_io.ivecs_read(paths[0]), vecs_io.fvecs_read(paths[1])
    if format == "npy":
        return np.load(paths[0]), np.load(paths[1])
    h5py = pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    with h5py.File(paths[0], "r") as f:
        return f["neighbors"][()], f["distances"][()]


@pytest.mark.parametrize("format", ["bigann", "cuvs", "ivecs", "npy", "hdf5"])
def test_every_groundtruth_writer_is_read_by_the_peers_readers(here, rng, format):
    ids, dist = rng.integers(0, 50_000, (9, 7)), rng.random((9, 7)).astype(np.float32)
    out = {"hdf5": "gt.hdf5", "ivecs": "gt.ivecs", "npy": "gt.npy"}.get(format, "gt")
    paths = tio.write_knn_groundtruth(out, ids, dist, format=format, distance="euclidean")
    got_ids, got_dist = _peer_read_knn(paths, format)
    assert np.array_equal(got_ids, ids) and np.array_equal(got_dist.view(np.uint32), dist.view(np.uint32))
    lims = np.array([0, 3, 3, 7, 8])
    if format == "npy":                            # the range layout, read by np.load
        written = tio.write_range_groundtruth("r.npy", lims, ids.ravel()[:8], dist.ravel()[:8], format="npy")
        back = [np.load(p) for p in written]
        assert np.array_equal(back[0], lims) and np.array_equal(back[1], ids.ravel()[:8])
        assert np.array_equal(back[2], dist.ravel()[:8])
