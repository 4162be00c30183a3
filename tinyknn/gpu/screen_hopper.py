"""The Hopper half of the tensor-core screen (kernels/screen_hopper.cuh), a mixin of gpu/screen.py's Screen.

On compute capability 9.0, step 3 of a screened batch is the Hopper screen: wgmma fed by TMA, a persistent grid
of one CTA per SM, the bound of each tile's largest r_x (`tile_rmax`) kept beside the row terms; step 2 is its
threshold mode over whole tiles of the strided sample where step 3 runs it (KT <= 2 bounds a tile).
TINYKNN_SCREEN=mma keeps the mma.sync screen there (A/B comparisons). The row tensor map is encoded again only
when the rows' address or count changes; the queries' once per batch.
"""

from __future__ import annotations

import math

from ..jit import render_screen as rs
from .plan import TensorMapArg
from .tensor_map import as_bytes, encode, sample_map_args, tensor_map_args

HOPPER_MIN_QUERIES = 256          # auto: the Hopper screen only where it measured faster on the H200 (2026-12-01,
HOPPER_MIN_PRODUCTS = 1 << 28     # bench/results/hopper_screen_check_...): 1M x 768 at 1,000 queries 5.12 against
                                  # 9.04 ms; slower at 1M x 768 x 100 (1.62 / 1.40) and 100k x 128 x 1,000 (0.67 / 0.59)
HOPPER_SMALL_MAX_QUERIES = 128    # a batch of at most this many: the small tile (render_screen.hopper_tile), where
HOPPER_SMALL_MIN_PRODUCTS = 1 << 25   # queries x rows reach this. H200, k = 10, whole against mma.sync's: 1M x 768
                                      # float32 x 100 0.61 / 1.11 ms, 1M x 128 float32 x 100 0.25 / 0.41, 2M x 128
                                      # uint8 x 100 0.41 / 0.54; even at 100k x 128 x 100 (0.18 / 0.16-0.24)


def hopper_pays(n_queries: int, n_rows: int) -> bool:
    """Whether a batch is large enough for the Hopper screen's 256-query tiles and persistent grid to win."""
    return n_queries >= HOPPER_MIN_QUERIES and n_queries * n_rows >= HOPPER_MIN_PRODUCTS


def small_tile_pays(n_queries: int, n_rows: int) -> bool:
    """Whether a batch of at most HOPPER_SMALL_MAX_QUERIES runs the Hopper screen's small tile (one 128-query
    tile streaming the rows) rather than mma.sync's."""
    return n_queries <= HOPPER_SMALL_MAX_QUERIES and n_queries * n_rows >= HOPPER_SMALL_MIN_PRODUCTS


def use_hopper(arch: str, choice: str) -> bool:
    """Whether step 3 runs the Hopper screen: on compute capability 9.0 unless TINYKNN_SCREEN=mma; a choice of
    wgmma on another device is a ValueError (a comparison must not measure the other kernel unawares)."""
    available = rs.hopper_arch(arch) is not None
    if choice == "wgmma" and not available:
        raise ValueError(f"TINYKNN_SCREEN=wgmma needs a device of compute capability 9.0 (arch sm_90); "
                         f"this one is {arch}")
    return available and choice != "mma"


class HopperSteps:
    """Mixin of Screen: the Hopper screen's launches, its tile bounds and its tensor maps (kept in `_maps`)."""

    def _hopper_for(self, nq: int):
        """The Hopper screen spec step 3 of a batch of nq queries runs (its small tile for at most 128 queries),
        or None for mma.sync's."""
        if not self._hopper_rows():
            return None
        small = nq <= HOPPER_SMALL_MAX_QUERIES
        if self.forced or (small_tile_pays(nq, self.searcher._n) if small else hopper_pays(nq, self.searcher._n)):
            return self.hopper_specs[small]
        return None

    def _hopper_rows(self) -> bool:
        """Whether the Hopper kernels can read this index's rows (compute capability 9.0, under 2^31 rows, every
        row: their tile bounds start at row 0, so a run of rows takes mma.sync's screen)."""
        s = self.searcher
        return self.hopper and s._n < (1 << 31) - 256 and getattr(s._view, "prefix", "") == ""

    def _tile_rows_all(self) -> list[int]:
        """The row-tile heights whose bounds are kept: the large tile's and, where it differs, the small one's."""
        return sorted({spec.param("bn") for spec in self.hopper_specs.values()})

    def _rmax_name(self, bn: int) -> str:
        """The device buffer of the tile bounds of tiles of `bn` rows (the large tile's: screen_tile_rmax)."""
        return "screen_tile_rmax" if bn == self.tile_rows else f"screen_tile_rmax_{bn}"

    def _tile_bounds(self, first_row: int, n: int) -> None:
        """tile_rmax of every Hopper tile (of each kept height) from the one holding first_row to the last of
        rows [0, n)."""
        s = self.searcher
        for bn in self._tile_rows_all():
            first, last = first_row // bn, -(-n // bn)
            tiles = s._kernel(rs.tiles_spec(bn, s._arch))
            tiles.prepare(s._pointer("screen_rx"), n, first, last, s._pointer(self._rmax_name(bn))).launch(
                math.ceil((last - first) / 8), 256, 0, s._stream)

    def _threshold_hopper(self, rows: int, nq: int, tiles: int, step: int, kept: int, screen_spec) -> None:
        """Step 2 on sm_90a: the sample's terms in tile order, then the Hopper screen's threshold mode (with the
        tile of `screen_spec`, the batch's Hopper screen)."""
        s = self.searcher
        small = screen_spec != self.hopper_specs[False]
        ptr, bn = s._pointer, screen_spec.param("bn")
        self._packed(rs.sample_spec(bn, s._arch), ptr("screen_sq_hi"), ptr("screen_rx"), step, tiles,
                     ptr("screen_sample_sq"), ptr("screen_sample_rmax"))[1].launch(math.ceil(tiles / 8), 256, 0,
                                                                                   s._stream)
        spec = rs.hopper_spec(s.metric, s.dtype, self.stride, s._arch, keep=kept, small=small)
        tile_q = rs.hopper_tile_queries(spec)
        sample_map = self._tensor_map("sample", (rows, tiles, step, bn), lambda: sample_map_args(
            rows, tiles, step, self.row_bytes, self.element_bytes, bn))
        query_map = self._query_map(nq, tile_q)
        loaded, launch = self._packed(spec, query_map, sample_map, tiles * bn,
                                      ptr("screen_sample_sq") if s.metric == "l2" else 0, ptr("screen_sample_rmax"),
                                      nq, self.row_bytes, 0, ptr("screen_e"), ptr("screen_f"), 0, 0, 0,
                                      ptr("screen_upper"))
        launch.launch(max(1, min(-(-nq // tile_q) * tiles, s._sm_count)), loaded.threads, loaded.shared_bytes,
                      s._stream)

    def _screen_hopper(self, rows: int, n_rows: int, nq: int, capacity: int, spec) -> None:
        """Step 3 on sm_90a: the persistent Hopper screen of `spec` (the large or the small tile), one CTA per SM."""
        s = self.searcher
        bn, tile_q = spec.param("bn"), rs.hopper_tile_queries(spec)
        ptr = s._pointer
        row_map = self._rows_map(f"rows{bn}", rows, n_rows, bn)
        query_map = self._query_map(nq, tile_q)
        tiles = -(-nq // tile_q) * -(-n_rows // bn)
        loaded, launch = self._packed(spec, query_map, row_map, n_rows,
                                      ptr("screen_sq_lo") if s.metric == "l2" else 0, ptr(self._rmax_name(bn)), nq,
                                      self.row_bytes, ptr("screen_t"), ptr("screen_e"), ptr("screen_f"),
                                      ptr("screen_counts"), ptr("screen_survivors"), capacity, 0)
        launch.launch(max(1, min(tiles, s._sm_count)), loaded.threads, loaded.shared_bytes, s._stream)

    def _tensor_map(self, name: str, what: tuple, make_args) -> TensorMapArg:
        """The kept map of `name`, encoded again (from make_args()) when what it maps changed."""
        kept = self._maps.get(name)
        if kept is None or kept[0] != what:
            kept = self._maps[name] = (what, TensorMapArg.from_buffer_copy(as_bytes(encode(make_args()))))
        return kept[1]

    def _rows_map(self, name: str, address: int, rows: int, box_rows: int) -> TensorMapArg:
        return self._tensor_map(name, (address, rows, box_rows), lambda: tensor_map_args(
            address, rows, self.row_bytes, self.element_bytes, box_rows))

    def _query_map(self, nq: int, tile_q: int) -> TensorMapArg:
        return self._rows_map(f"queries{tile_q}", self.searcher._pointer("screen_q"), nq, tile_q)


__all__ = ["HopperSteps", "HOPPER_MIN_PRODUCTS", "HOPPER_MIN_QUERIES", "HOPPER_SMALL_MAX_QUERIES",
           "HOPPER_SMALL_MIN_PRODUCTS", "hopper_pays", "small_tile_pays", "use_hopper"]
