"""What every searcher bench/search.py times shares: the Peer and Built records, the skip exception, blocks."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

GPU_BLOCK = 1 << 28   # elements of one query block's distance matrix on the GPU (1 GiB of float32)
CPU_BLOCK = 1 << 24   # ... on the CPU (64 MiB)


class Unsupported(Exception):
    """This peer cannot run this configuration; the message says why."""


@dataclass
class Built:
    search: Callable                   # (host queries (nq, dim)[, k]) -> NumPy (distances, ids); k: config.k
    close: Callable[[], None]
    resident: Callable | None = None   # device queries -> device (distances, ids)
    to_device: Callable | None = None  # host queries -> what `resident` takes
    clock: Callable | None = None      # clock(call) -> seconds, by CUDA events on the current stream
    note: str = ""                     # how this build computes (e.g. which half-precision matmul), for the rows


@dataclass(frozen=True)
class Peer:
    device: str                        # "cpu" or "cuda"
    module: str                        # the import that must work
    method: str                        # what it computes, for the results file
    build: Callable                    # (db float32, config) -> Built
    gpu_probe: Callable | None = None  # () -> None when its GPU is usable, else why not

    def probe(self) -> str | None:
        """None when the peer can run here, else why not (printed, never raised)."""
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # noqa: BLE001 - a missing or broken package is a note
            return f"cannot import {self.module} ({type(exc).__name__}: {exc})"
        try:
            return self.gpu_probe() if self.gpu_probe else None
        except Exception as exc:  # noqa: BLE001
            return f"no usable GPU ({type(exc).__name__}: {exc})"

    def describe(self) -> dict:
        return {"device": self.device, "module": self.module, "method": self.method, "version": _version(self.module)}


def _version(module: str) -> str | None:
    try:
        return str(getattr(importlib.import_module(module), "__version__", None))
    except Exception:  # noqa: BLE001
        return None


def to_numpy(x) -> np.ndarray:
    """A NumPy copy of a NumPy, CuPy or torch array."""
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def block_rows(n_data: int, elements: int) -> int:
    """Queries per block so that one block's (queries, n_data) distance matrix has about `elements`."""
    return max(1, elements // max(1, n_data))
