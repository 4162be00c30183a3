"""The one-query kernel's specs (single_kernel, kernels/single.cuh: selection and verify step in one launch): its
tuning, parameters and the variants a search may pick. Apart from render.py because its knobs (shadow, staged
verify, shared bound, listed) make it the largest of the variants; it builds on render.py's row layout, list
lengths and verify step. The variant catalogue is in render.py's docstring.
"""

from __future__ import annotations

from ..spec import KernelSpec
from .render import (BOUNDED_BYTES, ITEMSIZE, RADIX_BYTES, SCAN_CHUNKS_PER_LANE, align16, list_length, mark_listed,
                     query_floats, row_layout, scan_params, sort_slots, verify_params)

# Tuning (see bench/NOTES_SINGLE.md for the measurements behind each number).
SINGLE_WARPS = 16               # warps per single-query block (16: 0.057 ms on 100k x 128; 8: 0.073, 4: 0.13)
SINGLE_MAX_ROWS = 8192          # rows per single-query slice (its keys in shared memory): 1M rows in one wave of
                                # 132 slices, not 4 of 521 (1M x 768 float16: 384 -> 375 us); fewer rows keep theirs
SINGLE_MIN_LANES = 4            # lanes a row at least, for rows of 16+ chunks (100k x 128 float16 shadow: 2 lanes
                                # 22.2 us, 4 lanes 20.3): more rows in flight a warp than the scan's 8 chunks a lane
SINGLE_UNROLL = 2               # rows per lane whose loads are in flight together (1 for 8-bit rows: their
                                # 16-element chunks unpack into too many registers at 2; 1 where a lane holds
                                # more than SCAN_CHUNKS_PER_LANE chunks of a row, the lanes capped at 32: float32
                                # rows past 1,024 dims, whose 2 x 12 chunks spilled beside bounded_gather)
# The last block copies the lists to shared memory up to this many entries (170 slices of 18), beside
# bounded_gather's scratch: together the 32 KB the copy alone took at 4,096 entries.
SINGLE_COPY_MAX = 3072
SINGLE_STAGE_MAX_SMEM = 200 * 1024   # the staged verify step's shared memory at most (an H100/H200 block: 227 KB)
SINGLE_STAGE_ARCHS = ("sm_90", "sm_90a")   # where the verify step stages its rows by default, where they fit (H200,
                                # 1M x 768 kernel: float32 through its shadow 383.2 -> 376.4 us, float16 374.6 -> 372.2;
                                # 100k x 128 20.2 both): measured on Hopper only, whose blocks get 227 KB
SINGLE_STAGE_AHEAD = 4          # the staged chain's chunks loaded a step by default (H200, four interleaved rounds:
                                # kernel 100k x 128 19.6 -> 18.6 us, 1M x 768 float16 370.8 -> 368.3, float32
                                # through its shadow 375.9 -> 369.8; 8 the same as 4)
SINGLE_SHARED_BOUND_BYTES = 128 << 20   # on SINGLE_STAGE_ARCHS, one query that streams at least this many bytes
                                # has its slices share a bound (single_shares_bound)
SINGLE_MAX_K = 128              # the single-query kernel up to this k (its last block verifies k + margin)
SINGLE_SHADOW_MARGIN = 8        # candidates beyond k when streaming a float32 index's float16 shadow (its bound is
                                # looser than float32's: 2 extra would send more near-ties to the band search)


def single_params(dtype: str, dim: int, k: int, *, lanes: int | None = None, warps: int = SINGLE_WARPS,
                  rmax: int = SINGLE_MAX_ROWS, unroll: int | None = None,
                  cmax: int = SINGLE_COPY_MAX, shadow: bool = False, listed: bool = False,
                  stage: int | None = 0, shared_bound: bool = False) -> dict[str, int]:
    """Parameters of the single-query kernel: the scan kernel's lanes per row, a slice of at most
    `rmax` rows whose keys and positions sit in shared memory, and room for the verify step after.
    shadow: a float32 l2 index streams its float16 shadow (single.cuh's ShadowKeyBound), with a wider margin.
    listed: it reads the rows a position list names (a filter's, in place). stage=1: the verify step stages
    its candidates' rows in shared memory, a thread a candidate (verify.cuh's verify_distances_staged;
    ValueError where they do not fit in SINGLE_STAGE_MAX_SMEM); stage=2 to 16: staged, the chain loading that
    many chunks a step (its AHEAD); stage=None: staged where they fit, SINGLE_STAGE_AHEAD chunks a step.
    shared_bound (a knob, "gt"): a slice that finds another's KL-th key published lists only its keys under it
    (single.cuh's GT)."""
    if shadow and dtype != "float32":
        raise ValueError(f"only a float32 index streams a float16 shadow; got dtype {dtype!r}")
    streamed = "float16" if shadow else dtype
    kl = k + SINGLE_SHADOW_MARGIN if shadow else list_length(k)
    chunks, stride = row_layout(dim, streamed)
    if lanes is None:
        lanes = scan_params(streamed, dim, k)["lanes"]
        if chunks >= 4 * SINGLE_MIN_LANES:
            lanes = max(lanes, SINGLE_MIN_LANES)
    if unroll is None:
        unroll = SINGLE_UNROLL if ITEMSIZE[streamed] > 1 and -(-chunks // lanes) <= SCAN_CHUNKS_PER_LANE else 1
    query_bytes = align16(query_floats(chunks, stride, lanes) * 4) + 16
    slice_bytes = align16(query_bytes + rmax * 8 + sort_slots(kl) * 8 + RADIX_BYTES) + BOUNDED_BYTES
    verify_own = align16(verify_params(kl, False)["smem"])       # verify_shared_bytes<KL> (single.cuh)
    verify_bytes = verify_own + cmax * 8 + BOUNDED_BYTES             # + the lists, bounded_gather's scratch
    params = {"kl": kl, "lanes": lanes, "warps": warps, "rmax": rmax, "unroll": unroll, "cmax": cmax,
              "smem": max(slice_bytes, verify_bytes)}
    if stage is not None and not 0 <= stage <= 16:
        raise ValueError(f"stage is 0 (no staging), 1 or the staged chain's chunks a step up to 16; got {stage}")
    if stage != 0:
        row_bytes = row_layout(dim, dtype)[1] * ITEMSIZE[dtype]      # the stored rows, as verify reads them
        staged = verify_own + align16(dim * 8) + kl * ((row_bytes // 4) | 1) * 4
        fits = staged <= SINGLE_STAGE_MAX_SMEM
        if stage is None:
            stage = SINGLE_STAGE_AHEAD if fits else 0
        elif not fits:
            raise ValueError(f"stage={stage} needs {staged} bytes of shared memory for {kl} rows of {row_bytes} bytes; "
                             f"at most {SINGLE_STAGE_MAX_SMEM} fit")
        if stage:
            params = {**params, "smem": max(params["smem"], staged), "stage": stage}
    if shared_bound:
        params = {**params, "gt": 1}
    return mark_listed({**params, "shadow": 1} if shadow else params, listed)


def single_spec(metric: str, dtype: str, dim: int, k: int, arch: str, **overrides) -> KernelSpec:
    """The single-query kernel (selection and verify step in one launch); shadow=True only for l2. On
    SINGLE_STAGE_ARCHS its verify step stages its rows where they fit, SINGLE_STAGE_AHEAD chunks a step
    (stage=0, or 1 to 16, to choose)."""
    if overrides.get("shadow") and metric != "l2":
        raise ValueError(f"the single-query kernel streams a float16 shadow for l2 only; got metric {metric!r}")
    overrides.setdefault("stage", None if arch in SINGLE_STAGE_ARCHS else 0)
    return KernelSpec(metric, dtype, dim, k, "single", arch, tuple(single_params(dtype, dim, k, **overrides).items()))


def single_shares_bound(arch: str, dtype: str, dim: int, n_rows: int, shadow: bool = False) -> bool:
    """Whether one query's slices share a bound by default (single_params shared_bound): on SINGLE_STAGE_ARCHS,
    where the rows streamed reach SINGLE_SHARED_BOUND_BYTES, whose slices' streams end further apart than the
    select a published bound saves. H200, kernel medians of four interleaved rounds (bench/probes/single_ab.py):
    1M x 128 float32 94.7 -> 90.6 us, 1M x 768 float16 361.3 -> 357.1, float32 363.2 -> 359.0, 2M x 768
    float16 698.5 -> 691.0; but 100k x 128 float32 (26 MB of shadow) 18.9 -> 19.4."""
    streamed = "float16" if shadow else dtype
    row_bytes = row_layout(dim, streamed)[1] * ITEMSIZE[streamed]
    return arch in SINGLE_STAGE_ARCHS and n_rows * row_bytes >= SINGLE_SHARED_BOUND_BYTES


def single_spec_over(n_rows: int, metric: str, dtype: str, dim: int, k: int, arch: str, **overrides) -> KernelSpec:
    """The single-query kernel a search over `n_rows` rows runs: single_spec, with the slices' shared bound where
    single_shares_bound says unless `overrides` name it."""
    shadow = bool(overrides.get("shadow", False))
    overrides.setdefault("shared_bound", single_shares_bound(arch, dtype, dim, n_rows, shadow))
    return single_spec(metric, dtype, dim, k, arch, **overrides)


def single_specs(metric: str, dtype: str, dim: int, k: int, arch: str, listed: bool = False) -> list[KernelSpec]:
    """Every single-query kernel a search of (metric, dtype, dim, k) may pick: the rows themselves and, for
    float32 l2, the float16 shadow; on SINGLE_STAGE_ARCHS each also with the slices' shared bound."""
    shadows = (False, True) if metric == "l2" and dtype == "float32" else (False,)
    shared = (False, True) if arch in SINGLE_STAGE_ARCHS else (False,)
    knobs = [{"shadow": True} if shadow else {} for shadow in shadows]
    knobs = [dict(knob, shared_bound=True) if bound else knob for bound in shared for knob in knobs]
    return [single_spec(metric, dtype, dim, k, arch, **knob, **({"listed": True} if listed else {})) for knob in knobs]


__all__ = ["single_shares_bound", "single_spec", "single_spec_over", "single_specs"]
