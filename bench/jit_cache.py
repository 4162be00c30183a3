"""What run-time specialisation costs: cold NVRTC compiles, the disk hit of a fresh process, the memory hit.

Measured for every kernel variant one search of (metric, dtype, dim, k) launches (default l2, float32,
128, 10, for sm_90):
- cold: compile_cubin(render_source(spec)) per variant (NVRTC already loaded), and what loading NVRTC
  itself costs in a fresh process (import cuda.bindings.nvrtc + the first call);
- fresh process, warm disk cache: a new interpreter in which importing cuda.bindings.nvrtc fails
  (proof that no NVRTC call happens) times get_cubin for the first spec and for all of them; the
  design target is < 5 ms for the first;
- in-process disk hit (a new CubinCache over the same folder) and memory hit (the dict);
- parallel warm-up: the same compiles serially, with 2 threads and with 2 processes, and the states
  of two compiling threads sampled from /proc (does NVRTC release the GIL and compile concurrently?).
With a GPU the fresh process also times loading the cubin into the driver (cuModuleLoadData).

    python bench/jit_cache.py [--quick] [--metric l2 --dtype float32 --dim 128 --k 10 --arch sm_90]
Writes bench/results/jit_cache_<date>_<device>.json and .png.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import common_parser, environment, pyplot, summary_us, time_calls, write_results  # noqa: E402

FRESH_PROCESS = r"""
import json, sys, time
sys.modules["cuda.bindings.nvrtc"] = None      # any NVRTC import fails: a compile would raise
t0 = time.perf_counter()
from tinyknn.jit.cache import default_cache
from tinyknn.jit.search_kernels import specs_for_search
t1 = time.perf_counter()
specs = specs_for_search(*json.loads(sys.argv[1]))
cache = default_cache()
t2 = time.perf_counter()
first = cache.get(specs[0])
t3 = time.perf_counter()
for spec in specs[1:]:
    cache.get(spec)
t4 = time.perf_counter()
result = {"import_s": t1 - t0, "first_s": t3 - t2, "all_s": t4 - t2, "stats": cache.stats,
          "nvrtc_mapped": any("libnvrtc" in line for line in open("/proc/self/maps"))}
if sys.argv[2] == "gpu":
    from tinyknn.gpu.device import ensure_context
    from tinyknn.gpu.launcher import load_module
    ensure_context()
    t5 = time.perf_counter()
    load_module(first)
    result["load_module_s"] = time.perf_counter() - t5
print(json.dumps(result))
"""

NVRTC_LOAD = r"""
import json, time
t0 = time.perf_counter()
from cuda.bindings import nvrtc
t1 = time.perf_counter()
nvrtc.nvrtcVersion()
print(json.dumps({"import_s": t1 - t0, "first_call_s": time.perf_counter() - t1}))
"""


def _python(code: str, *args: str, env: dict | None = None) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"subprocess failed:\n{result.stderr}")
    return json.loads(result.stdout)


def _compile(spec):
    from tinyknn.jit.compiler import compile_cubin
    from tinyknn.jit.cuda_source import render_source

    start = time.perf_counter()
    compile_cubin(render_source(spec), spec.arch, spec=spec)
    return time.perf_counter() - start


def cold_compiles(specs, repeats: int) -> dict:
    from tinyknn.jit.compiler import nvrtc_version

    nvrtc_version()
    return {str(spec): {"variant": spec.variant, "seconds": [_compile(spec) for _ in range(repeats)]} for spec in specs}


def parallel_warm(specs) -> dict:
    """Wall time of compiling `specs` serially, with 2 threads and with 2 processes."""
    result = {"kernels": len(specs)}
    start = time.perf_counter()
    for spec in specs:
        _compile(spec)
    result["serial_s"] = time.perf_counter() - start
    for name, executor in (("threads_2_s", ThreadPoolExecutor), ("processes_2_s", ProcessPoolExecutor)):
        with executor(2) as pool:
            list(pool.map(_compile, specs[:2]))   # start the workers (and load NVRTC in them) untimed
            start = time.perf_counter()
            list(pool.map(_compile, specs))
            result[name] = time.perf_counter() - start
    return result


def thread_states(specs) -> dict:
    """Two threads compiling at once, sampled from /proc: both runnable means NVRTC takes no global lock.

    Wall times cannot tell that on a busy 2-core machine; thread states can, whatever the load.
    """
    import threading

    tids: list[int] = []

    def compile_in_thread(spec):
        tids.append(threading.get_native_id())
        _compile(spec)

    threads = [threading.Thread(target=compile_in_thread, args=(spec,)) for spec in specs[:2]]
    for thread in threads:
        thread.start()
    samples = {"both_runnable": 0, "one_sleeping": 0}
    while all(thread.is_alive() for thread in threads):
        states = []
        for tid in list(tids):
            try:
                states.append(Path(f"/proc/self/task/{tid}/stat").read_text().split(") ")[1][0])
            except OSError:
                states.append("-")
        if len(states) == 2 and "-" not in states:
            samples["both_runnable" if states == ["R", "R"] else "one_sleeping"] += 1
        time.sleep(0.005)
    for thread in threads:
        thread.join()
    return samples


def cache_hits(specs, folder: Path, fresh_runs: int, gpu: bool, combination) -> dict:
    from tinyknn.jit.cache import CubinCache

    warm = CubinCache(folder)
    for spec in specs:
        warm.get(spec)
    fresh = [_python(FRESH_PROCESS, json.dumps(combination), "gpu" if gpu else "cpu",
                     env={"TINYKNN_CACHE_DIR": str(folder.parent)}) for _ in range(fresh_runs)]
    assert all(run["stats"]["compiles"] == 0 and not run["nvrtc_mapped"] for run in fresh), fresh
    disk = time_calls(lambda: CubinCache(folder).get(specs[0]), repeats=50 if fresh_runs > 3 else 10)
    memory = time_calls(lambda: warm.get(specs[0]), repeats=20000 if fresh_runs > 3 else 2000)
    result = {
        "fresh_process_first_spec": summary_us([run["first_s"] for run in fresh]),
        "fresh_process_all_specs": summary_us([run["all_s"] for run in fresh]),
        "fresh_process_import_tinyknn_jit": summary_us([run["import_s"] for run in fresh]),
        "in_process_disk_hit": summary_us(disk),
        "memory_hit": summary_us(memory),
        "entry_bytes": {row["variant"]: row["size"] for row in warm.list_entries()},
    }
    if gpu:
        result["fresh_process_load_module"] = summary_us([run["load_module_s"] for run in fresh])
    return result


def plot(results: dict):
    plt = pyplot()
    labels, values = [], []
    for spec, row in results["cold_compile"].items():
        labels.append(f"compile {row['variant']}")
        values.append(statistics.median(row["seconds"]) * 1e3)
    labels.append("load NVRTC")
    values.append(results["nvrtc_load_ms"])
    hits = results["cache"]
    for name in ("fresh_process_first_spec", "in_process_disk_hit", "memory_hit"):
        labels.append(name.replace("_", " "))
        values.append(hits[name]["median_us"] / 1e3)
    figure, axis = plt.subplots(figsize=(9, 4.5))
    bars = axis.barh(labels, values, color=["#c44"] * (len(labels) - 3) + ["#48c", "#4a4", "#8a4"])
    axis.set_xscale("log")
    axis.axvline(5.0, color="k", linestyle="--", linewidth=1)
    axis.text(5.0, len(labels) - 0.5, " 5 ms target", va="center")
    for bar, value in zip(bars, values):
        axis.text(value, bar.get_y() + bar.get_height() / 2, f" {value:.3g} ms", va="center", fontsize=8)
    axis.set_xlabel("milliseconds (log scale)")
    axis.set_title(f"tinyknn JIT: {results['combination']} (median)")
    axis.invert_yaxis()
    return figure


def main() -> None:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--metric", default="l2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    from tinyknn.jit.search_kernels import specs_for_search

    env = environment()
    gpu = args.device != "cpu" and bool((env.get("cuda_device") or {}).get("available"))
    combination = [args.metric, args.dtype, args.dim, args.k, args.arch]
    specs = specs_for_search(*combination)
    repeats, fresh_runs = (1, 3) if args.quick else (3, 15)
    nvrtc_loads = [_python(NVRTC_LOAD) for _ in range(fresh_runs)]
    results = {
        "combination": " ".join(map(str, combination)),
        "load_average_before": os.getloadavg(),
        "nvrtc_load_ms": statistics.median(r["import_s"] + r["first_call_s"] for r in nvrtc_loads) * 1e3,
        "nvrtc_load_runs": nvrtc_loads,
        "cold_compile": cold_compiles(specs, repeats),
        "parallel_warm": parallel_warm(specs + specs_for_search(args.metric, args.dtype, args.dim, args.k, "sm_80")),
        "nvrtc_thread_states": thread_states(sorted(specs, key=lambda spec: spec.variant in ("scan", "tiled"))[-2:]),
    }
    with tempfile.TemporaryDirectory(prefix="tinyknn-bench-") as folder:
        results["cache"] = cache_hits(specs, Path(folder) / "cubins", fresh_runs, gpu, combination)
    results["load_average_after"] = os.getloadavg()   # other work on the machine skews compile times
    figure = plot(results)
    paths = write_results("jit_cache", results, figure=figure, env=env, out_dir=args.out_dir)
    for spec, row in results["cold_compile"].items():
        print(f"cold compile {spec}: {statistics.median(row['seconds']) * 1e3:.0f} ms")
    print(f"loading NVRTC in a fresh process: {results['nvrtc_load_ms']:.0f} ms")
    for name, value in results["parallel_warm"].items():
        print(f"parallel warm {name}: {value if name == 'kernels' else f'{value:.2f} s'}")
    print(f"two compiling threads sampled: {results['nvrtc_thread_states']}")
    for name in ("fresh_process_first_spec", "fresh_process_all_specs", "in_process_disk_hit", "memory_hit",
                 "fresh_process_load_module"):
        if name in results["cache"]:
            row = results["cache"][name]
            print(f"{name}: median {row['median_us']:.1f} us (p90 {row['p90_us']:.1f}, n={row['n']})")
    print("wrote", *map(str, paths.values()))


if __name__ == "__main__":
    main()
