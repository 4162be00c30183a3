"""Shards: the client's handles on a DaskIndex's shards (Dask actors, tinyknn.dask.shard.Shard), for tinyknn.dask.

Owns what is Dask-specific: creating a shard pinned to one worker, calling every shard at once and
waiting, noticing a lost worker (the actor's future leaves the "finished" state) so that no call ever
waits on it forever or answers without it, the shards' sizes, and where new rows go: the emptiest shards
first (`fill`), a dask.array block to a shard on the worker already holding it where that keeps the
shards even (`place`). An add's parts either all go in or are all taken out again (`add_parts`).
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np

from .shard import Shard
from ..errors import TinyKnnError

POLL_S = 0.5      # how often a call that is still running checks that its shard's worker is alive


class ShardUnavailable(TinyKnnError):
    """A shard's worker was lost: the call needing it was not answered (no partial answer is ever given)."""

    def __init__(self, shards: list[int], workers: list[str]):
        self.shards = shards
        where = ", ".join(f"shard {s} (worker {w})" for s, w in zip(shards, workers))
        super().__init__(f"{where}: the worker holding it was lost or cannot be reached, so the call was not "
                         f"answered (the other "
                         f"shards alone would give a partial answer); bring it back with "
                         f"DaskIndex.reload_shard(shard, path) from a file written by DaskIndex.save")


class Shards:
    """The shards of one DaskIndex: Index(dim, metric, dtype, device) each, on the workers of `client`."""

    def __init__(self, client, dim: int, metric: str, dtype: str, device: str):
        self.client = client
        self.spec = {"dim": dim, "metric": metric, "dtype": dtype}
        self.device = device
        self.name = uuid.uuid4().hex[:12]
        self.futures: list = []      # the actors' futures: holding them keeps the shards alive
        self.actors: list = []
        self.counts = np.zeros(0, dtype=np.int64)

    def workers_now(self) -> list[str]:
        workers = sorted(self.client.ncores())
        if not workers:
            raise ValueError("the Dask cluster has no workers; start some (or wait for them) first")
        return workers

    def emptiest_worker(self, shard: int) -> str:
        """The live worker holding the fewest shards other than `shard` (ties: the smallest address)."""
        workers = self.workers_now()
        held = {w: 0 for w in workers}
        for i, w in enumerate(self.workers):
            if i != shard and w in held:
                held[w] += 1
        return min(workers, key=lambda w: (held[w], w))

    def create(self, number: int, worker: str, path: str | None):
        """(future, actor, description) of a new shard on `worker`: empty, or the Index file at `path`."""
        future = self.client.submit(Shard, *self.spec.values(), self.device, path, actor=True, workers=[worker],
                                    allow_other_workers=False, pure=False,
                                    key=f"tinyknn-shard-{self.name}-{number}-{uuid.uuid4().hex[:8]}")
        while True:                  # a task pinned to a worker that has gone would wait for it forever
            try:
                actor = future.result(timeout=POLL_S)
                break
            except (TimeoutError, asyncio.TimeoutError):
                if worker not in self.client.ncores():
                    future.release()
                    raise ShardUnavailable([number], [worker]) from None
        description = actor.describe().result()
        found = {name: description[name] for name in self.spec}
        if found != self.spec:
            future.release()
            raise ValueError(f"the file {path} holds an index of {found}; this DaskIndex is {self.spec}")
        return future, actor, description

    def start(self, workers: list[str], paths: list[str | None]) -> list[dict]:
        """One shard per worker listed (the same worker may come more than once); their descriptions."""
        made = [self.create(i, worker, path) for i, (worker, path) in enumerate(zip(workers, paths))]
        self.futures = [future for future, _, _ in made]
        self.actors = [actor for _, actor, _ in made]
        self.counts = np.array([d["ntotal"] for _, _, d in made], dtype=np.int64)
        return [d for _, _, d in made]

    def replace(self, shard: int, future, actor, description: dict) -> None:
        old = self.futures[shard]
        self.futures[shard], self.actors[shard] = future, actor
        self.counts[shard] = description["ntotal"]
        old.release()

    def release(self) -> None:
        for future in self.futures:
            future.release()
        self.futures, self.actors, self.counts = [], [], np.zeros(0, dtype=np.int64)

    @property
    def n(self) -> int:
        return len(self.actors)

    @property
    def workers(self) -> list[str]:
        """The address of the worker each shard lives on."""
        return [actor._address for actor in self.actors]

    def alive(self, shard: int) -> bool:
        return self.futures[shard].status == "finished"

    # -- calls ------------------------------------------------------------------------------------
    def check_alive(self, shards=None) -> None:
        lost = [i for i in (range(self.n) if shards is None else shards) if not self.alive(i)]
        if lost:
            raise ShardUnavailable(lost, [self.workers[i] for i in lost])

    def result(self, shard: int, call):
        """The result of an actor call or a task, or ShardUnavailable once the shard's worker is gone."""
        while True:
            try:
                return call.result(timeout=POLL_S)
            except (TimeoutError, asyncio.TimeoutError):
                self.check_alive([shard])
            except OSError as exc:
                # The actor's "Unable to contact Actor's worker" is a plain OSError (the worker went away under
                # the call, perhaps before the scheduler noticed); the shard's own failures keep their type.
                if type(exc) is OSError or not self.alive(shard):
                    raise ShardUnavailable([shard], [self.workers[shard]]) from exc
                raise

    def each(self, method: str, *args, shards: dict | None = None) -> list:
        """Call `method` on every shard at once (`shards`: {shard: its args} instead) and wait for all."""
        calls = shards if shards is not None else {i: args for i in range(self.n)}
        self.check_alive(calls)
        running = {i: getattr(self.actors[i], method)(*arguments) for i, arguments in calls.items()}
        return [self.result(i, call) for i, call in running.items()]

    def add_parts(self, ids_of: dict, running: dict) -> None:
        """running[(shard, part)]: an add call or task under way, which returns the shard's size after it.
        Waits for all; if one fails, the parts that went in are removed again (ids_of[(shard, part)]) from
        the shards still alive and the first error is raised; else the sizes are updated."""
        totals, failure = {}, None
        for key, call in running.items():
            try:
                totals[key] = self.result(key[0], call)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the undo
                failure = failure or exc
        if failure is not None:
            for shard, part in totals:
                if self.alive(shard):
                    self.result(shard, self.actors[shard].remove(ids_of[shard, part]))
            raise failure
        for (shard, _), total in totals.items():
            self.counts[shard] = max(int(self.counts[shard]), int(total))

    # -- where new rows go ------------------------------------------------------------------------
    def fill(self, n: int) -> np.ndarray:
        """How many of n new rows each shard takes so that the sizes end as even as they can: the smallest
        shards filled up to a common level, the remainder one each to the smallest (lower numbers first)."""
        sizes = self.counts
        order = np.argsort(sizes, kind="stable")
        ordered = sizes[order]
        low, high = int(ordered[0]), int(ordered[-1]) + n     # the highest level the n rows can fill to
        while low < high:
            middle = (low + high + 1) // 2
            if int(np.maximum(0, middle - ordered).sum()) <= n:
                low = middle
            else:
                high = middle - 1
        taken = np.zeros(len(sizes), dtype=np.int64)
        taken[order] = np.maximum(0, low - ordered)
        rest = n - int(taken.sum())
        taken[[i for i in range(len(sizes)) if sizes[i] <= low][:rest]] += 1
        return taken

    def place(self, blocks: list, sizes: np.ndarray) -> list[int]:
        """A shard for each block (distributed futures): one on the worker already holding the block where
        that keeps the shards within a block of each other, else the smallest shard."""
        holders = self.client.who_has(blocks)
        planned = self.counts.astype(np.float64)
        workers = self.workers
        owners = []
        for block, size in zip(blocks, sizes.tolist()):
            local = [i for i in range(self.n) if workers[i] in holders.get(block.key, ())]
            smallest = int(np.argmin(planned))
            choice = min(local, key=lambda i: planned[i]) if local else smallest
            if planned[choice] > planned[smallest] + size:
                choice = smallest
            planned[choice] += size
            owners.append(choice)
        return owners


def shard_count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"n_shards must be a positive integer or None; got {value!r} ({type(value).__name__})")
    if int(value) < 1:
        raise ValueError(f"n_shards must be at least 1; got {int(value)}")
    return int(value)


def shard_number(value, n_shards: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"shard must be an integer; got {value!r} ({type(value).__name__})")
    if not 0 <= int(value) < n_shards:
        raise ValueError(f"shard must be in 0 .. {n_shards - 1}; got {int(value)}")
    return int(value)
