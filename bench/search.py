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


HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, then the checkout's tinyknn

import _common  # noqa: E402
import datasets  # noqa: E402
import oracle  # noqa: E402
import search_report  # noqa: E402
from search_peers import PEERS, settings as peer_settings  # noqa: E402
from search_sweep import Sweep, groups, measure, predict  # noqa: E402,F401 - groups, measure, predict: API

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


# The GPU sweep: the targets, in the order that keeps the most wanted rows inside --budget-s.
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
        help="default panels: gpu or cpu (smaller shapes)")
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
