#!/usr/bin/env python3
"""Where the single-query kernel's time goes, phase by phase, in the library's own kernel.

The kernel templates carry phase hooks (`TINYKNN_PHASE(i)` in kernels/single.cuh and verify.cuh) that are
empty in the library. This probe compiles the single-query specs with the hook defined (thread 0 of each
block writes %globaltimer and clock64 into a module global) and lets `index.search` load that cubin in place
of the library's, so the plan, the launch and the graph are the library's own. Each search's stamps are read
after it; the medians over --searches are reported, and the answers are checked against the float64 oracle
(tests/reference.py) up to 100k rows, and for their proof (no query sent to the band search) everywhere.

Phases: start, query (loaded), streamed, listed (the slice's list written), arrived (the arrival counter),
then in the last block only: copied (the lists into shared memory), gathered (the KL best under the bound),
distances (float64), sorted, done (the answer written).

    PYTHONPATH=$PWD python3 bench/probes/single_phases.py --out-dir $OUT        # H200, about a minute
    PYTHONPATH=$PWD python3 bench/probes/single_phases.py --compile-only        # no GPU: NVRTC + ptxas report

The probe of 2026-12-02, which timed copies of the kernel with variants of its tail, is in git:
`git show 664b9f6:bench/probes/single_phases.py` (and `.cuh`); SINGLE_PHASES.md has its results.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
import _common  # noqa: E402
from tinyknn.jit import compiler, cuda_source, render_single  # noqa: E402

K = 10
PHASES = ("start", "query", "streamed", "listed", "arrived", "copied", "gathered", "distances", "sorted", "done")
MAX_BLOCKS = 4096
SHAPES = {"20k x 128 float32": (20_000, 128, "float32"), "100k x 128 float32": (100_000, 128, "float32"),
          "1M x 768 float16": (1_000_000, 768, "float16"), "1M x 768 float32": (1_000_000, 768, "float32")}
STAMPS = "tinyknn_phase_stamps"
PREFIX = f"""// ---- bench/probes/single_phases.py: the phase hooks defined ----
extern "C" __device__ unsigned long long {STAMPS}[{MAX_BLOCKS * len(PHASES) * 2}];
#define TINYKNN_PHASE(i) do {{ if (threadIdx.x == 0) {{ unsigned long long now_; \\
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_)); \\
    unsigned long long* slot_ = {STAMPS} + ((unsigned long long)blockIdx.x * {len(PHASES)} + (i)) * 2; \\
    slot_[0] = now_; slot_[1] = (unsigned long long)clock64(); }} }} while (0)
"""


def stamped_source(spec) -> cuda_source.RenderedSource:
    """The library's source of `spec` with the hooks defined (the same name expression)."""
    plain = cuda_source.render_source(spec)
    return cuda_source.RenderedSource(PREFIX + plain.source, plain.name_expressions, plain.options)


def spec_of(label: str, arch: str, **overrides):
    """The kernel a search of `label` runs on `arch` with `overrides` (the slices' shared bound by the library's
    rule unless they name it)."""
    n, dim, dtype = SHAPES[label]
    return render_single.single_spec_over(n, "l2", dtype, dim, K, arch, shadow=dtype == "float32", **overrides)


def compile_only(arch: str) -> None:
    for label in SHAPES:
        cubin = compiler.compile_cubin(stamped_source(spec_of(label, arch)), arch)
        for name, report in cubin.reports.items():
            if "single_kernel" in name:
                print(f"{label:20s} registers {report.registers} stack {report.stack_bytes} "
                      f"spills {report.spill_bytes}")


class Stamped:
    """plan.get_cubin / plan.load_module patched: single-query specs compiled with the hooks; their modules kept."""

    def __init__(self, arch: str):
        from tinyknn.gpu import plan

        self.plan, self.arch, self.modules = plan, arch, []
        self._get, self._load = plan.get_cubin, plan.load_module
        plan.get_cubin, plan.load_module = self.get_cubin, self.load_module

    def get_cubin(self, spec):
        if spec.variant != "single":
            return self._get(spec)
        return compiler.compile_cubin(stamped_source(spec), self.arch)

    def load_module(self, cubin):
        module = self._load(cubin)
        if any("single_kernel" in name for name in cubin.lowered_names):
            self.modules.append(module)
        return module

    def close(self) -> None:
        self.plan.get_cubin, self.plan.load_module = self._get, self._load


def stamps_buffer(module) -> int:
    from cuda.bindings import driver

    from tinyknn.gpu.device import check

    pointer, size = check(driver.cuModuleGetGlobal(module.handle, STAMPS.encode()), "cuModuleGetGlobal")
    assert size == MAX_BLOCKS * len(PHASES) * 2 * 8, size
    return int(pointer)


def read_stamps(pointer: int, blocks: int) -> np.ndarray:
    from cuda.bindings import driver

    from tinyknn.gpu.device import check

    out = np.empty((blocks, len(PHASES), 2), np.uint64)
    check(driver.cuMemcpyDtoH(out.ctypes.data, pointer, out.nbytes), "cuMemcpyDtoH")
    return out.astype(np.int64)


def phases(stamps: list[np.ndarray]) -> dict:
    """Microseconds per phase, medians over searches. Inside a block by clock64 (at the rate measured against
    %globaltimer over the blocks' lives), across blocks by %globaltimer."""
    def us(values) -> float:
        return float(statistics.median(values))

    rows = {name: [] for name in ("start_spread", "query", "stream", "stream_max", "slice_select",
                                  "slice_select_max", "listed_to_last_arrival", "copy", "gather", "distances",
                                  "sort", "answer", "tail", "span")}
    ghz = []
    for s in stamps:
        gt, clk = s[..., 0], s[..., 1]
        life_gt = gt[:, 3] - gt[:, 0]
        ghz.append(float((clk[:, 3] - clk[:, 0]).sum() / max(1, life_gt.sum())))
    rate = statistics.median(ghz)
    for s in stamps:
        gt, clk = s[..., 0], s[..., 1]
        last = int(np.argmax(gt[:, 9]))

        def inside(a: int, b: int) -> np.ndarray:
            return (clk[:, b] - clk[:, a]) / rate / 1e3

        first = gt[:, 0].min()
        rows["start_spread"].append((gt[:, 0].max() - first) / 1e3)
        rows["query"].append(float(np.median(inside(0, 1))))
        stream = inside(1, 2)
        rows["stream"].append(float(np.median(stream)))
        rows["stream_max"].append(float(stream.max()))
        select = inside(2, 3)
        rows["slice_select"].append(float(np.median(select)))
        rows["slice_select_max"].append(float(select.max()))
        rows["listed_to_last_arrival"].append((gt[last, 4] - gt[:, 3].max()) / 1e3)
        for name, (a, b) in {"copy": (4, 5), "gather": (5, 6), "distances": (6, 7), "sort": (7, 8),
                             "answer": (8, 9), "tail": (4, 9)}.items():
            rows[name].append(float((clk[last, b] - clk[last, a]) / rate / 1e3))
        rows["span"].append((gt[last, 9] - first) / 1e3)
    return {"clock_ghz": rate, **{f"{name}_us": us(values) for name, values in rows.items()}}


def run_shape(label: str, searches: int, stamped: Stamped, rng, overrides: tuple = ()) -> dict:
    import reference
    import tinyknn

    n, dim, dtype = SHAPES[label]
    db = rng.standard_normal((n, dim), dtype=np.float32)
    queries = rng.standard_normal((8, dim), dtype=np.float32)
    with tinyknn.Index(dim, "l2", dtype, device="cuda") as index:
        index.add(db)
        searcher = index._searcher
        searcher.single_overrides = overrides      # render_single.single_params knobs (--stage)
        before = len(stamped.modules)
        answers = [index.search(queries[i:i + 1], K) for i in range(len(queries))]
        if len(stamped.modules) == before:
            raise SystemExit(f"{label}: the search loaded no stamped single-query kernel")
        pointer = stamps_buffer(stamped.modules[-1])
        checked = False
        if n <= 100_000:
            ref_d, ref_i = reference.exact_search(db, queries, K, "l2", dtype)
            for i, (d, ids) in enumerate(answers):
                assert np.array_equal(ids[0], ref_i[i]) and np.array_equal(d[0], ref_d[i]), f"{label}: query {i}"
            checked = True
        unproven = searcher.exact_reruns
        with searcher._lock, searcher._reading(None):
            plan = searcher._host_batch(1, K).plan
        slices = plan.slices
        collected = []
        for i in range(searches):
            index.search(queries[i % len(queries)][None], K)
            collected.append(read_stamps(pointer, slices))
        result = {"overrides": dict(overrides), "n": n, "dim": dim, "dtype": dtype, "slices": slices,
                  "rows_per_slice": plan.rows_per_slice,
                  "params": dict(spec_of(label, searcher._arch, **dict(overrides)).params), "oracle_checked": checked,
                  "unproven_of_8": unproven, **phases(collected)}
    print(f"{label:20s} slices {slices:4d}  " + "  ".join(
        f"{k[:-3]} {v:.1f}" for k, v in result.items() if k.endswith("_us")), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated labels of SHAPES")
    parser.add_argument("--searches", type=int, default=100)
    parser.add_argument("--compile-only", action="store_true", help="NVRTC and the ptxas report only (sm_90)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 4, 8), default=0,
                        help="0: the verify step reads its rows from global memory; 1: staged in shared memory; "
                             "2, 4, 8: staged, the chain loading that many chunks a step (render_single.single_params)")
    parser.add_argument("--shared-bound", choices=("on", "off"), default=None,
                        help="the slices share a bound or not (render_single.single_params shared_bound, single.cuh's "
                             "GT; default: the library's rule, render_single.single_shares_bound)")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    labels = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    if args.compile_only:
        compile_only("sm_90")
        return 0
    from tinyknn.gpu.device import current_device

    env = _common.environment()
    stamped = Stamped(current_device().arch)
    rng = np.random.default_rng(0)
    try:
        overrides = (("stage", args.stage),) + \
            ((("shared_bound", args.shared_bound == "on"),) if args.shared_bound else ())
        shapes = {label: run_shape(label, args.searches, stamped, rng, overrides) for label in labels}
    finally:
        stamped.close()
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / "single_phases.json"
        path.write_text(json.dumps({"environment": env, "k": K, "searches": args.searches, "shapes": shapes},
                                   indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
