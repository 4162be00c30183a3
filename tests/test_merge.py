"""tinyknn.index.merge.knn, the vectorised merge of per-shard answers: the same bits as the lexsort of every
candidate (`exact_order`, kept here as the reference) and as the float64 oracle over all rows, on random,
duplicated, tied, near-tied and padded parts, two to six of them, k beyond the rows, every metric; and it
asks for fewer float64 distances than the reference."""

from __future__ import annotations

import numpy as np
import pytest
from reference import exact_search

from tinyknn.index import merge


def reference_knn(parts, k, metric, resolve):
    """The merge as it was: every valid candidate flattened and put in order by one `exact_order`."""
    larger = merge.LARGER_IS_BETTER[metric]
    distances = np.concatenate([d for d, _ in parts], axis=1)
    ids = np.concatenate([i for _, i in parts], axis=1)
    n_queries, width = ids.shape
    shard = np.broadcast_to(np.repeat(np.arange(len(parts)), [i.shape[1] for _, i in parts]), ids.shape)
    rank = np.broadcast_to(np.concatenate([np.arange(i.shape[1]) for _, i in parts]), ids.shape)
    query = np.broadcast_to(np.arange(n_queries)[:, None], ids.shape)
    valid = ids >= 0
    query, distance, shard, rank, ids = query[valid], distances[valid], shard[valid], rank[valid], ids[valid]
    order = merge.exact_order(query, distance, shard, rank, ids, larger, resolve, limit=k)
    out_d = np.full((n_queries, k), -np.inf if larger else np.inf, dtype=np.float32)
    out_i = np.full((n_queries, k), -1, dtype=np.int64)
    query = query[order]
    counts = np.bincount(query, minlength=n_queries)
    position = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = position < k
    out_d[query[keep], position[keep]] = distance[order][keep]
    out_i[query[keep], position[keep]] = ids[order][keep]
    return out_d, out_i


def _data(rng, kind: str, n: int, d: int, nq: int):
    x = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((nq, d)).astype(np.float32)
    if kind == "duplicated":
        x[n // 3: n // 3 + 40] = x[3]              # copies of one row, in several parts
        x[-30:] = x[3]
        q[:5] = x[3]
    elif kind == "tied":
        x = rng.integers(-2, 3, (n, d)).astype(np.float32)      # few distinct distances: ties everywhere
        q = rng.integers(-2, 3, (nq, d)).astype(np.float32)
    elif kind == "near-ties":
        half = n // 2
        x[half:2 * half] = x[:half] + (rng.standard_normal((half, d)) * 1e-6).astype(np.float32)
        q = (x[:nq] + rng.standard_normal((nq, d)).astype(np.float32) * np.float32(0.2)).astype(np.float32)
    elif kind == "uint8":
        x = np.minimum(rng.exponential(25.0, (n, d)), 255).astype(np.uint8).astype(np.float32)
        twins = min(n // 10, nq)
        x[n - twins:] = x[:twins]                  # duplicated rows, as in BIGANN: a twin is the same distance away
        q = x[rng.integers(0, n, nq)].copy()
        q[:20] = x[:20]                            # ... and these queries' two nearest are a pair of twins: over
        # several parts, some pair lies in two of them, so the merge must settle a tie across parts
    return x, q


class Resolver:
    """The contract's float64 distance of (query, id) pairs, counting the pairs asked for."""

    def __init__(self, x, q, ids, metric):
        self.by_id = np.empty_like(x)
        self.by_id[ids] = x
        self.q, self.metric, self.pairs = q, metric, 0

    def __call__(self, numbers, ids, _shard):
        self.pairs += len(ids)
        return merge.exact_distances(self.q[numbers], self.by_id[ids], self.metric)


def _parts(rng, x, q, metric, n_parts, width, equal=False):
    """Each part's exact answer (width columns, padded where a part has fewer rows) over a random split of
    the rows (parts of random sizes, or of equal ones), under shuffled ids (so the smaller id of a tie may sit
    in any part)."""
    ids = rng.permutation(len(x)).astype(np.int64)
    if equal:
        cuts = np.arange(1, n_parts) * len(x) // n_parts
    else:
        cuts = np.sort(rng.choice(np.arange(1, len(x)), n_parts - 1, replace=False))
    pieces = np.split(rng.permutation(len(x)), cuts)
    parts = [exact_search(x[rows], q, width, metric, id_map=ids[rows]) for rows in pieces]
    return ids, parts


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("kind", ["random", "duplicated", "tied", "near-ties", "uint8"])
@pytest.mark.parametrize("n_parts,k", [(2, 10), (3, 25), (6, 40), (4, 150)])
def test_the_same_bits_as_the_reference_and_the_oracle(rng, metric, kind, n_parts, k):
    """k = 150 over 4 parts of ~100 rows: every part padded, the answer too (k beyond the 400 rows)."""
    x, q = _data(rng, kind, n=400 if k > 100 else 700, d=8, nq=50)
    ids, parts = _parts(rng, x, q, metric, n_parts, k)
    fast, slow = Resolver(x, q, ids, metric), Resolver(x, q, ids, metric)
    got = merge.knn(parts, k, metric, fast)
    want = reference_knn(parts, k, metric, slow)
    oracle = exact_search(x, q, k, metric, id_map=ids)
    for answer in (want, oracle):
        np.testing.assert_array_equal(got[1], answer[1])
        np.testing.assert_array_equal(got[0].view(np.uint32), answer[0].view(np.uint32))
    assert got[0].dtype == np.float32 and got[1].dtype == np.int64
    assert fast.pairs <= slow.pairs


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_parts_of_other_widths_and_padding_within(rng, metric):
    """A running answer of k columns merged with a shard's wider or narrower one; a part whose ids are -1
    (its distances anything) contributes nothing."""
    x, q = _data(rng, "tied", n=500, d=6, nq=30)
    ids = rng.permutation(len(x)).astype(np.int64)
    a = exact_search(x[:200], q, 20, metric, id_map=ids[:200])
    b = exact_search(x[200:], q, 35, metric, id_map=ids[200:])
    empty = (np.zeros((len(q), 5), dtype=np.float32), np.full((len(q), 5), -1, dtype=np.int64))
    resolve = Resolver(x, q, ids, metric)
    want = exact_search(x, q, 20, metric, id_map=ids)
    for parts in ([a, b], [b, a], [empty, a, b]):
        got = merge.knn(parts, 20, metric, resolve)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))


def test_ties_across_parts_past_the_kth_are_resolved_only_where_they_start_within_k():
    """A group of equal float32 distances that starts at position k - 1 and mixes parts only after k is
    resolved (its float64 order picks the k-th); one that starts at k is not asked for at all."""
    d = np.array([[1.0, 2.0, 2.0, 9.0]], dtype=np.float32)
    part_a = (d[:, :3], np.array([[10, 11, 12]]))
    part_b = (np.array([[2.0, 3.0, 3.0]], dtype=np.float32), np.array([[5, 6, 7]]))
    exact = {10: 1.0, 11: 2.0 + 1e-9, 12: 2.0 + 2e-9, 5: 2.0, 6: 3.0, 7: 3.0}
    asked = []

    def resolve(numbers, ids, shard):
        asked.extend(ids.tolist())
        return np.array([exact[i] for i in ids])

    got_d, got_i = merge.knn([part_a, part_b], 2, "l2", resolve)
    assert got_i.tolist() == [[10, 5]] and sorted(asked) == [5, 11, 12]
    asked.clear()
    got_d, got_i = merge.knn([part_a, part_b], 1, "l2", resolve)
    assert got_i.tolist() == [[10]] and asked == []
    # query 0 ties past k within one part (so the merge looks two columns further), query 1 mixes parts
    # there: from position k on, never asked for
    d_a = np.array([[1.0, 2.0, 2.0, 2.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    d_b = np.array([[2.5], [3.0]], np.float32)
    got_d, got_i = merge.knn([(d_a, np.array([[10, 11, 12, 13], [20, 21, 22, 23]])), (d_b, np.array([[30], [31]]))],
                             2, "l2", resolve)
    assert got_i.tolist() == [[10, 11], [20, 21]] and asked == []


@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("n_parts,k", [(2, 10), (3, 25), (4, 150)])
def test_integer_ties_go_to_the_smaller_id_in_any_part_without_resolving(rng, metric, n_parts, k):
    """Integer distances below 2**24 are their float64 distances: with exact_below every tie between parts
    goes to the smaller id wherever it sits (ids are shuffled, so often in a later part), at k's boundary
    and among padding too, and no float64 distance is asked for; the same bits as resolving every mixed
    tie, as the reference and as the oracle (the resolving merge did meet such ties)."""
    x, q = _data(rng, "tied", n=400 if k > 100 else 700, d=8, nq=50)
    ids, parts = _parts(rng, x, q, metric, n_parts, k)

    def never(*_):
        raise AssertionError("a float64 distance was asked for")

    got = merge.knn(parts, k, metric, never, exact_below=2.0 ** 24)
    resolving = Resolver(x, q, ids, metric)
    for answer in (merge.knn(parts, k, metric, resolving), reference_knn(parts, k, metric, Resolver(x, q, ids, metric)),
                   exact_search(x, q, k, metric, id_map=ids)):
        np.testing.assert_array_equal(got[1], answer[1])
        np.testing.assert_array_equal(got[0].view(np.uint32), answer[0].view(np.uint32))
    assert resolving.pairs > 0


def test_ties_at_or_beyond_exact_below_are_still_resolved():
    """The later part holds the smaller ids: a tie at 1.0 goes to id 5 unasked; the tie at 2**24 (float64
    2**24 + 0.5 and 2**24 + 1, both rounding to it) is put in float64 order, asked for those two only; ids
    past 32 bits take the merge that resolves mixed ties, to the same answer, asking the same two."""
    big = np.float32(2.0 ** 24)
    part_a = (np.array([[1.0, big, np.inf]], dtype=np.float32), np.array([[7, 8, -1]]))
    part_b = (np.array([[1.0, big]], dtype=np.float32), np.array([[5, 6]]))
    exact = {5: 1.0, 7: 1.0, 8: 2.0 ** 24 + 0.5, 6: 2.0 ** 24 + 1.0}
    asked = []

    def resolve(_numbers, ids, _shard):
        asked.extend(ids.tolist())
        return np.array([exact[i] for i in ids])

    got_d, got_i = merge.knn([part_a, part_b], 5, "l2", resolve, exact_below=2.0 ** 24)
    assert got_i.tolist() == [[5, 7, 8, 6, -1]] and sorted(asked) == [6, 8]
    assert got_d.tolist() == [[1.0, 1.0, big, big, np.inf]]
    offset = 1 << 32
    exact = {i + offset: v for i, v in exact.items()}
    asked.clear()
    shifted = [(d, np.where(i >= 0, i + offset, -1)) for d, i in (part_a, part_b)]
    _, got_i = merge.knn(shifted, 4, "l2", resolve, exact_below=2.0 ** 24)
    assert got_i.tolist() == [[5 + offset, 7 + offset, 8 + offset, 6 + offset]]
    assert sorted(asked) == [6 + offset, 8 + offset]


@pytest.mark.parametrize("kind", ["tied", "near-ties", "uint8"])
def test_blocks_of_rows_give_the_same_bits(rng, monkeypatch, kind):
    """Merged a few rows at a time (MERGE_BLOCK made small: blocks of 3 queries, the last shorter), each
    block's float64 questions asked with the queries' own numbers: the reference's bits, and so with ties
    settled by id where the distances are integers (exact_below)."""
    x, q = _data(rng, kind, n=500, d=8, nq=47)
    ids, parts = _parts(rng, x, q, "l2", 3, 20, equal=True)     # ties across parts: asserted below
    want = reference_knn(parts, 20, "l2", Resolver(x, q, ids, "l2"))
    monkeypatch.setattr(merge, "MERGE_BLOCK", 3 * 60)
    for exact_below in (0.0, 2.0 ** 24) if kind != "near-ties" else (0.0,):
        resolve = Resolver(x, q, ids, "l2")
        got = merge.knn(parts, 20, "l2", resolve, exact_below=exact_below)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
        assert resolve.pairs > 0 or exact_below
