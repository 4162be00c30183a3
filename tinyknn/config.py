"""The only place TINYKNN_* environment variables are read.

`get_config()` builds the process-wide settings lazily from the environment; tests call
`reset_config()` after changing the environment (or pass explicit values) instead of patching modules.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Config:
    cache_dir: Path          # TINYKNN_CACHE_DIR, else the platform's user cache dir + "tinyknn"
    require_gpu: bool        # TINYKNN_REQUIRE_GPU=1: a missing GPU fails the gpu tests instead of skipping
    cxx: str | None          # TINYKNN_CXX (else $CXX, else g++/c++/clang++): compiler for the CPU library
    cpu_threads: int         # TINYKNN_CPU_THREADS, else the number of usable cores
    arch: str | None         # TINYKNN_ARCH: force a target arch (e.g. "sm_90") instead of the device's
    device_memory_limit: int | None = None   # TINYKNN_DEVICE_MEMORY_LIMIT: bytes a GPU index may allocate
    screen: str = "auto"     # TINYKNN_SCREEN: the batch screen's kernel, "auto" (wgmma on sm_90, else mma), "mma",
                             # "wgmma" (an error on a device without it)


def _default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("tinyknn", appauthor=False))


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_SIZE_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _size(name: str) -> int | None:
    """A byte count such as 1048576, 512M or 2G (binary units), or None when unset."""
    text = os.environ.get(name, "").strip().lower().removesuffix("b").removesuffix("i")
    if not text:
        return None
    number, suffix = (text[:-1], text[-1]) if text[-1] in _SIZE_SUFFIXES else (text, "")
    try:
        value = int(float(number) * _SIZE_SUFFIXES[suffix])
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"{name} must be a positive byte count such as 1073741824, 512M or 2G; "
                         f"got {os.environ[name]!r}")
    return value


SCREEN_KERNELS = ("auto", "mma", "wgmma")


def _choice(name: str, allowed: tuple[str, ...]) -> str:
    """One of `allowed` (the first when unset)."""
    text = os.environ.get(name, "").strip().lower() or allowed[0]
    if text not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {os.environ[name]!r}")
    return text


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def get_config() -> Config:
    """The settings of this process, read from the environment once."""
    env = os.environ
    cache_dir = Path(env["TINYKNN_CACHE_DIR"]) if env.get("TINYKNN_CACHE_DIR") else _default_cache_dir()
    threads_text = env.get("TINYKNN_CPU_THREADS", "").strip()
    if threads_text:
        try:
            threads = int(threads_text)
        except ValueError:
            raise ValueError(f"TINYKNN_CPU_THREADS must be a positive integer; got {threads_text!r}") from None
        if threads < 1:
            raise ValueError(f"TINYKNN_CPU_THREADS must be a positive integer; got {threads_text!r}")
    else:
        threads = _usable_cores()
    return Config(
        cache_dir=cache_dir,
        require_gpu=_flag("TINYKNN_REQUIRE_GPU"),
        cxx=env.get("TINYKNN_CXX") or env.get("CXX") or None,
        cpu_threads=threads,
        arch=env.get("TINYKNN_ARCH") or None,
        device_memory_limit=_size("TINYKNN_DEVICE_MEMORY_LIMIT"),
        screen=_choice("TINYKNN_SCREEN", SCREEN_KERNELS),
    )


def set_cpu_threads(n: int) -> None:
    """Make the CPU library use n threads from the next call on, in every index of this process (what
    FAISS's omp_set_num_threads does); the setting is TINYKNN_CPU_THREADS, so child processes inherit it."""
    if isinstance(n, bool) or not isinstance(n, int) and not hasattr(n, "__index__"):
        raise TypeError(f"the number of CPU threads must be an integer; got {type(n).__name__} {n!r}")
    if int(n) < 1:
        raise ValueError(f"the number of CPU threads must be at least 1; got {int(n)}")
    os.environ["TINYKNN_CPU_THREADS"] = str(int(n))
    reset_config()


def reset_config() -> None:
    """Forget the cached settings so the next get_config() reads the environment again."""
    get_config.cache_clear()
