"""The label-partitioned row order (tinyknn.index.layout): labelled searches that read scattered rows make the
index put each label's rows together once they have read as many scattered rows as that costs; the reorder
changes no answer, no id, no label and nothing saved, and one that cannot allocate changes nothing at all.

Runs on the CPU and GPU searchers (both have permute_rows) and on the model searcher (the Index's own logic)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import tinyknn
from model_searcher import use_model
from reference import assert_exact
from tinyknn.index import layout as _layout

METRICS = ("l2", "ip", "cosine")


@pytest.fixture(params=["model", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request, monkeypatch):
    if request.param == "model":
        use_model(monkeypatch)
    return request.param


def device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def scattered_index(rng, n=3000, dim=8, metric="l2", dtype="float32", labels=5, device="cpu"):
    """Random rows with random ids and labels (each label's rows scattered), some removed, some added again
    without a label: (index, {id: vector as stored}, {id: label})."""
    ids = rng.choice(10**9, n, replace=False).astype(np.int64)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    if dtype in ("int8", "uint8"):
        x = np.clip(np.round(x * 30), -127, 127).astype(np.float32)
    row_labels = rng.integers(0, labels, n)
    index = tinyknn.Index(dim, metric=metric, dtype=dtype, device=device)
    index.add(x[:2500], ids=ids[:2500], labels=row_labels[:2500])
    index.add(x[2500:], ids=ids[2500:])
    gone = rng.choice(ids, 300, replace=False)
    index.remove(gone)
    index.add(x[np.isin(ids, gone)][:100], ids=ids[np.isin(ids, gone)][:100])
    return index


def answers(index, rng, dim=8, labels=5):
    """Every kind of search, with the queries and arguments fixed by rng's state."""
    q = rng.standard_normal((7, dim)).astype(np.float32)
    if index.dtype in ("int8", "uint8"):
        q = np.clip(np.round(q * 30), -127, 127).astype(np.float32)
    query_labels = rng.integers(0, labels, len(q))
    held = np.sort(index._ids.ids_of_rows())      # (row order changes with a reorder; ids do not)
    allowed = rng.choice(held, len(held) // 3, replace=False)
    radius = {"l2": 12.0, "ip": 1.0, "cosine": 0.3}[index.metric] * (900 if index.dtype == "int8" and index.metric != "cosine" else 1)
    return [*index.search(q, 10), *index.search(q, 10, labels=query_labels),
            *index.search(q, 10, labels=query_labels, filter=allowed), *index.search(q, 10, filter=allowed),
            *index.range_search(q, radius, labels=query_labels), *index.range_search(q, radius),
            index.get(held), index.contains(np.concatenate([held, [-5, 10**12]]))]


def label_rows_are_contiguous(index) -> bool:
    return all(np.all(np.diff(rows) == 1) for rows in (index._labels.rows_of(label) for label in range(5)))


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("metric", METRICS)
def test_a_reorder_changes_no_answer_id_label_or_file(backend, rng, metric, dtype):
    index = scattered_index(rng, metric=metric, dtype=dtype, device=device(backend))
    seed = int(rng.integers(2**32))
    before, saved = answers(index, np.random.default_rng(seed)), io.BytesIO()
    assert not label_rows_are_contiguous(index)
    with index._add_lock, index._view:
        index._layout.reorder(index._searcher, index._ids, index._labels)
    assert label_rows_are_contiguous(index) and index._layout.reorders == 1
    after = answers(index, np.random.default_rng(seed))
    for was, now in zip(before, after):
        assert was.dtype == now.dtype and np.array_equal(was, now)
    index.save(saved)
    again = tinyknn.Index.load(io.BytesIO(saved.getvalue()))
    for was, now in zip(before, answers(again, np.random.default_rng(seed))):
        assert np.array_equal(was, now)
    vectors, ids = index._searcher.export()
    labels, has = index._labels.column()
    assert np.array_equal(index._ids.ids_of_rows(), ids)
    assert np.all(np.diff(labels[has]) >= 0) and not has[np.argmin(has):].any()   # by label, unlabelled last


def test_labelled_searches_reorder_once_the_scattered_reads_reach_the_rows(backend, rng, monkeypatch):
    """Ski rental: the scattered runs that labelled searches read are counted; once they reach REORDER_FACTOR
    times the index's rows, the next labelled search reorders first; unfiltered and filter-only searches
    count nothing."""
    monkeypatch.setattr(_layout, "MIN_RUNS", 0)
    index = scattered_index(rng, device=device(backend))
    q = rng.standard_normal((1, 8)).astype(np.float32)
    index.search(q, 5)
    index.search(q, 5, filter=index._ids.ids_of_rows()[::3])
    assert index._layout.scattered_runs == 0
    runs = []
    while index._layout.reorders == 0:
        runs.append(index._layout.scattered_runs)
        label = len(runs) % 5
        got = index.search(q, 5, labels=[label])
        want = index._labels.rows_of(label)              # (after the search: it may have reordered first)
        assert_exact(*got, index._searcher.get_rows(want).astype(np.float32)
                     if backend != "model" else index._searcher.rows[want], q, 5, "l2",
                     id_map=index._ids.ids_of_rows()[want])
    due = _layout.REORDER_FACTOR * index.ntotal
    assert runs[-1] >= due and all(r < due for r in runs[:-1])
    assert len(runs) > 2 and label_rows_are_contiguous(index)
    assert index._layout.scattered_runs == 0    # the search that reordered read contiguous rows
    for label in range(5):
        index.search(q, 5, labels=[label])
    assert index._layout.scattered_runs == 0 and index._layout.reorders == 1


def test_labels_added_together_never_reorder(backend, rng, monkeypatch):
    """Each label added in one batch: its rows are one run, nothing is scattered, nothing is reordered."""
    monkeypatch.setattr(_layout, "MIN_RUNS", 0)
    index = tinyknn.Index(4, device=device(backend))
    for label in range(4):
        index.add(rng.standard_normal((50, 4)).astype(np.float32), labels=np.full(50, label))
    q = rng.standard_normal((3, 4)).astype(np.float32)
    for _ in range(200):
        index.search(q, 3, labels=[0, 1, 3])
    assert index._layout.scattered_runs == 0 and index._layout.reorders == 0


def test_a_reorder_that_cannot_allocate_changes_nothing(backend, rng, monkeypatch):
    """The searcher refuses the reorder (MemoryError, before it changes anything): a warning, the same
    answers, the rows where they were, and no retry at every search after (the count starts again).
    The warning is a RuntimeWarning pointing at the caller's search (it used to go to the "tinyknn" logger
    only, which has a NullHandler: nobody saw the warning the README promises)."""
    monkeypatch.setattr(_layout, "MIN_RUNS", 0)
    index = scattered_index(rng, device=device(backend))
    seed = int(rng.integers(2**32))
    before, rows_before = answers(index, np.random.default_rng(seed)), index._labels.rows_of(2).copy()

    def refuse(order):
        raise MemoryError("reordering the rows: out of memory (a test)")

    monkeypatch.setattr(index._searcher, "permute_rows", refuse)
    index._layout.scattered_runs = int(_layout.REORDER_FACTOR * index.ntotal) + 1
    with pytest.warns(RuntimeWarning, match="skipped putting each label's rows together .*out of memory \\(a test\\)"
                      ".*searches stay exact") as caught:
        index.search(rng.standard_normal((1, 8)).astype(np.float32), 3, labels=[2])
    assert len(caught) == 1 and caught[0].filename == __file__
    assert np.array_equal(index._labels.rows_of(2), rows_before)
    assert index._layout.scattered_runs < _layout.REORDER_FACTOR * index.ntotal
    for was, now in zip(before, answers(index, np.random.default_rng(seed))):
        assert np.array_equal(was, now)


def test_the_library_refuses_an_order_that_is_not_a_permutation(rng):
    """The CPU library checks the order before it copies anything (ValueError, nothing changed)."""
    index = scattered_index(rng)
    seed = int(rng.integers(2**32))
    before, n = answers(index, np.random.default_rng(seed)), index.ntotal
    for bad in (np.arange(n - 1), np.r_[np.arange(n - 1), 0], np.r_[np.arange(n - 1), n], np.arange(n) - 1):
        with pytest.raises(ValueError, match="every row position once|every row once"):
            index._searcher.permute_rows(bad)
    for was, now in zip(before, answers(index, np.random.default_rng(seed))):
        assert np.array_equal(was, now)
