"""Builds the C++ CPU library for this machine on first use and keeps it in a verified cache.

Why compile on the user's machine: `-march=native` uses every instruction the running CPU has (AVX2/FMA,
AVX-512, F16C) and none it lacks. A wheel may also ship prebuilt libraries (prebuilt.py), tried first.

The cache (cache.py: `get_config().cache_dir / "cpu"`): one `libtinyknn-<key>.so` per key, the key hashing the ABI
version, the sources, the compiler's identity, the flags and the CPU's identity, so a cache shared by several
machines never serves one CPU another's build. Beside each library a sidecar `<library>.json` records its
sha256 and what it was built from; it is written after a build succeeds, and a library is loaded only when its
bytes match it (a truncated file mapped by the loader would otherwise kill the process with SIGBUS, and a
foreign file in its place would load as something else). Anything that does not match is removed and rebuilt,
with a warning. The compiler's identity (its `--version` banner) is remembered by path, size and mtime, so a
process with a cached library runs no compiler at all, and one with no compiler on PATH still loads a cached
build made from the same sources for the same CPU. Builds go to a temporary file that is `os.replace`d into
place under a file lock: concurrent processes build once and never load half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .._paths import kernels_dir
from ..config import get_config
from ..errors import CpuLibraryError
from .cache import (_fallback_path, _write_json, file_sha256, library_dir, log, primary_dir, read_sidecar, remove,
                    sidecar, verified)

ABI_VERSION = 9          # must equal TK_ABI_VERSION in kernels/cpu/tinyknn_cpu.h (9: the one-call GPU search removed)
COMPILERS = ("g++", "c++", "clang++")
# -march=native: exactly the running CPU's instructions (arm64 compilers spell it -mcpu=native)
_NATIVE = "-mcpu=native" if platform.machine().lower() in ("arm64", "aarch64") else "-march=native"
# -Wl,-z,defs: a library with undefined symbols (a C driver such as gcc does not link libstdc++) fails to
# link, with the linker's message, instead of building a file that cannot be loaded
_LINK = ("-Wl,-z,defs",) if sys.platform.startswith("linux") else ()
FLAGS = ("-O3", _NATIVE, "-std=c++17", "-fPIC", "-shared", "-pthread", "-ffp-contract=fast",
         "-fvisibility=hidden", "-fno-math-errno", *_LINK)
SUFFIX = ".dylib" if sys.platform == "darwin" else ".so"



def source_files() -> list[Path]:
    """Everything the library is compiled from: kernels/cpu/* plus the shared headers."""
    root = kernels_dir()
    files = sorted((root / "cpu").glob("*.cpp")) + sorted((root / "cpu").glob("*.h"))
    return files + sorted(root.glob("*.cuh"))


def sources_digest(sources: list[Path]) -> str:
    """A hash of the sources' names and bytes: compiled into every build (tk_sources_digest), so that a
    prebuilt library made from other sources is never used."""
    digest = hashlib.sha256(f"abi {ABI_VERSION}\0".encode())
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


def find_compiler(required: bool = True) -> str | None:
    """The C++ compiler to use: config.cxx (TINYKNN_CXX or CXX) if set, else the first of COMPILERS found on
    PATH. None when there is none and `required` is False."""
    wanted = get_config().cxx
    candidates = [wanted] if wanted else list(COMPILERS)
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    if not required:
        return None
    tried = f"TINYKNN_CXX/CXX={wanted!r}" if wanted else ", ".join(COMPILERS)
    raise CpuLibraryError(
        f"tinyknn's CPU search needs a C++17 compiler to build its library on first use; tried {tried} "
        "and found none on PATH. Install one (Debian/Ubuntu: `apt install g++`; Fedora: `dnf install "
        "gcc-c++`; macOS: `xcode-select --install`) or point TINYKNN_CXX at one."
    )


def compiler_identity(cxx: str) -> str:
    """The compiler's own description of itself (its version banner), part of the cache key; remembered in
    the cache by the compiler's path, size and mtime, so it runs once per compiler, not once per process."""
    stat = os.stat(cxx)
    stamp = f"{os.path.realpath(cxx)}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = _identities()
    if stamp in memo:
        return memo[stamp]
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CpuLibraryError(f"cannot run the C++ compiler {cxx} --version: {exc}") from None
    identity = f"{cxx}\n{result.stdout.strip()}"
    memo[stamp] = identity
    _write_json(library_dir() / "compilers.json", memo)
    return identity


def _identities() -> dict:
    """The remembered identities: the cache's, else the fallback folder's (reading never needs to write)."""
    for folder in (primary_dir(), _fallback_path()):
        try:
            found = json.loads((folder / "compilers.json").read_text())
            if isinstance(found, dict):
                return found
        except (OSError, ValueError):
            pass
    return {}


def cpu_identity() -> str:
    """Model and feature flags of the running CPU: what -march=native compiles for."""
    parts = [platform.machine(), platform.processor()]
    try:
        wanted = ("vendor_id", "model name", "flags", "features", "cpu family", "model\t", "cpu part")
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(wanted):
                parts.append(line)
            elif not line.strip() and len(parts) > 2:
                break  # the first processor describes them all
    except OSError:
        pass
    if sys.platform == "darwin":
        for key in ("machdep.cpu.brand_string", "machdep.cpu.features", "hw.optional.arm64"):
            try:
                parts.append(subprocess.run(["sysctl", "-n", key], capture_output=True, text=True).stdout)
            except OSError:
                pass
    return "\n".join(parts)


def build_facts(sources: list[Path]) -> dict:
    """What a native build is made from, except the compiler: what a cached build must match to be used."""
    return {"abi": ABI_VERSION, "sources": sources_digest(sources), "flags": " ".join(FLAGS),
            "cpu": hashlib.sha256(cpu_identity().encode()).hexdigest()[:32]}


def library_key(cxx: str, sources: list[Path]) -> str:
    digest = hashlib.sha256(json.dumps(build_facts(sources), sort_keys=True).encode())
    digest.update(compiler_identity(cxx).encode())
    return digest.hexdigest()[:24]


def compile_library(cxx: str, sources: list[Path], target: Path) -> None:
    """Compile to a temporary file next to `target`, then os.replace it into place. Each .cpp is its own
    compiler process, all at once (the translation units are independent), then one link."""
    temporary = target.with_name(f"{target.name}.tmp{os.getpid()}")
    digest = f'-DTINYKNN_SOURCES_DIGEST="{sources_digest(sources)}"'
    units = [p for p in sources if p.suffix == ".cpp"]
    objects = [target.with_name(f"{target.name}.{p.stem}.tmp{os.getpid()}.o") for p in units]
    compiles = [[cxx, *FLAGS, digest, "-c", str(p), "-o", str(o)] for p, o in zip(units, objects)]
    command = [cxx, *FLAGS, *(str(o) for o in objects), "-o", str(temporary)]
    try:
        result = _run_all(compiles) or subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        temporary.unlink(missing_ok=True)
        raise CpuLibraryError(f"could not run the C++ compiler: {' '.join(command)}: {exc}") from None
    finally:
        for o in objects:
            o.unlink(missing_ok=True)
    if result.returncode != 0:
        command = result.args
        temporary.unlink(missing_ok=True)
        output = (result.stderr + result.stdout).strip()
        hint = ""
        if "undefined reference" in output and not Path(cxx).name.endswith("++"):
            hint = (f"\n{Path(cxx).name} looks like a C compiler driver, which does not link the C++ runtime: "
                    "set TINYKNN_CXX to a C++ compiler (g++, clang++)")
        raise CpuLibraryError(
            f"the C++ compiler failed to build tinyknn's CPU library (exit {result.returncode})\n"
            f"command: {' '.join(command)}\n--- compiler output ---\n{output}{hint}"
        )
    if not temporary.is_file():
        raise CpuLibraryError(
            f"the C++ compiler {cxx} exited 0 but produced no library (expected {temporary}); is it a C++ "
            "compiler? Set TINYKNN_CXX (or CXX) to one, e.g. g++ or clang++"
        )
    os.replace(temporary, target)


def _run_all(commands: list[list[str]]) -> subprocess.CompletedProcess | None:
    """Run the compiles concurrently; the first failed one's CompletedProcess, else None."""
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    failed = None
    for command, process in zip(commands, running):
        try:
            out, err = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        if process.returncode != 0 and failed is None:
            failed = subprocess.CompletedProcess(command, process.returncode, out, err)
    return failed


def build_library() -> Path:
    """The path of a verified library built for this machine: from the cache, else compiled now (once)."""
    return build_library_reporting()[0]


def build_library_reporting() -> tuple[Path, bool]:
    """(build_library()'s path, whether this call compiled it)."""
    from filelock import FileLock

    sources = source_files()
    cxx = find_compiler(required=False)
    if cxx is None:
        cached = cached_without_compiler(sources)
        if cached is not None:
            return cached, False
        find_compiler(required=True)  # raises, saying what was tried and what to install
    name = f"libtinyknn-{library_key(cxx, sources)}{SUFFIX}"
    primary = primary_dir() / name
    if verified(primary):  # found in the cache, writable or not
        log.debug("CPU library from the cache: %s", primary)
        return primary, False
    target = library_dir() / name
    if target != primary and verified(target):
        log.debug("CPU library from the fallback folder: %s", target)
        return target, False
    with FileLock(str(target) + ".lock", timeout=900):
        if verified(target):  # another process built it while we waited
            return target, False
        if target.exists() or target.is_symlink():
            remove(target, "does not match the checksum recorded when it was built")
        print(f"tinyknn: building the CPU library for this machine with {cxx} (first use only, about 10-30 s)",
              file=sys.stderr, flush=True)
        log.info("building the CPU library %s with %s", target, cxx)
        start = time.perf_counter()
        compile_library(cxx, sources, target)
        elapsed = time.perf_counter() - start
        _write_json(sidecar(target), {**build_facts(sources), "compiler": compiler_identity(cxx),
                                      "sha256": file_sha256(target)})
        print(f"tinyknn: built the CPU library in {elapsed:.1f} s: {target}", file=sys.stderr, flush=True)
        log.info("built the CPU library in %.1f s: %s", elapsed, target)
    return target, True


def cached_without_compiler(sources: list[Path]) -> Path | None:
    """With no compiler on PATH: a verified cached build of these sources, flags and CPU by any compiler."""
    facts = build_facts(sources)
    for folder in (primary_dir(), _fallback_path()):
        for candidate in sorted(folder.glob(f"libtinyknn-*{SUFFIX}"), key=_mtime, reverse=True):
            recorded = read_sidecar(candidate) or {}
            if all(recorded.get(name) == value for name, value in facts.items()) and verified(candidate):
                log.info("no C++ compiler found; using the cached CPU library %s", candidate)
                return candidate
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
