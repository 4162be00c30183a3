"""The backends behind an Index: the Searcher protocol they implement, and which one a device gets.

The CPU searcher (tinyknn.cpu) and the GPU searcher (tinyknn.gpu) are imported only when an index of
that device is created, so `import tinyknn` needs no GPU, driver or compiler.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

DEVICES = ("cpu", "cuda")
STORAGES = ("device", "host")


class Searcher(Protocol):
    """What a backend provides. Inputs arrive validated (host ndarrays or _validate.DeviceArray).

    Rows are positions 0 .. n-1; a searcher may move rows (answers never depend on row order: ties go
    to the smaller id). `add` appends rows with their ids, copies them before it returns (the caller
    reuses the array), and either takes all of them or raises with the searcher unchanged;
    `truncate(n_rows)` drops every row from n_rows on (the newest), so that an add handed over in
    several pieces can be undone when a later piece fails. `rows`, where given, is a sorted unique
    int64 array of the positions the call may return (possibly empty); k may exceed 2,048 and the rows
    there are (pad with id -1, distance +inf for l2, -inf for ip and cosine). `remove_rows(positions)`
    (sorted unique int64) swap-removes those rows at once and returns (moved_from, moved_to), int64
    arrays of the rows that moved; `get_rows(positions)` the stored rows (any int64 positions, in
    order) in the storage dtype; `range_search` FAISS's (lims, distances, ids) (INDEX_OPS.md). Optional:
    `permute_rows(order)` (new row i is old row order[i], every row once; all or nothing), which lets the
    Index keep each label's rows together (tinyknn.index.layout); a searcher without it keeps its order."""

    def add(self, vectors, ids: np.ndarray) -> None: ...
    def truncate(self, n_rows: int) -> None: ...
    def search(self, queries, k: int, rows: np.ndarray | None = None): ...
    def range_search(self, queries, radius: float, rows: np.ndarray | None = None): ...
    def remove_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def get_rows(self, positions: np.ndarray) -> np.ndarray: ...
    def reset(self) -> None: ...
    def export(self) -> tuple[np.ndarray, np.ndarray]: ...
    def close(self) -> None: ...


def parse_device(device) -> str:
    text = str(device).lower() if isinstance(device, str) else device
    if text in DEVICES:
        return text
    if isinstance(text, str) and text.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (tinyknn uses the current CUDA device); got {device!r}")
    raise ValueError(f"device must be one of 'cpu', 'cuda'; got {device!r}")


def parse_storage(storage, device: str) -> str:
    """'device' (the vectors in the device's memory) or 'host' (device='cuda' only: pinned host memory,
    streamed through the GPU chunk by chunk, for databases larger than the GPU)."""
    text = storage.lower() if isinstance(storage, str) else storage
    if text not in STORAGES:
        raise ValueError(f"storage must be one of 'device', 'host'; got {storage!r}")
    if text == "host" and device != "cuda":
        raise ValueError(f"storage='host' keeps the vectors in pinned host memory and streams them through the GPU: "
                         f"it needs device='cuda'; got device={device!r}")
    return text


def make_searcher(device: str, dim: int, metric: str, dtype: str, storage: str = "device") -> Searcher:
    if storage == "host":
        from ..gpu.host_tier import HostTierSearcher

        return HostTierSearcher(dim=dim, metric=metric, dtype=dtype)
    if device == "cpu":
        from ..cpu.library import DTYPE_CODES
        from ..cpu.searcher import CpuSearcher

        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype!r} is not available on device='cpu' (it stores "
                             f"{', '.join(map(repr, DTYPE_CODES))}); use one of those or device='cuda'")
        return CpuSearcher(dim=dim, metric=metric, dtype=dtype)
    from ..gpu.searcher import GpuSearcher

    return GpuSearcher(dim=dim, metric=metric, dtype=dtype)
