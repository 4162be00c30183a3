"""Filtered searches on the GPU read the allowed rows in place (tinyknn/gpu/searcher.py `_reading_rows`): one run of
rows is searched as a view of the index, scattered rows through the position list that the LISTED scan, single and
tiled kernels read; and the label-partitioned order is made on the device (`permute_rows`). Every answer is compared
bit for bit with the float64 oracle (tests/reference.py) and with the gathered copy (`read_in_place = False`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback

import numpy as np
import pytest

import tinyknn
from reference import assert_exact, exact_search
from tinyknn.spec import numpy_dtype

pytestmark = pytest.mark.gpu
METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8")


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    from gpu_warm import warm

    warm([(m, "float32", 24, k) for m in METRICS for k in (1, 10, 129)] +
         [(m, t, 24, 10) for m in METRICS for t in DTYPES] + [("l2", "float32", 128, 10)])


def vectors(rng, n, dim, dtype):
    """Rows an index of `dtype` holds exactly as given (8-bit: integers in range)."""
    if dtype == "int8":
        return rng.integers(-100, 100, (n, dim)).astype(np.float32)
    if dtype == "uint8":
        return rng.integers(0, 200, (n, dim)).astype(np.float32)
    return rng.standard_normal((n, dim)).astype(np.float32)


def build(rng, metric, dtype="float32", n=5000, dim=24):
    db = vectors(rng, n, dim, dtype)
    index = tinyknn.Index(dim, metric, dtype, device="cuda")
    ids = rng.permutation(10 * n)[:n].astype(np.int64)
    index.add(db, ids=ids)
    return index, db, ids


def allowed_sets(rng, n):
    """(name, sorted unique rows): what a filter or a label may allow."""
    return [("empty", np.empty(0, np.int64)), ("one row", np.array([n // 3])), ("last row", np.array([n - 1])),
            ("1 %", np.sort(rng.choice(n, n // 100, replace=False))),
            ("50 %", np.flatnonzero(rng.random(n) < 0.5)), ("every row", np.arange(n)),
            ("a run", np.arange(n // 5, n // 5 + n // 10)), ("two runs", np.r_[0:50, n - 50:n])]


def views_made(searcher) -> set:
    """The kinds of view (views.Rows prefixes) whose plans are cached."""
    return {key[4].prefix for key in searcher._plans if isinstance(key, tuple) and len(key) > 4
            and hasattr(key[4], "prefix")}


@pytest.mark.parametrize("metric", METRICS)
def test_allowed_rows_are_read_in_place_and_exact(metric, rng):
    index, db, ids = build(rng, metric)
    searcher = index._searcher
    q = rng.standard_normal((40, 24)).astype(np.float32)
    seen = set()
    for name, rows in allowed_sets(rng, len(db)):
        for k in (1, 10, 129):
            for batch in (q[:1], q[:3], q):            # single, scan, tiled
                d, i = searcher.search(batch, k, rows=rows)
                seen |= views_made(searcher)           # (the plan cache keeps the latest 32 plans and batches)
                assert_exact(d, i, db[rows], batch, k, metric, id_map=ids[rows])
                searcher.read_in_place = False
                try:
                    gathered = searcher.search(batch, k, rows=rows)
                finally:
                    searcher.read_in_place = True
                assert np.array_equal(i, gathered[1]), name
                assert np.array_equal(d.view(np.uint32), gathered[0].view(np.uint32)), name
    assert {"run", "list"} <= seen
    d, i = searcher.search(q, 10)                          # every row, after the filtered searches
    assert_exact(d, i, db, q, 10, metric, id_map=ids)
    index.close()


def test_in_place_views_copy_nothing(rng):
    """A run and a list are searched without the gathered "sub_" buffers; the list is in "row_list"."""
    index, db, ids = build(rng, "l2")
    searcher = index._searcher
    q = rng.standard_normal((5, 24)).astype(np.float32)
    run, scattered = np.arange(100, 900), np.sort(rng.choice(len(db), 700, replace=False))
    for rows in (run, scattered):
        for batch in (q[:1], q):
            assert_exact(*searcher.search(batch, 10, rows=rows), db[rows], batch, 10, "l2", id_map=ids[rows])
    assert searcher._buffers["row_list"].nbytes >= 700 * 4
    if not searcher.exact_reruns:                       # (a band search of a list gathers its rows: rare here)
        assert "sub_data" not in searcher._buffers
    index.close()


def test_a_repeated_allow_list_copies_its_rows_once(rng):
    """The same filter again finds its row list already on the device (the Index's kept rows of its ids, read-only),
    for one query and batches; another filter, the same ids in a new array after an add or a removal (new rows),
    and an array the searcher could see change (writeable) are copied again. Every answer exact."""
    index, db, ids = build(rng, "l2")
    searcher = index._searcher
    q = rng.standard_normal((5, 24)).astype(np.float32)
    allow = np.sort(rng.choice(ids, 700, replace=False))

    def check(filter_ids, held_ids, held_db):
        for batch in (q[:1], q):
            rows = np.flatnonzero(np.isin(held_ids, filter_ids))
            assert_exact(*index.search(batch, 10, filter=filter_ids), held_db[rows], batch, 10, "l2",
                         id_map=held_ids[rows])

    before = searcher.row_lists_copied
    check(allow, ids, db)
    check(allow.copy(), ids, db)                        # equal ids in another array: the kept rows
    assert searcher.row_lists_copied == before + 1
    other = np.sort(rng.choice(ids, 500, replace=False))
    check(other, ids, db)
    check(allow, ids, db)
    assert searcher.row_lists_copied == before + 3
    extra = vectors(rng, 10, 24, "float32")
    index.add(extra, ids=np.arange(10) + 10 * len(db))  # an add forgets the kept rows
    ids, db = np.r_[ids, np.arange(10) + 10 * len(db)], np.r_[db, extra]
    check(allow, ids, db)
    assert searcher.row_lists_copied == before + 4
    gone = allow[:100]
    index.remove(gone)                                  # a removal moves rows: the list must follow
    keep = ~np.isin(ids, gone)
    check(allow, ids[keep], db[keep])
    assert searcher.row_lists_copied == before + 5
    chosen = np.sort(rng.choice(ids[keep], 300, replace=False))
    rows = np.array(index._ids.rows_present(chosen))    # the searcher called with writeable rows: copied each time
    held = np.isin(ids, chosen)
    for _ in range(2):
        assert_exact(*searcher.search(q, 10, rows=rows), db[held], q, 10, "l2", id_map=ids[held])
    assert searcher.row_lists_copied == before + 7
    index.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_every_dtype_through_the_index(metric, dtype, rng):
    """filter= and labels= through the Index, each dtype: scattered labels (a list), one label's run, an allow-list."""
    n = 3000
    db = vectors(rng, n, 24, dtype)
    labels = rng.integers(0, 7, n)
    labels[1000:1400] = 9                                   # label 9: one run
    index = tinyknn.Index(24, metric, dtype, device="cuda")
    ids = np.arange(n) * 5 + 3
    index.add(db, ids=ids, labels=labels)
    q = vectors(rng, 12, 24, dtype)
    allow = np.sort(rng.choice(ids, 300, replace=False))
    for batch in (q[:1], q[:4], q):
        for label in (2, 9):
            d, i = index.search(batch, 10, labels=np.full(len(batch), label))
            rows = np.flatnonzero(labels == label)
            assert_exact(d, i, db[rows], batch, 10, metric, dtype, id_map=ids[rows])
        d, i = index.search(batch, 10, filter=allow)
        rows = np.flatnonzero(np.isin(ids, allow))
        assert_exact(d, i, db[rows], batch, 10, metric, dtype, id_map=ids[rows])
    index.close()


def test_one_query_streams_the_shadow_of_the_allowed_rows(rng):
    """A float32 l2 index: one query over a list or a run streams the float16 shadow at the allowed rows (the
    run's from its first row); rows far apart in value so the bound proves most answers."""
    index, db, ids = build(rng, "l2", n=20000, dim=128)
    searcher = index._searcher
    q = rng.standard_normal((6, 128)).astype(np.float32)
    for rows in (np.arange(7001, 9000), np.sort(rng.choice(len(db), 2000, replace=False)), np.arange(19990, 20000)):
        for i in range(len(q)):
            assert_exact(*searcher.search(q[i:i + 1], 10, rows=rows), db[rows], q[i:i + 1], 10, "l2", id_map=ids[rows])
    assert searcher._screen.usable and searcher._screen.shadow
    index.close()


@pytest.mark.parametrize("metric", METRICS)
def test_ties_in_a_list_go_to_the_band_search_of_its_rows(metric, rng):
    """40 copies of one vector among scattered allowed rows: the verify step cannot order them, the band search
    answers over the listed rows only (gathered for it), ties by the smaller id."""
    n, dim = 4000, 24
    db = rng.standard_normal((n, dim)).astype(np.float32)
    copies = rng.choice(n, 80, replace=False)
    db[copies] = 10 * db[copies[0]]                         # far from the rest: the copies are every query's best
    index = tinyknn.Index(dim, metric, device="cuda")
    ids = rng.permutation(n).astype(np.int64)
    index.add(db, ids=ids)
    rows = np.sort(np.r_[copies[::2], rng.choice(np.setdiff1d(np.arange(n), copies), 500, replace=False)])
    before = index._searcher.exact_reruns
    for batch in (db[copies[:1]], np.repeat(db[copies[:1]], 3, axis=0), np.repeat(db[copies[:1]], 20, axis=0)):
        d, i = index._searcher.search(batch, 10, rows=rows)
        assert_exact(d, i, db[rows], batch, 10, metric, id_map=ids[rows])
    assert index._searcher.exact_reruns > before
    index.close()


def test_k_beyond_the_kernels_and_range_search_gather(rng):
    index, db, ids = build(rng, "l2", n=5000)
    rows = np.flatnonzero(rng.random(len(db)) < 0.5)
    q = rng.standard_normal((3, 24)).astype(np.float32)
    assert_exact(*index._searcher.search(q, 2100, rows=rows), db[rows], q, 2100, "l2", id_map=ids[rows])
    index.close()


def test_cuda_queries_read_a_list_in_place(rng):
    cupy = pytest.importorskip("cupy")
    index, db, ids = build(rng, "cosine")
    q = rng.standard_normal((5, 24)).astype(np.float32)
    allow = np.sort(rng.choice(ids, 200, replace=False))
    rows = np.flatnonzero(np.isin(ids, allow))
    for batch in (q[:1], q):
        d, i = index.search(cupy.asarray(batch), 10, filter=allow)
        assert_exact(cupy.asnumpy(d), cupy.asnumpy(i), db[rows], batch, 10, "cosine", id_map=ids[rows])
    index.close()


# -- the label-partitioned order on the device -----------------------------------------------------------------
def labelled_index(rng, metric="l2", dtype="float32", n=4000, dim=24, labels=6):
    db = vectors(rng, n, dim, dtype)
    row_labels = rng.integers(0, labels, n)
    row_labels[rng.random(n) < 0.05] = -1                 # unlabelled rows
    has = row_labels >= 0
    ids = rng.choice(10**9, n, replace=False).astype(np.int64)
    index = tinyknn.Index(dim, metric, dtype, device="cuda")
    index.add(db[has], ids=ids[has], labels=row_labels[has])
    index.add(db[~has], ids=ids[~has])
    lone = vectors(rng, 1, dim, dtype)
    index.add(lone, ids=[10**9 + 7], labels=[77])          # a label of one row
    held = {int(i): (v, int(l)) for i, v, l in zip(ids, db, row_labels)}     # id -> (vector, label or -1)
    held[10**9 + 7] = (lone[0], 77)
    return index, held


def allowed(held, dim, label=None, allow=None):
    """(rows as given, their ids ascending) of the vectors a search with `label` and `allow` (a set) may return."""
    keep = sorted(i for i, (_, l) in held.items() if (label is None or l == label) and (allow is None or i in allow))
    rows = np.array([held[i][0] for i in keep], dtype=np.float32).reshape(len(keep), dim)
    return rows, np.array(keep, dtype=np.int64)


def assert_index_exact(index, held, q, rng, metric="l2", dtype="float32"):
    """Labelled (many labels, one of one row, an empty one), labelled and allow-listed, and unfiltered searches
    of 1, 3 and 30 queries against the oracle over what `held` says the index holds."""
    allow = set(rng.choice(sorted(held), len(held) // 10, replace=False).tolist())
    dim = q.shape[1]
    for label in (0, 3, 5, 77, 123):                      # 123: an empty label
        for batch in (q[:1], q[:3], q):
            labels = np.full(len(batch), label)
            rows, keep = allowed(held, dim, label)
            assert_exact(*index.search(batch, 10, labels=labels), rows, batch, 10, metric, dtype, id_map=keep)
            rows, keep = allowed(held, dim, label, allow)
            assert_exact(*index.search(batch, 10, labels=labels, filter=np.array(sorted(allow))), rows, batch, 10,
                         metric, dtype, id_map=keep)
    rows, keep = allowed(held, dim)
    assert_exact(*index.search(q, 10), rows, q, 10, metric, dtype, id_map=keep)


def reorder(index):
    with index._add_lock, index._view:
        index._layout.reorder(index._searcher, index._ids, index._labels)


@pytest.mark.parametrize("metric,dtype", [("l2", "float32"), ("ip", "float16"), ("cosine", "int8")])
def test_the_reorder_on_the_device_keeps_every_answer(metric, dtype, rng):
    index, held = labelled_index(rng, metric, dtype)
    q = vectors(rng, 30, 24, dtype)
    assert_index_exact(index, held, q, np.random.default_rng(1), metric, dtype)
    reorder(index)
    for label in (0, 3, 77):                               # each label is one run now: searched as a view
        rows = index._labels.rows_of(label)
        assert len(rows) and rows[-1] - rows[0] == len(rows) - 1
    vectors_now, ids_now = index._searcher.export()
    assert np.array_equal(ids_now, index._ids.ids_of_rows())
    want = np.array([held[int(i)][0] for i in ids_now]).astype(numpy_dtype(dtype))
    assert np.array_equal(vectors_now, want)                # every row moved with its id
    assert_index_exact(index, held, q, np.random.default_rng(1), metric, dtype)
    index.search(q[:1], 10, labels=[3])
    assert "run" in views_made(index._searcher)         # a label's rows searched as a view of the index
    gone = rng.choice(sorted(held), 400, replace=False)    # removals and adds after the reorder
    index.remove(gone)
    for i in gone.tolist():
        del held[i]
    fresh = vectors(rng, 300, 24, dtype)
    new_ids = np.arange(300) + 2 * 10**9
    new_labels = rng.integers(0, 6, 300)
    index.add(fresh, ids=new_ids, labels=new_labels)
    held.update({int(i): (v, int(l)) for i, v, l in zip(new_ids, fresh, new_labels)})
    assert_index_exact(index, held, q, np.random.default_rng(2), metric, dtype)
    reorder(index)
    assert_index_exact(index, held, q, np.random.default_rng(3), metric, dtype)
    index.close()


def test_a_bad_order_is_refused_and_changes_nothing(rng):
    index, held = labelled_index(rng)
    searcher, n = index._searcher, index.ntotal
    q = rng.standard_normal((4, 24)).astype(np.float32)
    before = index.search(q, 10), index.search(q, 10, labels=[1, 1, 2, 2])
    for bad in (np.arange(n - 1), np.r_[np.arange(n - 1), 0], np.r_[np.arange(n - 1), n], np.arange(n) - 1):
        with pytest.raises(ValueError, match="every row position once|every row once"):
            searcher.permute_rows(bad)
    with pytest.raises(TypeError, match="1-D array of integer row positions"):
        searcher.permute_rows(np.arange(n, dtype=np.float64))
    after = index.search(q, 10), index.search(q, 10, labels=[1, 1, 2, 2])
    for was, now in zip(before, after):
        assert np.array_equal(was[1], now[1]) and np.array_equal(was[0], now[0])
    index.close()


STALL_S = 60      # a lock or a search held this long is a stall (a reorder takes milliseconds): fail, do not hang


def thread_frames() -> str:
    """Every other thread's innermost frames, for a stall's failure message."""
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident != threading.get_ident():
            where = traceback.extract_stack(frame)[-4:]
            lines.append(" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(where)))
    return "\n".join(lines)


@contextlib.contextmanager
def held_within(lock, seconds: float, what: str):
    """`with lock:`, failing with the threads' frames where it is not had within `seconds`."""
    if not lock.acquire(timeout=seconds):
        pytest.fail(f"{what} not had within {seconds} s; the threads:\n{thread_frames()}")
    try:
        yield
    finally:
        lock.release()


def test_searches_during_reorders_see_one_order_or_the_other(rng):
    """Threads search (unfiltered, labelled, allow-listed; 1 query and batches) while the main thread reorders the
    rows again and again (random orders, ids and labels permuted in step under the Index's locks, as
    LabelLayout.reorder does): the index holds the same vectors throughout, so every answer must be the oracle's."""
    index, held = labelled_index(rng, n=3000)
    q = rng.standard_normal((20, 24)).astype(np.float32)
    allow = np.array(sorted(rng.choice(sorted(held), 300, replace=False).tolist()))
    calls = [({}, None, None), ({"labels": np.full(20, 2)}, 2, None), ({"filter": allow}, None, set(allow.tolist()))]
    want = []
    for _, label, allow_set in calls:
        rows, keep = allowed(held, 24, label, allow_set)
        want.append(exact_search(rows, q, 10, "l2", id_map=keep))
    failures, stop = [], threading.Event()

    def searching(which):
        kwargs, _, _ = calls[which]
        while not stop.is_set():
            for size in (1, 20):
                extra = {key: (value[:size] if key == "labels" else value) for key, value in kwargs.items()}
                d, i = index.search(q[:size], 10, **extra)
                if not (np.array_equal(i, want[which][1][:size]) and
                        np.array_equal(d.view(np.uint32), want[which][0][:size].view(np.uint32))):
                    failures.append((which, size))

    threads = [threading.Thread(target=searching, args=(which,), daemon=True) for which in (0, 0, 1, 2)]
    for thread in threads:
        thread.start()
    try:
        order_rng = np.random.default_rng(5)
        for turn in range(30):
            order = order_rng.permutation(index.ntotal).astype(np.int64)
            with held_within(index._add_lock, STALL_S, f"reorder {turn}: the add lock"), \
                    held_within(index._view, STALL_S, f"reorder {turn}: _view"):
                index._searcher.permute_rows(order)
                index._ids.apply_permutation(order)
                index._labels.apply_permutation(order)
    finally:
        stop.set()
        deadline = time.monotonic() + STALL_S
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), f"a search did not return:\n{thread_frames()}"
    assert not failures, failures[:5]
    index.close()
