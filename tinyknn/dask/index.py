"""DaskIndex: an exact index whose rows are split into shards held on the workers of a Dask cluster.

    from distributed import Client, LocalCluster
    from tinyknn.dask import DaskIndex
    index = DaskIndex(Client(LocalCluster()), dim=128, metric="l2")
    index.add(x)                      # NumPy, or a dask.array (its chunks go to the workers, not the client)
    D, I = index.search(q, k=10)      # the answer one tinyknn.Index holding every row gives, bit for bit

Each shard is a tinyknn.Index inside a Dask actor (tinyknn.dask.shard), pinned to one worker and handled
from the client by tinyknn.dask.shards; Dask brings the transport and the scheduling, tinyknn the shards
and the exact merge (tinyknn.index.merge). The client keeps only the shards' handles and sizes and the next
automatic id; ids are unique across the shards (checked with them on every add of given ids). Input is
checked on the client with Index's own checks and messages before any shard changes; an add that fails on
a shard part way is undone on the others.

A shard whose worker is lost is never answered around: a call that needs it raises ShardUnavailable naming
it; `reload_shard` brings it back from a file written by `save` (one file per shard plus manifest.json).

Length: one class mirroring Index's surface across shards; the shard actor and the client's handles live
in shard.py and shards.py, a dask.array's add in blocks.py, the saved directory's manifest in manifest.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from ..index import merge as _dask_merge
from ..inputs import validate as _validate
from ..inputs import validate_ops as _ops
from ..index.backends import parse_device
from .blocks import checked_blocks, is_dask_array, send_blocks
from .manifest import read_manifest, write_manifest
from .shards import Shards, ShardUnavailable, shard_count, shard_number
from ..index.ids import IdMap
from ..spec import numpy_dtype, parse_dim, parse_dtype, parse_metric


class DaskIndex:
    """Exact k-NN over shards on Dask workers: DaskIndex(client, dim, metric, dtype, device, n_shards).

    - `client`: a distributed.Client; `n_shards` (default: the number of workers) shards are placed on the
      workers in turn (sorted by address), each a tinyknn.Index(dim, metric, dtype, device) in the worker's
      memory. A worker runs its shards' calls one at a time; the Index uses the worker's
      TINYKNN_CPU_THREADS (give each worker process one shard and its cores).
    - add/search/range_search/remove/get/contains take what Index takes (search and range_search: host
      queries) and answer what one Index holding all the rows answers, bit for bit; automatic ids follow
      Index's rule. `add` also takes a dask.array (chunks of known size; ids/labels NumPy or dask).
    - Calls from several threads are served one at a time (a search never sees half of an add).
    - A shard whose worker is lost: ShardUnavailable, never a partial answer; see reload_shard.
    """

    def __init__(self, client, dim: int, metric: str = "l2", dtype: str = "float32", device: str = "cpu",
                 n_shards: int | None = None):
        self._setup(client, parse_dim(dim), parse_metric(metric), parse_dtype(dtype), parse_device(device))
        workers = self._shards.workers_now()
        count = len(workers) if n_shards is None else shard_count(n_shards)
        self._start([workers[i % len(workers)] for i in range(count)], [None] * count)

    def _setup(self, client, dim: int, metric: str, dtype: str, device: str) -> None:
        try:
            from distributed import Client
        except ImportError as exc:
            raise ImportError("tinyknn.dask needs Dask's distributed scheduler: pip install 'tinyknn[dask]' "
                              "(distributed and dask[array])") from exc
        if not isinstance(client, Client):
            raise TypeError(f"client must be a distributed.Client; got {type(client).__name__}")
        if client.asynchronous:
            raise ValueError("DaskIndex needs a synchronous distributed.Client (its calls block until answered); "
                             "got one created with asynchronous=True")
        self.client, self.dim, self.metric, self.dtype, self.device = client, dim, metric, dtype, device
        self._storage = numpy_dtype(dtype)
        self._lock = threading.RLock()
        self._shards = Shards(client, dim, metric, dtype, device)
        self._files: list[str | None] = []
        self._next_auto = 0

    def _start(self, workers: list[str], paths: list[str | None]) -> None:
        descriptions = self._shards.start(workers, paths)
        self._next_auto = max([d["next_auto"] for d in descriptions], default=0)
        self._files = list(paths)

    # -- the shards -------------------------------------------------------------------------------
    @property
    def n_shards(self) -> int:
        return self._shards.n

    @property
    def shard_workers(self) -> list[str]:
        """The address of the worker each shard lives on."""
        return self._shards.workers

    @property
    def shard_sizes(self) -> list[int]:
        return self._shards.counts.tolist()

    @property
    def ntotal(self) -> int:
        """How many vectors the shards hold."""
        return int(self._shards.counts.sum())

    def __len__(self) -> int:
        return self.ntotal

    def __repr__(self) -> str:
        return (f"tinyknn.dask.DaskIndex(dim={self.dim}, metric={self.metric!r}, dtype={self.dtype!r}, "
                f"device={self.device!r}, n_shards={self.n_shards}, ntotal={self.ntotal})")

    # -- changes ----------------------------------------------------------------------------------
    def add(self, x, ids=None, labels=None) -> None:
        """Add vectors x (n, dim): NumPy (any Index input), or a dask.array whose blocks are checked and
        handed to the shards on the workers. `ids` and `labels` as Index.add; a failed add changes nothing."""
        blocks = None
        if is_dask_array(x):                   # checked in Index's order: the values first, then ids, labels
            x, blocks = checked_blocks(self.client, x, self.dim, self.dtype)
        else:
            x = _validate.host_rows(x, self.dim, self.dtype)
        n = int(x.shape[0])
        given, row_labels = self._ids_and_labels(n, ids, labels)
        with self._lock:
            self._shards.check_alive()
            new = self._new_ids(n, given)
            if n == 0:
                return
            ids_of, running = (self._send_rows(x, new, row_labels) if blocks is None
                               else send_blocks(self.client, self._shards, x, blocks, new, row_labels))
            self._shards.add_parts(ids_of, running)
            self._next_auto = max(self._next_auto, int(new.max()) + 1)

    def _send_rows(self, vectors: np.ndarray, new: np.ndarray, row_labels):
        """Host rows in one contiguous piece per shard, the emptiest shards filled first."""
        shards = self._shards
        bounds = np.concatenate(([0], np.cumsum(shards.fill(len(new)))))
        parts = {(i, 0): slice(int(bounds[i]), int(bounds[i + 1])) for i in range(shards.n)
                 if bounds[i + 1] > bounds[i]}
        running = {key: shards.actors[key[0]].add(_validate.as_storage(vectors[part], self._storage), new[part],
                                                  None if row_labels is None else row_labels[part])
                   for key, part in parts.items()}
        return {key: new[part] for key, part in parts.items()}, running

    def _ids_and_labels(self, n: int, ids, labels):
        if is_dask_array(ids):
            ids = ids.compute()
        if is_dask_array(labels):
            labels = labels.compute()
        given = None if ids is None else _validate.user_ids(ids, n)
        return given, None if labels is None else _ops.labels(labels, n, "labels (one per added vector)")

    def _new_ids(self, n: int, given: np.ndarray | None) -> np.ndarray:
        """The ids of an add of n rows, checked as Index checks them (with Index's own checks)."""
        if given is None:
            automatic = IdMap()
            automatic.next_auto = self._next_auto
            return automatic.auto_ids(n)
        IdMap().check_new(given, given=True)                # ids repeated within the batch
        held = np.zeros(n, dtype=bool)
        for found in self._shards.each("contains", given):
            held |= found
        if held.any():
            taken = IdMap()
            taken.commit(np.unique(given[held]))
            taken.check_new(given, given=True)              # raises Index's message for ids already held
        return given

    def remove(self, ids) -> int:
        """Remove the vectors of `ids` from every shard holding them; how many were removed."""
        wanted = _ops.id_list(ids, "ids to remove")
        with self._lock:
            removed = self._shards.each("remove", wanted)
            self._shards.counts -= np.asarray(removed, dtype=np.int64)
            return int(sum(removed))

    # -- questions --------------------------------------------------------------------------------
    def get(self, ids) -> np.ndarray:
        """The stored vectors of `ids` (one id: (dim,); a 1-D array-like: (n, dim)), as Index.get."""
        one = np.ndim(ids) == 0
        wanted = _ops.id_list([_ops.one_id(ids, "id")] if one else ids, "ids to get")
        out = np.empty((len(wanted), self.dim), dtype=self._storage)
        found = np.zeros(len(wanted), dtype=bool)
        with self._lock:
            for held, vectors in self._shards.each("take", wanted):
                out[held] = vectors
                found |= held
        missing = np.unique(wanted[~found])
        if len(missing):
            raise ValueError(f"get: {len(missing)} of the ids asked for are not in the index: "
                             f"{missing[:10].tolist()}{' ...' if len(missing) > 10 else ''}")
        return out[0] if one else out

    def contains(self, ids) -> np.ndarray:
        """A bool per id: whether a shard holds it."""
        return self.locate(ids) >= 0

    def locate(self, ids) -> np.ndarray:
        """The shard holding each id (int64), -1 where none does."""
        wanted = _ops.id_list(ids, "ids")
        where = np.full(len(wanted), -1, dtype=np.int64)
        with self._lock:
            for shard, held in enumerate(self._shards.each("contains", wanted)):
                where[held] = shard
        return where

    def __contains__(self, item) -> bool:
        return bool(self.contains([_ops.one_id(item, "the id in `id in index`")])[0])

    def search(self, q, k: int, *, filter=None, labels=None) -> tuple[np.ndarray, np.ndarray]:
        """Index.search over every shard (host queries): (distances float32, ids int64) (nq, k), exact."""
        k = _ops.search_k(k)
        queries, allowed, query_labels = self._query_args(q, filter, labels)
        with self._lock:
            parts = self._shards.each("search", queries, k, allowed, query_labels)
            return _dask_merge.knn(parts, k, self.metric, self._resolver(queries))

    def range_search(self, q, radius: float, *, filter=None,
                     labels=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Index.range_search over every shard: (lims, distances, ids) in FAISS's layout, exact order."""
        radius = _ops.radius(radius, self.metric)
        queries, allowed, query_labels = self._query_args(q, filter, labels)
        with self._lock:
            parts = self._shards.each("range_search", queries, radius, allowed, query_labels)
            return _dask_merge.ranges(parts, self.metric, self._resolver(queries))

    def _query_args(self, q, filter, labels):
        if _validate.is_device_array(q):
            raise TypeError("DaskIndex takes host (NumPy) queries; the shards may be on other machines")
        queries = _validate.host_queries(q.compute() if is_dask_array(q) else q, self.dim, True, self.dtype)
        allowed = None if filter is None else _ops.id_list(filter, "filter")
        query_labels = None if labels is None else _ops.labels(labels, queries.shape[0], "labels (one per query)")
        return queries, allowed, query_labels

    def _resolver(self, queries: np.ndarray):
        """resolve(query numbers, ids, shards) for the merge: the shards compute the float64 distances."""
        def resolve(query_numbers: np.ndarray, ids: np.ndarray, owners: np.ndarray) -> np.ndarray:
            exact = np.empty(len(ids), dtype=np.float64)
            chosen = {int(s): owners == s for s in np.unique(owners)}
            values = self._shards.each("exact", shards={s: (queries[query_numbers[sel]], ids[sel])
                                                        for s, sel in chosen.items()})
            for sel, value in zip(chosen.values(), values):
                exact[sel] = value
            return exact
        return resolve

    # -- files and lost shards --------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> None:
        """One Index file per shard (written by the shard's worker: `directory` must be reachable from every
        worker, e.g. a shared file system) and manifest.json beside them, written last."""
        directory = Path(directory).absolute()
        directory.mkdir(parents=True, exist_ok=True)
        files = [str(directory / f"shard-{i:04d}.tinyknn") for i in range(self.n_shards)]
        with self._lock:
            totals = self._shards.each("save", shards={i: (files[i],) for i in range(self.n_shards)})
            write_manifest(directory, files, totals, self.dim, self.metric, self.dtype)
            self._files = files

    @classmethod
    def load(cls, client, directory: str | os.PathLike, device: str = "cpu") -> "DaskIndex":
        """A DaskIndex from a directory written by save(): one shard per file, placed on the workers in turn.
        Automatic ids go on after the largest id the files hold (as a loaded Index's do)."""
        directory = Path(directory).absolute()
        manifest = read_manifest(directory)
        index = cls.__new__(cls)
        index._setup(client, parse_dim(manifest["dim"]), parse_metric(manifest["metric"]),
                     parse_dtype(manifest["dtype"]), parse_device(device))
        workers = index._shards.workers_now()
        paths = [str(directory / shard["file"]) for shard in manifest["shards"]]
        index._start([workers[i % len(workers)] for i in range(len(paths))], paths)
        return index

    def reload_shard(self, shard: int, path: str | os.PathLike | None = None, worker: str | None = None) -> None:
        """Replace shard `shard` (lost or not) by the Index file at `path` (default: the shard's file of the
        last save or load), on `worker` (default: the live worker holding the fewest shards). Its ids must
        not be held by another shard (ValueError, nothing changed). Changes made after that save are lost."""
        shards = self._shards
        shard = shard_number(shard, shards.n)
        path = self._files[shard] if path is None else str(Path(path).absolute())
        if path is None:
            raise ValueError(f"no saved file is known for shard {shard}; pass the path of its Index file")
        with self._lock:
            worker = shards.emptiest_worker(shard) if worker is None else worker
            future, actor, description = shards.create(shard, worker, path)
            others = [i for i in range(shards.n) if i != shard and shards.alive(i)]
            ids = actor.ids().result()
            clash = [i for i, held in zip(others, shards.each("contains", shards={i: (ids,) for i in others}))
                     if held.any()]
            if clash:
                future.release()
                raise ValueError(f"the file {path} holds ids that shard(s) {clash} hold now; shard {shard} was "
                                 f"not replaced")
            shards.replace(shard, future, actor, description)
            self._next_auto = max(self._next_auto, description["next_auto"])
            self._files[shard] = path

    def close(self) -> None:
        """Free the shards on the workers now; the DaskIndex cannot be used afterwards."""
        self._shards.release()

    def __enter__(self) -> "DaskIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
