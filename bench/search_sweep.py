"""bench/search.py's measuring loop: groups of panels sharing an index, the float64 oracle of each group,
every (panel, peer, nq, mode) point timed within the budget, and its exactness against the oracle."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

import _common
import datasets
import oracle
from search_peers import Unsupported, to_numpy


def measure(call, args, clock=None):
    """(timing summary in us with the first call's time, output of a warm call). The first call pays any
    compile or lazy set-up; the second, untimed like it, estimates how many timed calls fit in --target-s.
    A slow first call is no guide to the rest: a cold kernel cache's compiles took one GPU query's first
    call to 2.2 s, which left the row 2 samples at 0.30 ms where warm calls take 0.03."""
    start = time.perf_counter()
    output = call()
    first_s = time.perf_counter() - start
    if first_s > 3 * args.max_call_s:  # a very slow point: its one call is the measurement
        return {**_common.summary_us([first_s]), "first_call_us": first_s * 1e6, "first_call_only": True}, output
    start = time.perf_counter()
    output = call()
    warm_s = time.perf_counter() - start
    reps = int(min(args.max_reps, max(args.min_reps, args.target_s / max(warm_s, 1e-7))))
    if warm_s * reps > 3 * args.max_call_s:  # a slow point: a few calls are enough to see it
        reps = max(1, int(3 * args.max_call_s / warm_s))
    if clock is None:
        samples = _common.time_calls(call, reps, warmup=0)
    else:
        samples = [clock(call) for _ in range(reps)]
    return {**_common.summary_us(samples), "first_call_us": first_s * 1e6}, output


def predict(measured: list[tuple[int, float]], nq: int) -> float:
    """Seconds per call at a larger nq: the line through the last two measured points (time grows about
    linearly in nq once the database read is amortised); from one point only its time, a lower bound."""
    if len(measured) < 2:
        return measured[-1][1] if measured else 0.0
    (n1, t1), (n2, t2) = measured[-2:]
    slope = max(0.0, (t2 - t1) / (n2 - n1))
    return t2 + slope * (nq - n2)


def groups(sweep) -> list[list]:
    """Consecutive panels that share an index (same data, size, dtype and metric) form one group."""
    out: list[list] = []
    for config in sweep:
        if out and out[-1][0].index_key == config.index_key:
            out[-1].append(config)
        else:
            out.append([config])
    return out


@dataclass
class Reference:
    """A group's data as searched and the float64 oracle of its first queries (None, and why, when it failed)."""

    source: np.ndarray
    queries: np.ndarray
    dtype: str
    metric: str
    exact: oracle.Exact | None
    why: str = ""

    def check(self, ids, k: int, nq: int) -> tuple[float | None, float | None]:
        """(strict id agreement, tie-aware recall) of a result, over the oracle's queries (None: no oracle)."""
        if self.exact is None:
            return None, None
        rows = min(nq, len(self.exact.ids))
        q64 = np.asarray(self.queries[:rows], dtype=np.float32).astype(np.float64)
        truth = datasets.truth_from(self.exact.distances[:rows, :k], q64, self.exact.max_norm2,
                                    self.source.shape[1], self.metric)
        rows_of = lambda valid: oracle.stored64(self.source[valid], self.dtype)  # noqa: E731
        return (oracle.agreement(ids, self.exact, k),
                datasets.recall(ids, truth, self.source, self.queries[:rows], rows_of=rows_of))


class Sweep:
    """Runs every (panel, peer, nq, mode) point within the budget and collects rows and skips."""

    def __init__(self, args, peers):
        self.args, self.peers = args, peers
        self.data = datasets.PanelData(args.fashion_mnist_dir, install=not args.no_install)
        self.rows, self.skipped, self.oracles, self.started = [], [], [], time.perf_counter()

    def skip(self, config, peer, reason, nq=None):
        self.skipped.append({"config": config.name, "peer": peer, "nq": nq, "reason": reason})
        print(f"  skip {peer:<12} {config.name}{'' if nq is None else f' nq={nq}'}: {reason}", flush=True)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def run(self, sweep, on_panel=lambda: None):
        """Every group of panels in order; on_panel() after each (the results file is rewritten as it grows)."""
        for group in groups(sweep):
            first = group[0]
            print("== " + "; ".join(c.name for c in group), flush=True)
            if self.over_budget():
                for config in group:
                    self.skip(config, "all", f"--budget-s {self.args.budget_s:g} s spent")
                continue
            try:
                raw, raw_queries = self.data.get(first.data, first.n_data, first.dim, max(max(c.nqs) for c in group))
            except datasets.DataUnavailable as exc:
                for config in group:
                    self.skip(config, "all", str(exc))
                continue
            reference = self.reference(group, datasets.for_dtype(raw, first.dtype),
                                       datasets.for_dtype(raw_queries, first.dtype))
            for name, peer in self.peers.items():
                if self.over_budget():
                    for config in group:
                        self.skip(config, name, f"--budget-s {self.args.budget_s:g} s spent")
                    continue
                self.run_peer(group, name, peer, reference)
            on_panel()

    def reference(self, group, source, queries) -> Reference:
        """The oracle of the group's first --truth-queries queries at its largest k; a failure is recorded."""
        first, k = group[0], max(c.k for c in group)
        rows = min(self.args.truth_queries, len(queries))
        about = {"panels": [c.name for c in group], "queries": rows, "k": k}
        try:
            exact = oracle.exact_neighbours(source, first.dtype, queries[:rows], k, first.metric, self.args.oracle)
        except Exception as exc:  # noqa: BLE001 - no oracle means no agreement column, not a crash
            why = f"oracle failed: {type(exc).__name__}: {exc}"
            print(f"  {why}", flush=True)
            self.oracles.append({**about, "error": why})
            return Reference(source, queries, first.dtype, first.metric, None, why)
        print(f"  oracle: {rows} queries, k={k}, float64 on {exact.backend}, {exact.seconds:.1f} s", flush=True)
        self.oracles.append({**about, "backend": exact.backend, "seconds": exact.seconds})
        return Reference(source, queries, first.dtype, first.metric, exact)

    def run_peer(self, group, name, peer, reference):
        start = time.perf_counter()
        try:
            built = peer.build(reference.source, group[0])
        except Unsupported as exc:
            return [self.skip(config, name, str(exc)) for config in group]
        except Exception as exc:  # noqa: BLE001 - one broken peer must not end the sweep
            return [self.skip(config, name, f"set-up failed: {type(exc).__name__}: {exc}") for config in group]
        add_s = time.perf_counter() - start
        try:
            for config in group:
                self.run_config(config, name, built, reference, add_s)
        finally:
            built.close()

    def run_config(self, config, name, built, reference, add_s):
        resident = built.resident is not None and (self.args.resident == "all" or
                                                   (self.args.resident == "headline" and config.headline))
        measured = []  # (nq, median seconds) of this peer in this panel
        for nq in config.nqs:
            if self.over_budget():
                self.skip(config, name, f"--budget-s {self.args.budget_s:g} s spent", nq)
                continue
            guess = predict(measured, nq)
            if guess > self.args.max_call_s and not config.required(nq):
                self.skip(config, name, f"predicted {guess:.1f} s per call > --max-call-s {self.args.max_call_s:g}", nq)
                continue
            if nq > len(reference.queries):
                self.skip(config, name, f"the data set has {len(reference.queries)} queries", nq)
                continue
            q = reference.queries[:nq]
            point = dict(config=config, name=name, nq=nq, reference=reference, add_s=add_s, built=built)
            median_s = self.point(mode="host", call=lambda: built.search(q, config.k), **point)
            if median_s is not None:
                measured.append((nq, median_s))
            if resident and median_s is not None:
                q_device = built.to_device(q)
                self.point(mode="device", call=lambda: built.resident(q_device, config.k), clock=built.clock, **point)

    def point(self, config, name, mode, nq, call, reference, add_s, built, clock=None):
        """Measure one point and record its row; returns the median seconds, or None when it failed."""
        try:
            timing, (_, ids) = measure(call, self.args, clock)
        except Exception as exc:  # noqa: BLE001
            self.skip(config, name, f"{mode} search failed: {type(exc).__name__}: {exc}", nq)
            return None
        ids = to_numpy(ids)
        agreement, recall = reference.check(ids, config.k, nq)
        row = {"config": config.name, **asdict(config), "nq": nq, "peer": name, "mode": mode,
               "device": self.peers[name].device, "median_ms": timing["median_us"] / 1e3,
               "agreement": agreement, "agreement_queries": min(nq, len(reference.exact.ids)) if reference.exact else 0,
               "recall": recall, "note": built.note, "add_s": add_s, "timing_us": timing}
        del row["nqs"]
        self.rows.append(row)
        shown = "n/a" if agreement is None else f"{agreement:.4f}"
        print(f"  {name:<12} {mode:<6} nq={nq:<6} {row['median_ms']:10.4f} ms  ids equal {shown}  recall "
              f"{'n/a' if recall is None else f'{recall:.4f}'}  (first call {timing['first_call_us'] / 1e3:.1f} ms, "
              f"n={timing['n']})", flush=True)
        return timing["median_us"] / 1e6
