"""Range search through the tensor-core screen (gpu/screen.py): the radius is each query's threshold.

A batch search's step 2 (a threshold from a sample) is not needed: a row strictly inside the radius has a
key strictly inside the radius's key, so the screen's steps 1 and 3 with that key as the threshold
(radius_thresholds, rounded so that no such row is lost) leave every hit among the survivors. Step 4 here
is range_survivors_kernel (kernels/screen_steps.cuh): each survivor's contract distance, a hit when strictly
inside, into the hit pool that gpu/hit_pool.py groups and sorts, as range_kernel's. A query with more
survivors than its room (first_room) is screened again with room for all of them (the screen keeps counting
past its capacity; Screen.range_rescreens): the same query, rows and threshold, so the same argument leaves every
hit among its survivors, and a pass of the few such queries costs far less than range_kernel's float64 pass
over every row for each. Only a query whose memory the device refuses (or, past RESCREEN_ROUNDS, whose
survivors overflow again) is handed back: gpu/ranges.py searches it with range_kernel, counted in
Screen.range_fallbacks. Where the screen does not apply (applies()), ranges.py uses range_kernel alone.
"""

from __future__ import annotations

import numpy as np

from ..csr import combine, offsets
from ..jit import render_screen as rs
from .hit_pool import HIT_BYTES, group_and_sort

SCREEN_BATCH = 2048             # queries a screen pass takes
SURVIVOR_BYTES = 64 << 20       # survivor lists a screen pass holds at most: a first screen gives each query
                                # SURVIVOR_BYTES / 4 / queries of room (at least SURVIVOR_CAPACITY, at most the
                                # rows), since a query past its room costs a second pass with every fixed cost
                                # of the first (H200, 1M x 128 clustered, 1,000 queries: 5 of them, 4,480-12,333
                                # survivors); a group screened again holds no more (a query needing more alone)
POOL_FIRST = 1 << 16            # hits the pool holds at first, at the least, or this many a query (grown to
POOL_PER_QUERY = 256            # the count when they are more: only step 4 runs again)
UNIT = 2.0 ** -53               # float64's unit roundoff
RESCREEN_ROUNDS = 2             # a count can change once: a first screen on the Hopper kernel has other error
                                # terms than a smaller group's mma.sync one; the same kernel counts the same


def applies(searcher, n_queries: int) -> bool:
    """Where a batch search would be screened (Screen.applies: metric, dtype, rows, queries, no filter; every
    row, never a run)."""
    return bool(getattr(searcher, "use_screen", False)) and searcher._screen.applies(n_queries, 1, runs=False)


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u), rounded up: the relative error of n float64 operations (Higham)."""
    return float(np.nextafter(n * UNIT / (1.0 - n * UNIT), np.inf))


def _up(x):
    return np.nextafter(x, np.inf)


def _down(x):
    return np.nextafter(x, -np.inf)


def radius_thresholds(metric: str, queries: np.ndarray, radius: float, max_squares: float) -> np.ndarray:
    """Each query's screen threshold for `radius` (float32, key units): every row strictly inside the radius
    (contract distance < radius; ip and cosine: > radius) has its real key below it, so the screen's lower
    bound of its key (never above the real key) is within it and the row survives. max_squares: an upper
    bound of every row's |x|^2 (ip only; row_stats).

    Derivation (u = 2^-53, gamma_n = n u / (1 - n u); q the float32 query as searched, x the stored row,
    both exact; every float64 step below is rounded outward with nextafter, each a bound of the real value):
    - l2: the screen's key is |x|^2 - 2 q.x = |q - x|^2 - |q|^2. The contract's d64 sums dim terms
      fl(fl(q_i - x_i)^2) in order: each term is its real value times (1 + t), |t| <= gamma_3 (no
      underflow: q_i - x_i is 0 or at least 2^-149, its square at least 2^-298, normal in float64), and the
      sum adds gamma_(dim-1), so d64 >= (1 - gamma_(dim+2)) d. A hit has d64 < radius, so d < radius /
      (1 - gamma_(dim+2)) <= radius (1 + 4 (dim + 2) u) (1 / (1 - g) <= 1 + 2 g for g <= 1/4; the factor is
      exact in float64). |q|^2: the float64 sum of the exact squares, in any order, is within
      gamma_dim of it, so |q|^2 >= sum (1 - gamma_dim). T = radius (1 + 4 (dim + 2) u) - sum (1 - gamma_dim).
      (A radius <= 0 has no hit: any T is right.)
    - ip: the key is -q.x; the contract's ip64 sums the exact products q_i x_i in order, within
      gamma_dim sum |q_i x_i| <= gamma_dim |q| |x| of q.x. A hit has ip64 > radius, so -q.x < -radius +
      gamma_dim |q| max |x|: T = -radius + gamma_dim sqrt(sum (1 + gamma_dim) max_squares (1 + gamma_dim)).
    - cosine: the key is -cos(q, x) (the screen's unit shadows; zero rows have key 0 = -cos64). cos64 =
      fl(dot64 / fl(fl(sqrt(qq64)) fl(sqrt(xx64)))): dot64 within gamma_dim |q| |x| of q.x, qq64 and xx64
      within a factor (1 +- gamma_dim), then two square roots, a product and a division (4 u), so
      |cos64 - cos| <= gamma_dim (1 + |e|) + |e| with |e| <= gamma_(dim+4) to first order, < 8 gamma_(dim+8):
      T = -radius + 8 gamma_(dim+8).
    Each T is rounded up to float32 (the screen compares float32 lower bounds with it)."""
    q = np.asarray(queries, dtype=np.float32).astype(np.float64)
    dim = q.shape[1]
    squares = np.einsum("ij,ij->i", q, q)       # exact squares, summed (any order): within gamma_dim; no
                                                # q * q temporary (its pages cost ~0.2 ms at 1,000 x 128)
    if metric == "l2":
        inside = _up(radius * (1.0 + 4.0 * (dim + 2) * UNIT))
        least_qq = _down(squares * _down(1.0 - gamma(dim)))
        bound = _up(inside - least_qq)
    elif metric == "ip":
        most_qq = _up(squares * _up(1.0 + gamma(dim)))
        most_xx = _up(float(max_squares) * _up(1.0 + gamma(dim)))
        slack = _up(gamma(dim) * _up(np.sqrt(_up(most_qq * most_xx))))
        bound = _up(-radius + slack)
    elif metric == "cosine":
        bound = np.full(len(q), _up(-radius + _up(8.0 * gamma(dim + 8))))
    else:
        raise ValueError(f"radius_thresholds: metric must be 'l2', 'ip' or 'cosine'; got {metric!r}")
    return float32_up(bound)


def float32_up(values) -> np.ndarray:
    """float64 values rounded up to float32 (at least the value; -inf only for -inf)."""
    values = np.atleast_1d(np.asarray(values, dtype=np.float64))
    with np.errstate(over="ignore"):            # beyond float32: +-inf, then -inf rounded up to -max
        out = values.astype(np.float32)
    low = out.astype(np.float64) < values
    out[low] = np.nextafter(out[low], np.float32(np.inf))
    return out


def max_squares(searcher) -> float:
    """The rows' largest |x|^2, rounded up (verify.cuh's row_stats, kept by the ingest kernel)."""
    stats = np.zeros(4, dtype=np.uint32)
    searcher._buffers["row_stats"].copy_to_host(stats, 16, searcher._stream)
    searcher._stream.synchronize()
    return float(stats[:1].view(np.float32)[0])


def screened(searcher, queries: np.ndarray, radius: float):
    """(counts, distances, ids, handed_back) of every query in CSR order, the queries in handed_back (the device
    refused the screen's memory, or their survivors overflowed even when screened again) with count 0 and no
    hits; None when the screen cannot run on this index (a float32 row beyond float16)."""
    screen = searcher._screen
    larger = searcher.metric != "l2"
    radius_key = -radius if larger else radius
    thresholds = radius_thresholds(searcher.metric, queries, radius,
                                   max_squares(searcher) if searcher.metric == "ip" else 0.0)
    counts, distances, ids, back = [], [], [], []
    for start in range(0, len(queries), SCREEN_BATCH):
        stop = min(len(queries), start + SCREEN_BATCH)
        try:
            part = _screen_batch(searcher, queries[start:stop], thresholds[start:stop], radius_key, larger)
        except MemoryError:            # a device cap or a full device: range_kernel, which halves its pool
            part = np.zeros(stop - start, np.int64), np.empty(0, np.float32), np.empty(0, np.int64), \
                np.arange(stop - start)
        if part is None:
            return None
        for kept, value in zip((counts, distances, ids, back), part):
            kept.append(value)
        back[-1] = back[-1] + start
    handed_back = np.concatenate(back) if back else np.zeros(0, np.int64)
    screen.range_queries += len(queries)
    screen.range_fallbacks += len(handed_back)
    return (np.concatenate(counts) if counts else np.zeros(0, np.int64),
            np.concatenate(distances) if distances else np.empty(0, np.float32),
            np.concatenate(ids) if ids else np.empty(0, np.int64), handed_back)


def _screen_batch(searcher, queries: np.ndarray, thresholds: np.ndarray, radius_key: float, larger: bool):
    """(counts, distances, ids, handed_back) of one batch: screened once, its overflowed queries again (their
    answers merged in query order, each query's hits as one screen of it alone would sort them)."""
    room = first_room(searcher._n, len(queries))
    try:
        first = _screen_once(searcher, queries, thresholds, radius_key, larger, room)
    except MemoryError:                 # no room for the larger lists: the screen's own capacity (or the error)
        if room <= rs.SURVIVOR_CAPACITY:
            raise
        first = _screen_once(searcher, queries, thresholds, radius_key, larger, rs.SURVIVOR_CAPACITY)
    if first is None:
        return None
    counts, distances, ids, over, needed = first
    if not len(over):
        return counts, distances, ids, over
    searcher._screen.range_rescreens += len(over)
    kept = _others(len(queries), over)
    answers, back = _screen_again(searcher, queries, thresholds, radius_key, larger, over, needed)
    lims, distances, ids = combine(len(queries), [(kept, offsets(counts[kept]), distances, ids), *answers])
    return np.diff(lims), distances, ids, back


def _screen_again(searcher, queries, thresholds, radius_key: float, larger: bool, which: np.ndarray,
                  needed: np.ndarray):
    """The overflowed queries `which` (batch numbers; needed: their counted survivors) screened again, in groups
    of similar counts with room for every survivor: ([(queries, lims, distances, ids)], handed_back). A group
    the device refuses is halved; a query refused alone, or overflowing RESCREEN_ROUNDS times, is handed back."""
    answers, back = [], []
    for _ in range(RESCREEN_ROUNDS):
        groups, again = _groups(which, needed), []
        while groups:
            group, wanted = groups.pop()
            try:
                part = _screen_once(searcher, queries[group], thresholds[group], radius_key, larger,
                                    int(wanted.max()))
            except MemoryError:            # a device cap or a full device: halves, then range_kernel
                if len(group) > 1:
                    half = len(group) // 2
                    groups += [(group[:half], wanted[:half]), (group[half:], wanted[half:])]
                else:
                    back.append(group)
                continue
            if part is None:               # not reached: the batch's first screen ran on these rows
                back.append(group)
                continue
            counts, distances, ids, over, more = part
            kept = _others(len(group), over)
            answers.append((group[kept], offsets(counts[kept]), distances, ids))
            again.append((group[over], more))
        which = np.concatenate([g for g, _ in again]) if again else np.zeros(0, np.int64)
        needed = np.concatenate([m for _, m in again]) if again else np.zeros(0, np.int64)
    back.append(which)
    return answers, np.sort(np.concatenate(back))


def first_room(n_rows: int, n_queries: int) -> int:
    """Survivors a query has room for in a batch's first screen: SURVIVOR_BYTES shared by its queries, at
    least SURVIVOR_CAPACITY, at most every row."""
    return max(rs.SURVIVOR_CAPACITY, min(n_rows, SURVIVOR_BYTES // (4 * max(1, n_queries))))


def _others(n: int, which: np.ndarray) -> np.ndarray:
    """0..n-1 without `which` (np.setdiff1d's hashing cost ~60 us a call on the H200's host)."""
    keep = np.ones(n, dtype=bool)
    keep[which] = False
    return np.flatnonzero(keep)


def _groups(which: np.ndarray, needed: np.ndarray) -> list:
    """(queries, counts) groups, by ascending count, each holding at most SURVIVOR_BYTES of survivor lists at
    its largest count (a query needing more alone)."""
    order = np.argsort(needed, kind="stable")
    which, needed = which[order], needed[order]
    groups, first = [], 0
    for i in range(1, len(which) + 1):
        if i == len(which) or (i + 1 - first) * int(needed[i]) * 4 > SURVIVOR_BYTES:
            groups.append((which[first:i], needed[first:i]))
            first = i
    return groups


def _blocks_a_query(searcher, nq: int, capacity: int, threads: int) -> int:
    """Blocks of step 4 per query: one for a full batch; the few queries screened again, with thousands of
    survivors each, spread over enough blocks for about two a multiprocessor (at most one per `threads`
    survivors, a survivor a thread)."""
    return max(1, min(-(-2 * searcher._sm_count // nq), -(-capacity // threads)))


def _screen_once(searcher, queries: np.ndarray, thresholds: np.ndarray, radius_key: float, larger: bool,
                 capacity: int):
    """Steps 1 and 3 (Screen.screen_within) with `capacity` survivors a query, then step 4 with a pool grown
    until it holds every hit: (counts, distances, ids, overflowed, their survivor counts), the overflowed
    queries with no hits. The hit counts and the pool are the searcher's own buffers (kept, grown when
    short), as the screen's are."""
    if not searcher._screen.screen_within(queries, thresholds, capacity):
        return None
    s, stream, nq = searcher, searcher._stream, len(queries)
    step_spec = rs.step_spec("range_survivors", s.metric, s.dtype, 0, s._arch)
    step = s._kernel(step_spec)
    # the total (uint64) then the hits a query (uint32): one fill, one copy into `counted`, which has the
    # survivors a query (uint32) after them
    found = s._device("range_found", 8 + nq * 4)
    total, hits = found.ptr, found.ptr + 8
    counted = s._pinned("range_counted", 8 + nq * 8)
    wanted = max(POOL_FIRST, POOL_PER_QUERY * nq)
    grid = (nq, _blocks_a_query(s, nq, capacity, step.threads), 1)
    while True:
        pool = s._device("range_pool", wanted * HIT_BYTES)
        room = pool.nbytes // HIT_BYTES           # keys, then ids, then queries
        keys, ids, owners = pool.ptr, pool.ptr + room * 8, pool.ptr + room * 16
        found.fill_bytes(0, 8 + nq * 4, stream)
        s._packed(step_spec, s._pointer("screen_survivors"), s._pointer("screen_counts"), capacity,
                  s._pointer("ids"), s._pointer("data"), s._pointer("screen_q32"), s._stride, s.dim, radius_key,
                  room, keys, ids, owners, hits, total)[1].launch(
            grid, step.threads, 0, stream)
        # the counts into one pinned buffer with one wait, after step 4 (which reads the survivors' counts on
        # the device): no pageable copy and wait before it
        found.copy_to_host(counted.ptr, 8 + nq * 4, stream)
        s._buffers["screen_counts"].copy_to_host(counted.ptr + 8 + nq * 4, nq * 4, stream)
        stream.synchronize()
        words = counted.array(np.uint32, 2 + 2 * nq)
        n_hits = int(words[:2].view(np.uint64)[0])
        if n_hits <= room:
            break
        wanted = n_hits                   # at most nq x capacity; the survivors are kept: step 4 again
    counts, survivors = words[2:2 + nq].copy(), words[2 + nq:].astype(np.int64)
    distances, out_ids = group_and_sort(s, keys, ids, owners, n_hits, counts, hits, larger)
    over = np.flatnonzero(survivors > capacity)
    return counts.astype(np.int64), distances, out_ids, over, survivors[over]


__all__ = ["applies", "radius_thresholds", "screened", "float32_up", "gamma"]
