#!/usr/bin/env python3
"""Where the single-query kernel's fixed cost goes: its phases stamped per block (%globaltimer, clock64), and
candidate variants of the fixed cost, each checked exact against the library's own search (and, up to 100k
rows, the float64 oracle of tests/reference.py). See SINGLE_PHASES.md for the phases and the variants.

    PYTHONPATH=$PWD python3 bench/probes/single_phases.py --out $OUT            # H200, about a minute
    PYTHONPATH=$PWD python3 bench/probes/single_phases.py --compile-only        # no GPU: NVRTC + ptxas report

Length: one probe (render, compile, launch, stamps, report) kept in one file so it stays one command.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
import single_query  # noqa: E402
from tinyknn.jit import compiler, cuda_source, render  # noqa: E402

K = 10
LAUNCHES = 200
SHAPES = {"20k": (20_000, 128), "100k": (100_000, 128), "1M": (1_000_000, 768)}   # float32, l2, the shadow
# name: (SEL, GATHER, SORTW, TAIL); the switches of single_phases.cuh
VARIANTS = {"copy": (0, 0, 1, 0), "block_sort": (0, 0, 0, 0), "warp_select": (1, 0, 1, 0),
            "warp_merge": (1, 1, 1, 0), "head_gather": (0, 2, 1, 0), "head_all": (2, 2, 1, 0),
            "tail_kernel": (0, 0, 1, 1), "tail_kernel_head": (0, 2, 1, 1), "head_all_l2": (2, 2, 1, 2)}
SLICE_SWEEP = {"20k": (20, 10), "100k": (66, 49)}       # fewer, fuller slices (rows a slice <= rmax)
SWEPT = ("copy", "head_all")
PHASES = ("start", "query", "streamed", "listed", "arrived", "copied", "gathered", "distances", "sorted", "done")
P = {name: i for i, name in enumerate(PHASES)}
_V, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
STREAM_ARGS = (_V, _V, _V, _L, _L, _V, _V, _V, _V, _V, _V, _V, _V, _V, _V, _I, _V)
TAIL_ARGS = (_V, _V, _I, _V, _V, _V, _V, _V, _V, _V, _V, _I, _V)


# -- rendering: the library's spec, the probe's instantiations -------------------------------------
def library_spec(dim: int, arch: str, warps: int | None):
    overrides = {"warps": warps} if warps else {}
    return render.single_spec("l2", "float32", dim, K, arch, shadow=True, **overrides)


def probe_names(spec, variant: str, stamp: int) -> tuple[str, str | None, int, int]:
    """(stream kernel, tail kernel or None, stream smem, tail smem) of `variant` over the library's `spec`."""
    sel, gather, sortw, tail = VARIANTS[variant]
    args = cuda_source.name_expression(spec).split("<", 1)[1].rsplit(">", 1)[0].split(", ")
    metric, bound, stored, _streamed, dim, k, kl, _lanes, warps, _rmax, _unroll, cmax, _smem = args
    scratch = int(warps) * int(kl) * 8
    if gather == 2 or sel == 2:
        scratch = max(scratch, render._BOUNDED_BYTES)   # merge.cuh's BOUNDED_SHARED
    smem = spec.param("smem") + scratch
    stream = f"tinyknn::probe_single_kernel<{', '.join(args[:-1])}, {smem}, {stamp}, {sel}, {gather}, {sortw}, {tail}>"
    tail_smem = render._align16(render.verify_params(int(kl), False)["smem"]) + int(cmax) * 8 + scratch
    tail_name = (f"tinyknn::probe_tail_kernel<{metric}, {bound}, {stored}, {dim}, {k}, {kl}, {warps}, {cmax}, "
                 f"{tail_smem}, {stamp}, {gather}, {sortw}>") if tail == 1 else None
    return stream, tail_name, smem, tail_smem


def probe_source() -> str:
    text = (Path(__file__).with_name("single_phases.cuh")).read_text()
    text = "\n".join(line for line in text.splitlines() if line.strip() != "#pragma once")
    return cuda_source.kernel_source() + "\n// ---- bench/probes/single_phases.cuh ----\n" + text + "\n"


def compile_all(specs: dict, variants, arch: str) -> dict:
    """One NVRTC program per (library spec, variant), stamped and not, compiled in parallel (NVRTC releases the
    GIL); the ptxas report of each probe kernel printed; CompileError on failure, SystemExit on a spill.
    Returns {(label, variant): cubin}."""
    source = probe_source()

    def build(job):
        label, variant = job
        names = []
        for stamp in (0, 1):
            stream, tail, _, _ = probe_names(specs[label], variant, stamp)
            names += [stream] + ([tail] if tail else [])
        t0 = time.perf_counter()
        cubin = compiler.compile_cubin(cuda_source.RenderedSource(source, tuple(names), cuda_source.OPTIONS), arch)
        return cubin, time.perf_counter() - t0

    jobs = [(label, variant) for label in specs for variant in variants]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(len(jobs), 16)) as pool:
        built = dict(zip(jobs, pool.map(build, jobs)))
    print(f"compiled {len(jobs)} programs for {arch} in {time.perf_counter() - t0:.1f} s")
    for (label, variant), (cubin, seconds) in built.items():
        for name, report in cubin.reports.items():
            if not name.startswith("tinyknn::probe_"):
                continue        # the library's plain kernels, compiled along with the source
            kind = "tail" if "probe_tail" in name else "stream"
            stamp = name.rsplit(", ", 5 if kind == "stream" else 3)[1]
            print(f"  dim {label:4s} {variant:21s} {kind:6s} stamp {stamp}: registers {report.registers:3d} "
                  f"stack {report.stack_bytes} spills {report.spill_bytes}  ({seconds:.0f} s)")
            if report.spill_bytes or report.stack_bytes:
                raise SystemExit(f"{name}: spills or a stack frame ({report})")
    return {job: cubin for job, (cubin, _) in built.items()}


# -- on the device --------------------------------------------------------------------------------
def events_us(issue, stream, launches: int) -> float:
    """Median microseconds of one issue(), back to back between CUDA events (bench/single_query.py's way)."""
    return single_query._events_ms(issue, stream, launches) * 1e3


class Probe:
    """One variant's kernels launched on the library's buffers (rows, shadow, ids, row_stats) with the probe's
    own query, lists, outputs and stamps."""

    def __init__(self, module, spec, variant, lib_values, n, slices, rows, stream, buffers):
        from tinyknn.gpu.launcher import CapturedGraph

        self.slices, self.rows, self.stream, self.b, self.variant = slices, rows, stream, buffers, variant
        self.threads = spec.param("warps") * 32
        self.launches = {}
        for stamp in (0, 1):
            stream_name, tail_name, smem, tail_smem = probe_names(spec, variant, stamp)
            kernel = module.kernel(stream_name)
            if smem > 48 * 1024:
                kernel.set_max_dynamic_shared(smem)
            data, shadow, norms, _, _, _, ids = lib_values[:7]
            row_stats, dim = lib_values[12], lib_values[15]
            b = buffers
            main = kernel.prepare(STREAM_ARGS, (data, shadow, norms, n, rows, b["query"].ptr, ids, b["keys"].ptr,
                                                b["positions"].ptr, b["distances"].ptr, b["ids"].ptr,
                                                b["arrivals"].ptr, row_stats, b["status"].ptr, b["threshold"].ptr,
                                                dim, b["stamps"].ptr))
            tail = None
            if tail_name:
                tail_kernel = module.kernel(tail_name)
                if tail_smem > 48 * 1024:
                    tail_kernel.set_max_dynamic_shared(tail_smem)
                tail = tail_kernel.prepare(TAIL_ARGS, (b["keys"].ptr, b["positions"].ptr, slices, ids,
                                                       b["distances"].ptr, b["ids"].ptr, data, b["query"].ptr,
                                                       row_stats, b["status"].ptr, b["threshold"].ptr, dim,
                                                       b["stamps"].ptr))
            self.launches[stamp] = (main, smem, tail, tail_smem)
        self.graph = CapturedGraph(stream, lambda: self.issue(0))

    def issue(self, stamp: int, stamps_ptr: int | None = None) -> None:
        main, smem, tail, tail_smem = self.launches[stamp]
        if stamps_ptr is not None:
            main.set(16, stamps_ptr)
            if tail is not None:
                tail.set(12, stamps_ptr)
        main.launch(self.slices, self.threads, smem, self.stream)
        if tail is not None:
            tail.launch(1, self.threads, tail_smem, self.stream)

    def answer(self, query: np.ndarray):
        self.b["query"].copy_from_host(query, stream=self.stream)
        self.issue(0)
        d, i, s = np.empty(K, np.float32), np.empty(K, np.int64), np.empty(1, np.int32)
        self.b["distances"].copy_to_host(d, stream=self.stream)
        self.b["ids"].copy_to_host(i, stream=self.stream)
        self.b["status"].copy_to_host(s, stream=self.stream)
        self.stream.synchronize()
        return d, i, int(s[0])

    def stamped(self, launches: int) -> np.ndarray:
        """(launches, slices + 1, phases, 2): globaltimer ns and clock64 per block, row `slices` the tail kernel."""
        row = (self.slices + 1) * len(PHASES) * 2 * 8
        self.b["stamps"].fill_bytes(0, row * launches, self.stream)
        for launch in range(launches):
            self.issue(1, self.b["stamps"].ptr + launch * row)
        out = np.empty((launches, self.slices + 1, len(PHASES), 2), np.uint64)
        self.b["stamps"].copy_to_host(out, row * launches, self.stream)
        self.stream.synchronize()
        self.issue(1, self.b["stamps"].ptr)     # leave slot 16 at the buffer's start
        return out.astype(np.int64)


def phases(stamps: np.ndarray, slices: int, tail_kernel: bool) -> dict:
    """Per-phase microseconds, medians over launches (per-block phases: the median block of each launch, and the
    slowest). Durations inside a block by clock64 at the clock rate measured against %globaltimer."""
    gt, clk = stamps[..., 0], stamps[..., 1]
    blocks = slice(0, slices)
    life = P["listed"]
    ghz = (clk[:, blocks, life] - clk[:, blocks, P["start"]]).sum() / max(
        1, (gt[:, blocks, life] - gt[:, blocks, P["start"]]).sum())

    def per_block(a: str, b: str) -> tuple[float, float]:
        d = (clk[:, blocks, P[b]] - clk[:, blocks, P[a]]) / ghz / 1e3
        return float(np.median(np.median(d, axis=1))), float(np.median(d.max(axis=1)))

    seen = np.unique(gt[:, blocks, :P["arrived"] + 1])
    seen = np.diff(seen[seen > 0])
    out = {"clock_ghz": float(ghz), "globaltimer_tick_ns": int(seen[seen > 0].min()) if (seen > 0).any() else None}
    for name, (a, b) in {"query": ("start", "query"), "stream": ("query", "streamed"),
                         "slice_select": ("streamed", "listed")}.items():
        out[f"{name}_us"], out[f"{name}_max_us"] = per_block(a, b)
    first = gt[:, blocks, P["start"]].min(axis=1)
    out["start_spread_us"] = float(np.median(gt[:, blocks, P["start"]].max(axis=1) - first)) / 1e3
    if tail_kernel:
        last = slices
        tail_start = gt[:, last, P["start"]]
        gap = tail_start - gt[:, blocks, P["listed"]].max(axis=1)
        out["last_listed_to_tail_start_us"] = float(np.median(gap)) / 1e3
        begin = "start"
    else:
        out["arrival_us"], out["arrival_max_us"] = per_block("listed", "arrived")
        last = np.argmax(gt[:, blocks, P["done"]], axis=1)            # the block that ran the tail
        out["first_start_to_last_arrival_us"] = float(np.median(gt[:, blocks, P["arrived"]].max(axis=1) - first)) / 1e3
        begin = "arrived"
    rows = np.arange(len(gt))
    tail_clk = clk[rows, last] if not tail_kernel else clk[:, last]
    steps = [begin, "copied", "gathered", "distances", "sorted", "done"]
    for a, b in zip(steps, steps[1:]):
        out[f"tail_{b}_us"] = float(np.median((tail_clk[:, P[b]] - tail_clk[:, P[a]]) / ghz / 1e3))
    out["tail_total_us"] = float(np.median((tail_clk[:, P["done"]] - tail_clk[:, P[begin]]) / ghz / 1e3))
    done = gt[rows, last, P["done"]] if not tail_kernel else gt[:, last, P["done"]]
    out["span_us"] = float(np.median(done - first)) / 1e3
    return out


def split(n: int, slices: int, spec) -> tuple[int, int]:
    """(slices, rows a slice) as plan.split_rows rounds a forced slice count (whole granules, <= rmax)."""
    granule = spec.param("warps") * 32 // spec.param("lanes")
    rows = math.ceil(max(granule, K, math.ceil(n / slices)) / granule) * granule
    if rows > spec.param("rmax"):
        raise SystemExit(f"{slices} slices of {n} rows need {rows} rows a slice; rmax is {spec.param('rmax')}")
    return math.ceil(n / rows), rows


def run_shape(label, n, dim, cubins, spec, variants, launches, n_check, rng) -> dict:
    import tinyknn
    import reference
    from tinyknn.gpu.launcher import load_module
    from tinyknn.gpu.memory import DeviceBuffer

    t0 = time.perf_counter()
    db = rng.standard_normal((n, dim), dtype=np.float32)
    queries = rng.standard_normal((n_check, dim), dtype=np.float32)
    result = {"n": n, "dim": dim, "k": K, "runs": []}
    with tinyknn.Index(dim, "l2", "float32", device="cuda") as index:
        index.add(db)
        reruns = index._searcher.exact_reruns
        expected = [index.search(queries[i:i + 1], K) for i in range(n_check)]
        lib_unproven = index._searcher.exact_reruns - reruns     # the library's band searches among them
        if n <= 100_000:     # the library itself against the float64 oracle
            ref_d, ref_i = reference.exact_search(db, queries, K, "l2")
            assert all(np.array_equal(expected[i][1][0], ref_i[i]) and np.array_equal(expected[i][0][0], ref_d[i])
                       for i in range(n_check)), f"{label}: the library's search differs from tests/reference.py"
        del db
        searcher = index._searcher
        with searcher._lock, searcher._reading(None):
            batch = searcher._host_batch(1, K)
            used = searcher._main_spec(1, K, False)
        if cuda_source.name_expression(used) != cuda_source.name_expression(library_spec(dim, spec.arch, None)):
            raise SystemExit(f"{label}: the searcher's spec {used} is not the one the probe renders")
        stream = searcher._stream
        lib_values = batch.plan.main.values()
        result["library"] = {"slices": batch.plan.slices, "rows_per_slice": batch.plan.rows_per_slice,
                             "unproven": lib_unproven,
                             "kernel_us": events_us(lambda: batch.plan.launch(stream), stream, launches)}
        stride = render.row_layout(dim, "float32")[1]
        kl = spec.param("kl")
        most = max([batch.plan.slices] + list(SLICE_SWEEP.get(label, ()))) + 1
        sizes = {"query": stride * 4, "keys": most * kl * 4, "positions": most * kl * 4, "distances": K * 4,
                 "ids": K * 8, "arrivals": 16, "status": 16, "threshold": 16,
                 "stamps": launches * most * len(PHASES) * 16}
        buffers = {name: DeviceBuffer(size) for name, size in sizes.items()}
        for buffer in buffers.values():
            buffer.fill_bytes(0, stream=stream)
        padded = np.zeros((n_check, stride), np.float32)
        padded[:, :dim] = queries
        try:
            for variant in variants:
                counts = [batch.plan.slices] + (list(SLICE_SWEEP.get(label, ())) if variant in SWEPT else [])
                for count in counts:
                    slices, rows = split(n, count, spec)
                    probe = Probe(load_module(cubins[variant]), spec, variant, lib_values, n, slices, rows, stream,
                                  buffers)
                    unproven, differ = 0, []
                    for i in range(n_check):     # a proven answer must be the library's, bit for bit
                        d, ids, status = probe.answer(padded[i])
                        unproven += status
                        if status == 0 and not (np.array_equal(ids, expected[i][1][0])
                                                and np.array_equal(d.view(np.int32), expected[i][0][0].view(np.int32))):
                            differ.append({"query": i, "ids": ids.tolist(), "library": expected[i][1][0].tolist()})
                    run = {"variant": variant, "slices": slices, "rows_per_slice": rows,
                           "checked": n_check, "unproven": unproven, "differ": differ,
                           "kernel_us": events_us(lambda: probe.issue(0), stream, launches),
                           "graph_us": events_us(lambda: probe.graph.launch(stream), stream, launches),
                           "stamped_us": events_us(lambda: probe.issue(1), stream, launches // 2)}
                    run.update(phases(probe.stamped(launches), slices, VARIANTS[variant][3] == 1))
                    probe.graph.close()
                    result["runs"].append(run)
                    print_run(label, run)
        finally:
            for buffer in buffers.values():
                buffer.close()
    result["seconds"] = time.perf_counter() - t0
    return result


COLUMNS = (("kernel_us", "kernel"), ("graph_us", "graph"), ("stamped_us", "stamped"), ("span_us", "span"),
           ("start_spread_us", "starts"), ("stream_us", "stream"), ("stream_max_us", "str.max"),
           ("slice_select_us", "select"), ("arrival_us", "arrive"), ("tail_copied_us", "t.copy"),
           ("tail_gathered_us", "t.gath"), ("tail_distances_us", "t.dist"), ("tail_sorted_us", "t.sort"),
           ("tail_done_us", "t.done"), ("tail_total_us", "t.total"))


def print_run(label: str, run: dict) -> None:
    cells = " ".join(f"{run[key]:7.2f}" if key in run else "      -" for key, _ in COLUMNS)
    print(f"{label:5s} {run['variant']:21s} {run['slices']:4d} {cells}  unproven {run['unproven']}/{run['checked']}"
          f"{'  DIFFERS FROM THE LIBRARY: ' + str(run['differ']) if run['differ'] else ''}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for single_phases.json")
    parser.add_argument("--compile-only", action="store_true", help="NVRTC + ptxas report only (no GPU needed)")
    parser.add_argument("--shapes", default="20k,100k,1M", help=f"of {list(SHAPES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}")
    parser.add_argument("--warps", type=int, default=None, help="warps a block (default: the library's)")
    parser.add_argument("--launches", type=int, default=LAUNCHES)
    parser.add_argument("--check", type=int, default=8, help="queries checked exact per variant")
    parser.add_argument("--arch", default=None, help="compile for this arch (default: the GPU's, else sm_90)")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    bad = [s for s in shapes if s not in SHAPES] + [v for v in variants if v not in VARIANTS]
    if bad:
        parser.error(f"unknown shapes or variants {bad}; shapes are {list(SHAPES)}, variants {list(VARIANTS)}")
    arch = args.arch
    if not args.compile_only and arch is None:
        from tinyknn.gpu.device import current_device
        arch = current_device().arch
    arch = arch or "sm_90"
    specs = {s: library_spec(SHAPES[s][1], arch, args.warps) for s in shapes}
    dims = {str(SHAPES[s][1]): specs[s] for s in shapes}
    cubins = compile_all(dims, variants, arch)
    if args.compile_only:
        return 0
    rng = np.random.default_rng(0)
    payload = {"date": time.strftime("%Y-%m-%d"), "arch": arch, "k": K, "launches": args.launches,
               "variants": {v: dict(zip(("sel", "gather", "sortw", "tail"), VARIANTS[v])) for v in variants},
               "shapes": {}}
    print(f"{'shape':5s} {'variant':21s} {'sl':>4s} " + " ".join(f"{title:>7s}" for _, title in COLUMNS))
    for label in shapes:
        n, dim = SHAPES[label]
        spec = specs[label]
        mine = {variant: cubins[(str(dim), variant)] for variant in variants}
        payload["shapes"][label] = run_shape(label, n, dim, mine, spec, variants, args.launches, args.check, rng)
        lib = payload["shapes"][label]["library"]
        print(f"{label:5s} library kernel {lib['kernel_us']:.2f} us, {lib['slices']} slices of {lib['rows_per_slice']}")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "single_phases.json").write_text(json.dumps(payload, indent=1))
    wrong = [(label, run["variant"], run["slices"]) for label, shape in payload["shapes"].items()
             for run in shape["runs"] if run["differ"] or run["unproven"] > shape["library"]["unproven"]]
    if wrong:
        print(f"FAILED: answers that differ from the library's, or more of them unproven: {wrong}")
        return 1
    print("every variant proved as many answers as the library, each the library's bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
