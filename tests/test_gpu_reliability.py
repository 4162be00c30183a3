"""GPU side of "nothing crashes, nothing is lost": device memory that does not fit is a clear MemoryError and the
index stays as it was (a configured cap, TINYKNN_DEVICE_MEMORY_LIMIT, makes that cheap to test), and a failed
piece of a chunked add is undone with truncate."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn
from tinyknn.config import reset_config
from reference import assert_exact

pytestmark = pytest.mark.gpu


@pytest.fixture
def device_cap(monkeypatch):
    def set_cap(text: str):
        monkeypatch.setenv("TINYKNN_DEVICE_MEMORY_LIMIT", text)
        reset_config()
    yield set_cap
    monkeypatch.delenv("TINYKNN_DEVICE_MEMORY_LIMIT", raising=False)
    reset_config()


def test_an_add_beyond_the_cap_raises_and_changes_nothing(device_cap, rng):
    device_cap("8M")
    db = rng.standard_normal((2000, 64)).astype(np.float32)
    q = rng.standard_normal((5, 64)).astype(np.float32)
    with tinyknn.Index(64, "l2", device="cuda") as index:
        index.add(db)
        before = index.search(q, 10)
        big = rng.standard_normal((40_000, 64)).astype(np.float32)      # 10 MB more than the cap allows
        with pytest.raises(MemoryError, match=r"needs [\d,]+ more bytes of device memory.*allows 8,388,608"):
            index.add(big)
        assert index.ntotal == 2000
        after = index.search(q, 10)
        np.testing.assert_array_equal(before[1], after[1])
        assert_exact(*after, db, q, 10, "l2")
        index.add(db[:100] + 1.0)                                          # still usable
        assert index.ntotal == 2100


def test_a_search_whose_scratch_does_not_fit_says_so(device_cap, rng):
    db = rng.standard_normal((30_000, 32)).astype(np.float32)
    with tinyknn.Index(32, "ip", device="cuda") as index:
        index.add(db)
        in_use = sum(b.nbytes for b in index._searcher._buffers.values() if hasattr(b, "fill_bytes"))
        device_cap(str(in_use + (4 << 20)))   # the database fits; candidate lists of 5,000 x k = 2048 do not
        with pytest.raises(MemoryError, match="device memory"):
            index.search(rng.standard_normal((5000, 32)).astype(np.float32), 2048)
        d, i = index.search(db[:3], 5)
        assert_exact(d, i, db, db[:3], 5, "ip")


def test_truncate_drops_the_newest_rows(rng):
    db = rng.standard_normal((500, 16)).astype(np.float32)
    with tinyknn.Index(16, "cosine", device="cuda") as index:
        index.add(db)
        index._searcher.add(db[:50] * 3.0, np.arange(1000, 1050))
        index._searcher.truncate(500)
        d, i = index.search(db[:4], 7)
        assert_exact(d, i, db, db[:4], 7, "cosine")
        with pytest.raises(ValueError, match="between 0 and 500"):
            index._searcher.truncate(501)


def test_an_add_under_eight_searching_threads_takes_at_most_5x_its_idle_time(rng):
    """The GPU's side of tests/test_cpu_reliability.py's test of the same name: a GPU index's calls take turns
    (tinyknn.gpu.turns), and a waiting add goes ahead of the searches still waiting, so it waits for the one
    search running, not for a line of them."""
    from test_cpu_reliability import add_under_search_bench

    bench = add_under_search_bench()
    x = rng.standard_normal((200_000, 128), dtype=np.float32)
    batch = rng.standard_normal((2000, 128), dtype=np.float32)
    q = rng.standard_normal((1, 128), dtype=np.float32)
    with tinyknn.Index(128, device="cuda") as index:
        index.add(x, ids=np.arange(len(x)))
        for _ in range(3):                               # first calls: kernels, plans, staging
            index.search(q, 10)
            bench.timed_add(index, batch, len(x))
        searchers = bench.Searchers(index, q, 10, 8)
        try:
            got = bench.measure(index, batch, searchers, rounds=15, adds=3, settle_s=0.05, first_id=len(x))
        finally:
            searchers.stop()
        idle, loaded = np.median(got["idle"]), np.median(got["loaded"])
        print(f"add of 2,000 rows: idle {idle * 1e3:.2f} ms, under 8 searching threads {loaded * 1e3:.2f} ms "
              f"({loaded / idle:.1f}x; {got['searches_while_loaded']} searches meanwhile)")
        assert got["searches_while_loaded"] >= 8, got["searches_while_loaded"]
        assert loaded <= 5 * idle, (idle, loaded)
        assert index.ntotal == len(x)
        assert_exact(*index.search(q, 10), x, q, 10, "l2")
