"""Helpers every benchmark script shares: the environment record, timing statistics, output files.

Stable API (other bench scripts import it):
    common_parser(description) -> argparse.ArgumentParser   (--quick, --device, --out-dir)
    environment() -> dict            machine, GPU (name, driver, clocks before), library versions, date
    gpu_clocks() -> dict | None      one nvidia-smi reading (clocks, temperature, power, pstate)
    time_calls(fn, repeats, warmup=3) -> list[float]   seconds per call, perf_counter_ns
    median_us(samples) -> float      median of samples given in seconds, in microseconds
    summary_us(samples) -> dict      median, p10, p90, min, max (us) and n
    pyplot()                         matplotlib.pyplot with the Agg backend (no display needed)
    write_results(name, payload, figure=None, env=None, out_dir=None, label=None) -> dict[str, Path]
        bench/results/<name>_<date>_<device>.json (+ .png); clocks are read again "after".
    normal_index(rng, n, dim, metric, dtype, device) -> tinyknn.Index   n seeded standard normal float32 rows,
        added in pieces of ADD_PIECE so that the host never holds them all
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LIBRARIES = ("numpy", "cuda-bindings", "cuda-core", "cuda-pathfinder", "cupy", "cupy-cuda13x", "cupy-cuda12x",
             "torch", "faiss-cpu", "hnswlib", "matplotlib", "tinyknn")
_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
               "temperature.gpu", "power.draw", "pstate", "memory.total")


def common_parser(description: str) -> argparse.ArgumentParser:
    """The options every script accepts; scripts add their own to the returned parser."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a smoke run that finishes in under a minute")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="restrict to what runs on this device (cpu: no GPU needed)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    return parser


def gpu_clocks() -> dict | None:
    """One nvidia-smi reading of the first GPU, or None where there is no nvidia-smi / GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"nvidia-smi failed: {exc}"}
    if not out:
        return None
    values = [v.strip() for v in out[0].split(",")]
    return dict(zip(_SMI_FIELDS, values))


def _library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if int(err) == 0:
            versions["nvrtc"] = f"{major}.{minor}"
    except Exception as exc:  # noqa: BLE001 - a missing NVRTC is a fact to record, not a failure
        versions["nvrtc"] = f"unavailable: {type(exc).__name__}"
    return versions


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cuda_device() -> dict | None:
    """The device tinyknn would use, through its own runtime (None without a GPU)."""
    try:
        from tinyknn.gpu import device
    except Exception as exc:  # noqa: BLE001
        return {"error": f"tinyknn.gpu cannot be imported: {exc}"}
    if not device.has_gpu():
        return {"available": False, "reason": device.why_no_gpu()}
    info = device.current_device()
    return {"available": True, **info.as_dict(), "driver_version": device.driver_version()}


def environment() -> dict:
    """Everything a reader needs to reproduce or discount a result; clocks are read now ("before")."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return {
        "date": now.date().isoformat(),
        "time_utc": now.strftime("%H:%M:%S"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "argv": sys.argv,
        "libraries": _library_versions(),
        "cuda_device": _cuda_device(),
        "nvidia_smi_before": gpu_clocks(),
    }


ADD_PIECE = 250_000


def normal_index(rng, n: int, dim: int, metric: str = "l2", dtype: str = "float32", device: str = "cuda",
                 labels=None):
    """An index of n standard normal float32 rows drawn from rng, ADD_PIECE rows an add (labels: one int64 a
    row, or None)."""
    import numpy as np
    import tinyknn

    index = tinyknn.Index(dim, metric, dtype, device=device)
    for start in range(0, n, ADD_PIECE):
        piece = rng.standard_normal((min(ADD_PIECE, n - start), dim), dtype=np.float32)
        index.add(piece, labels=None if labels is None else labels[start:start + len(piece)])
    return index


def time_calls(fn, repeats: int, warmup: int = 3) -> list[float]:
    """Wall time of `repeats` calls of fn() (after `warmup` untimed ones), in seconds each."""
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append((clock() - t0) * 1e-9)
    return samples


def profile_per_call(fn, reps: int) -> list[dict]:
    """cProfile of `reps` calls of fn(): each function's calls, own and cumulative microseconds per call, the
    largest own time first (the probes' host-time tables)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        fn()
    profiler.disable()
    rows = [{"function": f"{path.split('/')[-1]}:{line} {name}", "calls_per_search": calls / reps,
             "own_us_per_search": own * 1e6 / reps, "cumulative_us_per_search": cumulative * 1e6 / reps}
            for (path, line, name), (calls, _, own, cumulative, _) in pstats.Stats(profiler).stats.items()]
    rows.sort(key=lambda r: -r["own_us_per_search"])
    return rows


def median_us(samples) -> float:
    """The median of samples given in seconds, in microseconds."""
    return statistics.median(samples) * 1e6


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary_us(samples) -> dict:
    """median, p10, p90, min and max of samples given in seconds, in microseconds, with their count."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("summary_us needs at least one sample; got none")
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p10_us": _quantile(ordered, 0.10) * 1e6,
        "p90_us": _quantile(ordered, 0.90) * 1e6,
        "min_us": ordered[0] * 1e6,
        "max_us": ordered[-1] * 1e6,
        "n": len(ordered),
    }


def pyplot():
    """matplotlib.pyplot on the Agg backend, so scripts run on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def device_label(env: dict) -> str:
    """The device part of a result file name: the GPU's name, else 'cpu-' + the CPU model."""
    gpu = env.get("cuda_device") or {}
    if gpu.get("available"):
        return _slug(gpu.get("name", "gpu"))
    smi = env.get("nvidia_smi_before") or {}
    if smi.get("name"):
        return _slug(smi["name"])
    return "cpu-" + _slug(env.get("cpu", "unknown"))[:40]


def write_results(name: str, payload: dict, figure=None, env: dict | None = None,
                  out_dir: Path | None = None, label: str | None = None) -> dict:
    """Write <name>_<date>_<device>.json (and .png from a matplotlib figure); returns their paths. `label`: the
    device part of the name when it is not device_label(env) (a CPU run on a machine that has a GPU)."""
    env = dict(env) if env is not None else environment()
    env["nvidia_smi_after"] = gpu_clocks()
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{env['date']}_{label or device_label(env)}"
    paths = {"json": out_dir / f"{stem}.json"}
    text = json.dumps({"benchmark": name, "environment": env, "results": payload}, indent=2, default=str)
    paths["json"].write_text(text + "\n")
    if figure is not None:
        paths["png"] = out_dir / f"{stem}.png"
        figure.savefig(paths["png"], dpi=120, bbox_inches="tight")
    return paths
