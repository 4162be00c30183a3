#!/usr/bin/env python3
"""Search latency and exactness: tinyknn against PyTorch (fp32, TF32, fp16 GEMM) and CuPy on the GPU, FAISS,
hnswlib and NumPy on the CPU.

Host NumPy in and out, host clock, medians after warm-up (optionally device-resident inputs, CUDA events);
every row carries its strict id agreement with the float64 oracle (bench/oracle.py) and its tie-aware recall.
Method, sweep and flags: bench/README.md.
"""

from __future__ import annotations

import itertools
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, then the checkout's tinyknn

import _common  # noqa: E402
import datasets  # noqa: E402
import oracle  # noqa: E402
import search_report  # noqa: E402
from search_peers import PEERS, Unsupported, settings as peer_settings, to_numpy  # noqa: E402

NQ = (1, 10, 100, 1000, 10000)


@dataclass(frozen=True)
class Config:
    """One panel of the sweep: a database and a search, timed at several query counts."""

    data: str            # "random" (standard normal), "clustered", "sift-like" (uint8) or "fashion-mnist"
    n_data: int
    dim: int
    dtype: str
    metric: str
    k: int
    nqs: tuple[int, ...] = NQ

    @property
    def name(self) -> str:
        size = (str(self.n_data) if self.n_data < 1000 else f"{self.n_data // 1000}k" if self.n_data < 1_000_000
                else f"{self.n_data // 1_000_000}M")
        return f"{self.data} {size}x{self.dim} {self.dtype} {self.metric} k={self.k}"

    @property
    def headline(self) -> bool:
        return self == Config("random", 100_000, 128, "float32", "l2", 10, self.nqs)

    def required(self, nq: int) -> bool:
        """The targets' points (headline panel, nq 1 and 1,000) are measured however slow the trend."""
        return self.headline and nq in (1, 1000)

    @property
    def index_key(self) -> tuple:
        """Panels with the same key share one build per peer (they differ only in k and nq)."""
        return (self.data, self.n_data, self.dim, self.dtype, self.metric)


def _embeddings(dtype: str, metric: str) -> Config:
    return Config("clustered", 1_000_000, 768, dtype, metric, 10, (1000,))


# The GPU sweep: issue 13's targets, in the order that keeps the most wanted rows inside --budget-s.
GPU_SWEEP = (
    Config("random", 100_000, 128, "float32", "l2", 10),
    Config("random", 1_000_000, 768, "float32", "l2", 10, (1, 100, 1000)),
    Config("random", 1_000_000, 768, "float32", "l2", 100, (100,)),
    Config("random", 1_000_000, 768, "float16", "l2", 10, (1, 1000)),
    Config("random", 10_000_000, 128, "float16", "l2", 10, (2048,)),
    Config("sift-like", 10_000_000, 128, "uint8", "l2", 10, (2048,)),
    *(_embeddings("float16", metric) for metric in ("l2", "ip", "cosine")),
    *(_embeddings("bfloat16", metric) for metric in ("l2", "ip", "cosine")),
)
# The CPU sweep: every value of every axis appears at least once; 100,000 x 128 float32 k=10 is the targets' row.
CPU_SWEEP = (
    Config("random", 100_000, 128, "float32", "l2", 10),
    Config("random", 100_000, 128, "float32", "l2", 100),
    Config("random", 100_000, 128, "float16", "l2", 10),
    Config("random", 10_000, 64, "float32", "ip", 10),
    Config("random", 1_000_000, 768, "float32", "l2", 10),
)
FASHION_SWEEP = tuple(Config("fashion-mnist", 60_000, 784, dtype, "l2", k)
                      for dtype in ("float32", "float16") for k in (10, 100))
QUICK_SWEEP = (  # the cheap panel first, so that a loaded machine's budget still leaves both
    Config("random", 10_000, 64, "float16", "ip", 100, (1, 100)),
    Config("random", 100_000, 128, "float32", "l2", 10, (1, 1000)),
)


DATA_ABOUT = {
    "random": "standard normal float32, seeded; queries drawn apart from the database",
    "clustered": datasets.clustered_embeddings.__doc__.replace("\n", " "),
    "sift-like": datasets.sift_like.__doc__.replace("\n", " "),
}


def parse_args(argv=None):
    parser = _common.common_parser(__doc__.splitlines()[0])
    add = parser.add_argument
    add("--budget-s", type=float, default=None,
        help="start no new measurement after this many seconds (default: gpu sweep 200, cpu sweep 420, quick 30); "
             "results are still written")
    add("--max-call-s", type=float, default=None,
        help="skip a peer at a larger nq when its trend predicts longer calls than this (default 2, quick 1)")
    add("--target-s", type=float, default=None, help="timed seconds per measurement (default 0.25, quick 0.05)")
    add("--min-reps", type=int, default=None, help="timed calls at least (default 5, quick 3)")
    add("--max-reps", type=int, default=200)
    add("--truth-queries", type=int, default=None,
        help="queries checked against the float64 oracle (default 100, quick 20)")
    add("--oracle", choices=("auto", "torch", "numpy"), default="auto",
        help="where the float64 oracle runs (auto: torch on the GPU when there is one, else NumPy)")
    add("--sweep", choices=("gpu", "cpu"), default=None,
        help="default panels: gpu (issue 13's targets; default unless --device cpu) or cpu (smaller shapes)")
    add("--peers", default="", help="comma list of peers to run (default all): " + ",".join(PEERS))
    add("--resident", choices=("headline", "all", "off"), default="headline",
        help="also time GPU peers on device-resident inputs (CUDA events) for these panels")
    add("--fashion-mnist", choices=("on", "off"), default=None,
        help="include Fashion-MNIST (default on, off with --quick or a custom sweep)")
    add("--fashion-mnist-dir", default=None, help="folder with the *-images-idx3-ubyte[.gz] files")
    add("--no-install", action="store_true", help="never apt-get install dataset-fashion-mnist")
    add("--note", default="", help="free text stored in the results (e.g. what else ran on the machine)")
    axes = parser.add_argument_group("custom sweep: the cross product of the given values replaces the "
                                     "default random-data panels (axes not given take the headline's value)")
    axes.add_argument("--data", nargs="+", choices=tuple(datasets.GENERATED),
                      help="default random (sift-like for int8/uint8)")
    axes.add_argument("--n-data", type=int, nargs="+")
    axes.add_argument("--dim", type=int, nargs="+")
    axes.add_argument("--dtype", nargs="+", choices=("float32", "float16", "bfloat16", "int8", "uint8"))
    axes.add_argument("--metric", nargs="+", choices=("l2", "ip", "cosine"))
    axes.add_argument("--k", type=int, nargs="+")
    axes.add_argument("--nq", type=int, nargs="+")
    args = parser.parse_args(argv)
    args.target_s = args.target_s or (0.05 if args.quick else 0.25)
    args.min_reps = args.min_reps or (3 if args.quick else 5)
    args.max_call_s = args.max_call_s or (1.0 if args.quick else 2.0)
    args.sweep = args.sweep or ("cpu" if args.device == "cpu" else "gpu")
    args.budget_s = args.budget_s or (30.0 if args.quick else 200.0 if args.sweep == "gpu" else 420.0)
    args.truth_queries = args.truth_queries or (20 if args.quick else 100)
    custom = any([args.data, args.n_data, args.dim, args.dtype, args.metric, args.k])
    args.fashion_mnist = args.fashion_mnist or ("on" if args.sweep == "cpu" and not (args.quick or custom) else "off")
    return args


def choose_sweep(args) -> list[Config]:
    custom = [args.n_data, args.dim, args.dtype, args.metric, args.k]
    if any(custom) or args.data:
        defaults = ([100_000], [128], ["float32"], ["l2"], [10])
        values = [given or default for given, default in zip(custom, defaults)]
        sweep = [Config(data, *combo) for combo in itertools.product(*values)
                 for data in (args.data or ["sift-like" if combo[2] in ("int8", "uint8") else "random"])]
        kinds = list(datasets.GENERATED)
        sweep.sort(key=lambda c: kinds.index(c.data))  # stable: one data set generated once
    else:
        sweep = list(QUICK_SWEEP if args.quick else GPU_SWEEP if args.sweep == "gpu" else CPU_SWEEP)
    if args.fashion_mnist == "on":
        sweep += FASHION_SWEEP
    if args.nq:
        sweep = [Config(**{**asdict(c), "nqs": tuple(args.nq)}) for c in sweep]
    return sweep


def measure(call, args, clock=None):
    """(timing summary in us with the first call's time, output of a warm call). The first call pays any
    compile or lazy set-up; the second (skipped when the first was already slow) estimates how many timed
    calls fit in --target-s."""
    start = time.perf_counter()
    output = call()
    first_s = warm_s = time.perf_counter() - start
    if first_s > 3 * args.max_call_s:  # a very slow point: its one call is the measurement
        return {**_common.summary_us([first_s]), "first_call_us": first_s * 1e6, "first_call_only": True}, output
    if first_s < args.max_call_s:
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


def groups(sweep) -> list[list[Config]]:
    """Consecutive panels that share an index (same data, size, dtype and metric) form one group."""
    out: list[list[Config]] = []
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


def main(argv=None) -> int:
    args = parse_args(argv)
    env = _common.environment()
    wanted = [p for p in args.peers.split(",") if p] or list(PEERS)
    unknown = sorted(set(wanted) - set(PEERS))
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; known: {', '.join(PEERS)}")
    peers = {}
    for name in wanted:
        peer = PEERS[name]
        why = ("--device cpu" if args.device == "cpu" and peer.device == "cuda" else
               "--device cuda" if args.device == "cuda" and peer.device == "cpu" else peer.probe())
        if why:
            print(f"note: {name} skipped: {why}", flush=True)
        else:
            peers[name] = peer
    sweep = choose_sweep(args)
    run = Sweep(args, peers)
    name = "search_quick" if args.quick else "search"
    signal.signal(signal.SIGTERM, _interrupt)  # a timeout's SIGTERM still writes what was measured
    try:
        run.run(sweep, on_panel=lambda: _common.write_results(name, payload(args, sweep, wanted, peers, run), None,
                                                              env, args.out_dir))
        interrupted = False
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", flush=True)
        interrupted = True
    figure = search_report.plot(run.rows, [c.name for c in sweep], list(PEERS)) if run.rows else None
    paths = _common.write_results(name, {**payload(args, sweep, wanted, peers, run), "interrupted": interrupted},
                                  figure, env, args.out_dir)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if run.rows:
        print("\n" + search_report.table(run.rows, list(PEERS)) + "\n\n"
              + search_report.markdown(run.rows, run.skipped, list(PEERS)))
    else:
        print("no rows measured")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def payload(args, sweep, wanted, peers, run) -> dict:
    """Everything measured so far, with what was asked and what was skipped."""
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "sweep": [{"name": c.name, **asdict(c)} for c in sweep],
        "peers": {name: peer.describe() for name, peer in PEERS.items() if name in wanted},
        "peers_run": list(peers),
        "peer_settings": peer_settings(),
        "fashion_mnist": run.data.fashion_about,
        "data": DATA_ABOUT,
        "oracle": {"definition": oracle.__doc__.split("\n\n")[1].replace("\n", " "), "runs": run.oracles},
        "rows": run.rows,
        "skipped": run.skipped,
        "wall_s": time.perf_counter() - run.started,
    }


if __name__ == "__main__":
    sys.exit(main())
