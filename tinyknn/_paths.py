"""Where the shipped non-Python files live: in a wheel, inside the package; in a checkout, at the top.

The kernel sources (`kernels/`) and the warm-up manifests (`cache/`) sit at the top of the repository
so that the CPU and GPU code share one copy; the wheel maps them to `tinyknn.kernels` and
`tinyknn.manifests` (see pyproject.toml). Both lookups try the installed location first.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKOUT_DIR = _PACKAGE_DIR.parent


def _find(installed: Path, checkout: Path, marker: str) -> Path:
    for candidate in (installed, checkout):
        if (candidate / marker).is_file():
            return candidate
    raise FileNotFoundError(
        f"tinyknn cannot find its {marker!r}: looked in {installed} and {checkout}; "
        "the installation is incomplete, reinstall tinyknn"
    )


def kernels_dir() -> Path:
    """The folder that holds common.cuh, metrics.cuh, ... and cpu/."""
    return _find(_PACKAGE_DIR / "kernels", _CHECKOUT_DIR / "kernels", "metrics.cuh")


def manifests_dir() -> Path:
    """The folder that holds the warm-up manifests (default.toml)."""
    return _find(_PACKAGE_DIR / "manifests", _CHECKOUT_DIR / "cache", "default.toml")
