#!/usr/bin/env python3
"""Search latency and recall: tinyknn against PyTorch and CuPy on the GPU, FAISS, hnswlib and NumPy on the CPU.

Host NumPy in and out, host clock, medians after warm-up (optionally device-resident inputs, CUDA events);
every row carries its recall against a float64 reference. Method, sweep and flags: bench/README.md.
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
from search_peers import PEERS, Unsupported, settings as peer_settings, to_numpy  # noqa: E402

NQ = (1, 10, 100, 1000, 10000)


@dataclass(frozen=True)
class Config:
    """One panel of the sweep: a database and a search, timed at several query counts."""

    data: str            # "random" (standard normal) or "fashion-mnist"
    n_data: int
    dim: int
    dtype: str
    metric: str
    k: int
    nqs: tuple[int, ...] = NQ

    @property
    def name(self) -> str:
        size = f"{self.n_data // 1000}k" if self.n_data < 1_000_000 else f"{self.n_data // 1_000_000}M"
        return f"{self.data} {size}x{self.dim} {self.dtype} {self.metric} k={self.k}"

    @property
    def headline(self) -> bool:
        return self == Config("random", 100_000, 128, "float32", "l2", 10, self.nqs)

    def required(self, nq: int) -> bool:
        """The targets' points (headline panel, nq 1 and 1,000) are measured however slow the trend."""
        return self.headline and nq in (1, 1000)


# Every value of every axis appears at least once; the 100,000 x 128 float32 k=10 panel is the targets' row.
DEFAULT_SWEEP = (
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


def parse_args(argv=None):
    parser = _common.common_parser(__doc__.splitlines()[0])
    add = parser.add_argument
    add("--budget-s", type=float, default=None,
        help="start no new measurement after this many seconds (default 420, quick 30); results are still written")
    add("--max-call-s", type=float, default=None,
        help="skip a peer at a larger nq when its trend predicts longer calls than this (default 2, quick 1)")
    add("--target-s", type=float, default=None, help="timed seconds per measurement (default 0.25, quick 0.05)")
    add("--min-reps", type=int, default=None, help="timed calls at least (default 5, quick 3)")
    add("--max-reps", type=int, default=200)
    add("--truth-queries", type=int, default=100, help="queries checked against the float64 reference")
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
    axes.add_argument("--n-data", type=int, nargs="+")
    axes.add_argument("--dim", type=int, nargs="+")
    axes.add_argument("--dtype", nargs="+", choices=("float32", "float16"))
    axes.add_argument("--metric", nargs="+", choices=("l2", "ip"))
    axes.add_argument("--k", type=int, nargs="+")
    axes.add_argument("--nq", type=int, nargs="+")
    args = parser.parse_args(argv)
    args.target_s = args.target_s or (0.05 if args.quick else 0.25)
    args.min_reps = args.min_reps or (3 if args.quick else 5)
    args.max_call_s = args.max_call_s or (1.0 if args.quick else 2.0)
    args.budget_s = args.budget_s or (30.0 if args.quick else 420.0)
    custom = any([args.n_data, args.dim, args.dtype, args.metric, args.k])
    args.fashion_mnist = args.fashion_mnist or ("off" if args.quick or custom else "on")
    return args


def choose_sweep(args) -> list[Config]:
    custom = [args.n_data, args.dim, args.dtype, args.metric, args.k]
    if any(custom):
        defaults = ([100_000], [128], ["float32"], ["l2"], [10])
        values = [given or default for given, default in zip(custom, defaults)]
        sweep = [Config("random", *combo) for combo in itertools.product(*values)]
    else:
        sweep = list(QUICK_SWEEP if args.quick else DEFAULT_SWEEP)
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


class Sweep:
    """Runs every (panel, peer, nq, mode) point within the budget and collects rows and skips."""

    def __init__(self, args, peers):
        self.args, self.peers = args, peers
        self.data = datasets.PanelData(args.fashion_mnist_dir, install=not args.no_install)
        self.rows, self.skipped, self.started = [], [], time.perf_counter()

    def skip(self, config, peer, reason, nq=None):
        self.skipped.append({"config": config.name, "peer": peer, "nq": nq, "reason": reason})
        print(f"  skip {peer:<12} {config.name}{'' if nq is None else f' nq={nq}'}: {reason}", flush=True)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def run(self, sweep, on_panel=lambda: None):
        """Every panel in order; on_panel() after each (the results file is rewritten as it grows)."""
        for config in sweep:
            print(f"== {config.name}", flush=True)
            try:
                db, queries = self.data.get(config.data, config.n_data, config.dim, max(config.nqs))
            except datasets.DataUnavailable as exc:
                self.skip(config, "all", str(exc))
                continue
            stored = db.astype(config.dtype, copy=False)  # the database as the index holds it
            truth = datasets.ground_truth(stored, queries, config.k, config.metric, self.args.truth_queries)
            for name, peer in self.peers.items():
                if self.over_budget():
                    self.skip(config, name, f"--budget-s {self.args.budget_s:g} s spent")
                    continue
                self.run_peer(config, name, peer, db, (stored, queries, truth))
            on_panel()

    def run_peer(self, config, name, peer, db, reference):
        start = time.perf_counter()
        try:
            built = peer.build(db, config)
        except Unsupported as exc:
            return self.skip(config, name, str(exc))
        except Exception as exc:  # noqa: BLE001 - one broken peer must not end the sweep
            return self.skip(config, name, f"set-up failed: {type(exc).__name__}: {exc}")
        add_s = time.perf_counter() - start
        resident = built.resident is not None and (self.args.resident == "all" or
                                                   (self.args.resident == "headline" and config.headline))
        try:
            measured = []  # (nq, median seconds) of this peer in this panel
            for nq in config.nqs:
                if self.over_budget():
                    self.skip(config, name, f"--budget-s {self.args.budget_s:g} s spent", nq)
                    continue
                guess = predict(measured, nq)
                if guess > self.args.max_call_s and not config.required(nq):
                    why = f"predicted {guess:.1f} s per call > --max-call-s {self.args.max_call_s:g}"
                    self.skip(config, name, why, nq)
                    continue
                if nq > len(reference[1]):
                    self.skip(config, name, f"the data set has {len(reference[1])} queries", nq)
                    continue
                q = reference[1][:nq]
                median_s = self.point(config, name, "host", nq, lambda: built.search(q), reference, add_s)
                if median_s is not None:
                    measured.append((nq, median_s))
                if resident and median_s is not None:
                    q_device = built.to_device(q)
                    self.point(config, name, "device", nq, lambda: built.resident(q_device), reference, add_s,
                               clock=built.clock)
        finally:
            built.close()

    def point(self, config, name, mode, nq, call, reference, add_s, clock=None):
        """Measure one point and record its row; returns the median seconds, or None when it failed."""
        try:
            timing, (_, ids) = measure(call, self.args, clock)
        except Exception as exc:  # noqa: BLE001
            self.skip(config, name, f"{mode} search failed: {type(exc).__name__}: {exc}", nq)
            return None
        stored, queries, truth = reference
        row = {"config": config.name, **asdict(config), "nq": nq, "peer": name, "mode": mode,
               "device": self.peers[name].device, "median_ms": timing["median_us"] / 1e3,
               "recall": datasets.recall(to_numpy(ids), truth, stored, queries[:nq]),
               "add_s": add_s, "timing_us": timing}
        del row["nqs"]
        self.rows.append(row)
        print(f"  {name:<12} {mode:<6} nq={nq:<6} {row['median_ms']:10.4f} ms  recall {row['recall']:.4f}  "
              f"(first call {timing['first_call_us'] / 1e3:.1f} ms, n={timing['n']})", flush=True)
        return timing["median_us"] / 1e6


def plot(rows, sweep):
    """Latency against nq on log axes, one panel per configuration, one line per peer and mode."""
    plt = _common.pyplot()
    panels = [c.name for c in sweep if any(r["config"] == c.name for r in rows)]
    cols = min(3, len(panels))
    lines = -(-len(panels) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(5.2 * cols, 3.9 * lines), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        mine = [r for r in rows if r["config"] == panel]
        for peer, mode in dict.fromkeys((r["peer"], r["mode"]) for r in mine):
            points = sorted((r["nq"], r["median_ms"], r["recall"]) for r in mine
                            if (r["peer"], r["mode"]) == (peer, mode))
            worst = min(recall for _, _, recall in points)
            label = (peer + (" (device-resident)" if mode == "device" else "")
                     + (f", recall {worst:.3f}" if worst < 1 else ""))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                    color=f"C{list(PEERS).index(peer)}", linestyle="--" if mode == "device" else "-")
        ax.set(xscale="log", yscale="log", xlabel="queries per call (nq)", ylabel="median latency (ms)", title=panel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def table(rows) -> str:
    """One line per (panel, nq, mode); a column per peer: median ms and recall."""
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    lines = [f"{'configuration':<38} {'nq':>6} {'mode':<6} " + " ".join(f"{p:>19}" for p in peers)]
    for key in dict.fromkeys((r["config"], r["nq"], r["mode"]) for r in rows):
        cells = {r["peer"]: f"{r['median_ms']:.4g} ms ({r['recall']:.3f})" for r in rows
                 if (r["config"], r["nq"], r["mode"]) == key}
        lines.append(f"{key[0]:<38} {key[1]:>6} {key[2]:<6} " + " ".join(f"{cells.get(p, '-'):>19}" for p in peers))
    return "\n".join(lines)


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
    figure = plot(run.rows, sweep) if run.rows else None
    paths = _common.write_results(name, {**payload(args, sweep, wanted, peers, run), "interrupted": interrupted},
                                  figure, env, args.out_dir)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    print("\n" + table(run.rows) if run.rows else "no rows measured")
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
        "rows": run.rows,
        "skipped": run.skipped,
        "wall_s": time.perf_counter() - run.started,
    }


if __name__ == "__main__":
    sys.exit(main())
