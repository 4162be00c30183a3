#!/usr/bin/env python3
"""Index operations against the speed and behaviour targets, every row in one run on one device.

1M x 128 float32 l2 (standard normal, seeded), ids 0..n-1 given, labels 0..99 (each 1 % of the rows): add
of 1 row with its own id; filtered search (one label, a 1 % allow-list) against unfiltered, 1 and 1,000
queries, k = 10; remove of 1 % and the first search after it against the same search after an idle pause as long
as the removal (and, recorded, warm before it); range
search with ~100 hits per query against search(k=100), 1,000 queries; k = 10,000 against k = 2,048, 100
queries (`--sections` picks some of them: removal,ranges,large_k are the GPU selection's rows). Host NumPy in
and out (so every call returns synchronised), host clock, medians after warm-up. Every row says what it
measured, its target, whether the issue states that target for this device, and whether it is met; a
few answers of every kind are checked against the float64 oracle (bench/oracle.py), ids and distance
bits. The threads target is tests/test_index_concurrency.py (TINYKNN_STRESS_SECONDS=30). `--pytest "FILES"` runs
those tests first (`pytest -x -q`, the log into --out-dir; the run's exit status is theirs when they fail, after
the measurements): one device command checks and measures. On the GPU the filtered section also times the searcher alone over random allow-lists
of several sizes and a run, read in place and gathered (`filter_sweep` in the JSON's timings).

Length: one section per row of the targets' table, each with its own checks, in the one script the docs cite.
"""

from __future__ import annotations

import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, then the checkout's tinyknn

import _common  # noqa: E402
import index_ops_report as report  # noqa: E402
import oracle  # noqa: E402

import tinyknn  # noqa: E402

LABELS = 100                    # label l holds the rows with label l: 1 % each


def parse_args(argv=None):
    parser = _common.common_parser(__doc__.splitlines()[0])
    add = parser.add_argument
    add("--budget-s", type=float, default=150.0, help="start no new section after this many seconds (default 150)")
    add("--rows", type=int, default=1_000_000, help="database rows (default 1,000,000; --quick 100,000)")
    add("--dim", type=int, default=128)
    add("--target-s", type=float, default=0.5, help="timed seconds per measurement (default 0.5)")
    add("--min-reps", type=int, default=3)
    add("--max-reps", type=int, default=100)
    add("--check-queries", type=int, default=3, help="queries of each kind checked against the float64 oracle")
    add("--removals", type=int, default=5, help="removals of 1 %% timed (each re-added afterwards)")
    add("--seed", type=int, default=0)
    add("--note", default="", help="free text stored in the results")
    add("--pytest", default="", help="pytest arguments to run first (-x -q added; log in --out-dir); when they "
        "fail the run still measures, then exits with pytest's status")
    add("--pytest-timeout", type=float, default=420.0, help="seconds the tests may take (default 420; then status 124)")
    add("--no-screen-runs", action="store_true", help="screen no label's run of rows on the GPU (screen.SCREEN_RUNS "
        "off: a label's batch takes the other kernels, as before runs were screened)")
    add("--sections", default=",".join(s.__name__ for s in SECTIONS),
        help="comma-separated sections to run (default: all of " + ",".join(s.__name__ for s in SECTIONS) + ")")
    args = parser.parse_args(argv)
    names = {section.__name__: section for section in SECTIONS}
    unknown = [name for name in args.sections.split(",") if name not in names]
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; the sections are {', '.join(names)}")
    args.sections = [names[name] for name in args.sections.split(",")]
    if args.quick:
        args.rows, args.target_s, args.removals = min(args.rows, 100_000), 0.1, 3
    if args.device == "auto":
        from tinyknn.gpu.device import has_gpu

        args.device = "cuda" if has_gpu() else "cpu"
    return args


def warm_kernels(dim: int) -> float:
    """Compile (or load from the cache) the GPU kernels of the run's k values at once, in parallel (NVRTC
    releases the GIL); returns the seconds it took. Kernels it does not list compile at their first call."""
    from concurrent.futures import ThreadPoolExecutor

    from tinyknn.gpu.device import current_device
    from tinyknn.jit import render, search_kernels
    from tinyknn.jit.cache import get_cubin

    from tinyknn.jit import render_screen

    start, arch = time.perf_counter(), current_device().arch
    specs = {spec for k in (1, 10, 100, 2048)
             for spec in search_kernels.specs_for_search("l2", "float32", dim, k, arch)}
    specs |= set(render_screen.specs_for_range_screen("l2", "float32", arch,
                                                      render.row_layout(dim, "float16")[1]))
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(get_cubin, sorted(specs)))
    return time.perf_counter() - start


class Bench:
    """The database, the index, and what was measured so far."""

    def __init__(self, args):
        self.args, self.started = args, time.perf_counter()
        rng = np.random.default_rng(args.seed)
        clock = time.perf_counter
        t0 = clock()
        self.x = rng.standard_normal((args.rows, args.dim), dtype=np.float32)
        self.labels = rng.integers(0, LABELS, args.rows)
        self.queries = rng.standard_normal((1000, args.dim), dtype=np.float32)
        self.rng = rng
        self.setup = {"generate_s": clock() - t0,
                      "kernels_s": warm_kernels(args.dim) if args.device == "cuda" else 0.0}
        t0 = clock()
        self.index = tinyknn.Index(args.dim, "l2", "float32", device=args.device)
        self.index.add(self.x, ids=np.arange(args.rows), labels=self.labels)
        self.setup["build_s"] = clock() - t0
        self.rows, self.checks, self.timings, self.skipped = [], [], {}, []

    def left(self) -> bool:
        return time.perf_counter() - self.started < self.args.budget_s

    def time(self, name: str, fn) -> float:
        """Median seconds of fn() after a first call (kept) and a sizing call; samples kept under `name`."""
        clock = time.perf_counter
        t0 = clock()
        fn()
        first = clock() - t0
        t0 = clock()
        fn()
        reps = int(min(self.args.max_reps, max(self.args.min_reps, self.args.target_s / max(clock() - t0, 1e-9))))
        samples = _common.time_calls(fn, reps, warmup=0)
        self.timings[name] = {"first_call_us": first * 1e6, **_common.summary_us(samples)}
        return statistics.median(samples)

    def row(self, name: str, measured: float, unit: str, direction: str, limit: float, devices: str, **details):
        met = measured <= limit if direction == "<=" else measured >= limit
        self.rows.append({"name": name, "measured": measured, "unit": unit, "target": f"{direction} {limit:g} {unit}",
                          "direction": direction, "limit": limit, "met": bool(met), "target_devices": devices,
                          "target_applies": self.args.device in devices.split("+"), **details})
        print(f"{name:<64} {measured:9.3f} {unit:<3} target {direction} {limit:g}  "
              f"{'met' if met else 'MISSED'}{'' if self.args.device in devices else ' (not this device)'}", flush=True)

    def check(self, what: str, got, rows: np.ndarray | None, queries: np.ndarray, k: int) -> None:
        """The first --check-queries answers against the float64 oracle over x[rows] (ids are positions in x)."""
        nq = min(self.args.check_queries, len(queries))
        source = self.x if rows is None else self.x[rows]
        exact = oracle.exact_neighbours(source, "float32", queries[:nq], k, "l2")
        want = exact.ids if rows is None else rows[exact.ids]
        got_d, got_i = (np.asarray(a)[:nq, :k] for a in got)
        self.checks.append({"what": what, "queries": nq, "k": k, "oracle": exact.backend,
                            "ids_agree": float(np.mean(got_i == want)),
                            "distances_bitwise": bool(np.array_equal(
                                got_d.view(np.uint32), exact.distances.astype(np.float32).view(np.uint32)))})


def add_one(b: Bench) -> None:
    """One row with its own (new) id, again and again; the rows are removed afterwards."""
    n, fresh = b.args.rows, iter(range(b.args.rows, 2**62))
    row = b.rng.standard_normal((1, b.args.dim), dtype=np.float32)
    added = []

    def add():
        added.append(next(fresh))
        b.index.add(row, ids=added[-1:])

    seconds = b.time("add_1_row", add)
    got = b.index.search(row, 1)
    b.checks.append({"what": "the added row is found first, at distance 0", "queries": 1, "k": 1,
                     "ids_agree": float(got[1][0, 0] in added), "distances_bitwise": bool(got[0][0, 0] == 0.0)})
    b.index.remove(added)
    assert b.index.ntotal == n
    b.row("add 1 row with its own id", seconds * 1e3, "ms", "<=", 1.0, "cpu")


def filtered(b: Bench) -> None:
    """Queries/s of a 1 % label and a 1 % allow-list against unfiltered, 1 and 1,000 queries, k = 10."""
    allow = np.sort(b.rng.choice(b.args.rows, max(1, b.args.rows // 100), replace=False))
    label_rows = np.flatnonzero(b.labels == 7)
    few = b.queries[:b.args.check_queries]
    allow_list_copy(b, allow)
    b.check("unfiltered", b.index.search(few, 10), None, few, 10)
    kinds = (("label", label_rows, lambda q: {"labels": np.full(len(q), 7)}),
             (f"{len(allow):,}-id allow-list", allow, lambda q: {"filter": allow}))
    for kind, rows, kwargs in kinds:
        b.check(kind, b.index.search(few, 10, **kwargs(few)), rows, few, 10)
    label_layout(b)
    b.check("label, after the reorder", b.index.search(few, 10, labels=np.full(len(few), 7)), label_rows, few, 10)
    alone = {kind: subset_index(b, rows) for kind, rows, _ in kinds}
    for nq in (1, 1000):
        q = b.queries[:nq]
        plain = b.time(f"unfiltered_{nq}q", lambda: b.index.search(q, 10))
        for kind, rows, kwargs in kinds:
            given = kwargs(q)
            seconds = b.time(f"{kind}_{nq}q", lambda: b.index.search(q, 10, **given))
            floor = b.time(f"{kind}_rows_alone_{nq}q", lambda: alone[kind].search(q, 10))
            b.row(f"filtered 1 % by {kind}, {nq:,} {'query' if nq == 1 else 'queries'}: speed-up", plain / seconds,
                  "x", ">=", 5.0 if nq == 1 else 10.0, "cpu+cuda", filtered_ms=seconds * 1e3,
                  unfiltered_ms=plain * 1e3, allowed_rows=len(rows), rows_alone_ms=floor * 1e3,
                  rows_alone_speedup=plain / floor)
            print(f"    the {len(rows):,} rows alone in an index: {floor * 1e3:.3f} ms, "
                  f"{plain / floor:.2f} x unfiltered", flush=True)
    for index in alone.values():
        index.close()
    b.time("allow_list_ids_to_rows", lambda: b.index._ids.rows_present(allow))     # the Index's share of it
    if b.args.device == "cuda":
        filter_sweep(b)


def subset_index(b: Bench, rows: np.ndarray):
    """An index of the allowed rows alone (their ids kept): the filtered search's ceiling, since a filter
    cannot make a search cheaper than one over an index that holds only what it allows. Its answers must be
    the filtered search's."""
    index = tinyknn.Index(b.args.dim, "l2", "float32", device=b.args.device)
    index.add(b.x[rows], ids=rows)
    b.check(f"an index of the {len(rows):,} allowed rows alone", index.search(b.queries[:b.args.check_queries], 10),
            rows, b.queries[:b.args.check_queries], 10)
    return index


SWEEP_ROWS = (100, 1_000, 10_000, 100_000)      # allow-list sizes of filter_sweep (random rows), and one run


def filter_sweep(b: Bench) -> None:
    """The GPU searcher alone, k = 10, 1 and 1,000 queries: random allow-lists of SWEEP_ROWS rows and a run of 1 %
    of the rows, each read in place (a view or the position list) and gathered (read_in_place off: the copy the
    filtered search made before); both answers must be equal. Says where the gather is faster, if anywhere."""
    searcher, n = b.index._searcher, b.args.rows
    sets = [(f"random {m:,}", np.sort(b.rng.choice(n, m, replace=False))) for m in SWEEP_ROWS if m < n]
    sets.append((f"run of {n // 100:,}", np.arange(n // 3, n // 3 + n // 100)))
    sweep = {}
    for name, rows in sets:
        for nq in (1, 1000):
            q = b.queries[:nq]
            in_place = searcher.search(q, 10, rows=rows)
            searcher.read_in_place = False
            try:
                gathered = searcher.search(q, 10, rows=rows)
                gathered_s = b.time(f"sweep {name} {nq}q gathered", lambda: searcher.search(q, 10, rows=rows))
            finally:
                searcher.read_in_place = True
            in_place_s = b.time(f"sweep {name} {nq}q in place", lambda: searcher.search(q, 10, rows=rows))
            sweep[f"{name}, {nq}q"] = {"in_place_ms": in_place_s * 1e3, "gathered_ms": gathered_s * 1e3,
                                       "equal": bool(np.array_equal(in_place[1], gathered[1]) and np.array_equal(
                                           in_place[0].view(np.uint32), gathered[0].view(np.uint32)))}
            print(f"filter sweep {name}, {nq} q: in place {in_place_s * 1e3:.3f} ms, gathered {gathered_s * 1e3:.3f} "
                  f"ms, equal {sweep[f'{name}, {nq}q']['equal']}", flush=True)
    b.timings["filter_sweep"] = sweep
    b.checks.append({"what": "filter sweep: in place equals gathered (ids and distance bits)", "queries": 1000,
                     "k": 10, "ids_agree": float(np.mean([v["equal"] for v in sweep.values()])),
                     "distances_bitwise": all(v["equal"] for v in sweep.values())})


def label_layout(b: Bench, limit: int = 10_000) -> None:
    """One-query searches of label 0, 1, 2, ... until the index puts each label's rows together
    (tinyknn.index.layout: once the scattered rows read add up to the index's rows; searchers with permute_rows
    only, the CPU's and the GPU's), each timed: how many it took, their median, and the one that paid for the reorder."""
    layout, q = b.index._layout, b.queries[:1]
    if not hasattr(b.index._searcher, "permute_rows"):
        b.timings["label_layout"] = {"reorders": layout.reorders, "note": "this device's searcher keeps its order"}
        return
    clock, samples, before = time.perf_counter, [], layout.reorders
    while layout.reorders == before and len(samples) < limit:
        t0 = clock()
        b.index.search(q, 10, labels=[len(samples) % LABELS])
        samples.append(clock() - t0)
    b.timings["label_layout"] = {"searches_until_reorder": len(samples), "reorders": layout.reorders,
                                 "scattered_1q_median_ms": statistics.median(samples[:-1] or samples) * 1e3,
                                 "search_with_reorder_ms": samples[-1] * 1e3, "total_s": sum(samples)}
    print(f"label layout: {len(samples)} one-query labelled searches (median "
          f"{b.timings['label_layout']['scattered_1q_median_ms']:.2f} ms), then one that reordered the rows: "
          f"{samples[-1] * 1e3:.0f} ms", flush=True)


def allow_list_copy(b: Bench, allow: np.ndarray, limit: int = 10_000) -> None:
    """One-query searches of the allow-list until the CPU searcher keeps its row-major copy (kernels/cpu/row_copy.h:
    built once the gathered searches of scattered rows have lost about its cost), each timed: how many it took,
    their median, and the one that built the copy."""
    searcher, q = b.index._searcher, b.queries[:1]
    if not hasattr(searcher, "row_copy_counts"):
        b.timings["allow_list_copy"] = {"note": "this device's searcher keeps no row copy"}
        return
    clock, samples = time.perf_counter, []
    while searcher.row_copy_counts()[2] == 0 and len(samples) < limit:
        t0 = clock()
        b.index.search(q, 10, filter=allow)
        samples.append(clock() - t0)
    if not samples:
        b.timings["allow_list_copy"] = {"searches_until_copy": 0, "row_copy": searcher.row_copy_counts()}
        return
    b.timings["allow_list_copy"] = {"searches_until_copy": len(samples), "row_copy": searcher.row_copy_counts(),
                                    "gathered_1q_median_ms": statistics.median(samples[:-1] or samples) * 1e3,
                                    "search_with_copy_ms": samples[-1] * 1e3, "total_s": sum(samples)}
    print(f"allow-list row copy: {len(samples)} one-query searches of the allow-list (median "
          f"{b.timings['allow_list_copy']['gathered_1q_median_ms']:.2f} ms), then one that built the copy: "
          f"{samples[-1] * 1e3:.0f} ms", flush=True)


WARM_SEARCHES = 3                # untimed searches of a shape before the timed one: plan, graph, screen terms


def removal(b: Bench) -> None:
    """Remove 1 % (random ids), then the first search of 1 and of 1,000 queries after it, against the same
    searches after an idle pause as long as a removal (the row's target), and warm just before it (a record);
    then the second search after it; re-add. Each round first searches each shape WARM_SEARCHES times untimed
    (the re-add of the previous round drops the plans, and a shape's second search captures its graph).

    Why the pause: any search that follows a few milliseconds without one pays a one-time wake-up, removal
    or not (1 query on 1M x 128: ~200 us after 10 ms idle against ~145 us back to back on the H200,
    bench/results/logs/removal_idle_*), and a removal is such a pause for the device. The searches run in the
    same order everywhere (1 query, then 1,000), so each timed one follows the same kind of step: a 1-query
    search right after a batch takes 15-25 us more than one after another (bench/results/logs/removal_trace_*)."""
    n, q1000 = b.args.rows, b.queries
    removes = []
    before, paused, after, second = ({1: [], 1000: []} for _ in range(4))
    clock = time.perf_counter

    def timed(into):
        for nq in (1, 1000):        # 1 query after a pause or a removal, then a batch after 1 query
            t0 = clock()
            found = b.index.search(q1000[:nq], 10)
            into[nq].append(clock() - t0)
        return found

    def warm():
        for nq in (1, 1000):
            for _ in range(WARM_SEARCHES):
                b.index.search(q1000[:nq], 10)

    for round_ in range(b.args.removals + 1):       # the first round (untimed) measures a removal's length
        gone = b.rng.choice(n, n // 100, replace=False)
        if round_:
            warm()
            time.sleep(statistics.median(removes))
            timed(paused)
        warm()
        timed(before)
        t0 = clock()
        assert b.index.remove(gone) == len(gone)
        removes.append(clock() - t0)
        got = timed(after)
        timed(second)
        kept = np.setdiff1d(np.arange(n), gone)
        b.index.add(b.x[gone], ids=gone, labels=b.labels[gone])
        if not round_:
            for runs in (before, after, second):
                for nq in runs:
                    runs[nq].clear()
    b.check("after a removal of 1 %", got, kept, q1000, 10)
    b.timings["remove_1pct"] = _common.summary_us(removes[1:])
    b.row("remove 1 % of the rows", statistics.median(removes[1:]) * 1e3, "ms", "<=", 20.0, "cuda",
          removed=n // 100)
    for nq in (1, 1000):
        for name, runs in (("before_remove", before), ("after_pause", paused), ("after_remove", after),
                           ("second_after_remove", second)):
            b.timings[f"search_{nq}q_{name}"] = _common.summary_us(runs[nq])
        first, warm_before = statistics.median(after[nq]), statistics.median(before[nq])
        b.timings[f"search_{nq}q_after_remove_against_warm_before"] = first / warm_before
        b.timings[f"search_{nq}q_second_after_remove_against_warm_before"] = \
            statistics.median(second[nq]) / warm_before
        print(f"  {nq:,} queries: warm before {warm_before * 1e3:.3f} ms, after a pause "
              f"{statistics.median(paused[nq]) * 1e3:.3f}, first after the removal {first * 1e3:.3f} "
              f"({first / warm_before:.2f}x warm), second {statistics.median(second[nq]) * 1e3:.3f}", flush=True)
        b.row(f"next search after it, {nq:,} {'query' if nq == 1 else 'queries'}: time ratio", first /
              statistics.median(paused[nq]), "x", "<=", 1.05, "cuda", after_ms=first * 1e3,
              before_ms=statistics.median(paused[nq]) * 1e3, warm_before_ms=warm_before * 1e3,
              against="the same search after an idle pause as long as the removal")


def radius_for(b: Bench, hits: int) -> float:
    """An l2 radius at which the first 250 queries average about `hits` neighbours: a first guess from their
    2,048 nearest (which undercounts the queries with more), then bisection on range_search's counts (the
    counts are heavy-tailed: a few queries near the data's centre have thousands)."""
    q = b.queries[:250]
    d, _ = b.index.search(q, 2048)
    candidates = np.sort(d.ravel())
    mean = lambda r: np.mean([np.searchsorted(row, r) for row in d])   # noqa: E731
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if mean(candidates[middle]) < hits else (low, middle)
    count = lambda r: float(np.diff(b.index.range_search(q, r)[0]).mean())   # noqa: E731
    high = float(candidates[low])
    low = high
    while count(low) > hits:                      # the guess only ever counts too few, so it is high enough
        low *= 0.97
    for _ in range(6):
        middle = (low + high) / 2
        low, high = (middle, high) if count(middle) < hits else (low, middle)
    return (low + high) / 2


def ranges(b: Bench) -> None:
    """range_search with ~100 hits per query against search(k=100), 1,000 queries (on the GPU through the
    tensor-core screen, the radius as its threshold; the queries it screens again or hands back, and
    range_kernel alone)."""
    q, radius = b.queries, radius_for(b, 100)
    knn = b.time("search_k100_1000q", lambda: b.index.search(q, 100))
    seconds = b.time("range_1000q", lambda: b.index.range_search(q, radius))
    screen = getattr(b.index._searcher, "_screen", None)
    before = (screen.range_queries, screen.range_fallbacks, screen.range_rescreens) if screen is not None else None
    lims, distances, ids = b.index.range_search(q, radius)
    screened = {} if before is None else {"screened_queries": screen.range_queries - before[0],
                                          "handed_back_queries": screen.range_fallbacks - before[1],
                                          "screened_again_queries": screen.range_rescreens - before[2]}
    counts = np.diff(lims)
    nq = min(b.args.check_queries, len(q))
    k = int(counts[:nq].max()) + 1
    exact = oracle.exact_neighbours(b.x, "float32", q[:nq], k, "l2")
    agree, bitwise = [], True
    for i in range(nq):
        hit = slice(lims[i], lims[i + 1])
        agree.append(np.array_equal(ids[hit], exact.ids[i, :counts[i]]) and exact.distances[i, counts[i]] >= radius)
        bitwise &= np.array_equal(distances[hit].view(np.uint32),
                                  exact.distances[i, :counts[i]].astype(np.float32).view(np.uint32))
    b.checks.append({"what": "range search (every hit, nothing else within the radius)", "queries": nq, "k": k,
                     "oracle": exact.backend, "ids_agree": float(np.mean(agree)), "distances_bitwise": bool(bitwise)})
    if b.args.device == "cuda":
        screened["range_kernel_alone_ms"] = range_block_sweep(b, q, radius, (lims, distances, ids)) * 1e3
        print(f"range search: {screened}", flush=True)
    b.row("range search ~100 hits, 1,000 queries: time vs search(k=100)", seconds / knn, "x", "<=", 1.5, "cuda",
          radius=radius, range_ms=seconds * 1e3, knn_ms=knn * 1e3, hits_mean=float(counts.mean()),
          hits_median=float(np.median(counts)), hits_max=int(counts.max()), **screened)


def range_block_sweep(b: Bench, q: np.ndarray, radius: float, want) -> float:
    """range_search by range_kernel alone (the screen switched off), its queries per block forced to each of
    QB_SWEEP (each row is read once per block's queries; more queries hold more registers) and left to
    render's choice: kept in the timings, the answers checked equal to the screened ones (`want`). Returns the
    median seconds of render's choice."""
    from tinyknn.gpu import ranges as gpu_ranges

    searcher = b.index._searcher
    searcher.use_screen = False
    try:
        for qb in QB_SWEEP + (None,):
            gpu_ranges.QUERIES_PER_BLOCK = qb
            got = b.index.range_search(q, radius)
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), f"range_kernel with QB = {qb} differs"
            alone = b.time(f"range_1000q_rows_qb{qb or 'default'}", lambda: b.index.range_search(q, radius))
    finally:
        gpu_ranges.QUERIES_PER_BLOCK = None
        del searcher.use_screen                   # the class's default again
    return alone


QB_SWEEP = (4, 8, 16, 32)


def large_k(b: Bench) -> None:
    """k = 10,000 against k = 2,048, 100 queries."""
    q = b.queries[:100]
    times = {k: b.time(f"k{k}_100q", lambda k=k: b.index.search(q, k)) for k in (2048, 10_000)}
    for k in times:
        b.check(f"k = {k:,}", b.index.search(q[:b.args.check_queries], k), None, q, k)
    b.row("k = 10,000, 100 queries: time vs k = 2,048", times[10_000] / times[2048], "x", "<=", 3.0, "cuda",
          k10000_ms=times[10_000] * 1e3, k2048_ms=times[2048] * 1e3)


SECTIONS = (add_one, filtered, removal, ranges, large_k)


def run_tests(args) -> int:
    """`pytest -x -q` over args.pytest, its output into --out-dir/index_ops_pytest.log and the terminal's tail."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = args.out_dir / "index_ops_pytest.log"
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-x", "-q", *shlex.split(args.pytest)]
    try:
        done = subprocess.run(command, cwd=HERE.parent, capture_output=True, text=True, timeout=args.pytest_timeout)
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                         for part in (exc.stdout, exc.stderr))
        output, status = output + f"\n--pytest-timeout {args.pytest_timeout:g} s passed\n", 124
    log.write_text(output)
    print(output[-3000:], flush=True)
    print(f"pytest {args.pytest}: exit status {status} in {time.perf_counter() - started:.0f} s (log {log})",
          flush=True)
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.no_screen_runs and args.device == "cuda":    # (this process only: not the --pytest run)
        from tinyknn.gpu import screen

        screen.SCREEN_RUNS = False
    tests_status = run_tests(args) if args.pytest else 0
    env = _common.environment()
    if args.device == "cpu":       # name the file after the CPU even on a GPU host (the GPU is not used)
        env["gpu_on_host"], env["cuda_device"] = env.get("cuda_device"), {"available": False, "reason": "--device cpu"}
        env["nvidia_smi_before"] = None
    signal.signal(signal.SIGTERM, _interrupt)   # a timeout's SIGTERM still writes what was measured
    bench = Bench(args)
    print(f"{args.device}: {args.rows:,} x {args.dim} float32 l2, set-up {bench.setup}", flush=True)
    interrupted = False
    try:
        for section in args.sections:
            if not bench.left():
                bench.skipped.append({"section": section.__name__, "why": f"--budget-s {args.budget_s:g} spent"})
                continue
            section(bench)
            _common.write_results("index_ops", report.payload(bench), None, env, args.out_dir)
    except KeyboardInterrupt:
        interrupted = True
    paths = _common.write_results("index_ops", {**report.payload(bench), "interrupted": interrupted,
                                                "pytest": {"args": args.pytest, "exit_status": tests_status}},
                                  report.plot(bench), env, args.out_dir)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print(report.markdown(bench))
    if tests_status:
        print(f"FAILED: pytest {args.pytest} exited with status {tests_status} (log in {args.out_dir})", flush=True)
    return tests_status


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
