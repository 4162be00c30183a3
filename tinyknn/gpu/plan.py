"""The search plan: which kernels a search of (n_queries, k) launches, on which grid, with parameters
packed once.

Length: the plan's grid rules and the launch arguments of every kernel it can run are kept together, since
the slot order of one must follow the other.

A search is two launches: a selection kernel (`scan` for small batches, `tiled` for large ones) that
writes the k + margin best of every (query, database slice) by its float32 key (large l2 batches by
a cheaper filter key), then `verify`, which settles each query's answer in float64 under the
exactness contract and writes a per-query status (1: not proven; the searcher then runs the `band`
search for that query, see render.py). The database is split into enough slices to give every SM
several blocks, so a single query still uses the whole GPU. A plan is built once per (n_queries, k) for the
index's current buffers and size; `add`, `reset` and buffer growth throw the plans away.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

from ..jit import cuda_source, render, render_screen, render_single
from ..jit.cache import get_cubin
from ..spec import KernelSpec
import numpy as np

from .launcher import Kernel, PreparedLaunch, ReplayedIssue, load_module

# Tuning, from the measurements in bench/NOTES_GPU.md.
SCAN_MAX_QUERIES = 8        # up to this many queries per batch: scan; tiled beyond (crossover in NOTES_GPU.md)
USE_SINGLE = True           # one query: the single-query kernel (tests switch it off to reach the others)
SCAN_WAVES = 1              # scan grid: SMs x resident blocks per SM x this many waves
TILED_WAVES = 1             # tiled grid: the fewest whole waves that fill the GPU (fewer slices, fewer lists)
TILED_MIN_FILL = 0.85       # ... where the last wave holds at least this share of resident blocks
SINGLE_MIN_SLICE_ROWS = 512    # one query: at least this many rows a slice (not yet measured; bench/single_query.py)
MAX_BATCH = 8192            # queries per launch pair (bounds the candidate buffer; grid.y <= 65535)
ROW_KERNEL_THREADS = 256        # ingest, band, rows, range and the screen steps: rows one by one
SELECTION_THREADS = {"select": 1024, "segment_sort": 512}   # select.cuh's SELECT_THREADS, SORT_THREADS

_P, _I, _L, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_double


class TensorMapArg(ctypes.Structure):
    """A CUtensorMap passed by value (128 bytes; the kernel declares it __grid_constant__)."""
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


ARGUMENTS = {
    # ingest_kernel(src, src_itemsize, src_row_stride, n_rows, dim, dst, dst_row_stride, norms, squared, norm_max,
    #               status)
    "norms": (_P, _I, _L, _L, _I, _P, _I, _P, _I, _P, _P),
    # scan/tiled(data, inv_norms, n_data, rows_per_slice, queries, n_queries, row_stride, out_keys, out_positions,
    #            bounds, listed_rows)
    "scan": (_P, _P, _L, _L, _P, _I, _I, _P, _P, _P, _P),
    "tiled": (_P, _P, _L, _L, _P, _I, _I, _P, _P, _P, _P),
    # single_kernel(data, scan_rows, inv_norms, n_data, rows_per_slice, queries, ids, out_keys, out_positions,
    #               out_distances, out_ids, arrivals, row_stats, status, threshold, dim, listed_rows)
    "single": (_P, _P, _P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P),
    # verify_kernel(keys, positions, n_lists, ids, out_distances, out_ids, bounds, data, queries, row_stride, dim,
    #               row_stats, status, threshold)
    "verify": (_P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P),
    # band_kernel(data, ids, n_data, row_stride, dim, queries, which, threshold, capacity, band_keys, band_ids,
    #             counts)
    "band": (_P, _P, _L, _I, _I, _P, _P, _P, _I, _P, _P, _P),
    # copy_rows_kernel(src, dst, words_per_row, from, to, count, src_ids, dst_ids, src_norms, dst_norms)
    "rows": (_P, _P, _I, _P, _P, _L, _P, _P, _P, _P),
    # range_kernel(data, inv_norms, ids, n_data, row_stride, dim, queries, n_queries, radius_key, row_stats,
    #              capacity, out_keys, out_ids, pool_queries, counts, total)
    "range": (_P, _P, _P, _L, _I, _I, _P, _I, _D, _P, _L, _P, _P, _P, _P, _P),
    # select_kernel(keys, ids, n, take, segment, out_keys, out_ids)
    "select": (_P, _P, _L, _I, _L, _P, _P),
    # scatter_kernel(pool_keys, pool_ids, pool_queries, total, segments, cursors, out_keys, out_ids)
    "scatter": (_P, _P, _P, _L, _P, _P, _P, _P),
    # segment_sort_kernel(keys, ids, segments, counts, out_offsets, larger, out_distances, out_ids)
    "segment_sort": (_P, _P, _P, _P, _P, _I, _P, _P),
    # screen_kernel(data, n_rows, row_step, sq_norms, row_norms, queries, n_queries, row_bytes, thresholds,
    #               err_scale, err_offset, counts, survivors, capacity, out_upper, tiles_per_block)
    "screen": (_P, _L, _L, _P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _I, _P, _I),
    # screen_queries_kernel(queries, n_queries, query_stride, dim, out, out_stride, n_mma, shadow, normalize,
    #                       key_scale, err_scale, err_offset)
    "screen_queries": (_P, _I, _I, _I, _P, _I, _I, _I, _I, _D, _P, _P),
    # screen_rows_kernel(data, row_stride, first, last, dim, shadow, shadow_stride, normalize, sq_lo, sq_hi, r_x,
    #                    status)
    "screen_rows": (_P, _I, _L, _L, _I, _P, _I, _I, _P, _P, _P, _P),
    # screen_hopper_kernel(tmap_q, tmap_x, n_rows, sq_norms, tile_rmax, n_queries, row_bytes, thresholds, err_scale,
    #                      err_offset, counts, survivors, capacity, out_upper)
    "screen_hopper": (TensorMapArg, TensorMapArg, _I, _P, _P, _I, _I, _P, _P, _P, _P, _P, _I, _P),
    # tile_rmax_kernel(r_x, n_rows, first_tile, last_tile, tile_rmax)
    "screen_tiles": (_P, _L, _L, _L, _P),
    # sample_terms_kernel(sq_hi, r_x, step, n_tiles, sample_sq, sample_rmax)
    "screen_sample": (_P, _P, _L, _I, _P, _P),
    # threshold_kernel(upper, per_query, threshold)
    "threshold": (_P, _I, _P),
    # verify_survivors_kernel(survivors, counts, ids, data, queries, row_stride, dim, out_distances, out_ids, status)
    "survivors": (_P, _P, _P, _P, _P, _I, _I, _P, _P, _P),
    # range_survivors_kernel(survivors, counts, survivor_capacity, ids, data, queries, row_stride, dim, radius_key,
    #                        capacity, out_keys, out_ids, pool_queries, hits, total)
    "range_survivors": (_P, _P, _I, _P, _P, _P, _I, _I, _D, _L, _P, _P, _P, _P, _P),
}
# Where the outputs (distances, ids, status, threshold) sit among a plan's last launch's arguments.
OUTPUT_SLOTS = {"verify": (4, 5, 12, 13), "single": (9, 10, 13, 14)}


@dataclass(frozen=True)
class LoadedKernel:
    """A kernel of one spec, loaded into the current context, with its launch shape."""

    spec: KernelSpec
    kernel: Kernel
    threads: int
    shared_bytes: int
    blocks_per_sm: int

    def prepare(self, *values) -> PreparedLaunch:
        return self.kernel.prepare(ARGUMENTS[self.spec.variant], values or None)


def load_kernel(spec: KernelSpec) -> LoadedKernel:
    """cubin (memory, disk or NVRTC) -> module (once per process) -> kernel with its shared memory set."""
    kernel = load_module(get_cubin(spec)).kernel(cuda_source.name_expression(spec))
    if spec.variant == "screen":
        threads = 32 * spec.param("wq") * spec.param("wn")
    elif spec.variant == "screen_hopper":
        threads = render_screen.hopper_threads(spec)
    elif spec.variant in ("scan", "single", "tiled", "verify", "survivors"):
        threads = spec.param("warps") * 32
    elif spec.variant in SELECTION_THREADS:
        threads = SELECTION_THREADS[spec.variant]
    else:                       # ingest, band, rows, range and the screen's steps
        threads = ROW_KERNEL_THREADS
    shared = spec.param("smem", 0)
    if shared > 48 * 1024:
        kernel.set_max_dynamic_shared(shared)
    return LoadedKernel(spec, kernel, threads, shared, max(1, kernel.max_active_blocks_per_sm(threads, shared)))


def choose_variant(n_queries: int, k: int) -> str:
    """single for one query (k up to SINGLE_MAX_K), scan for small batches (and whenever k is beyond the
    tiled kernel), tiled for large ones."""
    if n_queries == 1 and k <= render_single.SINGLE_MAX_K and USE_SINGLE:
        return "single"
    return "scan" if n_queries <= SCAN_MAX_QUERIES or k > render.TILED_MAX_K else "tiled"


def queries_per_block(spec: KernelSpec) -> int:
    if spec.variant == "single":
        return 1
    return spec.param("qb") if spec.variant == "scan" else spec.param("bq")


def rows_granule(spec: KernelSpec) -> int:
    """Rows a block handles per step: slices are whole multiples of it."""
    if spec.variant in ("scan", "single"):
        return spec.param("warps") * 32 // spec.param("lanes")
    return spec.param("bn")


def whole_wave_slices(groups: int, resident: int, variant: str) -> int:
    """Slices per query group so that groups x slices blocks fill whole waves of `resident` blocks:
    the scan takes SCAN_WAVES waves; the tiled kernel the fewest waves (from TILED_WAVES) whose blocks
    fill TILED_MIN_FILL of them (10,000 queries: 157 groups x 3 slices in 2 waves, not 157 x 1 in one)."""
    if variant in ("scan", "single"):
        return max(1, resident * SCAN_WAVES // groups)
    waves = TILED_WAVES
    while True:
        slices = max(1, resident * waves // groups)
        if groups * slices >= TILED_MIN_FILL * waves * resident or waves >= 8:
            return slices
        waves += 1


def split_rows(n_data: int, groups: int, loaded: LoadedKernel, sm_count: int, k: int,
               slices: int | None = None) -> tuple[int, int]:
    """(slices, rows_per_slice): enough blocks for every SM, slices no smaller than a step or k."""
    if slices is None:   # rounded down: a last wave of a few blocks would cost as much as a full one
        slices = whole_wave_slices(groups, sm_count * loaded.blocks_per_sm, loaded.spec.variant)
        if loaded.spec.variant == "single":     # a small database: fewer blocks, fewer lists for the last one
            slices = min(slices, max(1, math.ceil(n_data / SINGLE_MIN_SLICE_ROWS)))
    if loaded.spec.variant == "single":   # its slices hold at most rmax rows (a multiple of the granule) ...
        resident = sm_count * loaded.blocks_per_sm
        needed = math.ceil(n_data / loaded.spec.param("rmax"))
        if needed > slices:     # ... in whole waves: 2M rows at 8,192 a slice take 245 slices in 2 waves, as 264 do
            slices = math.ceil(needed / resident) * resident
    granule = rows_granule(loaded.spec)
    rows = max(granule, k, math.ceil(max(n_data, 1) / max(1, slices)))
    rows = math.ceil(rows / granule) * granule
    return max(1, math.ceil(n_data / rows)), rows


@dataclass
class SearchPlan:
    """The launches of one batch shape, parameters packed: the selection kernel and the verify step
    (verify None: the single-query kernel verifies in its last block); `launch` enqueues them."""

    variant: str
    n_queries: int
    k: int
    slices: int
    rows_per_slice: int
    main: PreparedLaunch
    main_grid: tuple[int, int, int]
    main_block: int
    main_shared: int
    verify: PreparedLaunch | None
    verify_block: int
    verify_shared: int
    bounds: object          # DeviceBuffer of n_queries uint32: zero before a search, zeroed again by verify
    list_k: int             # candidates per (query, slice): k + the verify step's margin

    def launch(self, stream) -> None:
        self.main.launch(self.main_grid, self.main_block, self.main_shared, stream)
        if self.verify is not None:
            self.verify.launch(self.n_queries, self.verify_block, self.verify_shared, stream)

    def _outputs(self) -> tuple[PreparedLaunch, tuple[int, int, int, int]]:
        """The launch that writes the results (verify, or the single-query kernel) and its output slots."""
        return (self.main, OUTPUT_SLOTS["single"]) if self.verify is None else (self.verify, OUTPUT_SLOTS["verify"])

    @property
    def threshold_ptr(self) -> int:
        """Where the last launch writes each query's threshold (the band search reads it)."""
        last, slots = self._outputs()
        return last.values()[slots[3]]

    def set_outputs(self, distances_ptr: int, ids_ptr: int, status_ptr: int, threshold_ptr: int) -> None:
        """Point the verify step at other result arrays (device arrays of the caller's framework) and at
        another status and threshold array."""
        last, slots = self._outputs()
        for slot, value in zip(slots, (distances_ptr, ids_ptr, status_ptr, threshold_ptr)):
            last.set(slot, value)


def result_layout(n_queries: int, k: int) -> tuple[int, int, int]:
    """(ids offset, status offset, total bytes) of one batch's results: float32 distances, int64 ids
    and int32 statuses, so that one copy brings all of them back."""
    ids_offset = (n_queries * k * 4 + 7) // 8 * 8
    status_offset = ids_offset + n_queries * k * 8
    return ids_offset, status_offset, status_offset + n_queries * 4


class HostBatch(ReplayedIssue):
    """A plan plus the copies around it for host queries: pinned stage -> device, the two launches,
    device results -> pinned (one query: written there by the kernel). The NumPy views of the staging are
    made once. On its second use the whole sequence is captured as a CUDA graph and replayed with one driver
    call."""

    def __init__(self, plan: SearchPlan, queries, stage, query_bytes: int, results, results_stage,
                 row_stride: int):
        n, k = plan.n_queries, plan.k
        self.plan, self.queries, self.stage_buffer, self.query_bytes = plan, queries, stage, query_bytes
        self.results, self.results_stage = results, results_stage
        ids_offset, status_offset, self.result_bytes = result_layout(n, k)
        self.stage = stage.array(np.float32, (n, row_stride))
        raw = results_stage.array(np.uint8, self.result_bytes)
        self.distances = raw[:n * k * 4].view(np.float32).reshape(n, k)
        self.ids = raw[ids_offset:status_offset].view(np.int64).reshape(n, k)
        self.status = raw[status_offset:].view(np.int32)
        # One query: the single-query kernel writes its results into the pinned staging itself (mapped host
        # memory), one copy-engine operation fewer: 38.4 -> 32.7 us end to end on 100k x 128
        # (bench/probes/single_io.py, H200). Batches keep the copy: their results are many and written by many
        # blocks, where one bulk copy is the cheaper way over the bus.
        self.direct = plan.verify is None
        if self.direct:
            base = results_stage.device_ptr
            plan.set_outputs(base, base + ids_offset, base + status_offset, plan.threshold_ptr)

    def issue(self, stream) -> None:
        self.queries.copy_from_host(self.stage_buffer, self.query_bytes, stream)
        self.plan.launch(stream)
        if not self.direct:
            self.results.copy_to_host(self.results_stage, self.result_bytes, stream)

    def run(self, stream, use_graphs: bool) -> None:
        self.replay(stream, self.issue, use_graphs)


def list_k(main: KernelSpec) -> int:
    """Candidates the selection kernel keeps per (query, slice)."""
    return main.param("kl")


def candidate_bytes(n_queries: int, slices: int, per_list: int) -> int:
    """Bytes of (key, position) candidates a plan writes: n_queries x slices x per_list x (4 + 4)."""
    return n_queries * slices * per_list * 8


def build_plan(main: LoadedKernel, verify: LoadedKernel | None, *, n_queries: int, k: int, n_data: int, dim: int,
               slices: int, rows_per_slice: int, row_stride: int, data_ptr: int, norms_ptr: int, queries_ptr: int,
               scan_rows_ptr: int = 0, listed_rows_ptr: int = 0,
               keys_ptr: int, positions_ptr: int, ids_ptr: int, distances_out: int, ids_out: int,
               bounds, row_stats_ptr: int, status_ptr: int, threshold_ptr: int) -> SearchPlan:
    """The selection kernel `main` and the verify step after it, parameters packed (the single-query
    kernel: one launch, its last block verifies; `bounds` holds its arrival counter; it streams
    `scan_rows_ptr`, a float32 index's float16 shadow, when given, else the rows themselves). listed_rows_ptr: the
    int32 positions a listed kernel reads (n_data of them; 0 for the others)."""
    groups = math.ceil(n_queries / queries_per_block(main.spec))
    if main.spec.variant == "single":
        single = main.prepare(data_ptr, scan_rows_ptr or data_ptr, norms_ptr, n_data, rows_per_slice, queries_ptr,
                              ids_ptr, keys_ptr, positions_ptr, distances_out, ids_out, bounds.ptr, row_stats_ptr,
                              status_ptr, threshold_ptr, dim, listed_rows_ptr)
        return SearchPlan("single", n_queries, k, slices, rows_per_slice, single, (slices, 1, 1), main.threads,
                          main.shared_bytes, None, 0, 0, bounds, list_k(main.spec))
    main_launch = main.prepare(data_ptr, norms_ptr, n_data, rows_per_slice, queries_ptr, n_queries, row_stride,
                               keys_ptr, positions_ptr, bounds.ptr, listed_rows_ptr)
    verify_launch = verify.prepare(keys_ptr, positions_ptr, slices, ids_ptr, distances_out, ids_out, bounds.ptr,
                                   data_ptr, queries_ptr, row_stride, dim, row_stats_ptr, status_ptr, threshold_ptr)
    return SearchPlan(main.spec.variant, n_queries, k, slices, rows_per_slice, main_launch,
                      (slices, groups, 1), main.threads, main.shared_bytes,
                      verify_launch, verify.threads, verify.shared_bytes, bounds, list_k(main.spec))


__all__ = [
    "HostBatch", "LoadedKernel", "MAX_BATCH", "SearchPlan", "build_plan", "candidate_bytes", "choose_variant",
    "list_k", "result_layout",
    "load_kernel", "split_rows",
]
