"""A/B of the CPU search before and after the float64 verify (issue 12), in one run.

    python3 bench/probes/exactness_ab.py --base /path/to/old/checkout [--rounds-1 200] [--rounds-many 15]

Two worker processes, one importing tinyknn from --base (git main before the change), one from this
checkout, each holding the same 100,000 x 128 standard-normal float32 l2 index (the headline shape of
bench/cpu_vs_peers.py). The parent asks them for one timed search at a time, alternating A and B, so a
slow spell of the shared machine hits both alike; medians per side. One-query rounds cycle through
different queries. Writes bench/results/exactness_ab_<date>_cpu-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORKER = r"""
import sys, time, json
import numpy as np
import tinyknn
n, dim, k, nq_many, seed = map(int, sys.argv[1:6])
rng = np.random.default_rng(seed)
db = rng.standard_normal((n, dim)).astype(np.float32)
queries = rng.standard_normal((4096, dim)).astype(np.float32)
index = tinyknn.Index(dim)
index.add(db)
for _ in range(3):
    index.search(queries[:1], k); index.search(queries[:nq_many], k)
print(json.dumps({"ready": tinyknn.__file__}), flush=True)
turn = 0
for line in sys.stdin:
    nq = int(line)
    q = queries[turn % (4096 - nq):][:nq] if nq < 4096 else queries
    turn += 1
    start = time.perf_counter_ns()
    D, I = index.search(q, k)
    elapsed = (time.perf_counter_ns() - start) / 1e6
    print(json.dumps({"ms": elapsed, "first_id": int(I[0, 0])}), flush=True)
"""


def start(root: Path, args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(root))
    process = subprocess.Popen([sys.executable, "-c", WORKER, str(args.n_data), str(args.dim), str(args.k),
                                str(args.nq_many), str(args.seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=env, cwd=str(root))
    ready = json.loads(process.stdout.readline())
    print(f"worker from {root}: {ready['ready']}", file=sys.stderr)
    return process


def ask(process: subprocess.Popen, nq: int) -> float:
    process.stdin.write(f"{nq}\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())["ms"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, type=Path)
    parser.add_argument("--n-data", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--nq-many", type=int, default=1000)
    parser.add_argument("--rounds-1", type=int, default=200)
    parser.add_argument("--rounds-many", type=int, default=15)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--settle-s", type=float, default=0.05)
    parser.add_argument("--name", default=platform.processor() or platform.machine())
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[2]
    workers = {"A (base)": start(args.base.resolve(), args), "B (this checkout)": start(here, args)}
    times = {side: {1: [], args.nq_many: []} for side in workers}
    for nq, rounds in ((1, args.rounds_1), (args.nq_many, args.rounds_many)):
        for r in range(rounds):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))
            for side in order:
                times[side][nq].append(ask(workers[side], nq))
                time.sleep(args.settle_s)
    for process in workers.values():
        process.stdin.close()
        process.wait()
    summary = {}
    for nq in (1, args.nq_many):
        a = np.median(times["A (base)"][nq])
        b = np.median(times["B (this checkout)"][nq])
        summary[str(nq)] = {"base_ms": a, "new_ms": b, "ratio": b / a,
                            "base_p10_p90": np.percentile(times["A (base)"][nq], [10, 90]).tolist(),
                            "new_p10_p90": np.percentile(times["B (this checkout)"][nq], [10, 90]).tolist()}
        print(f"{nq:5d} queries: base {a:8.2f} ms, new {b:8.2f} ms, ratio {b / a:.3f}")
    out = here / "bench" / "results" / f"exactness_ab_{time.strftime('%Y-%m-%d')}_cpu-{args.name.replace(' ', '-').lower()}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                               "times": {side: {str(nq): v for nq, v in t.items()} for side, t in times.items()},
                               "load_average": os.getloadavg()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
