"""tinyknn.groundtruth: the ground truth equals the float64 oracle (tests/reference.py) bit for bit, from arrays
and from files, in one Index or merged over shards; checkpoints resume to the same bits and refuse other
inputs; outputs keep each format's distance convention; `compare` classifies a float32 ground truth; the
command line works end to end."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from reference import contract_distances, exact_search, searched, stored

import tinyknn.io as tio
from tinyknn.groundtruth import compare, groundtruth
from tinyknn.groundtruth.command import main as command_main


def _assert_bits(got, want):
    (got_d, got_i), (want_d, want_i) = got, want
    assert got_d.dtype == np.float32 and got_i.dtype == np.int64
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_d.view(np.uint32), want_d.view(np.uint32))


def _data(rng, kind: str, n=1500, d=12, nq=40):
    x = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((nq, d)).astype(np.float32)
    if kind == "duplicated":
        x[200:260] = x[7]                       # 61 copies of one row
        x[1400:1460] = x[7]                     # ... in several shards
        q[:10] = x[7]
    elif kind == "tied":
        x = rng.integers(-2, 3, (n, d)).astype(np.float32)      # a few distinct distances: many exact ties
        q = rng.integers(-2, 3, (nq, d)).astype(np.float32)
    elif kind == "far":
        x = (x * np.float32(1e-3) + np.float32(3e4)).astype(np.float32)
        q = (q * np.float32(1e-3) + np.float32(3e4)).astype(np.float32)
    elif kind == "near-ties":
        x[700:1400] = x[:700] + (rng.standard_normal((700, d)) * 1e-6).astype(np.float32)
        q = (x[:nq] + rng.standard_normal((nq, d)).astype(np.float32) * np.float32(0.2)).astype(np.float32)
    return x, q


@pytest.mark.parametrize("kind", ["random", "duplicated", "tied", "far", "near-ties"])
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_equals_the_oracle_in_one_index_and_over_shards(rng, kind, metric):
    x, q = _data(rng, kind)
    want = exact_search(x, q, 25, metric)
    _assert_bits(groundtruth(x, q, 25, metric), want)
    _assert_bits(groundtruth(x, q, 25, metric, shard_rows=400, query_batch=16, batch_rows=128), want)


@pytest.mark.parametrize("dtype,extension", [("uint8", ".u8bin"), ("int8", ".i8bin"), ("float16", ".f16bin")])
def test_storage_dtypes_from_files(tmp_path, rng, dtype, extension):
    if dtype == "float16":
        x = rng.standard_normal((900, 10)).astype(np.float16)
        q = rng.standard_normal((30, 10)).astype(np.float16)
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, (900, 10), endpoint=True).astype(dtype)
        q = rng.integers(info.min, info.max, (30, 10), endpoint=True).astype(dtype)
        x[100:130] = x[3]
    tio.write_vectors(tmp_path / f"b{extension}", x)
    tio.write_vectors(tmp_path / f"q{extension}", q)
    got = groundtruth(str(tmp_path / f"b{extension}"), str(tmp_path / f"q{extension}"), 12, "l2", shard_rows=250)
    _assert_bits(got, exact_search(x, q.astype(np.float32), 12, "l2", dtype=dtype))


def test_files_rows_queries_limit_and_padding(tmp_path, rng):
    x, q = _data(rng, "random", n=600)
    tio.write_vectors(tmp_path / "b.fvecs", x)
    tio.write_vectors(tmp_path / "q.fvecs", q)
    got = groundtruth(tmp_path / "b.fvecs", tmp_path / "q.fvecs", 10, "l2", rows=450, queries_limit=17)
    _assert_bits(got, exact_search(x[:450], q[:17], 10, "l2"))
    d, i = groundtruth(x[:5], q, 8, "ip")                 # k > n: padded with (-inf, -1)
    _assert_bits((d, i), exact_search(x[:5], q, 8, "ip"))
    assert np.all(i[:, 5:] == -1) and np.all(d[:, 5:] == -np.inf)


def test_bases_tinyknn_cannot_store_need_a_dtype(rng):
    x, q = _data(rng, "random", n=200)
    with pytest.raises(ValueError, match=r"holds float64 values.*Pass dtype='float32'"):
        groundtruth(x.astype(np.float64), q, 5)
    _assert_bits(groundtruth(x.astype(np.float64), q, 5, dtype="float32"), exact_search(x, q, 5, "l2"))
    with pytest.raises(ValueError, match="exactly one of k .* or radius"):
        groundtruth(x, q, 5, radius=1.0)
    with pytest.raises(ValueError, match=r"rows = 201 but <ndarray \(200, 12\)> holds 200 rows"):
        groundtruth(x, q, 5, rows=201)


def test_hdf5_train_and_test_of_one_file(tmp_path, rng):
    pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    x, q = _data(rng, "random", n=500)
    path = tmp_path / "data.hdf5"
    tio.write_knn_groundtruth(path, np.zeros((len(q), 1), int), np.zeros((len(q), 1), np.float32), format="hdf5",
                              distance="angular", train=x, test=q)
    _assert_bits(groundtruth(path, path, 7, "cosine"), exact_search(x, q, 7, "cosine"))
    _assert_bits(groundtruth(f"{path}:train", f"{path}:test", 7, "l2"), exact_search(x, q, 7, "l2"))


def _range_oracle(x, q, radius, metric):
    dist = contract_distances(stored(x, "float32"), searched(q), metric)
    lims, ds, ids = [0], [], []
    for row in dist:
        hit = np.flatnonzero(row < radius if metric == "l2" else row > radius)
        order = np.lexsort((hit, row[hit] if metric == "l2" else -row[hit]))
        ds.append(row[hit][order].astype(np.float32))
        ids.append(hit[order])
        lims.append(lims[-1] + len(hit))
    return np.array(lims), np.concatenate(ds), np.concatenate(ids)


@pytest.mark.parametrize("metric,radius", [("l2", 14.0), ("ip", 4.0)])
def test_range_equals_the_oracle(rng, metric, radius):
    x, q = _data(rng, "duplicated", n=800)
    want = _range_oracle(x, q, radius, metric)
    for kwargs in ({}, {"shard_rows": 300, "query_batch": 7}):
        lims, d, i = groundtruth(x, q, metric=metric, radius=radius, **kwargs)
        np.testing.assert_array_equal(lims, want[0])
        np.testing.assert_array_equal(i, want[2])
        np.testing.assert_array_equal(d.view(np.uint32), want[1].view(np.uint32))


class _Stop(Exception):
    pass


def _interrupt_after(calls: int):
    seen = []

    def progress(done, total, stage):
        if stage.startswith("adding"):
            return
        seen.append(done)
        if len(seen) == calls:
            raise _Stop
    return progress


@pytest.mark.parametrize("radius", [None, 12.0])
def test_checkpoint_resumes_to_the_same_bits(tmp_path, rng, radius):
    x, q = _data(rng, "duplicated", n=900)
    args = dict(metric="l2", shard_rows=300, query_batch=8, k=None if radius else 15, radius=radius)
    want = groundtruth(x, q, **args)
    checkpoint = tmp_path / "run.ckpt"
    for stop_after in (2, 7):           # within the first shard, then within a later one
        with pytest.raises(_Stop):
            groundtruth(x, q, checkpoint=checkpoint, progress=_interrupt_after(stop_after), **args)
        assert checkpoint.exists()
    got = groundtruth(x, q, checkpoint=checkpoint, **args)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert not checkpoint.exists()                   # removed once the run is done


def test_checkpoint_of_other_inputs_is_refused(tmp_path, rng):
    x, q = _data(rng, "random", n=600)
    checkpoint = tmp_path / "run.ckpt"
    with pytest.raises(_Stop):
        groundtruth(x, q, 10, "l2", checkpoint=checkpoint, query_batch=8, progress=_interrupt_after(1))
    y = x.copy()
    y[-1, 0] += 1                                    # the last row is always among the sampled rows
    with pytest.raises(ValueError, match=r"run\.ckpt was written for different inputs .*sample_blake2b"):
        groundtruth(y, q, 10, "l2", checkpoint=checkpoint, query_batch=8)
    with pytest.raises(ValueError, match=r"k: checkpoint 10, this run 11"):
        groundtruth(x, q, 11, "l2", checkpoint=checkpoint, query_batch=8)
    open(checkpoint, "wb").write(b"garbage")
    with pytest.raises(ValueError, match=r"run\.ckpt is not a readable tinyknn ground-truth checkpoint"):
        groundtruth(x, q, 10, "l2", checkpoint=checkpoint, query_batch=8)


@pytest.mark.parametrize("metric,format,convert", [
    ("l2", "bigann", lambda d: d), ("ip", "bigann", lambda d: d), ("cosine", "cuvs", lambda d: 1.0 - d),
    ("l2", "hdf5", np.sqrt), ("cosine", "hdf5", lambda d: 1.0 - d), ("cosine", "npy", lambda d: d),
    ("l2", "ivecs", lambda d: d)])
def test_outputs_keep_each_formats_convention(tmp_path, rng, metric, format, convert):
    if format == "hdf5":
        pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    x, q = _data(rng, "random", n=400)
    out = tmp_path / {"hdf5": "gt.hdf5", "npy": "gt.npy", "ivecs": "gt.ivecs"}.get(format, "gt.bin")
    d, i = groundtruth(x, q, 9, metric, output=out, format=format)
    dist = contract_distances(stored(x, "float32"), searched(q), metric)
    want = convert(np.take_along_axis(dist, i, axis=1)).astype(np.float32)
    record = json.loads(open(f"{out}.json").read())
    truth = tio.read_knn_groundtruth(record["output"]["files"][0])
    np.testing.assert_array_equal(truth.ids, i)
    np.testing.assert_array_equal(truth.distances.view(np.uint32), want.view(np.uint32))
    assert record["metric"] == metric and record["k"] == 9 and record["base"]["rows"] == 400
    assert record["output"]["format"] == format and record["tinyknn"]
    assert len(record["base"]["sample_blake2b"]) == 32 and record["device"] == "cpu"
    if format == "hdf5":
        assert truth.distance == {"l2": "euclidean", "cosine": "angular"}[metric]
        assert np.array_equal(tio.read_vectors(f"{out}:train"), x)


def test_compare_classifies_a_float32_groundtruth(rng):
    """A float32 brute force (norm expansion, argpartition then sort, as cuVS's CPU fallback) on near-tie
    data: its differences from the exact answer are ties or float32 misorderings, none an error; a planted
    wrong id is the one error."""
    n, d, nq, k = 3000, 24, 120, 10
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[1500:1800] = x[:300] + (rng.standard_normal((300, d)) * 2e-6).astype(np.float32)
    x[2900:3000] = x[300:400]
    q = (x[np.r_[0:60, 300:360]] + rng.standard_normal((nq, d)) * 0.3).astype(np.float32)
    dist = (q * q).sum(1, dtype=np.float32)[:, None] + (x * x).sum(1, dtype=np.float32)[None, :] - \
        np.float32(2) * (q @ x.T)
    part = np.argpartition(dist, k - 1, axis=1)[:, :k]
    part_d = np.take_along_axis(dist, part, 1)
    order = np.argsort(part_d, axis=1)
    ids32, d32 = np.take_along_axis(part, order, 1), np.take_along_axis(part_d, order, 1).astype(np.float32)
    exact = groundtruth(x, q, k, "l2")
    result = compare((ids32, d32), exact, x, q, k, "l2")
    # the classification, recomputed independently from the oracle's float64 distances
    d64 = contract_distances(stored(x, "float32"), searched(q), "l2")
    differ = ids32 != exact[1]
    rows, cols = np.nonzero(differ)
    cand = d64[rows, ids32[rows, cols]]
    true = d64[rows, exact[1][rows, cols]]
    assert result.differ == differ.sum() > 0
    assert result.ties == np.sum(cand == true) > 0
    assert result.float32_misorderings == np.sum(cand != true) > 0
    assert result.errors == 0 and 0.99 < result.recall["ids"] <= result.recall["exact"] <= 1.0
    assert result.distances_differing > 0 and result.max_distance_relative_error < 1e-3
    planted = ids32.copy()
    far = int(np.argmax(d64[5]))
    planted[5, 3] = far
    again = compare((planted, None), exact, x, q, k, "l2")
    assert again.errors == 1 and again.examples[0]["kind"] == "error" and again.examples[0]["candidate_id"] == far
    planted[6, 4] = planted[6, 2]
    assert compare((planted, None), exact, x, q, k, "l2").duplicates == 1


def test_command_computes_and_checks(tmp_path, rng, capsys):
    x, q = _data(rng, "duplicated", n=500)
    base, queries, out = str(tmp_path / "b.fbin"), str(tmp_path / "q.fbin"), str(tmp_path / "gt.bin")
    tio.write_vectors(base, x)
    tio.write_vectors(queries, q)
    assert command_main([base, queries, "-k", "10", "-o", out, "--queries", "30", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["queries"]["rows"] == 30 and record["output"]["distance_convention"] == "squared_l2"
    truth = tio.read_knn_groundtruth(out)
    _assert_bits((truth.distances, truth.ids), exact_search(x, q[:30], 10, "l2"))
    assert command_main(["check", out, "--base", base, "--queries", queries, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["differ"] == 0 and report["recall"]["exact"] == 1.0
    wrong = truth.ids.copy()
    wrong[0, 0] = int(np.argmax(contract_distances(stored(x, "float32"), searched(q[:1]), "l2")[0]))
    tio.write_knn_groundtruth(tmp_path / "wrong.bin", wrong, truth.distances)
    assert command_main(["check", str(tmp_path / "wrong.bin"), out, "--base", base, "--queries", queries,
                         "--strict"]) == 1
    assert "real errors: 1" in capsys.readouterr().out
    assert command_main([base, queries, "-k", "5", "-o", str(tmp_path / "r.bin"), "--range", "3"]) == 2
    assert command_main([base]) == 2
    open(tmp_path / "bad.fbin", "wb").write(b"\x01\x00\x00\x00" * 3)
    assert command_main([str(tmp_path / "bad.fbin"), queries, "-k", "3", "-o", out]) == 1
    assert "bad.fbin" in capsys.readouterr().err


def test_command_range_and_progress_lines(tmp_path, rng, capsys, caplog):
    x, q = _data(rng, "random", n=300)
    base, queries, out = str(tmp_path / "b.npy"), str(tmp_path / "q.npy"), str(tmp_path / "r.bin")
    np.save(base, x)
    np.save(queries, q)
    with caplog.at_level(logging.INFO, logger="tinyknn.groundtruth"):
        assert command_main([base, queries, "--range", "10", "-o", out]) == 0
    assert "hits" in capsys.readouterr().out
    assert any("rows/s" in r.getMessage() for r in caplog.records)   # log lines: stderr is not a terminal here
    truth = tio.read_range_groundtruth(out)
    want = _range_oracle(x, q, 10.0, "l2")
    np.testing.assert_array_equal(truth.lims, want[0])
    np.testing.assert_array_equal(truth.ids, want[2])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "duplicated", "tied", "far", "near-ties"])
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_gpu_equals_cpu_and_the_oracle(rng, kind, metric):
    """One Index on the GPU, and shards of 1,700 rows merged on the GPU's answers: the oracle's bits, and the
    CPU's."""
    x, q = _data(rng, kind, n=5000, d=32, nq=100)
    want = exact_search(x, q, 20, metric)
    cpu = groundtruth(x, q, 20, metric, device="cpu")
    _assert_bits(cpu, want)
    _assert_bits(groundtruth(x, q, 20, metric, device="cuda"), cpu)
    _assert_bits(groundtruth(x, q, 20, metric, device="cuda", shard_rows=1700, query_batch=33), want)


@pytest.mark.gpu
def test_gpu_uint8_file_over_shards_equals_the_oracle(tmp_path, rng):
    """A SIFT-like uint8 file (integer distances: ties everywhere) as the scale benchmark computes it, k = 100."""
    x = np.minimum(rng.exponential(25.0, (6000, 128)), 255).astype(np.uint8)
    x[1000:1100] = x[5]
    q = x[rng.integers(0, len(x), 64)].copy()
    tio.write_vectors(tmp_path / "b.u8bin", x)
    tio.write_vectors(tmp_path / "q.u8bin", q)
    want = exact_search(x, q.astype(np.float32), 100, "l2", dtype="uint8")
    for kwargs in ({}, {"shard_rows": 2500, "query_batch": 20}):
        got = groundtruth(str(tmp_path / "b.u8bin"), str(tmp_path / "q.u8bin"), 100, "l2", device="cuda", **kwargs)
        _assert_bits(got, want)


@pytest.mark.parametrize("extension,readers", [(".u8bin", 1), (".fvecs", 1), (".npy", 1), (".u8bin", 3)])
def test_read_ahead_batches_are_the_files_rows(tmp_path, rng, monkeypatch, extension, readers):
    """The add batches read ahead by reader threads (one pread for a big-ann file, a copy for others), cut
    at the shards' boundaries, handed over in order however many read at once, each valid until the next is
    asked for (their buffers are used again: at most read_ahead + 1 of them); none left after close."""
    from tinyknn.groundtruth import batches as batches_module
    from tinyknn.groundtruth.batches import Batches, spans_of
    from tinyknn.groundtruth.inputs import Source

    monkeypatch.setattr(batches_module, "READERS", readers)

    x = rng.integers(0, 256, (1000, 12)).astype(np.uint8 if extension == ".u8bin" else np.float32)
    path = tmp_path / f"b{extension}"
    np.save(path, x) if extension == ".npy" else tio.write_vectors(path, x)
    source = Source(str(path), "the base")
    spans = spans_of(300, 1000, 300, 128)
    assert spans == [[(300, 428), (428, 556), (556, 600)], [(600, 728), (728, 856), (856, 900)], [(900, 1000)]]
    reader = Batches(source, [span for shard in spans for span in shard], read_ahead=2)
    got, buffers = [], set()
    for a, b, rows in reader:
        assert not isinstance(rows, np.memmap)          # read into memory of their own
        np.testing.assert_array_equal(rows, x[a:b])
        got.append((a, b, rows.copy()))
        buffers.add(id(rows.base))
    reader.close()
    assert not _readers()
    assert [(a, b) for a, b, _ in got] == [span for shard in spans for span in shard]
    np.testing.assert_array_equal(np.concatenate([rows for _, _, rows in got]), x[300:])
    assert len(buffers) <= 3, len(buffers)
    source.close()


def _readers() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("tinyknn-groundtruth-reader")]


@pytest.fixture
def overlapped(monkeypatch):
    """The GPU's file path on the CPU: shards by default (of at least 100 rows here), a reader thread that
    runs up to three batches ahead of the adds and searches."""
    from tinyknn.groundtruth import compute

    monkeypatch.setattr(compute, "_overlaps", lambda base, device, client: base.path is not None)
    monkeypatch.setattr(compute, "MIN_OVERLAP_SHARD_ROWS", 100)
    monkeypatch.setattr(compute, "READ_AHEAD_BYTES", 3 * 64 * 16)
    return compute


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_overlapped_shards_equal_one_index_and_resume(tmp_path, rng, overlapped, monkeypatch, metric):
    """A uint8 file (integer distances: float32 ties across shards everywhere) cut into 8 shards by default,
    read ahead across their boundaries: the bits of one Index over every row, also when cut short in the
    first and a later shard and resumed, and when resumed where the read does not overlap (another device:
    the checkpoint's shards are kept)."""
    x = np.minimum(rng.exponential(25.0, (1000, 16)), 255).astype(np.uint8)
    x[500:560] = x[3]
    q = np.concatenate([x[[3, 10, 700]], rng.integers(0, 256, (37, 16))]).astype(np.uint8)
    tio.write_vectors(tmp_path / "b.u8bin", x)
    tio.write_vectors(tmp_path / "q.u8bin", q)
    base, queries = str(tmp_path / "b.u8bin"), str(tmp_path / "q.u8bin")
    args = dict(metric=metric, batch_rows=64, query_batch=16)
    want = groundtruth(x, q, 30, shard_rows=1000, **args)                   # one Index, no reader thread
    _assert_bits(want, exact_search(x, q.astype(np.float32), 30, metric, dtype="uint8"))
    _assert_bits(groundtruth(base, queries, 30, output=tmp_path / "gt.bin", **args), want)
    record = json.loads((tmp_path / "gt.bin.json").read_text())
    assert record["shards"] == 8          # ceil(1000 / 8) = 125 rows
    # where the time went: every stage of a file run with 8 shards, none negative, together the whole run
    stages = record["stages_seconds"]
    assert set(stages) == {"opening", "reading and adding", "searching", "merging", "writing"}
    assert min(stages.values()) >= 0 and sum(stages.values()) >= record["seconds"] - 0.01
    checkpoint = tmp_path / "run.ckpt"
    for stop_after in (2, 10):
        with pytest.raises(_Stop):
            groundtruth(base, queries, 30, checkpoint=checkpoint, progress=_interrupt_after(stop_after), **args)
        assert checkpoint.exists() and not _readers()           # the reader stopped with the run
    _assert_bits(groundtruth(base, queries, 30, checkpoint=checkpoint, **args), want)
    with pytest.raises(_Stop):
        groundtruth(base, queries, 30, checkpoint=checkpoint, progress=_interrupt_after(5), **args)
    monkeypatch.setattr(overlapped, "_overlaps", lambda base, device, client: False)   # default: one shard
    _assert_bits(groundtruth(base, queries, 30, checkpoint=checkpoint, **args), want)
    assert not checkpoint.exists()


def test_a_failed_read_stops_the_run_and_its_reader(tmp_path, rng, overlapped, monkeypatch):
    """The reader's error is raised in the caller (the first batch of the fourth shard of 100 rows), and the
    reader is gone."""
    from tinyknn.groundtruth.inputs import Source

    x = rng.integers(0, 256, (600, 8)).astype(np.uint8)
    tio.write_vectors(tmp_path / "b.u8bin", x)
    real = Source.read

    def read(self, start, stop, into=None):
        if start >= 300:
            raise OSError(f"cannot read rows {start}..{stop}")
        return real(self, start, stop, into)

    monkeypatch.setattr(Source, "read", read)
    with pytest.raises(OSError, match="cannot read rows 300..364"):
        groundtruth(str(tmp_path / "b.u8bin"), x[:5], 4, "l2", batch_rows=64)
    assert not _readers()


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_gpu_overlapped_shards_equal_the_oracle_and_resume_across_devices(tmp_path, rng, monkeypatch, metric):
    """A SIFT-like uint8 file on the GPU, cut by default into 8 shards (of at least 500 rows here) read ahead
    while each is searched: the oracle's bits; a run cut short on the GPU resumes on the CPU (keeping the
    checkpoint's shards) and one cut short on the CPU resumes on the GPU, to the same bits."""
    from tinyknn.groundtruth import compute

    monkeypatch.setattr(compute, "MIN_OVERLAP_SHARD_ROWS", 500)
    monkeypatch.setattr(compute, "READ_AHEAD_BYTES", 4 * 256 * 128)
    x = np.minimum(rng.exponential(25.0, (6000, 128)), 255).astype(np.uint8)
    x[1000:1100] = x[5]
    x[5500:5550] = x[5]
    q = x[rng.integers(0, len(x), 50)].copy()
    tio.write_vectors(tmp_path / "b.u8bin", x)
    tio.write_vectors(tmp_path / "q.u8bin", q)
    base, queries = str(tmp_path / "b.u8bin"), str(tmp_path / "q.u8bin")
    want = exact_search(x, q.astype(np.float32), 100, metric, dtype="uint8")
    args = dict(metric=metric, batch_rows=256, query_batch=16)
    _assert_bits(groundtruth(base, queries, 100, device="cuda", output=tmp_path / "gt.bin", **args), want)
    assert json.loads((tmp_path / "gt.bin.json").read_text())["shards"] == 8
    checkpoint = tmp_path / "run.ckpt"
    for first, then in (("cuda", "cpu"), ("cpu", "cuda")):
        shard_rows = None if first == "cuda" else 1500        # the CPU's default would be one (never cut short)
        with pytest.raises(_Stop):
            groundtruth(base, queries, 100, device=first, checkpoint=checkpoint, progress=_interrupt_after(9),
                        shard_rows=shard_rows, **args)
        _assert_bits(groundtruth(base, queries, 100, device=then, checkpoint=checkpoint, **args), want)
        assert not checkpoint.exists() and not _readers()
