"""The CPU library under failure and load (the audit's cases, 15, 16): an add that fails changes nothing,
truncate undoes a part-done add, an add under searching threads takes at most 5x its idle time, an add's memory
stays near the data's size."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tinyknn
from tinyknn.cpu import library
from reference import assert_exact

METRICS = ("l2", "ip", "cosine")


_CAPPED_ADD = """
import resource, sys
import numpy as np
sys.path.insert(0, {tests!r})
import tinyknn
from tinyknn.cpu import library
from reference import assert_exact

rng = np.random.default_rng({seed})
db = rng.standard_normal((5000, 32)).astype(np.float32)
q = rng.standard_normal((20, 32)).astype(np.float32)
index = tinyknn.Index(32, metric={metric!r}, dtype={dtype!r})
index.add(db)
before = index.search(q, 10), index.search(q[:2], 10)
searcher = index._searcher
vectors, ids = np.zeros((1, 32), dtype={dtype!r}), np.zeros(1, np.int64)
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
size_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size_kb * 1024 + (1 << 30), hard))   # 1 GiB more than in use now
for huge in (2**33, 2**40):      # 1 TiB and more: beyond the cap whatever the machine's overcommit policy
    status = searcher._library.tk_index_add(searcher._handle, vectors.ctypes.data, huge, ids.ctypes.data)
    assert status == library.STATUS_OUT_OF_MEMORY, status
    assert searcher.size() == 5000
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
after = index.search(q, 10), index.search(q[:2], 10)
for (d0, i0), (d1, i1) in zip(before, after):
    assert np.array_equal(d0, d1) and np.array_equal(i0, i1)
assert_exact(*after[0], db, q, 10, {metric!r}, {dtype!r})
index.add(db[:100])              # and the index keeps working
assert searcher.size() == 5100
print("ok")
"""


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("metric", METRICS)
def test_an_add_that_cannot_be_allocated_changes_nothing(rng, metric, dtype):
    """An add whose allocation fails reports out of memory and leaves the index exactly as it
    was: same size, same answers (before, the library kept a half-added batch and a later search crashed).
    In a child process whose address space is capped (RLIMIT_AS), so that the allocation fails on every
    machine: with overcommit allowed, a 1 TiB mapping could succeed and the add would read past its input."""
    from pathlib import Path

    script = _CAPPED_ADD.format(tests=str(Path(__file__).resolve().parent), seed=int(rng.integers(2**31)),
                                metric=metric, dtype=dtype)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.parametrize("metric", METRICS)
def test_truncate_drops_the_rows_of_a_failed_chunked_add(rng, metric):
    """CpuSearcher.truncate(n) (what Index.add calls when a later chunk of a chunked add fails): the index
    answers exactly as one that never held the dropped rows, through every path, and grows again."""
    db = rng.standard_normal((9000, 32)).astype(np.float32)
    q = rng.standard_normal((30, 32)).astype(np.float32)
    index = tinyknn.Index(32, metric=metric)
    searcher = index._searcher
    kept = 5003                                     # inside a panel: its tail becomes padding again
    searcher.add(db[:kept], np.arange(kept, dtype=np.int64))
    searcher.add(db[kept:], np.arange(kept, len(db), dtype=np.int64))
    searcher.truncate(kept)
    assert searcher.size() == kept
    for batch in (q[:1], q[:5], q):
        distances, ids = searcher.search(batch, 10)
        assert_exact(distances, ids, db[:kept], batch, 10, metric)
    with pytest.raises(ValueError, match="n_rows"):
        searcher.truncate(kept + 1)
    searcher.truncate(0)
    assert searcher.size() == 0 and np.all(searcher.search(q[:1], 3)[1] == -1)
    searcher.add(db[:4000] + 100, np.arange(4000, dtype=np.int64))   # a new frame for the sketch
    distances, ids = searcher.search(q[:3] + 100, 7)
    assert_exact(distances, ids, db[:4000] + 100, q[:3] + 100, 7, metric)


def test_an_add_under_eight_searching_threads_takes_at_most_5x_its_idle_time(rng):
    """An add of 2,000 rows to a 200,000 x 128 index while 8 threads each search one query in a loop takes at
    most 5x the same add with no search running, median against median, with no allowance. The measurement
    is bench/add_under_search.py's: idle and loaded adds alternate round by round, so a change in the
    machine's load meets both sides alike; up to three such measurements, the first within 5x passing (another
    process holding the cores through a whole measurement made one 7.4x; an add the searches starve fails all). The library's gate (kernels/cpu/gate.h) lets the add wait for the
    searches already running and nothing else, runs no more searches at once than there are cores, and
    resumes the searches a grace after the add, once its thread is back in Python. Before: 5-8x on 2 cores
    of the GPU machine, 9-17x on the shared 2-core VM (where the old test passed only by +20 ms)."""
    assert_add_under_search_within_5x(tinyknn.Index(128), rng)


MEASUREMENTS = 3                 # of the add under search, until one is within 5x


def assert_add_under_search_within_5x(index, rng) -> None:
    """The measurement both devices' tests make: 200,000 rows into `index`, then adds of 2,000 rows idle and
    under 8 searching threads, alternating round by round (bench/add_under_search.py's harness)."""
    bench = add_under_search_bench()
    x = rng.standard_normal((200_000, 128), dtype=np.float32)
    batch = rng.standard_normal((2000, 128), dtype=np.float32)
    q = rng.standard_normal((1, 128), dtype=np.float32)
    index.add(x, ids=np.arange(len(x)))
    for _ in range(3):                      # first calls: kernels, plans, staging, pages of new blocks, scratch
        index.search(q, 10)
        bench.timed_add(index, batch, len(x))
    ratios = []
    for _ in range(MEASUREMENTS):       # another process on the cores can hold them for a whole measurement:
        searchers = bench.Searchers(index, q, 10, 8)      # a starving add fails every one, noise only some
        try:
            got = bench.measure(index, batch, searchers, rounds=15, adds=3, settle_s=0.05, first_id=len(x))
        finally:
            searchers.stop()
        idle, loaded = statistics.median(got["idle"]), statistics.median(got["loaded"])
        print(f"add of 2,000 rows: idle {idle * 1e3:.2f} ms, under 8 searching threads {loaded * 1e3:.2f} ms "
              f"({loaded / idle:.1f}x; {got['searches_while_loaded']} searches meanwhile)")
        assert got["searches_while_loaded"] >= 8, got["searches_while_loaded"]
        ratios.append(loaded / idle)
        if loaded <= 5 * idle:
            break
    assert min(ratios) <= 5, ratios
    assert index.ntotal == len(x)                        # every added batch was removed again
    assert_exact(*index.search(q, 10), x, q, 10, "l2")


def add_under_search_bench():
    """bench/add_under_search.py as a module (its harness is what the test measures with)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "add_under_search.py"
    spec = importlib.util.spec_from_file_location("add_under_search", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_memory_of_an_add_stays_near_the_data(tmp_path):
    """The memory the library's add of 400,000 x 128 float32 (205 MB) takes at its peak, beyond
    the caller's arrays, is at most 1.6x the data (the index's copy, the float16 sketch (0.5x) and the ids;
    panels grow in blocks, never by a copying doubling). Measured in a fresh process (its peak RSS, VmHWM)."""
    script = textwrap.dedent("""
        import json
        import numpy as np
        import tinyknn
        def rss(field="VmRSS"):
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) for line in status if line.startswith(field)) * 1024
        x = np.random.default_rng(0).standard_normal((400_000, 128), dtype=np.float32)
        ids = np.arange(len(x), dtype=np.int64)
        index = tinyknn.Index(128)
        index.add(x[:10])
        index.reset()
        before = rss()
        index._searcher.add(x, ids)
        peak = rss("VmHWM")   # (not ru_maxrss: Linux keeps it across exec, so it holds pytest's RSS at the fork)
        print(json.dumps({"raw": x.nbytes, "before": before, "peak": peak, "after": rss()}))
    """)
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    grown = (measured["peak"] - measured["before"]) / measured["raw"]
    print(f"peak growth during the add: {grown:.2f}x the data ({measured})")
    assert grown <= 1.6


def test_k_beyond_the_library_limit_is_refused(rng):
    """k beyond what the library allows (2^40) is refused before anything is written."""
    index = tinyknn.Index(4)
    index.add(rng.standard_normal((64, 4)).astype(np.float32))
    out = np.empty(1, np.float32), np.empty(1, np.int64)
    searcher = index._searcher
    q = np.zeros((1, 4), np.float32)
    status = searcher._library.tk_index_search(searcher._handle, q.ctypes.data, 1, 2**41, 1, out[0].ctypes.data,
                                                out[1].ctypes.data)
    with pytest.raises(ValueError, match="k must be"):
        library.check(searcher._library, status, "search")


def test_an_add_that_runs_out_of_address_space_changes_nothing():
    """The audit's case as it met it (`ulimit -v`, an add of float32 l2 rows whose panels fit but whose
    sketch does not): MemoryError, and the library still holds exactly the rows Python registered (before,
    it kept the panels of the failed add and a later search crashed)."""
    script = textwrap.dedent("""
        import json, resource
        import numpy as np
        import tinyknn
        rng = np.random.default_rng(1)
        db = rng.standard_normal((5000, 128)).astype(np.float32)
        big = np.ones((600_000, 128), np.float32)   # 307 MB: its panels fit in 350 MB more, panels + sketch do not
        q = rng.standard_normal((3, 128)).astype(np.float32)
        index = tinyknn.Index(128)
        index.add(db)
        before = index.search(q, 5)
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) for line in status if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + 350 * 2**20, resource.RLIM_INFINITY))
        try:
            index.add(big)
            outcome = "added"
        except MemoryError as exc:
            outcome = "MemoryError"
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        after = index.search(q, 5)
        same = all(np.array_equal(a, b) for a, b in zip(before, after))
        print(json.dumps({"outcome": outcome, "python": index.ntotal, "library": index._searcher.size(), "same": same}))
    """)
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured == {"outcome": "MemoryError", "python": 5000, "library": 5000, "same": True}, measured
