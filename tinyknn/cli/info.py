"""`tinyknn info`: what this installation has (versions, NVRTC, GPU, cubin cache, CPU library).

Every probe reports its failure as text instead of raising: `info` is what a user runs when
something does not work, so it must itself always work.
"""

from __future__ import annotations

import json
import platform
import sys


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _nvrtc() -> str:
    try:
        from ..jit.compiler import nvrtc_version

        return ".".join(map(str, nvrtc_version()))
    except Exception as exc:  # noqa: BLE001 - a probe: any failure is the answer
        return f"unavailable: {exc}"


def _gpu() -> dict:
    try:
        from ..gpu.device import current_device, driver_version, has_gpu, why_no_gpu

        if not has_gpu():
            return {"available": False, "reason": why_no_gpu()}
        device = current_device()
        return {"available": True, "name": device.name, "arch": device.arch, "sm_count": device.sm_count,
                "memory_bytes": device.total_memory_bytes, "driver": driver_version()}
    except Exception as exc:  # noqa: BLE001
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def _cpu_library() -> str:
    """Search two vectors through tinyknn.Index on the CPU (builds or loads the library if it can), and
    say what the library was built with."""
    try:
        import numpy as np

        from ..cpu.library import get_library
        from ..index import Index

        with Index(dim=4, device="cpu") as index:
            index.add(np.eye(2, 4, dtype=np.float32))
            _, ids = index.search(np.eye(1, 4, dtype=np.float32), k=1)
        if int(ids[0, 0]) != 0:
            return f"wrong answer (nearest id {int(ids[0, 0])}, expected 0)"
        return f"ready ({get_library().tk_build_info().decode()})"
    except Exception as exc:  # noqa: BLE001
        return f"unavailable: {type(exc).__name__}: {exc}"


def gather() -> dict:
    from .._version import __version__
    from ..jit.cache import default_cache

    return {
        "tinyknn": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {name: _package_version(name) for name in ("numpy", "cuda-core", "cuda-bindings")},
        "nvrtc": _nvrtc(),
        "gpu": _gpu(),
        "cache": default_cache().info(),
        "cpu_library": _cpu_library(),
    }


def cmd_report(args) -> int:
    report = gather()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    gpu = report["gpu"]
    gpu_text = (f"{gpu['name']} ({gpu['arch']}, {gpu['sm_count']} SMs, driver {gpu['driver']})"
                if gpu["available"] else f"none ({gpu['reason']})")
    lines = [
        ("tinyknn", report["tinyknn"]),
        ("python", report["python"]),
        ("platform", report["platform"]),
        *report["packages"].items(),
        ("NVRTC", report["nvrtc"]),
        ("GPU", gpu_text),
        ("cubin cache", f"{report['cache']['location']} ({report['cache']['entries']} entries, "
                        f"{report['cache']['bytes']:,} bytes)"),
        ("CPU library", report["cpu_library"]),
    ]
    for name, value in lines:
        print(f"{name + ':':15s}{value}")
    return 0
