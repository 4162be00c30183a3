"""Build hook: a wheel carries the CPU library prebuilt for x86-64-v2, v3 (AVX2) and v4 (AVX-512).

`python -m build` (or `pip wheel .`) compiles kernels/cpu/*.cpp three times, with -march=x86-64-v2/-v3/-v4
in place of -march=native and every other flag as the first-use build has it, into
tinyknn/_prebuilt/libtinyknn-x86-64-v{2,3,4}.so; at run time tinyknn.cpu loads the best one the CPU
supports, so the CPU path needs no compiler. The compiling is tinyknn.cpu.prebuilt.build_prebuilt's (one
definition of the flags, and the sidecar each library is verified against), one process per level so the
three run in parallel (the compiler: TINYKNN_CXX, CXX, else g++/c++/clang++). The wheel is tagged for the
platform (the libraries do not depend on the Python ABI: py3-none-linux_x86_64). Editable installs (`pip
install -e`) and other platforms skip this: there the library is built on first use. Metadata: pyproject.toml.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
LEVELS = ("x86-64-v2", "x86-64-v3", "x86-64-v4")
PREBUILT = "_prebuilt"


def _prebuilding() -> bool:
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


# Runs tinyknn.cpu.prebuilt.build_prebuilt(level, folder) from this checkout without tinyknn/__init__.py (which
# imports numpy, absent from an isolated build environment): tinyknn.cpu's build modules need only the stdlib.
_BUILD_ONE = textwrap.dedent("""
    import sys, types
    from pathlib import Path
    root, level, folder = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    package = types.ModuleType("tinyknn")
    package.__path__ = [str(root / "tinyknn")]
    sys.modules["tinyknn"] = package
    from tinyknn.cpu.prebuilt import build_prebuilt
    build_prebuilt(level, folder)
""")


def build_level(level: str, folder: Path) -> None:
    """One prebuilt library (and its sidecar) by tinyknn.cpu.prebuilt, in a process of its own."""
    number = level.rsplit("v", 1)[1]
    # tinyknn's settings would look up the user cache folder with platformdirs, which an isolated build
    # environment lacks; the prebuilding never uses the cache, so it gets a throwaway folder.
    with tempfile.TemporaryDirectory(prefix="tinyknn-prebuild-") as scratch:
        env = dict(os.environ, TINYKNN_CACHE_DIR=scratch)
        result = subprocess.run([sys.executable, "-c", _BUILD_ONE, str(ROOT), number, str(folder)],
                                capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"building the {level} CPU library failed (exit {result.returncode}):\n"
                           f"{result.stderr}{result.stdout}")


class BuildPyWithLibraries(build_py):
    """build_py, then the three prebuilt CPU libraries into the build's tinyknn/_prebuilt/."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or not _prebuilding():
            return
        folder = Path(self.build_lib) / "tinyknn" / PREBUILT
        folder.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=len(LEVELS)) as pool:
            for future in [pool.submit(build_level, level, folder) for level in LEVELS]:
                future.result()


class BinaryDistribution(Distribution):
    """Native libraries inside: install to platlib, and the wheel is platform-specific."""

    def has_ext_modules(self):
        return _prebuilding()


class PlatformWheel(bdist_wheel):
    """... but not tied to one Python: the libraries are called through ctypes, not the C API."""

    def get_tag(self):
        python, abi, plat = super().get_tag()
        return ("py3", "none", plat) if _prebuilding() else (python, abi, plat)


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithLibraries, "bdist_wheel": PlatformWheel})
