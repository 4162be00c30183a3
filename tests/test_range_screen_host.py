"""The host side of range search through the screen (gpu/range_screen.py, gpu/hit_pool.py; no GPU needed): the
radius -> threshold conversion against an exact rational model (a row strictly inside the radius by the
contract's float64 distance must have its real key strictly below the float32 threshold), its tightness, the
rounding up to float32, and the merge of the screen's answers with range_kernel's."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from reference import contract_distances, searched, stored
from tinyknn.gpu import hit_pool, range_screen
from tinyknn.jit import cuda_source, render_screen


def exact_key(metric: str, q: np.ndarray, x: np.ndarray):
    """The screen's real key of one (query, row) as exact rationals: l2 (|x|^2 - 2 q.x,), ip (-q.x,), cosine
    (-q.x, |q|^2 |x|^2): the key is -q.x / sqrt(the second)."""
    qf = [Fraction(float(v)) for v in q]
    xf = [Fraction(float(v)) for v in x]
    dot = sum((a * b for a, b in zip(qf, xf)), Fraction(0))
    if metric == "l2":
        return (sum((b * b for b in xf), Fraction(0)) - 2 * dot,)
    if metric == "ip":
        return (-dot,)
    return -dot, sum((a * a for a in qf), Fraction(0)) * sum((b * b for b in xf), Fraction(0))


def below(key, threshold: float) -> bool:
    """Whether the real key is strictly below the threshold (exactly; cosine's square root by squaring)."""
    t = Fraction(float(threshold))
    if len(key) == 1:
        return key[0] < t
    minus_dot, norms = key                       # key = minus_dot / sqrt(norms) (norms 0: key 0)
    if norms == 0:
        return 0 < t
    if t >= 0:                                   # minus_dot < t sqrt(norms)
        return minus_dot < 0 or minus_dot * minus_dot < t * t * norms
    return minus_dot < 0 and minus_dot * minus_dot > t * t * norms


def rows_and_queries(rng, kind: str, dim: int, dtype: str):
    n = 24
    if kind == "far":                            # far from the origin: l2's |q|^2 cancels nearly all of the key
        x = rng.standard_normal((n, dim)) + 1000.0
        q = x[:4] + rng.standard_normal((4, dim)) * 1e-3
    elif kind == "tiny":                         # float32 subnormals
        x = rng.standard_normal((n, dim)) * 1e-39
        q = x[:4] + rng.standard_normal((4, dim)) * 1e-40
    elif kind == "integers":
        x = rng.integers(0, 256, (n, dim)).astype(np.float64)
        q = x[:4] + rng.integers(-3, 4, (4, dim))
    else:
        x = rng.standard_normal((n, dim)) * rng.uniform(0.01, 100.0, (n, 1))
        q = rng.standard_normal((4, dim)) * 3.0
    if dtype == "uint8":
        x = np.clip(np.rint(x), 0, 255)
    db = stored(x.astype(np.float32).astype(dtype) if dtype != "float32" else x.astype(np.float32), dtype)
    return db, searched(q.astype(np.float32))


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("kind,dtype,dim", [("normal", "float32", 72), ("normal", "float16", 768),
                                            ("far", "float32", 128), ("tiny", "float32", 40),
                                            ("integers", "uint8", 96), ("normal", "float32", 3)])
def test_a_row_inside_the_radius_by_one_ulp_has_its_key_below_the_threshold(metric, kind, dtype, dim, rng):
    """The radius just above each row's contract distance (so the row is a hit by the least margin) and at
    it (not a hit: nothing to prove, but the threshold stays finite): the real key is strictly below T."""
    db, q = rows_and_queries(rng, kind, dim, dtype)
    dist = contract_distances(db, q, metric)
    larger = metric != "l2"
    max_squares = float(np.float32(np.nextafter(np.max((db * db).sum(axis=1)) * (1 + 1e-12), np.inf)))
    checked = 0
    for i in range(len(q)):
        for j in range(len(db)):
            d = dist[i, j]
            radius = float(np.nextafter(d, -np.inf if larger else np.inf))    # d strictly inside it
            t = range_screen.radius_thresholds(metric, q[i:i + 1].astype(np.float32), radius, max_squares)[0]
            assert t.dtype == np.float32 and np.isfinite(t)
            key = exact_key(metric, q[i], db[j])
            assert below(key, t), (metric, kind, i, j, d, radius, float(t))
            checked += 1
    assert checked == len(q) * len(db)


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_the_threshold_is_tight(metric, rng):
    """T is the radius's key plus float64-sized slack, then rounded up to float32: within a few float32 ulps."""
    q = rng.standard_normal((50, 128)).astype(np.float32)
    radius = {"l2": 150.0, "ip": 2.5, "cosine": 0.25}[metric]
    t = range_screen.radius_thresholds(metric, q, radius, 300.0).astype(np.float64)
    qq = (q.astype(np.float64) ** 2).sum(axis=1)
    ideal = radius - qq if metric == "l2" else np.full(len(q), -radius)
    assert np.all(t >= ideal)
    assert np.all(t - ideal <= 4 * np.spacing(np.abs(ideal).astype(np.float32)).astype(np.float64) + 1e-9)


def test_thresholds_refuse_an_unknown_metric():
    with pytest.raises(ValueError, match="metric must be"):
        range_screen.radius_thresholds("hamming", np.zeros((1, 4), np.float32), 1.0, 1.0)


def test_float32_up_rounds_up_by_the_least_amount(rng):
    values = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.integers(-40, 38, 2000),
                             [0.0, -0.0, 1.0, -1.0, 1e300, -1e300, 3.4028235677973366e38]])
    up = range_screen.float32_up(values)
    wide = up.astype(np.float64)
    assert np.all(wide >= values)
    with np.errstate(over="ignore"):
        lower = np.nextafter(up, np.float32(-np.inf)).astype(np.float64)
    assert np.all(lower < values)
    assert range_screen.float32_up(-np.inf)[0] == -np.inf


def test_gamma_bounds_n_roundings():
    for n in (1, 3, 128, 65536):
        g = Fraction(range_screen.gamma(n))
        u = Fraction(1, 2 ** 53)
        assert g >= n * u / (1 - n * u)


def test_merge_answers_puts_each_query_in_csr_order(rng):
    n_queries = 40
    counts = rng.integers(0, 6, n_queries)
    which = np.sort(rng.choice(n_queries, 9, replace=False))
    counts[which] = 0
    other_counts = rng.integers(0, 8, len(which))
    # each query's hits: distances q + 0.01 i, ids 1000 q + i
    def hits(queries, per_query):
        d = np.concatenate([q + 0.01 * np.arange(c) for q, c in zip(queries, per_query)] + [np.empty(0)])
        i = np.concatenate([1000 * q + np.arange(c) for q, c in zip(queries, per_query)] + [np.empty(0, np.int64)])
        return d.astype(np.float32), i.astype(np.int64)
    first_d, first_i = hits(range(n_queries), counts)
    other_d, other_i = hits(which, other_counts)
    merged, d, i = hit_pool.merge_answers(counts, first_d, first_i, which, other_counts, other_d, other_i)
    want_counts = counts.copy()
    want_counts[which] = other_counts
    want_d, want_i = hits(range(n_queries), want_counts)
    np.testing.assert_array_equal(merged, want_counts)
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(i, want_i)
    same = hit_pool.merge_answers(counts, first_d, first_i, np.zeros(0, np.int64), [], first_d[:0], first_i[:0])
    np.testing.assert_array_equal(same[2], first_i)


def test_range_survivors_spec_names_its_kernel():
    spec = render_screen.step_spec("range_survivors", "cosine", "float16", 0, "sm_90")
    assert cuda_source.name_expression(spec) == "tinyknn::range_survivors_kernel<tinyknn::Cosine, tinyknn::half_bits>"
    specs = render_screen.specs_for_range_screen("l2", "float32", "sm_90", stride=128)
    assert [s.variant for s in specs] == ["screen_hopper", "screen_tiles", "screen_hopper", "screen_tiles", "screen",
                                          "screen_queries", "screen_rows", "range_survivors"]
    assert [s.param("bn") for s in specs[:4]] == [128, 128, 256, 256]          # the large tile's, then the small's
    eight_bit = render_screen.specs_for_range_screen("l2", "uint8", "sm_90", 128)
    assert [s.variant for s in eight_bit][:4] == ["screen_hopper", "screen_tiles", "screen_hopper", "screen"]
    assert [s.param("cw", 2) for s in eight_bit[:3:2]] == [3, 2]    # 8-bit: three consumers, then two; one tile bound
    assert "screen_hopper" not in [s.variant for s in render_screen.specs_for_range_screen("l2", "uint8", "sm_80", 128)]


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_range_survivors_kernel_needs_no_local_memory(arch):
    """Every metric and stored dtype's step 4 compiles with a 0-byte stack and no spills (without the
    launch bound's one block per SM, ptxas capped it at 32 registers and spilled)."""
    from tinyknn.jit.cache import get_cubin

    for metric in ("l2", "ip", "cosine"):
        for dtype in ("float32", "float16", "bfloat16", "int8", "uint8"):
            spec = render_screen.step_spec("range_survivors", metric, dtype, 0, arch)
            report = get_cubin(spec).reports[cuda_source.name_expression(spec)]
            assert (report.stack_bytes, report.spill_bytes) == (0, 0), (metric, dtype, report)


class ModelScreens:
    """range_screen._screen_once over a model of a batch: query j (its float32 column holds j) has hits[j] hits
    (distances j + 0.01 i, ids 1000 j + i) and survivors[j] survivors, plus drift(t) more when screened for the
    t-th time (t = 0 first: a re-screen on another kernel counts with other error terms); a screen past the
    first of more than `memory` survivor entries (queries x capacity) is refused, as a device cap would."""

    def __init__(self, hits, survivors, memory=None, drift=lambda t: 0):
        self.hits, self.survivors, self.memory, self.drift = hits, survivors, memory, drift
        self.times = np.zeros(len(hits), np.int64)
        self.calls = []                           # (queries, capacity, their survivors as counted before)

    def __call__(self, searcher, queries, thresholds, radius_key, larger, capacity):
        which = queries[:, 0].astype(np.int64)
        self.calls.append((which, capacity))
        if len(self.calls) > 1 and self.memory is not None and len(which) * capacity > self.memory:
            raise MemoryError(f"{len(which)} x {capacity}")
        counted = self.survivors[which] + np.array([self.drift(t) for t in self.times[which]], np.int64)
        self.times[which] += 1
        over = np.flatnonzero(counted > capacity)
        found = self.hits[which].copy()
        found[over] = 0
        distances, ids = model_hits(which, found)
        return found, distances, ids, over, counted[over]


def model_hits(queries, per_query):
    d = np.concatenate([q + 0.01 * np.arange(c) for q, c in zip(queries, per_query)] + [np.empty(0)])
    i = np.concatenate([1000 * q + np.arange(c) for q, c in zip(queries, per_query)] + [np.empty(0, np.int64)])
    return d.astype(np.float32), i.astype(np.int64)


def screen_model(monkeypatch, model, n_queries):
    """range_screen.screened over `model`: (counts, distances, ids, handed_back, the searcher's Screen)."""
    from types import SimpleNamespace

    monkeypatch.setattr(range_screen, "_screen_once", model)
    state = SimpleNamespace(range_queries=0, range_fallbacks=0, range_rescreens=0)
    searcher = SimpleNamespace(metric="l2", _screen=state, _n=10**6)
    queries = np.repeat(np.arange(n_queries, dtype=np.float32)[:, None], 4, axis=1)
    return (*range_screen.screened(searcher, queries, 1.0), state)


@pytest.mark.parametrize("case", ["fit", "drift once", "refused", "drift always"])
def test_overflowed_queries_are_screened_again_and_merged_in_csr_order(case, rng, monkeypatch):
    """The queries whose survivors overflowed the first screen are screened again in groups (each of at most
    SURVIVOR_BYTES of survivor lists at its largest count, or one query) with room for all their counted
    survivors; a count that grows once (another kernel) is screened a third time; a group the device
    refuses is halved down to one query, handed back then; a count that keeps growing is handed back after
    RESCREEN_ROUNDS. Every other query's hits come back in CSR order, as one screen of all would give them."""
    cap, n_queries = render_screen.SURVIVOR_CAPACITY, 300
    monkeypatch.setattr(range_screen, "SURVIVOR_BYTES", 4 * 6 * cap)
    hits = rng.integers(0, 6, n_queries)
    survivors = rng.integers(0, 3 * cap, n_queries)
    overflowed = np.flatnonzero(survivors > cap)
    memory = 2 * cap if case == "refused" else None
    drift = {"drift once": lambda t: 3 * cap * (t > 0),        # past every first count: a third screen
             "drift always": lambda t: 3 * cap * t}.get(case, lambda t: 0)
    model = ModelScreens(hits, survivors, memory, drift)
    counts, distances, ids, back, state = screen_model(monkeypatch, model, n_queries)
    want_back = {"refused": overflowed[survivors[overflowed] > memory] if memory else None,
                 "drift always": overflowed}.get(case, np.zeros(0, np.int64))
    np.testing.assert_array_equal(back, want_back)
    answered = hits.copy()
    answered[want_back] = 0
    np.testing.assert_array_equal(counts, answered)
    want_d, want_i = model_hits(range(n_queries), answered)
    np.testing.assert_array_equal(distances, want_d)
    np.testing.assert_array_equal(ids, want_i)
    if case == "refused":
        assert 0 < len(want_back) < len(overflowed)
    assert (state.range_queries, state.range_fallbacks, state.range_rescreens) == (
        n_queries, len(want_back), len(overflowed))
    assert model.calls[0][1] == cap and len(model.calls[0][0]) == n_queries
    screened_again = np.concatenate([which for which, _ in model.calls[1:]])
    assert set(screened_again) == set(overflowed)
    for which, capacity in model.calls[1:]:
        assert len(which) == 1 or len(which) * capacity * 4 <= range_screen.SURVIVOR_BYTES
        assert capacity >= survivors[which].max()
        assert capacity == survivors[which].max() or case.startswith("drift")
    rounds = np.bincount(screened_again, minlength=n_queries)[overflowed]
    if case == "fit":
        assert np.all(rounds == 1)
    if case in ("drift once", "drift always"):
        assert len(model.calls) > 2 and np.all(rounds == range_screen.RESCREEN_ROUNDS)


def test_no_overflow_is_one_screen(rng, monkeypatch):
    hits = rng.integers(0, 6, 100)
    model = ModelScreens(hits, rng.integers(0, render_screen.SURVIVOR_CAPACITY, 100))
    counts, distances, ids, back, state = screen_model(monkeypatch, model, 100)
    assert len(model.calls) == 1 and len(back) == 0 and state.range_rescreens == 0
    np.testing.assert_array_equal(counts, hits)
    np.testing.assert_array_equal(ids, model_hits(range(100), hits)[1])
