"""The host-memory tier against the bus it streams over.

One run: the database is allocated once in pinned host memory (HostTierSearcher.reserve) and filled in place
by threads with random values (float16: +-[1, 2) from random bits, no staging copy); plain pinned H2D
bandwidth is measured with CUDA events (cuMemcpyHtoDAsync of CHUNK_BYTES, median after warm-up); then
the tier's search of --queries queries (the first call also compiles, untimed), median of timed repeats,
reported as effective GB/s of database streamed and as a fraction of the H2D bandwidth; a sample of the
queries is checked against the float64 oracle (bench/oracle.py, torch on the GPU), ids and distances bit
for bit. Writes bench/results/host_tier_<date>_<device>.json and .png.

    PYTHONPATH=$PWD TINYKNN_CACHE_DIR=/tmp/tk python3 bench/host_tier.py --gb 20 --out-dir $OUT
    PYTHONPATH=$PWD TINYKNN_CACHE_DIR=/tmp/tk python3 bench/host_tier.py --gb 0.2 --out-dir $OUT   # quick
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402 - bench modules import each other by name
import oracle  # noqa: E402

FILL_ROWS_BYTES = 64 << 20     # rows one fill task writes
# Random bits -> finite values in +-[1, 2): keep the sign and mantissa bits, force the exponent of 1.0.
MASKS = {"float16": (np.uint16, 0x83FF, 0x3C00), "bfloat16": (np.uint16, 0x807F, 0x3F80),
         "float32": (np.uint32, 0x807FFFFF, 0x3F800000)}


def fill_random(rows: np.ndarray, seed: int, dtype: str, threads: int) -> None:
    """Fill rows (n, dim) of `dtype` in place with values +-[1, 2), FILL_ROWS_BYTES per task on `threads`
    threads (NumPy's generators and bitwise ufuncs release the GIL)."""
    word, keep, force = MASKS[dtype]
    flat = rows.reshape(-1).view(np.uint8)
    step = FILL_ROWS_BYTES
    seeds = np.random.SeedSequence(seed).spawn(-(-len(flat) // step))

    def task(i: int) -> None:
        part = flat[i * step:(i + 1) * step]
        words = part.view(word)
        bits = np.random.default_rng(seeds[i]).integers(0, np.iinfo(word).max, size=len(words), dtype=word,
                                                        endpoint=True)
        np.bitwise_and(bits, word(keep), out=words)
        np.bitwise_or(words, word(force), out=words)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(task, range(len(seeds))))


def random_queries(rng, n: int, dim: int) -> np.ndarray:
    """Queries from the database's distribution: +-[1, 2) in float32."""
    signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=(n, dim))
    return (signs * rng.uniform(1.0, 2.0, size=(n, dim))).astype(np.float32)


def h2d_bandwidth(host: np.ndarray, repeats: int, warmup: int = 2) -> dict:
    """Pinned host -> device copies of host (C-contiguous, pinned) timed with CUDA events: GB/s (1e9 bytes)."""
    from tinyknn.gpu.memory import DeviceBuffer, Event, Stream

    nbytes = host.nbytes
    samples = []
    with DeviceBuffer(nbytes) as device, Stream() as stream, Event() as start, Event() as end:
        for i in range(warmup + repeats):
            start.record(stream)
            device.copy_from_host(host, nbytes, stream)
            end.record(stream)
            end.synchronize()
            if i >= warmup:
                samples.append(start.elapsed_ms(end) / 1e3)
    median = statistics.median(samples)
    return {"bytes": nbytes, "samples_s": samples, "median_s": median, "gbps": nbytes / median / 1e9}


def check_exact(tier, queries: np.ndarray, distances, ids, k: int, metric: str, dtype: str) -> dict:
    """Ids and float32 distances of the sample queries against the float64 oracle, bit for bit."""
    n = tier.ntotal
    exact = oracle.exact_neighbours(tier._store.rows[:n], dtype, queries, k, metric)
    want_ids, want_d = exact.ids, exact.distances.astype(np.float32)
    return {"queries": len(queries), "ids_equal": bool(np.array_equal(ids[:, :want_ids.shape[1]], want_ids)),
            "distances_equal": bool(np.array_equal(distances[:, :want_d.shape[1]].view(np.uint32),
                                                   want_d.view(np.uint32))),
            "agreement": oracle.agreement(ids, exact, min(k, n)), "oracle_backend": exact.backend,
            "oracle_s": exact.seconds}


def traced_search(tier, queries: np.ndarray, k: int) -> dict:
    """One more search with the chunk workers' add (copy + ingest) and search (screen and the rest) timed on
    the host clock per call, and the screen's fallbacks: where a chunk's time goes."""
    import threading

    from tinyknn.gpu.host_worker import ChunkWorker

    calls: list[tuple[int, str, float, float]] = []
    originals = {name: getattr(ChunkWorker, name) for name in ("add", "search")}

    def timed(name):
        def call(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return originals[name](self, *a, **kw)
            finally:
                calls.append((threading.get_ident(), name, t0, time.perf_counter()))
        return call

    for name in originals:
        setattr(ChunkWorker, name, timed(name))
    try:
        start = time.perf_counter()
        tier.search(queries, k)
        total = time.perf_counter() - start
    finally:
        for name, function in originals.items():
            setattr(ChunkWorker, name, function)
    workers = [slot.worker for slot in tier._slots]
    per = {name: [c[3] - c[2] for c in calls if c[1] == name] for name in originals}
    summary = {"total_s": round(total, 4), "threads": len({c[0] for c in calls}),
               **{f"{name}_median_s": round(statistics.median(v), 4) for name, v in per.items() if v},
               **{f"{name}_calls": len(v) for name, v in per.items()},
               "screen_fallbacks": sum(w._screen.fallbacks for w in workers),
               "screen_queries": sum(w._screen.queries for w in workers)}
    return {"summary": summary, "calls": [(c[1], round(c[2] - start, 5), round(c[3] - start, 5)) for c in calls]}


def figure(h2d_gbps: float, tier_gbps: float, title: str):
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(["pinned H2D copy", "host tier search"], [h2d_gbps, tier_gbps], color=["#888888", "#1f77b4"])
    ax.axhline(0.85 * h2d_gbps, color="#d62728", linestyle="--", label="target: 85 % of H2D")
    ax.set_ylabel("GB/s (1e9 bytes)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    for x, value in enumerate([h2d_gbps, tier_gbps]):
        ax.text(x, value, f"{value:.1f}", ha="center", va="bottom")
    return fig


def parse_args(argv=None):
    parser = _common.common_parser(__doc__.splitlines()[0])
    add = parser.add_argument
    add("--gb", type=float, default=20.0, help="database size in GB (1e9 bytes of stored vectors); --quick: 0.2")
    add("--budget-s", type=float, default=100.0, help="start no timed repeat after this many seconds")
    add("--dim", type=int, default=128)
    add("--dtype", choices=sorted(MASKS), default="float16")
    add("--metric", choices=("l2", "ip", "cosine"), default="l2")
    add("--k", type=int, default=10)
    add("--queries", type=int, default=2048)
    add("--check-queries", type=int, default=16, help="queries checked against the float64 oracle")
    add("--repeats", type=int, default=5, help="timed searches at most (the budget may stop them sooner)")
    add("--seed", type=int, default=20261201)
    add("--chunk-mb", type=int, default=None,
        help="host rows per chunk in MiB (tinyknn.gpu.host_tier.CHUNK_BYTES; default the library's, 512)")
    args = parser.parse_args(argv)
    if args.quick:
        args.gb = min(args.gb, 0.2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    from tinyknn.gpu import has_gpu, why_no_gpu

    if not has_gpu():
        print(f"bench/host_tier.py needs a GPU: {why_no_gpu()}")
        return 2
    from tinyknn.gpu import host_tier
    from tinyknn.spec import numpy_dtype

    if args.chunk_mb is not None:
        host_tier.CHUNK_BYTES = args.chunk_mb << 20

    env = _common.environment()
    itemsize = np.dtype(numpy_dtype(args.dtype)).itemsize
    n = max(1, int(args.gb * 1e9) // (args.dim * itemsize))
    threads = max(1, len(os.sched_getaffinity(0)))
    steps: dict[str, float] = {}
    tier = host_tier.HostTierSearcher(args.dim, args.metric, args.dtype)
    try:
        t0 = time.perf_counter()
        tier.reserve(n)
        steps["pinned_alloc_s"] = time.perf_counter() - t0

        def write(rows, ids):
            fill_random(rows, args.seed, args.dtype, threads)
            ids[:] = np.arange(len(ids), dtype=np.int64)

        t0 = time.perf_counter()
        tier.append_with(n, write)
        steps["fill_s"] = time.perf_counter() - t0
        rows = tier._store.rows[:n]
        copy_rows = max(1, min(n, (1 << 30) // (args.dim * itemsize)))
        h2d = h2d_bandwidth(rows[:copy_rows], repeats=5)
        queries = random_queries(np.random.default_rng(args.seed + 1), args.queries, args.dim)
        t0 = time.perf_counter()
        distances, ids = tier.search(queries, args.k)          # compiles on first use: untimed
        steps["first_search_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for few in (1, 2):      # the kernels of the rare widening (a chunk's k-th tied in float32): 2 (k + 1)
            tier.search(queries[:few], 2 * args.k + 1)
        steps["warm_widening_s"] = time.perf_counter() - t0
        sample = min(args.check_queries, args.queries)
        exact = check_exact(tier, queries[:sample], distances[:sample], ids[:sample], args.k, args.metric, args.dtype)
        samples = []
        while len(samples) < args.repeats and (not samples or time.perf_counter() - began < args.budget_s):
            t0 = time.perf_counter()
            again = tier.search(queries, args.k)
            samples.append(time.perf_counter() - t0)
            exact["repeat_identical"] = exact.get("repeat_identical", True) and bool(
                np.array_equal(again[1], ids) and np.array_equal(again[0], distances))
        trace = traced_search(tier, queries, args.k)
        chunk_rows = tier.chunk_rows()
        reruns = tier.exact_reruns
    finally:
        tier.close()
    database_bytes = n * args.dim * itemsize
    median = statistics.median(samples)
    tier_gbps = database_bytes / median / 1e9
    payload = {
        "config": {"gb": args.gb, "rows": n, "dim": args.dim, "dtype": args.dtype, "metric": args.metric, "k": args.k,
                   "queries": args.queries, "database_bytes": database_bytes, "chunk_rows": chunk_rows,
                   "chunks": -(-n // chunk_rows), "chunk_bytes": host_tier.CHUNK_BYTES},
        "h2d": h2d,
        "search": {"samples_s": samples, "median_s": median, "effective_gbps": tier_gbps,
                   "fraction_of_h2d": tier_gbps / h2d["gbps"], "target_fraction": 0.85,
                   "queries_per_s": args.queries / median, "exact_reruns": reruns},
        "exact": exact,
        "steps": steps,
        "trace": trace,
        "wall_s": time.perf_counter() - began,
    }
    title = (f"{n:,} x {args.dim} {args.dtype} {args.metric} in pinned host memory, {args.queries} queries, "
             f"k={args.k}: {100 * tier_gbps / h2d['gbps']:.0f} % of H2D")
    paths = _common.write_results("host_tier", payload, figure(h2d["gbps"], tier_gbps, title), env, args.out_dir)
    print(f"H2D {h2d['gbps']:.1f} GB/s; tier {tier_gbps:.1f} GB/s ({100 * tier_gbps / h2d['gbps']:.1f} %), "
          f"median {median * 1e3:.1f} ms over {len(samples)} runs; exact: ids {exact['ids_equal']}, distances "
          f"{exact['distances_equal']} ({sample} queries); wall {payload['wall_s']:.1f} s; steps {steps}")
    print("trace (one more search): " + ", ".join(f"{key} {value}" for key, value in trace["summary"].items()))
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0 if exact["ids_equal"] and exact["distances_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
