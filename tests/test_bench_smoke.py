"""The search benchmark keeps working: its quick CPU run end to end, the float64 oracle and agreement it
reports (against tests/reference.py), its recall, its data and its sweeps."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench modules import each other by name (oracle, _common)


def _bench_module(name: str):
    """bench/<name>.py loaded by path (bench/ is not a package; `datasets` would clash with PyPI's)."""
    spec = importlib.util.spec_from_file_location(f"tinyknn_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_search_quick_cpu_writes_exact_tinyknn_rows(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH / "search.py"), "--quick", "--device", "cpu", "--out", str(tmp_path),
         "--budget-s", "600"],                      # a loaded machine must not turn rows into skips
        capture_output=True, text=True, timeout=900,
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    (result_file,) = tmp_path.glob("search_quick_*.json")
    assert list(tmp_path.glob("search_quick_*.png")), output
    result = json.loads(result_file.read_text())
    assert result["environment"]["date"] and result["environment"]["libraries"]["numpy"]
    rows, skipped = result["results"]["rows"], result["results"]["skipped"]
    assert all(r["median_ms"] > 0 and r["timing_us"]["n"] >= 1 for r in rows), rows
    tiny = [r for r in rows if r["peer"] == "tinyknn-cpu"]
    assert tiny, f"no tinyknn-cpu rows; skipped: {[s for s in skipped if s['peer'] == 'tinyknn-cpu']}"
    assert [r["recall"] for r in tiny] == [1.0] * len(tiny), tiny
    assert {"faiss", "numpy"} <= {r["peer"] for r in rows}, skipped   # the bench extra is installed in CI
    assert all(r["recall"] == 1.0 for r in rows if r["dtype"] == "float32"), rows
    assert [r["agreement"] for r in tiny] == [1.0] * len(tiny), tiny   # the exactness contract, ties included
    assert all(0.0 <= r["agreement"] <= 1.0 and r["agreement_queries"] >= 1 for r in rows), rows
    # the float64 oracle: NumPy, or torch on a CUDA device where the machine has one (the GPU machine does)
    assert all(run["backend"] in ("numpy", "torch cuda") for run in result["results"]["oracle"]["runs"]), \
        result["results"]["oracle"]
    assert "configuration" in done.stdout and "| workload | nq |" in done.stdout  # the tables come last
    assert done.stdout.rstrip().splitlines()[-1].startswith(("Cells:", "- skipped"))


def test_recall_counts_ties_and_rejects_wrong_or_repeated_ids():
    datasets = _bench_module("datasets")
    rng = np.random.default_rng(7)
    db = rng.standard_normal((500, 16)).astype(np.float32)
    db[1] = db[0]                                   # an exact tie
    queries = np.vstack([db[0] + 0.01, rng.standard_normal((9, 16))]).astype(np.float32)
    truth = datasets.ground_truth(db, queries, k=1, metric="l2")
    exact = ((queries[:, None, :].astype(np.float64) - db[None].astype(np.float64)) ** 2).sum(-1)
    best = exact.argmin(axis=1)
    assert np.allclose(truth.kth[:, 0], exact.min(axis=1))
    assert datasets.recall(best[:, None], truth, db, queries) == 1.0
    tie = best.copy()
    tie[0] = 1 - best[0]                            # the other copy of the tied row
    assert datasets.recall(tie[:, None], truth, db, queries) == 1.0
    wrong = best.copy()
    wrong[3] = exact[3].argmax()
    assert datasets.recall(wrong[:, None], truth, db, queries) == 0.9
    truth3 = datasets.ground_truth(db, queries, k=3, metric="ip")
    top3 = np.argsort(-(queries.astype(np.float64) @ db.T.astype(np.float64)), axis=1)[:, :3]
    assert datasets.recall(top3, truth3, db, queries) == 1.0
    top3[:, 2] = top3[:, 0]                         # a repeated id is counted once
    assert abs(datasets.recall(top3, truth3, db, queries) - 2 / 3) < 1e-12


def test_idx_images_are_read_and_checked(tmp_path):
    datasets = _bench_module("datasets")
    images = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    header = np.array([0x803, 3, 4, 5], dtype=">u4").tobytes()
    with gzip.open(tmp_path / "x-idx3-ubyte.gz", "wb") as handle:
        handle.write(header + images.tobytes())
    read = datasets.read_idx_images(tmp_path / "x-idx3-ubyte.gz")
    assert read.shape == (3, 20) and np.array_equal(read, images.reshape(3, 20))
    (tmp_path / "bad").write_bytes(header + images.tobytes()[:-1])
    with pytest.raises(ValueError, match="IDX3"):
        datasets.read_idx_images(tmp_path / "bad")
    folder, why = datasets.find_fashion_mnist(tmp_path, install=False)
    assert folder is None and "train-images-idx3-ubyte" in why


def test_cpu_sweep_covers_every_value_of_every_axis():
    search = _bench_module("search")
    sweep = search.choose_sweep(search.parse_args(["--device", "cpu"]))
    random_panels = [c for c in sweep if c.data == "random"]
    assert {nq for c in sweep for nq in c.nqs} == {1, 10, 100, 1000, 10000}
    assert {c.n_data for c in random_panels} == {10_000, 100_000, 1_000_000}
    assert {c.dim for c in random_panels} == {64, 128, 768}
    assert {c.dtype for c in sweep} == {"float32", "float16"} and {c.k for c in sweep} == {10, 100}
    assert {(c.dtype, c.k) for c in sweep if c.data == "fashion-mnist"} == {
        (d, k) for d in ("float32", "float16") for k in (10, 100)}
    for args in (["--device", "cpu"], ["--quick"]):
        headline = [c for c in search.choose_sweep(search.parse_args(args)) if c.headline]
        assert headline and {1, 1000} <= set(headline[0].nqs) and headline[0].required(1000)
    custom = search.choose_sweep(search.parse_args(["--dim", "32", "96", "--k", "5", "--nq", "7"]))
    assert [(c.dim, c.k, c.nqs, c.data) for c in custom] == [(32, 5, (7,), "random"), (96, 5, (7,), "random")]
    eight_bit = search.choose_sweep(search.parse_args(["--dtype", "float16", "uint8"]))
    assert [(c.data, c.dtype) for c in eight_bit] == [("random", "float16"), ("sift-like", "uint8")]


def test_a_slow_first_call_does_not_set_the_number_of_samples():
    """A point whose first call pays a compile (here a 0.3 s sleep, above --max-call-s) but whose later calls
    are fast is timed over many warm calls, not the few the first call's time would allow."""
    sweep = _bench_module("search_sweep")
    search = _bench_module("search")
    args = search.parse_args(["--device", "cpu", "--max-call-s", "0.2", "--target-s", "0.05"])
    calls = []

    def call():
        calls.append(None)
        time.sleep(0.3 if len(calls) == 1 else 0.0005)
        return len(calls)

    timing, output = sweep.measure(call, args)
    assert timing["first_call_us"] >= 3e5 and timing["n"] >= args.min_reps and timing["n"] == len(calls) - 2
    assert timing["median_us"] < 1e5 and output == 2 and "first_call_only" not in timing


def test_gpu_sweep_has_every_target_workload_and_shares_builds():
    search = _bench_module("search")
    args = search.parse_args(["--device", "cuda"])
    sweep = search.choose_sweep(args)
    points = {(c.data, c.n_data, c.dim, c.dtype, c.metric, c.k, nq) for c in sweep for nq in c.nqs}
    wanted = {("random", 100_000, 128, "float32", "l2", 10, nq) for nq in (1, 10, 100, 1000, 10000)}
    wanted |= {("random", 1_000_000, 768, "float32", "l2", 10, nq) for nq in (1, 100, 1000)}
    wanted |= {("random", 1_000_000, 768, "float32", "l2", 100, 100), ("random", 1_000_000, 768, "float16", "l2", 10, 1),
               ("random", 10_000_000, 128, "float16", "l2", 10, 2048), ("sift-like", 10_000_000, 128, "uint8", "l2", 10, 2048)}
    wanted |= {("clustered", 1_000_000, 768, dtype, metric, 10, 1000)
               for dtype in ("float16", "bfloat16") for metric in ("l2", "ip", "cosine")}
    assert wanted <= points, wanted - points
    assert args.fashion_mnist == "off" and args.budget_s <= 200 and args.truth_queries == 100
    k10_k100 = [g for g in search.groups(sweep) if g[0].n_data == 1_000_000 and g[0].dtype == "float32"]
    assert [[c.k for c in g] for g in k10_k100] == [[10, 100]]     # one build per peer for both k
    data_order = [c.data for c in sweep]
    assert all(data_order.index(d) + data_order.count(d) - 1 == len(data_order) - 1 - data_order[::-1].index(d)
               for d in set(data_order)), data_order                  # each data set generated once


def test_oracle_equals_the_reference_with_ties_chunks_and_every_metric(monkeypatch):
    oracle, reference = _bench_module("oracle"), _reference()
    monkeypatch.setattr(oracle._NumpyOps, "work", 900)   # many blocks of rows, merged across blocks
    rng = np.random.default_rng(3)
    ints = rng.integers(0, 3, (2000, 6)).astype(np.uint8)        # exact ties everywhere
    floats = rng.standard_normal((2000, 12)).astype(np.float32)
    floats[7], floats[30] = floats[1500], 0.0                     # a duplicate, a zero row (cosine 0)
    for source, dtype in ((ints, "uint8"), (floats, "float32"), (floats, "float16")):
        queries = source[:5].astype(np.float32) + (0 if dtype == "uint8" else 0.01)
        for metric in ("l2", "ip", "cosine"):
            exact = oracle.exact_neighbours(source, dtype, queries, 40, metric, backend="numpy")
            want_d, want_i = reference.exact_search(source.astype(np.float32), queries, 40, metric,
                                                    "float32" if dtype == "uint8" else dtype)
            assert np.array_equal(exact.ids, want_i), (dtype, metric)
            assert np.array_equal(exact.distances.astype(np.float32), want_d), (dtype, metric)
            assert oracle.agreement(want_i, exact, 40) == 1.0
    swapped = exact.ids.copy()
    swapped[0, [3, 4]] = swapped[0, [4, 3]]                       # the same ids, two in the wrong order
    assert oracle.agreement(swapped, exact, 40) == 1 - 2 / (5 * 40)


def test_bfloat16_rounding_is_to_nearest_even():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    oracle = _bench_module("oracle")
    values = np.random.default_rng(4).standard_normal(100_000).astype(np.float32)
    halfway = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)], dtype=np.float32)  # ties: to even
    for x in (values, halfway):
        assert np.array_equal(oracle.bfloat16_bits(x), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_generated_data_sets_are_what_they_say():
    datasets = _bench_module("datasets")
    emb, emb_q = datasets.clustered_embeddings(5000, 50, 96)
    assert emb.dtype == np.float32 and np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)
    mean_cos = float((emb[:2000:2] * emb[1:2000:2]).sum(axis=1).mean())
    assert 0.1 < mean_cos < 0.5, mean_cos                         # shared direction, not isotropic
    sift, sift_q = datasets.sift_like(5000, 50, 128)
    assert sift.dtype == np.uint8 and sift_q.shape == (50, 128) and (sift == 0).mean() > 0.1
    assert np.array_equal(datasets.sift_like(5000, 60, 128)[0], sift)   # seeded: the same rows for any nq
    assert datasets.for_dtype(sift, "int8").dtype == np.int8 and datasets.for_dtype(sift, "int8").min() >= -128


def _reference():
    spec = importlib.util.spec_from_file_location("tinyknn_bench_reference", BENCH.parent / "tests" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
def test_torch_oracle_equals_the_numpy_oracle_bit_for_bit():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    oracle = _bench_module("oracle")
    rng = np.random.default_rng(5)
    floats = rng.standard_normal((30_000, 40)).astype(np.float32)
    floats[11], floats[12] = floats[29_000], 0.0
    ints = rng.integers(0, 4, (30_000, 16)).astype(np.uint8)
    for source, dtypes in ((floats, ("float32", "float16", "bfloat16")), (ints, ("uint8",))):
        queries = source[:64].astype(np.float32)
        for dtype in dtypes:
            for metric in ("l2", "ip", "cosine"):
                on_gpu = oracle.exact_neighbours(source, dtype, queries, 50, metric, backend="torch")
                on_cpu = oracle.exact_neighbours(source, dtype, queries, 50, metric, backend="numpy")
                assert on_gpu.backend == "torch cuda"
                assert np.array_equal(on_gpu.ids, on_cpu.ids), (dtype, metric)
                assert np.array_equal(on_gpu.distances, on_cpu.distances), (dtype, metric)


@pytest.mark.gpu
def test_search_gpu_small_sweep_runs_every_gpu_peer(tmp_path):
    pytest.importorskip("torch")
    command = [sys.executable, str(BENCH / "search.py"), "--device", "cuda", "--n-data", "20000", "--dim", "48",
               "--dtype", "float32", "float16", "bfloat16", "uint8", "--metric", "l2", "cosine", "--nq", "1", "64",
               "--k", "10", "--out-dir", str(tmp_path), "--target-s", "0.02"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    output = done.stdout[-6000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    (result_file,) = tmp_path.glob("search_*.json")
    result = json.loads(result_file.read_text())["results"]
    rows = result["rows"]
    assert {"torch-fp32", "torch-tf32", "torch-fp16"} <= {r["peer"] for r in rows}, result["skipped"]
    assert all(run.get("backend") == "torch cuda" for run in result["oracle"]["runs"]), result["oracle"]
    assert all(r["agreement"] is not None for r in rows), output
    exact = [r for r in rows if r["peer"] == "tinyknn-cuda" and r["dtype"] in ("float32", "float16")]
    assert exact and all(r["agreement"] == 1.0 for r in exact), exact
    assert all(r["note"] for r in rows if r["peer"] == "torch-fp16"), rows


def test_single_query_bench_checks_and_cpu_skip(tmp_path):
    """bench/single_query.py: without a GPU it writes a skipped record; its checks read the best mode of each
    shape against the targets (100k x 128 float32 <= 35 us end to end)."""
    single = _bench_module("single_query")
    assert single.main(["--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("single_query_*.json")
    assert "needs a CUDA GPU" in json.loads(written.read_text())["results"]["skipped"]
    payload = {"shapes": {"100k x 128 float32": {"modes": {"float16 shadow": {"default_us": 34.0},
                                                           "float32 rows": {"default_us": 60.0}}},
                          "1M x 768 float16": {"modes": {"stored rows": {"default_us": 420.0}}}}}
    assert single.checks(payload) == {"100k x 128 float32: end to end <= 35 us": True,
                                      "1M x 768 float16: end to end <= 380 us": False}


def test_groundtruth_scale_small_run_on_the_cpu(tmp_path):
    """bench/groundtruth_scale.py's whole flow at a small size: the file rows through the command and the API
    on the CPU (exact on the sample, the same bits both ways), the CPU row against FAISS when installed, the
    GPU-only row skipped cleanly without a GPU."""
    from tinyknn.gpu import has_gpu

    done = subprocess.run(
        [sys.executable, str(BENCH / "groundtruth_scale.py"), "--run", "file,fbin,device,cpu", "--file-device", "cpu",
         "--rows", "30000", "--fbin-rows", "20000", "--device-rows", "20000", "--cpu-rows", "20000", "--queries", "60",
         "--cpu-queries", "60", "-k", "10", "--repeats", "1", "--check-queries", "5", "--threads", "2",
         "--workdir", str(tmp_path / "work"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result_file,) = tmp_path.glob("groundtruth_scale_*.json")
    rows = json.loads(result_file.read_text())["results"]
    for name in ("file", "fbin"):
        row = rows["rows"][name]
        assert row["check"]["ids_equal"] and row["check"]["distance_bits_equal"] and row["api_equals_command"], row
        assert row["command"]["seconds"] > 0 and row["read"]["bytes"] == row["base_bytes"] and "h2d" not in row
        assert all(began <= ended for began, ended in row["api_calls_s"]["search"]) and row["api_calls_s"]["search"]
    assert rows["rows"]["cpu"]["tinyknn_check"]["ids_equal"]
    assert importlib.util.find_spec("faiss") is None or rows["rows"]["cpu"]["faiss_median_s"] > 0
    assert ("device" in rows["skipped"]) != has_gpu()
    assert not list((tmp_path / "work").glob("*bin"))          # the data files are removed afterwards


def test_groundtruth_scale_synth_is_sift_like_and_prefix_stable(tmp_path):
    scale = _bench_module("groundtruth_scale")
    import tinyknn.io as tio

    small, large = tmp_path / "small.u8bin", tmp_path / "large.u8bin"
    scale.synth(small, 20_000, 128, "uint8", seed=3, threads=2)
    scale.synth(large, 50_000, 128, "uint8", seed=3, threads=1)
    x = tio.read_vectors(large)
    assert x.shape == (50_000, 128) and x.dtype == np.uint8
    np.testing.assert_array_equal(tio.read_vectors(small), x[:20_000])   # rows do not depend on n or threads
    assert 0.15 < np.mean(x == 0) < 0.4 and 10 < x.mean() < 30 and x.max() > 150   # SIFT-like, not uniform
    assert len(np.unique(x[:5000], axis=0)) > 4990                          # clustered rows, still distinct
    floats = tmp_path / "f.fbin"
    scale.synth(floats, 1000, 16, "float32", seed=3, threads=2)
    assert tio.read_vectors(floats).dtype == np.float32
