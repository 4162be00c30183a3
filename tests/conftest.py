"""Capability probes (each run once), the seeded random generator every test draws from, and shared fixtures."""

from __future__ import annotations

import functools
import os
import zlib

import numpy as np
import pytest

from tinyknn.config import get_config, reset_config


def _import_every_module() -> None:
    """Import every tinyknn module before any test runs. A module binds what it reads while it is imported (a
    default argument, a constant derived from another): first imported inside a test that monkeypatches such a
    value, it would keep the patched one for the rest of the process, so the order of the tests would decide
    what later tests run (once a screen's survivor room). Optional dependencies that are absent leave their
    adapters unimported here; their tests skip."""
    import importlib
    import pkgutil

    import tinyknn

    for info in pkgutil.walk_packages(tinyknn.__path__, "tinyknn.", onerror=lambda name: None):
        if info.name.rsplit(".", 1)[-1] == "__main__":      # `python -m` entry points run their command
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:
            pass


_import_every_module()


@functools.lru_cache(maxsize=1)
def gpu_probe() -> str | None:
    """None when a CUDA device is usable, else why not."""
    try:
        from tinyknn.gpu.device import has_gpu, why_no_gpu
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
        return f"tinyknn.gpu cannot be imported: {exc}"
    return None if has_gpu() else why_no_gpu()


@functools.lru_cache(maxsize=1)
def nvrtc_probe() -> str | None:
    """None when NVRTC can be loaded, else why not."""
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return f"nvrtcVersion failed: {err}"
        return None
    except Exception as exc:  # noqa: BLE001
        return f"NVRTC is not available: {exc}"


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        reason = gpu_probe()
        if reason is not None:
            if get_config().require_gpu:
                pytest.fail(f"TINYKNN_REQUIRE_GPU=1 but there is no usable GPU: {reason}", pytrace=False)
            pytest.skip(f"no GPU: {reason}")
    if item.get_closest_marker("nvrtc") is not None:
        reason = nvrtc_probe()
        if reason is not None:
            pytest.skip(f"no NVRTC: {reason}")


@pytest.fixture
def rng(request):
    """A generator seeded freshly per run and per test; the seed is printed when the test fails."""
    base = int(os.environ.get("TINYKNN_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))
    seed = (base + zlib.crc32(request.node.nodeid.encode())) % (2**32)
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: TINYKNN_TEST_SEED={base} (test seed {seed})")
    return np.random.default_rng(seed)


def _use_screen(choice: str, monkeypatch) -> None:
    """TINYKNN_SCREEN=choice for the test's indexes; a skip where wgmma is asked of a device before compute
    capability 9.0 (the caller undoes monkeypatch and resets the config after the test)."""
    from tinyknn.gpu.device import current_device
    from tinyknn.jit import render_screen

    if choice == "wgmma" and render_screen.hopper_arch(current_device().arch) is None:
        pytest.skip(f"the Hopper screen needs compute capability 9.0; this device is {current_device().arch}")
    monkeypatch.setenv("TINYKNN_SCREEN", choice)
    reset_config()


@pytest.fixture(params=("mma", "wgmma"))
def screen(request, monkeypatch):
    """The screen kernel the test's indexes use, mma.sync's then the Hopper one (wgmma: compute capability 9.0)."""
    _use_screen(request.param, monkeypatch)
    yield request.param
    monkeypatch.undo()
    reset_config()


@pytest.fixture
def wgmma(monkeypatch):
    """Every batch of the test's indexes on the Hopper screen (TINYKNN_SCREEN=wgmma; compute capability 9.0)."""
    _use_screen("wgmma", monkeypatch)
    yield
    monkeypatch.undo()
    reset_config()


@pytest.fixture
def spill_free_nvrtc():
    """Skips a check of the kernels' local memory where the NVRTC loaded is older than the release they are
    checked spill-free with (pyproject's floor; an older one still compiles them, with a few bytes spilled)."""
    from tinyknn.jit.compiler import SPILL_FREE_NVRTC, nvrtc_version

    found = nvrtc_version()
    if found < SPILL_FREE_NVRTC:
        pytest.skip(f"NVRTC {found[0]}.{found[1]} predates {SPILL_FREE_NVRTC[0]}.{SPILL_FREE_NVRTC[1]}, the release the "
                    "kernels are checked spill-free with")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty cubin/library cache for one test."""
    monkeypatch.setenv("TINYKNN_CACHE_DIR", str(tmp_path / "cache"))
    reset_config()
    yield tmp_path / "cache"
    reset_config()
