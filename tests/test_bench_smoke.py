"""The search benchmark keeps working: its quick CPU run end to end, and the recall it reports."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name: str):
    """bench/<name>.py loaded by path (bench/ is not a package; `datasets` would clash with PyPI's)."""
    spec = importlib.util.spec_from_file_location(f"tinyknn_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_search_quick_cpu_writes_exact_tinyknn_rows(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH / "search.py"), "--quick", "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
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
    assert "configuration" in done.stdout  # the table comes last


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


def test_default_sweep_covers_every_value_of_every_axis():
    search = _bench_module("search")
    sweep = search.choose_sweep(search.parse_args([]))
    random_panels = [c for c in sweep if c.data == "random"]
    assert {nq for c in sweep for nq in c.nqs} == {1, 10, 100, 1000, 10000}
    assert {c.n_data for c in random_panels} == {10_000, 100_000, 1_000_000}
    assert {c.dim for c in random_panels} == {64, 128, 768}
    assert {c.dtype for c in sweep} == {"float32", "float16"} and {c.k for c in sweep} == {10, 100}
    assert {(c.dtype, c.k) for c in sweep if c.data == "fashion-mnist"} == {
        (d, k) for d in ("float32", "float16") for k in (10, 100)}
    for args in ([], ["--quick"]):
        headline = [c for c in search.choose_sweep(search.parse_args(args)) if c.headline]
        assert headline and {1, 1000} <= set(headline[0].nqs) and headline[0].required(1000)
    custom = search.choose_sweep(search.parse_args(["--dim", "32", "96", "--k", "5", "--nq", "7"]))
    assert [(c.dim, c.k, c.nqs, c.data) for c in custom] == [(32, 5, (7,), "random"), (96, 5, (7,), "random")]
