"""The wheel: `python -m build` makes one with the CPU library prebuilt for x86-64-v2/v3/v4, and installed
into a fresh venv (no system site-packages, no CUDA stack, no compiler on PATH) it runs a CPU search.

One test, about 2-3 minutes on 2 cores (three -O3 compiles dominate), so it is marked slow; CI runs it.
The wheel is built from a copy of the package's files, so the checkout gets no build/ or egg-info.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "README.md", "tinyknn", "kernels", "cache")
LEVELS = ("x86-64-v2", "x86-64-v3", "x86-64-v4")

PREBUILT = r"""
import ctypes, json, pathlib
import tinyknn
from tinyknn.cpu.library import ABI_VERSION

NEEDS = {"x86-64-v2": {"sse4_2", "popcnt", "ssse3"}, "x86-64-v3": {"avx2", "fma", "bmi2", "f16c", "movbe"},
         "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":")[1].split())
folder = pathlib.Path(tinyknn.__file__).parent / "_prebuilt"
loaded = {}
for level, needs in NEEDS.items():
    if needs <= flags:
        loaded[level] = ctypes.CDLL(str(folder / f"libtinyknn-{level}.so")).tk_abi_version() == ABI_VERSION
print(json.dumps(loaded))
"""

SEARCH = r"""
import importlib.util, json, sys
import numpy as np
import tinyknn
from tinyknn.cpu import library

rng = np.random.default_rng(7)
db = rng.standard_normal((500, 24)).astype(np.float32)
q = rng.standard_normal((6, 24)).astype(np.float32)
with tinyknn.Index(dim=24, metric="l2", device="cpu") as index:
    index.add(db)
    D, I = index.search(q, k=5)
exact = ((q[:, None, :].astype(np.float64) - db[None].astype(np.float64)) ** 2).sum(-1)
want = np.argsort(exact, axis=1, kind="stable")[:, :5]
print(json.dumps({
    "ids_exact": bool((I == want).all()),
    "tinyknn_file": tinyknn.__file__,
    "cuda_installed": importlib.util.find_spec("cuda") is not None,
    "faiss_module": importlib.util.find_spec("tinyknn.faiss") is not None,
}))
"""


def run(command, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, command))} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="the wheel carries prebuilt libraries for x86-64 Linux only")
def test_wheel_runs_a_cpu_search_without_compiler_or_cuda(tmp_path):
    pytest.importorskip("build", reason="`build` (the test extra) is not installed")
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__", "*.pyc", "_prebuilt")}
                                           if (ROOT / name).is_dir() else {}))
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(source)])
    (wheel,) = (tmp_path / "dist").glob("tinyknn-*.whl")
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {f"tinyknn/_prebuilt/libtinyknn-{level}.so{end}" for level in LEVELS for end in ("", ".json")} <= names
    assert {"tinyknn/py.typed", "tinyknn/faiss/__init__.py", "tinyknn/sklearn.py", "tinyknn/kernels/cpu/api.cpp"} <= names
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: cuda-core")]
    assert requires and all("extra ==" in line for line in requires)   # the CUDA stack only as an extra

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])   # no --system-site-packages: nothing of this checkout
    python = venv / "bin" / "python"
    clean = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}   # else pip may see a checkout
    run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)], env=clean)
    bare = tmp_path / "bin"   # PATH holds the venv and nothing else: no g++, c++ or clang++
    bare.mkdir()
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}{bare}", "HOME": str(tmp_path), "TINYKNN_CACHE_DIR": str(tmp_path / "cache")}
    assert shutil.which("g++", path=env["PATH"]) is None and shutil.which("c++", path=env["PATH"]) is None
    loaded = json.loads(run([str(python), "-c", PREBUILT], env=env, cwd=tmp_path).stdout)
    assert loaded.get("x86-64-v2") and all(loaded.values()), loaded   # every level this CPU runs loads, our ABI
    result = subprocess.run([str(python), "-c", SEARCH], capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ids_exact"] and report["faiss_module"] and not report["cuda_installed"]
    assert report["tinyknn_file"].startswith(str(venv))   # the installed wheel, not this checkout
    built = list((tmp_path / "cache").rglob("*.so"))
    assert built == [], f"a library was compiled instead of the prebuilt one loaded: {built}"


BLOCK_CUDA = r"""
import importlib, importlib.util, pkgutil, sys

class NoCuda:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"{name} is blocked: a CPU-only install has no CUDA stack")

sys.meta_path.insert(0, NoCuda())
import numpy as np   # (before the blocker's first use: numpy itself never asks for cuda)
import tinyknn

modules = sorted(m.name for m in pkgutil.walk_packages(tinyknn.__path__, "tinyknn.")
                 if not m.name.startswith("tinyknn.gpu") and not m.name.endswith(".__main__")
                 and (m.name != "tinyknn.sklearn" or importlib.util.find_spec("sklearn")))
for name in modules:
    importlib.import_module(name)
index = tinyknn.Index(dim=4, metric="ip")
index.add(np.eye(3, 4, dtype=np.float32))
assert index.search(np.eye(1, 4, dtype=np.float32), k=1)[1][0, 0] == 0
import tinyknn.faiss as faiss
flat = faiss.IndexFlatL2(4)
flat.add(np.eye(3, 4, dtype=np.float32))
assert flat.search(np.eye(1, 4, dtype=np.float32), 1)[1][0, 0] == 0
import contextlib, io
from tinyknn import cli
errors = io.StringIO()
with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()) as report:
    warm = cli.main(["cache", "warm", "--dim", "8", "--k", "1", "--arch", "sm_90"])
    info = cli.main(["info", "--json"])
assert warm == 2 and 'pip install "tinyknn[cuda]"' in errors.getvalue(), errors.getvalue()
assert info == 0 and '"available": false' in report.getvalue()
assert not any(m == "cuda" or m.startswith("cuda.") for m in sys.modules)
print(len(modules))
"""


def test_the_cpu_path_imports_nothing_of_cuda(tmp_path):
    """Every module but tinyknn.gpu.* imports, CPU searches run, `tinyknn info` works and `cache warm` says
    to install the extra, with any import of `cuda` refused (a CPU-only install)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINYKNN_CACHE_DIR": os.environ.get("TINYKNN_CACHE_DIR", str(tmp_path))}
    result = run([sys.executable, "-c", BLOCK_CUDA], env=env, cwd=tmp_path)
    assert int(result.stdout.strip()) > 20
