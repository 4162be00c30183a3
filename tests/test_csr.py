"""tinyknn.csr: answers to disjoint sets of queries put together in query order, against a query-by-query
model, whichever way combine copies them (run by run, or a scatter of every hit)."""

from __future__ import annotations

import numpy as np
import pytest

from tinyknn import csr


def by_query(n_queries, answers):
    """The model: each query's hits from the answer that names it, query by query."""
    hits = {}
    for queries, lims, distances, ids in answers:
        for i, q in enumerate(queries):
            hits[int(q)] = (distances[lims[i]:lims[i + 1]], ids[lims[i]:lims[i + 1]])
    none = (np.empty(0, np.float32), np.empty(0, np.int64))
    parts = [hits.get(q, none) for q in range(n_queries)]
    return (csr.offsets([len(d) for d, _ in parts]), np.concatenate([d for d, _ in parts] + [none[0]]),
            np.concatenate([i for _, i in parts] + [none[1]]))


@pytest.mark.parametrize("run_hits", [1, csr.RUN_HITS, 1 << 40])
def test_combine_puts_range_answers_in_query_order(run_hits, rng, monkeypatch):
    """Answers of a few large runs (a screened batch and its few queries screened again), interleaved ones
    (label groups), queries in any order, empty answers and queries no answer names."""
    monkeypatch.setattr(csr, "RUN_HITS", run_hits)
    for _ in range(300):
        n_queries, n_answers = int(rng.integers(0, 60)), int(rng.integers(1, 5))
        owner = rng.integers(-1, n_answers, n_queries)
        answers = []
        for a in range(n_answers):
            queries = np.flatnonzero(owner == a)
            if rng.random() < 0.5:
                queries = rng.permutation(queries)
            counts = rng.integers(0, 200 if rng.random() < 0.5 else 4, len(queries)) * (rng.random(len(queries)) < 0.7)
            lims = csr.offsets(counts)
            answers.append((queries if rng.random() < 0.8 else queries.tolist(), lims,
                            rng.random(int(lims[-1])).astype(np.float32), rng.integers(0, 1 << 40, int(lims[-1]))))
        got, want = csr.combine(n_queries, answers), by_query(n_queries, answers)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)
