"""Prebuilt CPU libraries a wheel ships, so that `pip install` runs the CPU path without a compiler.

`tinyknn/_prebuilt/libtinyknn-x86-64-v{2,3,4}.so`, each with the sidecar `<library>.json` build.py writes
(sha256, sources digest, ABI), built by `build_prebuilt(level, folder)` (`-march=x86-64-v<level>` instead of
`-march=native`). The running CPU's features pick the best level it supports (psABI levels: v4 AVX-512,
v3 AVX2/FMA/F16C, v2 SSE4.2/POPCNT); a prebuilt library is used only when its bytes match its sidecar and it
was built from the sources this installation holds, else the first-use build takes over.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from . import build, cache

# What each x86-64 psABI level needs, as /proc/cpuinfo names the features (lzcnt is "abm" there).
LEVEL_FEATURES = {
    2: {"sse4_1", "sse4_2", "ssse3", "popcnt"},
    3: {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"},
    4: {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


def prebuilt_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "_prebuilt"


def cpu_features() -> set[str]:
    """The running CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_levels(features: set[str]) -> list[int]:
    """The x86-64 levels these features allow, best first (each level needs every lower one's features)."""
    levels, needed = [], set()
    for level in (2, 3, 4):
        needed |= LEVEL_FEATURES[level]
        if needed <= features:
            levels.append(level)
    return levels[::-1]


def library_name(level: int) -> str:
    return f"libtinyknn-x86-64-v{level}{build.SUFFIX}"


def candidates(features: set[str] | None = None, folder: Path | None = None) -> list[Path]:
    """The shipped libraries this CPU can run, best first, that are present and match these sources."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    folder = folder or prebuilt_dir()
    if not folder.is_dir():
        return []
    digest = build.sources_digest(build.source_files())
    found = []
    for level in supported_levels(cpu_features() if features is None else features):
        path = folder / library_name(level)
        recorded = cache.read_sidecar(path) or {}
        if path.is_file() and recorded.get("sources") == digest and recorded.get("abi") == build.ABI_VERSION:
            if cache.verified(path):
                found.append(path)
            else:
                cache.log.warning("prebuilt CPU library %s does not match its checksum; not used", path)
    return found


def build_prebuilt(level: int, folder: Path, cxx: str | None = None) -> Path:
    """Build the library for x86-64 psABI level `level` into folder (with its sidecar): for wheel builds."""
    if level not in LEVEL_FEATURES:
        raise ValueError(f"level must be one of {sorted(LEVEL_FEATURES)}; got {level!r}")
    cxx = cxx or build.find_compiler()
    sources = build.source_files()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / library_name(level)
    flags = tuple(f"-march=x86-64-v{level}" if flag == build._NATIVE else flag for flag in build.FLAGS)
    saved, build.FLAGS = build.FLAGS, flags
    try:
        start = time.perf_counter()
        build.compile_library(cxx, sources, target)
        facts = {**build.build_facts(sources), "level": level, "compiler": build.compiler_identity(cxx),
                 "sha256": cache.file_sha256(target)}
        cache.log.info("built prebuilt CPU library %s in %.1f s", target, time.perf_counter() - start)
    finally:
        build.FLAGS = saved
    cache._write_json(cache.sidecar(target), facts)
    return target
