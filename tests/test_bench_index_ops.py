"""bench/index_ops.py keeps working: a small CPU run writes one JSON and one PNG holding every target row of
the index-operations table, each with its measurement, target and verdict, and every answer it checked agrees with float64."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_index_ops_bench_cpu_writes_every_target_row(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH / "index_ops.py"), "--device", "cpu", "--rows", "20000", "--quick",
         "--removals", "2", "--out-dir", str(tmp_path), "--budget-s", "600"],   # a loaded machine skips nothing
        capture_output=True, text=True, timeout=900,
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    (result_file,) = tmp_path.glob("index_ops_*_cpu-*.json")
    assert list(tmp_path.glob("index_ops_*_cpu-*.png")), output
    results = json.loads(result_file.read_text())["results"]
    rows = results["rows"]
    assert len(rows) == 10 and not results["skipped"], (rows, results["skipped"])
    names = " ".join(row["name"] for row in rows)
    for part in ("add 1 row", "by label, 1 query", "allow-list, 1,000 queries", "remove 1 %", "next search",
                 "range search", "k = 10,000"):
        assert part in names, (part, names)
    for row in rows:
        assert row["measured"] > 0 and isinstance(row["met"], bool), row
        assert row["met"] == (row["measured"] <= row["limit"] if row["direction"] == "<=" else
                              row["measured"] >= row["limit"]), row
    assert {row["target_applies"] for row in rows} == {True, False}    # the cuda-only rows say so
    for row in rows:                    # each filter beside an index of its allowed rows alone (its ceiling)
        if row["name"].startswith("filtered"):
            assert row["rows_alone_ms"] > 0 and row["rows_alone_speedup"] > 0, row
    assert len(results["exactness"]) == 11 and results["all_exact"], results["exactness"]
    assert sum("allowed rows alone" in check["what"] for check in results["exactness"]) == 2
