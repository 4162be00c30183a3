#!/usr/bin/env python3
"""How a screened batch should bring its float32 queries to the device, and where the rest of its host time goes.

A screened batch copies its queries into pinned staging with one NumPy copy, then issues one DMA; on the H200's
host that copy ran at ~10 GB/s (296 us for 1,000 x 768) while the device idled. Variants of Screen._upload,
patched in turn (interleaved rounds, answers checked equal to the current one's):
  stage       the current upload (one copy into pinned staging, one DMA)
  direct      cuMemcpyHtoDAsync straight from the caller's pageable array where its rows need no padding (the
              driver stages it in pieces, its copies overlapping the DMA); else stage
  threads-N   the staging copy in N pieces by N threads (N - 1 pool workers and the caller), each piece's DMA
              issued as its copy lands
  pieces-N    the same pieces copied one after another by the caller, each piece's DMA issued as it lands
For each: the whole search's median, and the host time of the upload. Then, on the current upload, host
timestamps inside one search (index.search entry, Screen.search entry, upload start and end, the wait's start
and end, Screen.search exit, index.search exit), medians of each interval.

    PYTHONPATH=$PWD python3 bench/probes/query_upload.py --out $OUT/query_upload.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
from tinyknn.gpu import memory  # noqa: E402
from tinyknn.gpu import screen as screen_module  # noqa: E402

ORIGINAL = screen_module.Screen._upload
POOLS: dict[int, ThreadPoolExecutor] = {}


def direct(self, queries):
    s = self.searcher
    if queries.dtype == np.float32 and queries.flags.c_contiguous and s._stride == s.dim:
        s._buffers["screen_q32"].copy_from_host(queries, queries.nbytes, s._stream)
        return
    ORIGINAL(self, queries)


def pieces(n_pieces: int, threaded: bool):
    def upload(self, queries):
        s = self.searcher
        nq, target = len(queries), s._buffers["screen_q32"]
        row_bytes = s._stride * 4
        stage = s._pinned("screen_stage", nq * row_bytes)
        staged = stage.array(np.float32, (nq, s._stride))
        bounds = np.linspace(0, nq, n_pieces + 1).astype(int)

        def copy(i):
            a, b = bounds[i], bounds[i + 1]
            staged[a:b, :s.dim] = queries[a:b]
            if s._stride > s.dim:
                staged[a:b, s.dim:] = 0.0

        def dma(i):
            a, b = int(bounds[i]), int(bounds[i + 1])
            if b > a:
                err, = memory.driver.cuMemcpyHtoDAsync(target.ptr + a * row_bytes, stage.ptr + a * row_bytes,
                                                       (b - a) * row_bytes, s._stream.handle)
                if err:
                    raise RuntimeError(f"cuMemcpyHtoDAsync: {err}")

        if threaded:
            pool = POOLS.get(n_pieces)
            if pool is None:
                pool = POOLS[n_pieces] = ThreadPoolExecutor(n_pieces - 1)
            futures = [pool.submit(copy, i) for i in range(1, n_pieces)]
            copy(0)
            dma(0)
            for i, future in enumerate(futures, 1):
                future.result()
                dma(i)
        else:
            for i in range(n_pieces):
                copy(i)
                dma(i)
    return upload


VARIANTS = {"stage": ORIGINAL, "direct": direct, "pieces-4": pieces(4, False),
            "threads-2": pieces(2, True), "threads-4": pieces(4, True), "threads-8": pieces(8, True)}


def timed(fn, log):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((t0, time.perf_counter_ns()))
    return wrapped


def shape_run(args, n, dim, dtype, nq) -> dict:
    rng = np.random.default_rng(0)
    index = _common.normal_index(rng, n, dim, "l2", dtype)
    q = rng.standard_normal((nq, dim), dtype=np.float32)
    reference = None
    walls = {name: [] for name in VARIANTS}
    uploads = {name: [] for name in VARIANTS}
    for name, upload in VARIANTS.items():      # warm-up (and the answers) of each
        screen_module.Screen._upload = upload
        for _ in range(3):
            _, ids = index.search(q, args.k)
        if reference is None:
            reference = ids
        if not np.array_equal(ids, reference):
            raise SystemExit(f"{name}: answers differ from the current upload's")
    for _ in range(args.rounds):
        for name, upload in VARIANTS.items():
            log = []
            screen_module.Screen._upload = timed(upload, log)
            for _ in range(args.reps):
                t0 = time.perf_counter_ns()
                index.search(q, args.k)
                walls[name].append((time.perf_counter_ns() - t0) / 1e3)
            uploads[name] += [(b - a) / 1e3 for a, b in log]
    screen_module.Screen._upload = ORIGINAL

    # host timestamps inside one search on the current upload
    marks: dict[str, list] = {}
    patched = {}
    for owner, attr, label in ((screen_module.Screen, "search", "screen"), (screen_module.Screen, "_upload", "upload"),
                               (memory.Stream, "synchronize", "wait")):
        patched[(owner, attr)] = getattr(owner, attr)
        setattr(owner, attr, timed(getattr(owner, attr), marks.setdefault(label, [])))
    intervals: dict[str, list] = {}
    try:
        for _ in range(args.rounds * args.reps):
            for log in marks.values():
                log.clear()
            t0 = time.perf_counter_ns()
            index.search(q, args.k)
            t1 = time.perf_counter_ns()
            (s0, s1), (u0, u1), (w0, w1) = marks["screen"][-1], marks["upload"][-1], marks["wait"][-1]
            for name, a, b in (("entry_to_screen", t0, s0), ("screen_to_upload", s0, u0), ("upload", u0, u1),
                               ("upload_to_wait", u1, w0), ("wait", w0, w1), ("wait_to_screen_exit", w1, s1),
                               ("screen_exit_to_return", s1, t1), ("whole", t0, t1)):
                intervals.setdefault(name, []).append((b - a) / 1e3)
    finally:
        for (owner, attr), fn in patched.items():
            setattr(owner, attr, fn)
    index.close()
    result = {"shape": {"n": n, "dim": dim, "dtype": dtype, "queries": nq, "k": args.k},
              "whole_us_median": {name: statistics.median(v) for name, v in walls.items()},
              "upload_host_us_median": {name: statistics.median(v) for name, v in uploads.items()},
              "intervals_us_median": {name: statistics.median(v) for name, v in intervals.items()}}
    print(f"{n} x {dim} {dtype}, {nq} queries:")
    for name in VARIANTS:
        print(f"  {name:10s} whole {result['whole_us_median'][name]:8.1f} us  upload {result['upload_host_us_median'][name]:7.1f} us")
    print("  intervals: " + ", ".join(f"{k} {v:.1f}" for k, v in result["intervals_us_median"].items()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    shapes = [(1_000_000, 768, "float16", 1000), (100_000, 128, "float32", 1000), (1_000_000, 768, "float32", 100)]
    results = [shape_run(args, *shape) for shape in shapes]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": _common.environment(), "args": vars(args), "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
