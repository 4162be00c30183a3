"""The CPU target, side by side: tinyknn's CPU search against FAISS, hnswlib and NumPy in one run.

    python3 bench/cpu_vs_peers.py [--quick] [--rounds-1 N] [--rounds-many N]

What: 100,000 x 128 float32 standard-normal database, l2, k = 10, 1 query and 1,000 queries per call
(`--n-data`, `--dim`, `--k`, `--nq-many` change that). Who (bench/search_peers.py builds them):
tinyknn `Index(device="cpu")`, FAISS `IndexFlatL2`, hnswlib `BFIndex` (num_threads=-1), NumPy (BLAS
matmul on the norm expansion, argpartition). Every peer uses all usable cores.
How: host NumPy in and out, host clock (perf_counter_ns; every call returns host arrays, so it is
synchronised). Two warm-up calls per peer, then rounds: in each round every peer makes one call, in an
order rotated per round, so a slow spell of the machine hits all peers alike; the median over rounds is
reported. Every call is followed by a pause (`--settle-s`, 0.15 s) so that the thread pools of the peer
just timed (OpenBLAS spins ~0.1 s after a call) do not compete with the next one. `--protocol blocked`
times each peer's rounds back to back instead (its data as hot as the caches allow; written to
cpu_vs_peers_blocked_...). One-query rounds cycle through different queries. The load averages before and after the
timing are recorded, and so is the share of the machine's CPU time other processes took while each
phase was timed (from /proc/stat): they slow the OpenMP peers (FAISS) most, so only runs where that
share is small are fair comparisons. Recall is against an exact float64 search
(bench/datasets.py: ties with the k-th neighbour count as correct).
Targets: 1 query <= 0.7 x min(hnswlib, FAISS); 1,000 queries <= 0.7 x FAISS.
Writes bench/results/cpu_vs_peers_<date>_<machine>.json and .png.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import datasets  # noqa: E402
from search_peers import PEERS, settings  # noqa: E402

PEER_NAMES = ("tinyknn-cpu", "faiss", "hnswlib", "numpy")


@dataclass(frozen=True)
class Config:
    dim: int
    dtype: str
    metric: str
    k: int


def parse_args():
    parser = _common.common_parser(__doc__.splitlines()[0])
    parser.add_argument("--n-data", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--nq-many", type=int, default=1000)
    parser.add_argument("--rounds-1", type=int, default=None, help="timed rounds of one query (default 100; quick 25)")
    parser.add_argument("--rounds-many", type=int, default=None, help="timed rounds of nq-many queries (default 9; quick 3)")
    parser.add_argument("--peers", default=",".join(PEER_NAMES), help="comma-separated subset of " + ",".join(PEER_NAMES))
    parser.add_argument("--protocol", choices=("interleaved", "blocked"), default="interleaved",
                        help="interleaved rounds (default) or each peer's rounds back to back (hot caches)")
    parser.add_argument("--settle-s", type=float, default=0.15,
                        help="pause after every call so the last peer's spinning thread pools go idle")
    parser.add_argument("--max-foreign", type=float, default=0.10,
                        help="a run where other processes took more of the CPU than this is written as *_noisy")
    parser.add_argument("--truth-queries", type=int, default=100, help="queries checked against float64")
    args = parser.parse_args()
    args.rounds_1 = args.rounds_1 or (25 if args.quick else 100)
    args.rounds_many = args.rounds_many or (3 if args.quick else 9)
    return args


def build_peers(db, config, names):
    built, notes = {}, {}
    for name in names:
        if name not in PEER_NAMES:
            raise SystemExit(f"--peers: unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")
        reason = PEERS[name].probe()
        if reason:
            notes[name] = reason
            print(f"[skip] {name}: {reason}")
            continue
        started = time.perf_counter()
        built[name] = PEERS[name].build(db, config)
        print(f"[build] {name}: {time.perf_counter() - started:.2f} s")
    return built, notes


class ForeignLoad:
    """The share of the machine's CPU time that other processes used while timing ran (Linux /proc/stat):
    this script's numbers are only as clean as that share is small."""

    def __enter__(self):
        self.start = (self._busy_seconds(), sum(os.times()[:2]), time.perf_counter())
        return self

    def __exit__(self, *exc):
        busy, ours, wall = self._busy_seconds(), sum(os.times()[:2]), time.perf_counter()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        foreign = (busy - self.start[0]) - (ours - self.start[1])
        self.fraction = max(0.0, foreign / ((wall - self.start[2]) * cores)) if busy else None

    @staticmethod
    def _busy_seconds() -> float:
        try:
            fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
        except OSError:
            return 0.0
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait


def schedule(names, rounds, protocol):
    """(round, peer) in timing order. interleaved: every round calls every peer once, in an order rotated
    per round (a slow spell hits all alike; each call finds the caches full of the other peers' data).
    blocked: each peer's rounds back to back (its own data stays as hot as the caches allow)."""
    if protocol == "blocked":
        return [(r, name) for name in names for r in range(rounds)]
    return [(r, name) for r in range(rounds) for name in names[r % len(names):] + names[: r % len(names)]]


def measure(built, queries, nq, rounds, warmup, settle, protocol):
    """{peer: (seconds per call list, ids of the truth queries)}.

    The script sleeps `settle` seconds whenever the next call is another peer's (interleaved: after every
    call): OpenBLAS (NumPy) keeps its threads spinning for about 0.1 s after a call and OpenMP (FAISS)
    for a few ms, which would otherwise steal the cores from whichever peer is timed next."""
    names = list(built)
    samples = {name: [] for name in names}
    ids = {name: [] for name in names}
    batches = [queries[r % len(queries): r % len(queries) + 1] for r in range(rounds)] if nq == 1 else [queries[:nq]]
    for name in names:
        for _ in range(warmup):
            built[name].search(batches[0])
            time.sleep(settle)
    clock = time.perf_counter_ns
    order = schedule(names, rounds, protocol)
    for step, (r, name) in enumerate(order):
        if protocol == "blocked" and r == 0:
            built[name].search(batches[0])  # warm this peer's data again after the others ran
        t0 = clock()
        _, found = built[name].search(batches[r % len(batches)])
        samples[name].append((clock() - t0) * 1e-9)
        if step + 1 < len(order) and order[step + 1][1] != name:
            time.sleep(settle)
        if nq > 1 or r < len(queries):
            ids[name].append(np.asarray(found))
    return {name: (samples[name], np.concatenate(ids[name])[: len(queries)] if nq == 1 else ids[name][-1])
            for name in names}


def table(rows):
    lines = [f"{'peer':<12} {'nq':>6} {'median ms':>10} {'p10':>9} {'p90':>9} {'recall':>7}"]
    for row in rows:
        t = row["timing_us"]
        lines.append(f"{row['peer']:<12} {row['nq']:>6} {row['median_ms']:>10.3f} {t['p10_us'] / 1e3:>9.3f} "
                     f"{t['p90_us'] / 1e3:>9.3f} {row['recall']:>7.4f}")
    return "\n".join(lines)


def targets(rows, nq_many):
    by = {(r["peer"], r["nq"]): r["median_ms"] for r in rows}
    out = {}
    ours_1, ours_many = by.get(("tinyknn-cpu", 1)), by.get(("tinyknn-cpu", nq_many))
    best_1 = min([by[(p, 1)] for p in ("faiss", "hnswlib") if (p, 1) in by], default=None)
    if ours_1 and best_1:
        out["one_query"] = {"ours_ms": ours_1, "best_peer_ms": best_1, "ratio": ours_1 / best_1, "target_ratio": 0.7,
                            "met": ours_1 <= 0.7 * best_1}
    if ours_many and ("faiss", nq_many) in by:
        faiss_ms = by[("faiss", nq_many)]
        out["many_queries"] = {"nq": nq_many, "ours_ms": ours_many, "faiss_ms": faiss_ms,
                               "ratio": ours_many / faiss_ms, "target_ratio": 0.7, "met": ours_many <= 0.7 * faiss_ms}
    return out


def plot(rows, nq_values):
    plt = _common.pyplot()
    figure, axes = plt.subplots(1, len(nq_values), figsize=(5 * len(nq_values), 3.6))
    for axis, nq in zip(np.atleast_1d(axes), nq_values):
        picked = [r for r in rows if r["nq"] == nq]
        axis.bar([r["peer"] for r in picked], [r["median_ms"] for r in picked],
                 yerr=[[r["median_ms"] - r["timing_us"]["p10_us"] / 1e3 for r in picked],
                       [r["timing_us"]["p90_us"] / 1e3 - r["median_ms"] for r in picked]],
                 color=["tab:red" if r["peer"] == "tinyknn-cpu" else "tab:gray" for r in picked])
        axis.set_yscale("log")
        axis.set_title(f"{nq} quer{'y' if nq == 1 else 'ies'} per call (median, p10-p90)")
        axis.set_ylabel("ms per call")
    figure.suptitle("CPU exact k-NN, 100k x 128 float32, l2, k=10")
    figure.tight_layout()
    return figure


def main():
    args = parse_args()
    env = _common.environment()
    config = Config(dim=args.dim, dtype="float32", metric="l2", k=args.k)
    db, queries = datasets.random_data(args.n_data, max(args.nq_many, args.truth_queries), args.dim)
    truth = datasets.ground_truth(db, queries, args.k, "l2", rows=args.truth_queries)
    built, notes = build_peers(db, config, [p.strip() for p in args.peers.split(",") if p.strip()])
    load_before = os.getloadavg()
    rows = []
    foreign = {}
    for nq, rounds in ((1, args.rounds_1), (args.nq_many, args.rounds_many)):
        with ForeignLoad() as load:
            results = measure(built, queries, nq, rounds, 1 if args.quick and nq > 1 else 2, args.settle_s,
                              args.protocol)
        foreign[str(nq)] = load.fraction
        for name, (samples, ids) in results.items():
            summary = _common.summary_us(samples)
            rows.append({"peer": name, "nq": nq, "median_ms": summary["median_us"] / 1e3, "timing_us": summary,
                         "recall": datasets.recall(ids, truth, db, queries), "method": PEERS[name].method})
    for item in built.values():
        item.close()
    payload = {"config": {"n_data": args.n_data, **config.__dict__, "data": "standard normal (seed 0)",
                          "quick": args.quick, "protocol": args.protocol, "settle_s": args.settle_s, "rounds": {"1": args.rounds_1, str(args.nq_many): args.rounds_many}},
               "settings": settings(), "skipped": notes, "rows": rows, "targets": targets(rows, args.nq_many),
               # other processes share these cores: the 1, 5 and 15 minute load averages around the timing
               "load_average": {"before": load_before, "after": os.getloadavg()},
               "foreign_cpu_share": foreign}
    noisy = any(share is not None and share > args.max_foreign for share in foreign.values())
    name = ("cpu_vs_peers" + ("_quick" if args.quick else "") + ("_blocked" if args.protocol == "blocked" else "")
            + ("_noisy" if noisy else ""))  # a run other processes disturbed never replaces a clean one
    paths = _common.write_results(name, payload,
                                  plot(rows, (1, args.nq_many)), env=env, out_dir=args.out_dir)
    print(table(rows))
    print(f"load average before {payload['load_average']['before']}, after {payload['load_average']['after']}; "
          f"CPU share used by other processes while timing: " +
          ", ".join(f"nq={nq}: {share:.0%}" for nq, share in foreign.items() if share is not None))
    for name, target in payload["targets"].items():
        print(f"{name}: ratio {target['ratio']:.2f} (target <= 0.7): {'met' if target['met'] else 'MISSED'}")
    print("wrote", *paths.values())


if __name__ == "__main__":
    main()
