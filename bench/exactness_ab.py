"""A/B: what the exactness contract (float64 verify, ties by id) costs on the headline searches.

Two or more source trees of tinyknn (e.g. `old=.ab/old` unpacked from the commit before the contract,
`new=.`) are measured in one run, each in its own process, round after round alternately (A B A B ...),
on the same data: 100,000 x 128 float32 l2, k = 10, host NumPy queries in and out; GPU 1, 1,000 and
10,000 queries, CPU 1 and 1,000. Each process builds the index, warms up, and reports the median of
`--repeats` synchronised host-clock timings per shape; the result per tree is the median over its rounds.

    PYTHONPATH=$PWD python3 bench/exactness_ab.py --tree old=.ab/old --tree new=. --device cuda
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import common_parser, environment, pyplot, write_results  # noqa: E402

SHAPES = {"cuda": (1, 1000, 10000), "cpu": (1, 1000)}
N, DIM, K = 100_000, 128, 10


def worker(device: str, repeats: int, screen: bool = True) -> dict:
    """Runs inside one tree's process: {n_queries: median seconds}."""
    import numpy as np
    import tinyknn

    rng = np.random.default_rng(0)
    db = rng.standard_normal((N, DIM)).astype(np.float32)
    queries = rng.standard_normal((max(SHAPES[device]), DIM)).astype(np.float32)
    index = tinyknn.Index(DIM, "l2", "float32", device=device)
    index.add(db)
    if not screen and hasattr(index._searcher, "use_screen"):
        index._searcher.use_screen = False      # the contract's own cost, without the tensor-core path
    out = {}
    for nq in SHAPES[device]:
        q = queries[:nq]
        count = repeats if nq < 10000 else max(5, repeats // 4)
        if device == "cpu" and nq > 1:
            count = max(3, repeats // 10)
        for _ in range(3):
            index.search(q, K)
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            index.search(q, K)
            samples.append(time.perf_counter() - start)
        out[str(nq)] = statistics.median(samples)
    index.close()
    return out


def run_tree(path: Path, device: str, repeats: int, screen: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path.resolve()))
    command = [sys.executable, __file__, "--worker", "--device", device, "--repeats", str(repeats)]
    if not screen:
        command.append("--no-screen")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{path}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a tinyknn source tree")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--worker", action="store_true", help=argparse_hidden())
    parser.add_argument("--no-screen", action="store_true", help="switch the GPU's tensor-core path off")
    parser.add_argument("--name", default="exactness_ab", help="result file name prefix")
    args = parser.parse_args(argv)
    device = "cuda" if args.device == "auto" else args.device
    if args.worker:
        print(json.dumps(worker(device, args.repeats, not args.no_screen)))
        return 0
    env = environment()
    trees = dict(item.split("=", 1) for item in args.tree)
    rounds = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, path in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
            rounds[name].append(run_tree(Path(path), device, args.repeats, not args.no_screen))
            print(f"round {r} {name}: " + ", ".join(f"{nq} q {s * 1e3:.3f} ms" for nq, s in rounds[name][-1].items()),
                  flush=True)
    medians = {name: {nq: statistics.median(r[nq] for r in runs) for nq in runs[0]} for name, runs in rounds.items()}
    names = list(trees)
    ratios = {nq: medians[names[-1]][nq] / medians[names[0]][nq] for nq in medians[names[0]]}
    for nq, ratio in ratios.items():
        print(f"{nq} queries: " + ", ".join(f"{name} {medians[name][nq] * 1e3:.3f} ms" for name in names) +
              f"  ({names[-1]}/{names[0]} = {ratio:.3f})")
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    labels = list(ratios)
    for offset, name in enumerate(names):
        axis.bar([i + 0.4 * offset for i in range(len(labels))], [medians[name][nq] * 1e3 for nq in labels], 0.4,
                 label=name)
    axis.set_xticks([i + 0.2 for i in range(len(labels))], [f"{nq} queries" for nq in labels])
    axis.set_yscale("log")
    axis.set_ylabel("ms (median)")
    axis.set_title(f"exactness A/B, {device}, {N:,} x {DIM} l2 k={K}")
    axis.legend()
    payload = {"device": device, "shape": [N, DIM, K], "trees": trees, "rounds": rounds, "medians_s": medians,
               "ratio_last_over_first": ratios, "repeats": args.repeats}
    payload["screen"] = not args.no_screen
    write_results(f"{args.name}_{device}", payload, figure, env, out_dir=args.out_dir)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
