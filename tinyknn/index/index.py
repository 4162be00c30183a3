"""Index: owns the database's ids and labels, validates every input, and hands the work to a searcher.

Ids and labels map onto row positions here (tinyknn.index.ids, tinyknn.index.labels); a filtered or labelled
search becomes searcher calls over the allowed rows (tinyknn.index.groups), and labelled searches that read
scattered rows make the index put each label's rows together (tinyknn.index.layout); searches into the caller's
arrays (out=) and prepared searches are tinyknn.index.prepared's. No CUDA and no ctypes here: the
searchers (tinyknn.index.backends) are imported lazily, so `import tinyknn` works on a machine with no GPU,
driver or compiler.

Length: the public class, one method per operation; each operation's work lives in the modules above.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any, BinaryIO

import numpy as np
from numpy.typing import ArrayLike

from . import groups as _groups, persist as _persist
from ..inputs import outputs as _outputs
from ..inputs import validate as _validate
from ..inputs import validate_ops as _ops
from .backends import DEVICES, Searcher, parse_device, parse_storage  # noqa: F401 - DEVICES re-exported
from .backends import make_searcher as _make_searcher  # tests replace it with a model searcher
from .handover import Handover
from .ids import IdMap
from .labels import Labels
from .layout import LabelLayout
from .persist import FILE_FORMAT, FILE_VERSION  # noqa: F401 - re-exported for callers and tests
from .prepared import PreparedSearch, search_into as _search_into
from ..spec import numpy_dtype, parse_dim, parse_dtype, parse_metric


class Index:
    """Exact k-nearest-neighbour index.

    Index(dim, metric="l2" | "ip" | "cosine", dtype="float32" | "float16" | "bfloat16" | "int8" | "uint8",
    device="cpu" | "cuda", storage="device" | "host")

    - `l2` reports squared Euclidean distances (smallest first), `ip` inner products (largest first),
      `cosine` the cosine similarity (largest first); a zero vector has similarity 0 with everything.
    - The database is stored in `dtype`; queries are searched in float32 whatever the index's dtype.
      Answers follow the exactness contract (docs/exactness.md): the float64 order, ties by the smaller id.
    - Input conversion: see `tinyknn.inputs.validate` (float16/32/64 and bfloat16 arrays, and for an 8-bit
      index integer arrays, NumPy or DLPack/CUDA; NaN, infinity, |x| > 2**50, masked arrays refused).
    - Ids: int64 in 0 .. 2**63 - 1, unique in the index. Without ids, an add numbers its rows on from
      the largest id the index has held since it was created, loaded or reset (0, 1, 2, ... for an
      index of automatic ids), so automatic ids never collide with given ones. Removed ids may be
      added again; updating a vector is `remove` then `add`.
    - Labels: one optional int64 per vector (`add(..., labels=)`); a search with `labels=` (one per
      query) sees only the vectors of each query's label.
    - Threads: calls may come from any number of threads; a search never sees half of an add or of a
      removal.
    - An Index pickles (through the save format, in memory) and copies (copy.copy and copy.deepcopy, from
      searcher to searcher a chunk at a time) onto the same device kind.
    - storage="host" (device="cuda" only): the vectors stay in pinned host memory and stream through the
      GPU in chunks at each search, copy and compute overlapped (tinyknn.gpu.host_tier), so the database
      may be larger than the GPU's memory; same answers, host (NumPy) inputs only.
    """

    def __init__(self, dim: int, metric: str = "l2", dtype: str = "float32", device: str = "cpu",
                 storage: str = "device"):
        self.dim = parse_dim(dim)
        self.metric = parse_metric(metric)
        self.dtype = parse_dtype(dtype)
        self._storage = numpy_dtype(self.dtype)
        self.device = parse_device(device)
        self.storage = parse_storage(storage, self.device)
        self._ids = IdMap()
        self._labels = Labels()
        self._layout = LabelLayout()
        self._add_lock = threading.Lock()      # one change (add, remove, reset, save) at a time
        self._handover = Handover(self._add_lock)   # adds in pieces; unfiltered searches see whole adds
        # ids/labels -> rows and the searcher call that uses the rows happen under _view, so that a
        # removal (which moves rows) can never come between them; unfiltered searches need neither.
        self._view = threading.Lock()
        backend = {} if self.storage == "device" else {"storage": self.storage}   # stand-in factories take 4
        self._searcher: Searcher | None = _make_searcher(self.device, self.dim, self.metric, self.dtype, **backend)

    # -- the database -------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        """How many vectors the index holds."""
        return self._ids.count

    def __len__(self) -> int:
        return self.ntotal

    def __repr__(self) -> str:
        return (f"tinyknn.Index(dim={self.dim}, metric={self.metric!r}, dtype={self.dtype!r}, "
                f"device={self.device!r}, ntotal={self.ntotal})")

    def add(self, x: ArrayLike, ids: ArrayLike | None = None, labels: ArrayLike | None = None) -> None:
        """Add vectors x of shape (n, dim); `ids` are optional int64 ids (default: see the class doc),
        `labels` an optional int64 label per vector (any integer array-like of shape (n,)).

        Host input is checked whole, then converted to the index's dtype and handed over in pieces
        of _validate.CHUNK_BYTES (no second full copy); CUDA input (device='cuda' only) is copied
        device to device without visiting the host. A failed add leaves the index as it was.
        """
        self._add(x, ids, labels)

    def _add(self, x, ids, labels, has_label: np.ndarray | None = None) -> None:
        """add(), and for load(): `has_label` says which rows of `labels` have one."""
        searcher = self._open_searcher()
        if self.device == "cuda" and _validate.is_device_array(x):
            vectors = _validate.device_matrix(x, self.dim, "vectors to add", self.dtype)
        else:
            vectors = _validate.host_rows(x, self.dim, self.dtype)
        n = vectors.shape[0]
        given = None if ids is None else _validate.user_ids(ids, n)
        row_labels = None if labels is None else _ops.labels(labels, n, "labels (one per added vector)")
        with self._add_lock:
            new = self._ids.auto_ids(n) if given is None else given
            self._ids.check_new(new, given=given is not None)
            if n == 0:
                return
            self._handover.hand_over(searcher, vectors, new, self._ids.count, self._storage, self.dim)
            with self._view:
                self._ids.commit(new)
                self._labels.append(n, row_labels, has_label)

    def remove(self, ids: ArrayLike) -> int:
        """Remove the vectors of `ids` (a 1-D integer array-like; ids not in the index are ignored) and
        return how many were removed. The ids may be added again afterwards. The searcher fills the
        holes with the last rows at once (O(removed x dim)): nothing is left to compact later."""
        wanted = _ops.id_list(ids, "ids to remove")
        searcher = self._open_searcher()
        with self._add_lock, self._view:
            rows = self._ids.rows_present(wanted)
            if not len(rows):
                return 0
            moved_from, moved_to = searcher.remove_rows(rows)
            moved_from = np.asarray(moved_from, dtype=np.int64)
            moved_to = np.asarray(moved_to, dtype=np.int64)
            self._ids.apply_removal(rows, moved_from, moved_to)
            self._labels.apply_removal(rows, moved_from, moved_to)
        return len(rows)

    def get(self, ids: ArrayLike) -> np.ndarray:
        """The stored vectors of `ids` (one id: shape (dim,); a 1-D array-like: (n, dim)) in the index's
        dtype; a ValueError names the ids that are not in the index."""
        one = np.ndim(ids) == 0
        wanted = _ops.id_list([_ops.one_id(ids, "id")] if one else ids, "ids to get")
        searcher = self._open_searcher()
        with self._view:
            rows = self._ids.rows_of(wanted)
            missing = wanted[rows < 0]
            if len(missing):
                shown = np.unique(missing)
                raise ValueError(f"get: {len(shown)} of the ids asked for are not in the index: "
                                 f"{shown[:10].tolist()}{' ...' if len(shown) > 10 else ''}")
            vectors = searcher.get_rows(rows)
        return vectors[0] if one else vectors

    def contains(self, ids: ArrayLike) -> np.ndarray:
        """A bool per id of the 1-D integer array-like `ids`: whether the index holds it."""
        wanted = _ops.id_list(ids, "ids")
        with self._view:
            return self._ids.rows_of(wanted) >= 0

    def __contains__(self, item: object) -> bool:
        wanted = np.array([_ops.one_id(item, "the id in `id in index`")], dtype=np.int64)
        with self._view:
            return bool(self._ids.rows_of(wanted)[0] >= 0)

    def search(self, q: ArrayLike, k: int, *, filter: ArrayLike | None = None,
               labels: ArrayLike | None = None, out: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
        """The k nearest database vectors of each query: (distances float32 (nq, k), ids int64 (nq, k)).

        Nearest first. Where a query may see fewer than k vectors the rows are padded with id -1 and
        distance +inf (-inf for 'ip' and 'cosine'). Any k >= 1, but k beyond 2,048 (the kernels' own
        limit) is a slower path: every allowed row's float64 distance is computed and the k best selected
        outside the selection kernels (on the GPU: on the host, host queries only), so it costs about an
        exact scan plus O(rows) per query whatever k is; results take 12 bytes per (query, k). `filter`: a 1-D integer array of the ids that may
        be returned (ids not in the index are ignored); `labels`: one int64 per query, each query seeing
        only the vectors added with its label; both together intersect. A filtered search reads only
        the allowed rows (one searcher call per distinct query label). Host input gives NumPy output;
        CuPy or torch CUDA input gives results of the same framework on the GPU, ordered after the
        caller's current stream (with `labels`, CUDA queries must all carry one label).

        out=(distances, ids): write the results into these arrays and return them (as NumPy's ufuncs
        do): float32 and int64, shape exactly (nq, k), C-contiguous, writeable; NumPy arrays for host
        queries, arrays of the results' framework on the index's GPU for CUDA queries (tinyknn.inputs.
        outputs). A wrong array is a TypeError/ValueError before anything is written. With filter and
        labels too. Repeated searches of one shape: prepare_search.
        """
        searcher = self._open_searcher()
        k = _ops.search_k(k)
        queries = self._queries(q)
        if out is not None:
            return self._search_out(searcher, queries, k, filter, labels, out)
        if filter is None and labels is None:
            return self._handover.whole_adds_only(searcher.search, queries, k)
        self._reorder_if_due(searcher, labels)
        with self._view:
            parts = self._groups(queries, filter, labels)
            return _groups.knn(searcher.search, queries, queries.shape[0], k, parts)

    def _search_out(self, searcher: Searcher, queries, k: int, filter, labels, out) -> tuple[Any, Any]:
        """search(..., out=out): the caller's arrays checked before anything is written, then filled."""
        given, targets, queries = _outputs.checked(out, queries, k)
        if filter is None and labels is None:
            self._handover.whole_adds_only(_search_into, searcher, queries, k, None, targets)
            return given
        self._reorder_if_due(searcher, labels)
        with self._view:
            parts = self._groups(queries, filter, labels)
            if len(parts) == 1 and parts[0].queries is None:
                _search_into(searcher, queries, k, parts[0].rows, targets)
            else:       # several labels: host queries only (_groups refuses them for CUDA queries)
                distances, ids = _groups.knn(searcher.search, queries, queries.shape[0], k, parts)
                np.copyto(targets[0], distances)
                np.copyto(targets[1], ids)
        return given

    def prepare_search(self, k: int, n_queries: int = 1) -> PreparedSearch:
        """A search with k and the number of queries per call bound once: `s = index.prepare_search(k=10,
        n_queries=1)`, then `D, I = s(q)` or `s(q, out=(D, I))` (out as in search). Each call checks only
        what can differ (for a C-contiguous float32 NumPy array of shape (n_queries, dim): its shape, dtype,
        layout and values) and searches the index as it is then: adds, removals and reset are seen, and a
        closed index is a ValueError. Results are fresh arrays per call unless out= is given. Safe to call
        from several threads. No filter or labels (use search). tinyknn.index.prepared has the details."""
        return PreparedSearch(self, k, n_queries)

    def range_search(self, q: ArrayLike, radius: float, *, filter: ArrayLike | None = None,
                     labels: ArrayLike | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every vector within `radius` of each query, in FAISS's layout: (lims int64 (nq + 1,),
        distances float32, ids int64), query i's hits at lims[i]:lims[i + 1], nearest first (ties by
        the smaller id). Within means distance < radius for 'l2' (squared distances: radius >= 0) and
        similarity > radius for 'ip' and 'cosine'. No cap on the number of hits. `filter` and `labels`
        as in search()."""
        searcher = self._open_searcher()
        radius = _ops.radius(radius, self.metric)
        queries = self._queries(q)
        if isinstance(queries, _validate.DeviceArray):
            raise TypeError("range_search takes host (NumPy) queries; its results are host arrays of "
                            "varying length: pass q.get() (CuPy) or q.cpu().numpy() (torch)")
        if filter is None and labels is None:
            return self._handover.whole_adds_only(searcher.range_search, queries, radius, None)
        self._reorder_if_due(searcher, labels)
        with self._view:
            parts = self._groups(queries, filter, labels)
            return _groups.ranges(searcher.range_search, queries, queries.shape[0], radius, parts)

    def _queries(self, q):
        if self.device == "cuda" and _validate.is_device_array(q):
            return _validate.device_matrix(q, self.dim, "queries", self.dtype, queries=True)
        # The GPU searcher checks host float32 values itself, on the host while the device works.
        return _validate.host_queries(q, self.dim, self.device == "cpu", self.dtype)

    def _groups(self, queries, filter, labels) -> list[_groups.Group]:
        """The searcher calls of a filtered search (call under _view: rows are only valid there)."""
        n_queries = queries.shape[0]
        allowed = None if filter is None else self._ids.rows_allowed(_ops.id_list(filter, "filter"))
        query_labels = None if labels is None else _ops.labels(labels, n_queries, "labels (one per query)")
        parts = _groups.groups(n_queries, allowed, query_labels, self._labels.rows_of)
        if query_labels is not None:
            for part in parts:
                self._layout.record(part.rows)
        if isinstance(queries, _validate.DeviceArray) and (len(parts) > 1 or parts[0].queries is not None):
            raise ValueError("labels with CUDA queries must be one label for all of them; pass host queries "
                             "or search each label's queries on their own")
        return parts

    def _reorder_if_due(self, searcher: Searcher, labels) -> None:
        """Before a labelled search: put each label's rows together once the labelled searches have read
        as many scattered rows as that costs (tinyknn.index.layout), on searchers that can reorder (the CPU's and
        the GPU's). A reorder the memory cannot hold is skipped with a warning; it changes nothing, and no answer."""
        if labels is None or not hasattr(searcher, "permute_rows") or not self._layout.due(self._ids.count):
            return
        with self._add_lock, self._view:
            if self._layout.due(self._ids.count):
                self._layout.reorder(searcher, self._ids, self._labels)

    def reset(self) -> None:
        """Remove every vector (the index keeps its dim, metric, dtype and device)."""
        with self._add_lock, self._view:
            self._open_searcher().reset()
            self._ids.reset()
            self._labels.reset()
            self._layout.scattered_runs = 0

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Free the index's native or GPU memory now; the index cannot be used afterwards."""
        searcher, self._searcher = self._searcher, None
        if searcher is not None:
            searcher.close()

    def __enter__(self) -> "Index":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_searcher(self) -> Searcher:
        if self._searcher is None:
            raise ValueError("this Index was closed; create a new one")
        return self._searcher

    # -- persistence --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike | BinaryIO) -> None:
        """Write the index to `path` (format: docs/index-operations.md, 'File format'; an uncompressed NumPy .npz, version 2),
        or onto a binary file object (e.g. io.BytesIO) as it is.

        A path is written to a temporary file beside it (beside its target, for a symbolic link) and
        renamed over it: a failed save leaves no temporary file behind and any previous file at `path`
        intact, and its OSError names `path`."""
        if hasattr(path, "write"):
            self._write(path)
        else:
            _persist.save(path, self._write)

    def _write(self, handle, streamed: bool = False) -> None:
        """The save format onto `handle`. streamed: the rows go from the searcher to `handle` a chunk at a
        time under the add lock (adds and removals wait; no copy of the whole database: pickling, which
        writes to memory); else a snapshot is exported first and written without the lock (save)."""
        with self._add_lock:
            searcher = self._open_searcher()
            labels = self._labels.column()
            if streamed:
                ids = self._ids.ids_of_rows()
                _persist.write(handle, self.dim, self.metric, self.dtype, self._row_blocks(searcher, len(ids)), ids,
                               labels)
                return
            vectors, ids = searcher.export()
        _persist.write(handle, self.dim, self.metric, self.dtype, vectors, ids, labels)

    def _row_blocks(self, searcher: Searcher, n: int):
        """Rows 0 .. n-1 in the storage dtype, _validate.CHUNK_BYTES at a time (call under _add_lock)."""
        step = max(1, _validate.CHUNK_BYTES // (self.dim * self._storage.itemsize))
        for start in range(0, n, step):
            yield searcher.get_rows(np.arange(start, min(n, start + step), dtype=np.int64))

    @classmethod
    def load(cls, path: str | os.PathLike | BinaryIO, device: str = "cpu", storage: str = "device") -> "Index":
        """Read an index written by save() from a path (a regular file holding one index) or a binary file
        object (read from its current position, and left just after the index: indexes saved one after
        another into one stream load in turn). Anything else is a TypeError.

        Files of format versions 1 (no labels) and 2 load. A damaged file, a file of another format
        version or one whose sizes disagree with its header is a ValueError (nothing larger than the file is allocated to find out).
        `device` and `storage` as in Index()."""
        device = parse_device(device)
        storage = parse_storage(storage, device)
        return _persist.load(path, lambda dim, metric, dtype: cls(dim, metric=metric, dtype=dtype, device=device,
                                                                  storage=storage))

    def __reduce__(self):
        """Pickling goes through the save format in memory (the rows written a chunk at a time), onto the
        same device kind and storage. Memory beyond the index: pickle.dump to a file, the format's bytes
        once; pickle.dumps, those and the pickle; pickle.loads, the bytes read and the new index."""
        if self._searcher is None:
            raise ValueError("cannot pickle or copy a closed tinyknn Index")
        buffer = io.BytesIO()
        self._write(buffer, streamed=True)
        return _restore, (buffer.getvalue(), self.device, self.storage)

    def __copy__(self) -> "Index":
        return self._copy()

    def __deepcopy__(self, memo) -> "Index":
        return self._copy()

    def _copy(self) -> "Index":
        """copy.copy and copy.deepcopy: an independent Index (base class) on the same device kind and storage,
        its rows copied from searcher to searcher a chunk at a time (memory: the copy and one chunk), with the
        same ids and labels; automatic ids go on after the largest id, as for a loaded index."""
        if self._searcher is None:
            raise ValueError("cannot pickle or copy a closed tinyknn Index")
        clone = Index(self.dim, metric=self.metric, dtype=self.dtype, device=self.device, storage=self.storage)
        try:
            with self._add_lock:
                ids = self._ids.ids_of_rows()
                labels = self._labels.column()
                start = 0
                for block in self._row_blocks(self._open_searcher(), len(ids)):
                    rows = slice(start, start + len(block))
                    values, has = (None, None) if labels is None else (labels[0][rows], labels[1][rows])
                    clone._add(block, ids[rows], values, has)
                    start = rows.stop
        except BaseException:
            clone.close()
            raise
        return clone


def _restore(data: bytes, device: str, storage: str = "device") -> Index:
    return Index.load(io.BytesIO(data), device=device, storage=storage)
