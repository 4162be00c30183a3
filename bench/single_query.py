"""One query on the GPU against the bandwidth floor: the single-query kernel streaming a float32 index's rows
or its float16 shadow (kernels/single.cuh), end to end (host NumPy in and out: the default search and a
prepared search with out=) and the kernel alone (CUDA events), beside a device-to-device copy of the same
bytes measured in the same run (the floor: the bytes the kernel must read, at the copy's bandwidth).

Rows: 20k and 100k x 128 float32 (float32 stream, float16 shadow), 1M x 768 float32 (both), 1M x 768
float16; with each shadow (or float16) row the kernel's knobs: forced slices (fewer, fuller blocks), rows a
slice, warps, rows in flight, lanes a row, the verify step's staging, the slices' shared bound. k = 10, l2,
medians over --reps calls after warm-up. The shadow and the float32 stream must return identical answers (both
are exact); the script fails if they do not.

    PYTHONPATH=$PWD python3 bench/single_query.py [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import _common  # noqa: E402

SHAPES = (("20k x 128 float32", 20_000, 128, "float32"), ("100k x 128 float32", 100_000, 128, "float32"), ("1M x 768 float32", 1_000_000, 768, "float32"),
          ("1M x 768 float16", 1_000_000, 768, "float16"))
TARGETS_MS = {"100k x 128 float32": 0.035, "1M x 768 float32": 0.45, "1M x 768 float16": 0.38}
K = 10
# (render_single.single_params overrides, forced slices): the kernel's knobs, timed alone (the defaults first).
SMALL_SWEEP = (({}, None), ({}, 132), ({}, 66), ({}, 49), ({"rmax": 4096}, 33), ({"rmax": 4096}, 25), ({"rmax": 8192}, 13),
               ({"warps": 32}, None), ({"unroll": 4}, None), ({"lanes": 4}, None), ({"warps": 8, "unroll": 4}, None),
               ({"lanes": 4, "warps": 32}, None), ({"stage": 0}, None), ({"stage": 1}, None), ({"stage": 8}, None),
               ({"shared_bound": True}, None))
LARGE_SWEEP = (({}, None), ({"rmax": 4096}, None), ({"rmax": 8192}, None), ({"unroll": 4}, None), ({"warps": 32}, None),
               ({"rmax": 4096, "warps": 32}, None), ({"rmax": 8192, "warps": 32}, None),
               ({"rmax": 16384, "warps": 32}, None), ({"stage": 0}, None), ({"stage": 1}, None), ({"stage": 8}, None),
               ({"shared_bound": False}, None))   # the default shares it on Hopper at these sizes


def _events_ms(issue, stream, launches: int, per_sample: int = 10) -> float:
    """Milliseconds of one `issue()`: the median over samples of `per_sample` calls back to back between two
    CUDA events (the gaps between launches hidden, as in a stream of searches), `launches` calls in all."""
    from tinyknn.gpu.memory import Event

    begin, end = Event(), Event()
    samples = []
    for _ in range(max(1, launches // per_sample)):
        begin.record(stream)
        for _ in range(per_sample):
            issue()
        end.record(stream)
        end.synchronize()
        samples.append(begin.elapsed_ms(end) / per_sample)
    return statistics.median(samples)


def _floor(nbytes: int, stream, launches: int) -> dict:
    """A device-to-device copy of `nbytes` (reads and writes them: 2 x nbytes moved); the floor of a kernel
    that reads nbytes once is nbytes at that bandwidth."""
    from tinyknn.gpu.memory import DeviceBuffer

    src, dst = DeviceBuffer(nbytes), DeviceBuffer(nbytes)
    try:
        src.fill_bytes(1, nbytes, stream)
        copy_ms = _events_ms(lambda: dst.copy_from_device(src.ptr, nbytes, stream), stream, launches)
    finally:
        src.close()
        dst.close()
    bandwidth = 2 * nbytes / (copy_ms * 1e-3)
    return {"bytes": nbytes, "copy_ms": copy_ms, "copy_bandwidth_TBps": bandwidth / 1e12,
            "floor_ms": nbytes / bandwidth * 1e3, **_read_floor(nbytes, launches)}


def _read_floor(nbytes: int, launches: int) -> dict:
    """The same bytes read once by torch.sum over float32 (a tuned reduction: reads only), where torch is
    installed: the floor of a kernel that only reads, which the copy's half need not be."""
    try:
        import torch
    except ImportError:
        return {}
    values = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(max(1, launches // 10)):
        begin.record()
        for _ in range(10):
            values.sum()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 10)
    del values
    read_ms = statistics.median(samples)
    return {"read_ms": read_ms, "read_bandwidth_TBps": nbytes / (read_ms * 1e-3) / 1e12}


def _kernel_ms(searcher, launches: int, slices: int | None = None, overrides: dict | None = None) -> dict:
    """The plan of one query (as a search builds it, with `slices` and render_single.single_params `overrides`
    forced), launched alone between CUDA events."""
    searcher.slices_override = slices
    searcher.single_overrides = tuple((overrides or {}).items())
    searcher._forget_plans()
    try:
        with searcher._lock, searcher._reading(None):
            batch = searcher._host_batch(1, K)
            spec = searcher._main_spec(1, K, False)
        ms = _events_ms(lambda: batch.plan.launch(searcher._stream), searcher._stream, launches)
        return {"kernel_ms": ms, "slices": batch.plan.slices, "rows_per_slice": batch.plan.rows_per_slice,
                "shadow": bool(spec.param("shadow", 0)), "params": dict(spec.params)}
    finally:
        searcher.slices_override = None
        searcher.single_overrides = ()
        searcher._forget_plans()


def _end_to_end(index, queries, reps: int) -> dict:
    """Median microseconds of index.search(q, K) and of a prepared search with out=, q cycling over `queries`."""
    prepared = index.prepare_search(k=K, n_queries=1)
    out = np.empty((1, K), np.float32), np.empty((1, K), np.int64)
    rows = [queries[i:i + 1] for i in range(len(queries))]
    result = {}
    calls = (("default_us", lambda q: index.search(q, K)), ("prepared_out_us", lambda q: prepared(q, out=out)))
    for name, call in calls:
        for q in rows[:20]:
            call(q)
        samples = []
        for i in range(reps):
            q = rows[i % len(rows)]
            t0 = time.perf_counter_ns()
            call(q)
            samples.append((time.perf_counter_ns() - t0) * 1e-3)
        result[name] = statistics.median(samples)
        result[name.replace("_us", "_p90_us")] = float(np.quantile(samples, 0.9))
    prepared.close()
    return result


def _warm(dim: int, dtype: str, sweep, n: int) -> None:
    """Compile the shape's kernels up front, in parallel (NVRTC releases the GIL): the sweep's as an index of `n`
    rows runs them (each knob on top of the defaults, the slices' shared bound among them)."""
    import concurrent.futures
    import os

    from tinyknn.gpu.device import current_device
    from tinyknn.jit import render_single, search_kernels
    from tinyknn.jit.cache import get_cubin

    arch = current_device().arch
    specs = set(search_kernels.specs_for_search("l2", dtype, dim, K, arch))
    specs |= {render_single.single_spec_over(n, "l2", dtype, dim, K, arch, shadow=dtype == "float32", **o)
              for o, _ in sweep}
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        list(pool.map(get_cubin, sorted(specs)))


def measure_shape(label: str, n: int, dim: int, dtype: str, reps: int, launches: int, rng, sweep: bool = True) -> dict:
    import tinyknn
    from tinyknn.jit import render

    knobs = (SMALL_SWEEP if n <= 200_000 else LARGE_SWEEP) if sweep else (({}, None),)
    db = rng.standard_normal((n, dim), dtype=np.float32)
    queries = rng.standard_normal((64, dim), dtype=np.float32)
    out = {"n": n, "dim": dim, "dtype": dtype, "k": K, "metric": "l2", "modes": {}}
    _warm(dim, dtype, knobs, n)
    with tinyknn.Index(dim, "l2", dtype, device="cuda") as index:
        index.add(db)
        del db
        searcher = index._searcher
        modes = ("float16 shadow", "float32 rows") if dtype == "float32" else ("stored rows",)
        answers = {}
        for mode in modes:
            searcher.single_shadow = mode != "float32 rows"
            searcher._forget_plans()
            reruns = searcher.exact_reruns
            answers[mode] = [index.search(queries[i:i + 1], K) for i in range(len(queries))]
            row = {"exact_reruns_of_64": searcher.exact_reruns - reruns, **_end_to_end(index, queries, reps),
                   **_kernel_ms(searcher, launches)}
            streamed = "float16" if row["shadow"] else dtype
            row["floor"] = _floor(n * render.row_layout(dim, streamed)[1] * render.ITEMSIZE[streamed],
                                  searcher._stream, launches)
            row["kernel_over_floor"] = row["kernel_ms"] / row["floor"]["floor_ms"]
            if mode != "float32 rows":      # the knobs: fewer, fuller blocks; more loads in flight; warps
                row["variants"] = [{"overrides": o, "slices_override": sl, **_kernel_ms(searcher, launches, sl, o)}
                                   for o, sl in knobs]
            out["modes"][mode] = row
            print(f"{label:20s} {mode:15s} search {row['default_us']:8.1f} us"
                  f"  prepared {row['prepared_out_us']:8.1f} us"
                  f"  kernel {row['kernel_ms'] * 1e3:8.1f} us  floor {row['floor']['floor_ms'] * 1e3:8.1f} us"
                  f"  ({row['floor']['copy_bandwidth_TBps']:.2f} TB/s)  read {row['floor'].get('read_ms', 0) * 1e3:8.1f} us"
                  f"  reruns {row['exact_reruns_of_64']}", flush=True)
        searcher.single_shadow = True
        if len(answers) == 2:
            (a, b) = answers.values()
            same = all(np.array_equal(x[1], y[1]) and np.array_equal(x[0].view(np.int32), y[0].view(np.int32))
                       for x, y in zip(a, b))
            out["shadow_answers_identical"] = same     # main() fails the run if not (after writing the JSON)
    return out


def figure(payload: dict):
    try:
        plt = _common.pyplot()
    except ImportError:     # no matplotlib: the JSON alone
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    labels, kernel, search, floor = [], [], [], []
    for label, res in payload["shapes"].items():
        for mode, row in res.get("modes", {}).items():
            labels.append(f"{label}\n{mode}")
            kernel.append(row["kernel_ms"] * 1e3)
            search.append(row["default_us"])
            floor.append(row["floor"]["floor_ms"] * 1e3)
    x = np.arange(len(labels))
    ax.bar(x - 0.27, floor, 0.27, label="floor (d2d copy bandwidth)")
    ax.bar(x, kernel, 0.27, label="kernel alone")
    ax.bar(x + 0.27, search, 0.27, label="search end to end")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("microseconds (median)")
    ax.set_title("one query, k = 10, l2: against the bandwidth floor")
    ax.legend(fontsize=8)
    return fig


def checks(payload: dict) -> dict:
    out = {}
    for label, res in payload["shapes"].items():
        best = min((row["default_us"] for row in res.get("modes", {}).values()), default=None)
        if best is not None and label in TARGETS_MS:
            out[f"{label}: end to end <= {TARGETS_MS[label] * 1e3:.0f} us"] = best <= TARGETS_MS[label] * 1e3
    return out


def main(argv=None) -> int:
    parser = _common.common_parser(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="searches per median (default 300; --quick 50)")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="the default kernel only, no knobs")
    args = parser.parse_args(argv)
    env = _common.environment()
    from tinyknn.gpu import device

    if args.device == "cpu" or not device.has_gpu():
        reason = "--device cpu" if args.device == "cpu" else device.why_no_gpu()
        paths = _common.write_results("single_query", {"skipped": f"needs a CUDA GPU: {reason}"}, env=env,
                                      out_dir=args.out_dir)
        print(f"single_query: skipped ({reason}); wrote {paths['json']}")
        return 0
    reps = args.reps or (50 if args.quick else 300)
    launches = 50 if args.quick else 200
    rng = np.random.default_rng(0)
    shapes = SHAPES[:2] if args.quick else SHAPES
    payload = {"settings": {"reps": reps, "launches": launches, "k": K, "sweep": args.sweep}, "shapes": {}}
    for label, n, dim, dtype in shapes:
        payload["shapes"][label] = measure_shape(label, n, dim, dtype, reps, launches, rng, args.sweep)
    payload["checks"] = checks(payload)
    paths = _common.write_results("single_query", payload, figure(payload), env, args.out_dir)
    print(f"checks: {payload['checks']}")
    print(f"wrote {paths['json']} and {paths.get('png')}")
    differ = [label for label, res in payload["shapes"].items() if res.get("shadow_answers_identical") is False]
    if differ:
        print(f"FAILED: the float16 shadow's answers differ from the float32 stream's on {differ}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
