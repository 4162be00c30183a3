"""KernelSpecs and name expressions of the tensor-core screen and the steps around it (kernels/screen.cuh,
kernels/screen_steps.cuh); cuda_source.name_expression hands these variants here. Pure text, no NVRTC, no GPU.

- "screen":         screen_kernel: rows against queries on the tensor cores (mma.sync), a row surviving a
                    query when its rigorous lower bound is within the query's threshold; with threshold=1, the
                    KT smallest upper bounds per row tile (over a strided sample) instead (threshold_keep).
- "screen_queries": the queries rounded to the screen's element type, with their error terms.
- "screen_rows":    the rows' terms (and a float32 index's float16 shadow).
- "threshold":      each query's threshold from the threshold mode's upper bounds.
- "survivors":      the survivors verified in float64 (the exactness contract), the k best written.
- "range_survivors": a range search's survivors verified in float64, the hits into range search's pool.
- "screen_hopper":  screen_hopper_kernel (kernels/screen_hopper.cuh): the screen mode on sm_90a (wgmma fed by
                    TMA), compiled only for sm_90a, and (kt > 0) its threshold mode; "screen_tiles": its per-tile
                    bound of r_x (tile_rmax); "screen_sample": the threshold mode's sample terms.
"""

from __future__ import annotations

from dataclasses import replace

from ..spec import KernelSpec, cpp_bool, parse_arch, trailing_arguments
from .render import ITEMSIZE

SCREEN_ELEMENTS = {"float16": "tinyknn::ScreenF16", "bfloat16": "tinyknn::ScreenBF16",
                   "int8": "tinyknn::ScreenS8", "uint8": "tinyknn::ScreenU8"}
ELEMENT_OF_STORAGE = {"float32": "float16", "float16": "float16", "bfloat16": "bfloat16", "int8": "int8",
                      "uint8": "uint8"}        # float32 indexes screen through a float16 shadow


def element_of(metric: str, dtype: str) -> str:
    """What the screen multiplies: the rows' own 16- or 8-bit values, a float32 index's float16 shadow, or
    for cosine the rows divided by their norms, a float16 shadow whatever the index's dtype: unit rows fit
    float16's range, and its 11-bit significand bounds a bfloat16 index's products 8x tighter than bfloat16's
    own (H200, 1M x 768 bfloat16 x 1,000, k = 10: 275 survivors a query through a bfloat16 shadow, 96
    through float16's; the search 3.63 -> 3.30 ms)."""
    if metric == "cosine":
        return "float16"
    return ELEMENT_OF_STORAGE[dtype]


def has_shadow(metric: str, dtype: str) -> bool:
    """Whether the screen reads a copy of the rows (float32 storage, or cosine's unit rows)."""
    return metric == "cosine" or dtype == "float32"
# Tuning, from the H200 probe (bench/NOTES_SCREEN.md): 128 x 128 tiles of 64-byte stages, 2 x 4 warps, 4 stages.
SCREEN_BQ, SCREEN_BN, SCREEN_BKB, SCREEN_WARPS_Q, SCREEN_WARPS_N, SCREEN_STAGES = 128, 128, 64, 2, 4, 4
THRESHOLD_STAGES = 2            # the threshold mode's ring: its [BQ][BN + 1] bounds take 66 KB more shared memory,
                                # so 4 stages (153.6 KB) held one block an SM and 2 (110.6 KB) hold two; H200, same
                                # answers: 100k x 128 float32, 1,000 queries, k = 10 / 100: 0.115 -> 0.091 / 2.03 ->
                                # 1.42 ms; 1M x 768 float32, 100 queries: 0.250 -> 0.211 ms (bench/NOTES_SCREEN.md)
SURVIVOR_CAPACITY = 4096        # survivors kept per query (more: the query goes to the other kernels)
SURVIVOR_WARPS = 8
SURVIVOR_FEW = 2048             # the verify step's first launch: queries with at most this many survivors, in
                                # 40 KB of shared memory and 64 registers a thread, four blocks an SM (the whole
                                # capacity's 80 KB and 82 registers held two); the second launch takes the rest
THRESHOLD_KEEP = 2              # upper bounds per (query, sample tile) at most: threshold_keep

_STORAGE = {"float32": "float", "float16": "tinyknn::half_bits", "bfloat16": "tinyknn::bf16_bits",
            "int8": "signed char", "uint8": "unsigned char"}
_METRICS = {"l2": "tinyknn::L2", "ip": "tinyknn::InnerProduct", "cosine": "tinyknn::Cosine"}


def screen_smem(threshold: bool, bq: int | None = None, bn: int | None = None, bkb: int | None = None,
                stages: int | None = None) -> int:
    """screen_smem_bytes of kernels/screen.cuh (a size not given: the module's tuning as it is now, so a probe
    that changes it gets the shared memory of what it builds)."""
    bq, bn = bq or SCREEN_BQ, bn or SCREEN_BN
    bkb, stages = bkb or SCREEN_BKB, stages or SCREEN_STAGES
    return stages * (bq + bn) * (bkb + 16) + (bq * (bn + 1) * 4 if threshold else 0) + stages * 8 * bn + 12 * bq


def threshold_keep(k: int, sample_tiles: int | None = None) -> int:
    """KT, the upper bounds the threshold mode keeps per (query, row tile of the sample). Any k upper bounds of
    distinct rows bound the k-th key from above (bench/NOTES_SCREEN.md, "Fewer bounds per tile"), so a tile
    may keep fewer than k: min(k, THRESHOLD_KEEP) once the sample has at least k tiles (then a query's k best
    sampled rows average at most one per tile, and a tile holding more than KT of them, the only way T gets
    looser, is rare); a sample of fewer tiles keeps the power of two at or above 2k / tiles (at most k), so
    tiles x KT >= 2k bounds are kept, twice the k needed. Each kept bound costs a warp argmin per (query, tile)
    and 4 bytes of screen_upper: at k = 100 nearly all of the threshold pass (10M x 128 uint8 on the H200:
    410 ms; 100k x 128 float32 x 1,000 queries, 98 tiles: 1.42 ms keeping 100, 0.137 keeping 4).
    sample_tiles None: a sample of at least k tiles (every search of 128 x k sampled rows or more)."""
    if k < 1:
        raise ValueError(f"k must be at least 1; got {k}")
    if sample_tiles is not None and sample_tiles < k:
        spread = -(-2 * k // max(sample_tiles, 1))
        return min(k, max(min(k, THRESHOLD_KEEP), 1 << (spread - 1).bit_length()))
    return min(k, THRESHOLD_KEEP)


def screen_spec(metric: str, dtype: str, k: int, arch: str, *, threshold: bool,
                sample_tiles: int | None = None) -> KernelSpec:
    """The screen (or, threshold=True, its threshold mode keeping threshold_keep(k, sample_tiles) upper
    bounds per tile: the spec's k and kl) of a `dtype` index."""
    kept = threshold_keep(k, sample_tiles) if threshold else 0
    stages = THRESHOLD_STAGES if threshold else SCREEN_STAGES
    params = {"threshold": int(threshold), "kl": kept if threshold else 1, "bq": SCREEN_BQ, "bn": SCREEN_BN,
              "bkb": SCREEN_BKB, "wq": SCREEN_WARPS_Q, "wn": SCREEN_WARPS_N, "stages": stages,
              "smem": screen_smem(threshold, stages=stages)}
    return KernelSpec(metric, dtype, 1, kept, "screen", arch, tuple(params.items()))


def step_spec(variant: str, metric: str, dtype: str, k: int, arch: str) -> KernelSpec:
    """screen_queries / screen_rows (per dtype), threshold (per k), survivors (per metric, dtype, k),
    range_survivors (per metric, dtype)."""
    params = {}
    if variant == "survivors":
        params = {"cap": SURVIVOR_CAPACITY, "warps": SURVIVOR_WARPS, "above": -1, "upto": SURVIVOR_CAPACITY,
                  "smem": SURVIVOR_CAPACITY * 20}
    keeps_k = variant in ("threshold", "survivors")
    keeps_metric = variant in ("survivors", "range_survivors") or (metric == "cosine" and variant != "threshold")
    return KernelSpec(metric if keeps_metric else "l2", dtype if variant != "threshold" else "float32", 1,
                      k if keeps_k else 0, variant, arch, tuple(params.items()))


# The Hopper screen (bench/NOTES_HOPPER.md, H200): cooperative tiles of 2 warpgroups, 4 stages of
# 128-byte k-blocks. 16-bit: 256 queries x 128 rows (2 x m64n128 per warpgroup; 601 TFLOP/s on 1M x 768 x
# 1,000, 350 on 10M x 128 x 2,048); 8-bit: 128 x 256 (m64n256; 302 TOPS on 10M x 128 x 2,048 uint8).
HOPPER_ARCH = "sm_90a"
HOPPER_DEVICE_ARCHES = ("sm_90", "sm_90a")      # compute capability 9.0 runs sm_90a code
HOPPER_STAGES, HOPPER_KB, HOPPER_SCALAR_SLOTS = 4, 128, 8
HOPPER_EPI_GROUP = 0            # probes only: hopper_spec's epi_group (0: the kernel's own choice)
HOPPER_INT_KEYS = True          # the screen's keys as integers where integer_keys allows (screen_hopper.cuh, IK)
HOPPER_PRODUCER_BIAS = True     # with l2's integer keys the producer's idle warps store |x|^2 biased
                                # (screen_hopper.cuh, PB; H200, 10M x 128 uint8 x 2,048: screen step
                                # 8.15 -> 8.00 ms at k = 10, 9.67 -> 9.59 at k = 100)
HOPPER_CONSUMERS = 3            # the 8-bit screen of one k-block with three consumer warpgroups (screen_hopper.cuh,
                                # CW; 192-query tiles, each consumer's rows in two halves; 2: the others' two).
                                # H200, 10M x 128 uint8 x 2,048: screen step 8.07 -> 7.28 ms at k = 10, 9.66 -> 8.54
                                # at k = 100, the same answers (screen_steps_consumers_2026-12-03T2229_*)
HOPPER_CONSUMERS_STAGES = 3     # ... and the stages that then fit (4 do not: 238,784 bytes; HOPPER_STAGES not used)
HOPPER_OVERLAP_HALVES = False   # probes only: the same screen with each consumer's work in two halves (8-bit: its
                                # rows; 16-bit: its two m64 blocks), one half's products in flight while the other's
                                # epilogue runs (screen_hopper.cuh, XO; rows of at most 2 k-blocks)
HOPPER_LEAN_TILES = True        # the screen's per-tile work trimmed (screen_hopper.cuh, LT): waits that sleep,
                                # descriptors in uniform registers, a query tile's terms loaded once, bounds a group
                                # ahead (H200, 10M x 128 uint8 x 2,048: screen step 7.28 -> 6.55 ms at k = 10;
                                # the threshold mode keeps its kernel). False: the kernel without them, for probes
HOPPER_HALF_KEYS = False        # probes only: with PB, l2's keys halved (screen_hopper.cuh, HK): the producer stores
                                # -(S' >> 1), a chunk's two rows of a query take one DPX max and one compare
                                # (H200, 10M x 128 uint8 x 2,048: screen step 6.54 -> 6.41 ms, the search within
                                # its spread; bench/NOTES_HOPPER.md)
HOPPER_ENTRY = "screen_hopper.cuh"
_HOPPER_VARIANTS = ("screen_hopper", "screen_tiles", "screen_sample")
HOPPER_MAX_KEEP = 2             # the Hopper threshold mode keeps 1 or 2 bounds per (query, tile); more: mma.sync's
_DOT_LIMIT = 1 << 24            # float32 holds every integer below this exactly
_INT_KEY_LIMIT = 1 << 23        # |x|^2 below this: |x|^2 + 2^23 is exact, its float bits 0x4B000000 + |x|^2
_LARGEST_PRODUCT = {"uint8": 255 * 255, "int8": 128 * 128}


def hopper_arch(arch: str) -> str | None:
    """The arch the Hopper screen compiles for on a device of `arch` (sm_90a on compute capability 9.0), else None."""
    text = str(arch).strip().lower()
    if text[:1].isdigit():
        text = f"sm_{text}"
    return HOPPER_ARCH if parse_arch(text) in HOPPER_DEVICE_ARCHES else None


def hopper_tile(element: str, small: bool = False) -> tuple[int, int]:
    """(BN rows, MW m64 blocks per warpgroup) of the Hopper screen's tile of 128 MW queries x BN rows. small: the
    tile of a batch of at most 128 queries, 128 x 256 (a 256-query tile would be mostly padding: 1M x 768 float32
    at 100 queries, H200, screen step 0.37 ms against 1.51, and 0.79 through mma.sync)."""
    return (256, 1) if element in ("int8", "uint8") or small else (128, 2)


def hopper_smem(bn: int, mw: int, stages: int | None = None, consumers: int = 2) -> int:
    """hopper_smem_bytes of kernels/screen_hopper.cuh (stages not given: HOPPER_STAGES as it is now)."""
    stages = stages or HOPPER_STAGES
    ring = stages * (64 * consumers * mw + bn) * HOPPER_KB
    return 1024 + ring + HOPPER_SCALAR_SLOTS * bn * 4 + 8 * (2 * stages + 2 * HOPPER_SCALAR_SLOTS)


def hopper_threads(spec: KernelSpec) -> int:
    """Threads of a Hopper screen block: the producer warpgroup and its consumers (cw, 2 unless a probe's 3)."""
    return 128 * (spec.param("cw", 2) + 1)


def hopper_tile_queries(spec: KernelSpec) -> int:
    """Queries of a Hopper screen tile (its tensor map's query box): 64 MW for each consumer warpgroup."""
    return 64 * spec.param("mw") * spec.param("cw", 2)


def hopper_k_blocks(row_bytes: int) -> int:
    """128-byte k-blocks of a row; the bound's n is 4 instructions (32 bytes of K each) per k-block."""
    return -(-row_bytes // HOPPER_KB)


def integer_keys(element: str, stride: int) -> bool:
    """Whether the Hopper screen's keys can be integers (screen_hopper.cuh, IK): 8-bit rows (and queries) of
    `stride` elements whose |x|^2 is below 2^23 (uint8 up to 129 elements, int8 up to 511), so every dot is exact
    and |x|^2 + 2^23 rounds only to an integer in float32."""
    largest = _LARGEST_PRODUCT.get(element)
    return largest is not None and largest * stride < _INT_KEY_LIMIT


def exact_conversion(element: str, stride: int) -> bool:
    """Whether every 8-bit dot product of `stride` elements is below 2^24 in magnitude, so that converting it
    to float32 rounds nothing (round-to-nearest, a full-rate instruction, then equals rounding up)."""
    largest = _LARGEST_PRODUCT.get(element)
    return largest is not None and largest * stride < _DOT_LIMIT


def _hopper_arch_of(arch: str) -> str:
    target = hopper_arch(arch)
    if target is None:
        raise ValueError(f"the Hopper screen runs on compute capability 9.0 (arch {', '.join(HOPPER_DEVICE_ARCHES)}); "
                         f"got arch {arch!r}")
    return target


def hopper_spec(metric: str, dtype: str, stride: int, arch: str, epi_group: int | None = None,
                keep: int = 0, small: bool = False) -> KernelSpec:
    """The Hopper screen of a `dtype` index whose screened rows hold `stride` elements, for a device of `arch`
    (sm_90 or sm_90a; the spec's arch is sm_90a). The stride decides the 8-bit conversion (exact or not), integer
    keys and, through the rows' k-blocks, the probes' CW and XO kernels.
    epi_group (default HOPPER_EPI_GROUP; 0: the kernel's choice): chunks of 8 rows the epilogue tests before one
    branch (screen_hopper.cuh, EG). keep 1 or 2: its threshold mode keeping that many bounds per (query, tile).
    small: the tile of batches of at most 128 queries (hopper_tile)."""
    element = element_of(metric, dtype)
    epi_group = HOPPER_EPI_GROUP if epi_group is None else epi_group
    bn, mw = hopper_tile(element, small)
    if not 0 <= keep <= HOPPER_MAX_KEEP:
        raise ValueError(f"keep is 0 (the screen) or 1 to {HOPPER_MAX_KEEP} (its threshold mode's bounds per tile); "
                         f"got {keep}")
    keyed = HOPPER_INT_KEYS and not keep and integer_keys(element, stride)
    biased = keyed and HOPPER_PRODUCER_BIAS and metric == "l2"
    k_blocks = hopper_k_blocks(stride * ITEMSIZE[element])
    three = (bn, mw) == (256, 1) and not keep and not small and k_blocks == 1 and HOPPER_CONSUMERS == 3
    stages = HOPPER_CONSUMERS_STAGES if three else HOPPER_STAGES
    overlap = HOPPER_OVERLAP_HALVES and not (three or keep or small) and 2 * k_blocks <= stages
    params = {"exact": int(exact_conversion(element, stride)), "bn": bn, "mw": mw, "stages": stages,
              "smem": hopper_smem(bn, mw, stages, 3 if three else 2), **({"eg": epi_group} if epi_group else {}),
              **({"kt": keep} if keep else {}), **({"ik": 1} if keyed else {}),
              **({"pb": 1} if biased else {}), **({"hk": 1} if biased and HOPPER_HALF_KEYS else {}),
              **({"cw": 3} if three else {}), **({"xo": k_blocks} if overlap else {}),
              **({"lt": 1} if HOPPER_LEAN_TILES and not keep else {})}
    return KernelSpec(metric, dtype, 1, 0, "screen_hopper", _hopper_arch_of(arch), tuple(params.items()))


def tiles_spec(bn: int, arch: str) -> KernelSpec:
    """tile_rmax_kernel: the largest r_x of each tile of `bn` rows (the Hopper screen's per-tile bound)."""
    return KernelSpec("l2", "float32", 1, 0, "screen_tiles", _hopper_arch_of(arch), (("bn", bn),))


def sample_spec(bn: int, arch: str) -> KernelSpec:
    """sample_terms_kernel: the Hopper threshold mode's sample of tiles of `bn` rows (|x|^2, largest r_x)."""
    return KernelSpec("l2", "float32", 1, 0, "screen_sample", _hopper_arch_of(arch), (("bn", bn),))


def hopper_kernels(metric: str, dtype: str, stride: int, arch: str, keeps) -> list[KernelSpec]:
    """The Hopper kernels of a screened search, for large batches and for small (one spec where the tiles are
    the same): the screen, its tile bounds, its threshold mode for each of `keeps` (bounds kept per tile) and the
    threshold mode's sample terms."""
    specs = []
    for small in (False, True):
        main = hopper_spec(metric, dtype, stride, arch, small=small)
        bn = main.param("bn")
        specs += [main, tiles_spec(bn, arch),
                  *(hopper_spec(metric, dtype, stride, arch, keep=keep, small=small) for keep in keeps),
                  sample_spec(bn, arch)]
    return list(dict.fromkeys(specs))


def entry_header(spec: KernelSpec) -> str | None:
    """The kernels/ header that holds `spec`'s template when it is not search.cuh (the sm_90a-only ones)."""
    return HOPPER_ENTRY if spec.variant in _HOPPER_VARIANTS else None


def name_expression(spec: KernelSpec) -> str:
    p = spec.param
    if spec.variant == "screen_tiles":
        return f"tinyknn::tile_rmax_kernel<{p('bn')}>"
    if spec.variant == "screen_sample":
        return f"tinyknn::sample_terms_kernel<{p('bn')}>"
    element = SCREEN_ELEMENTS[element_of(spec.metric, spec.dtype)]
    if spec.variant == "screen_hopper":
        args = [element, cpp_bool(spec.metric != "l2"), cpp_bool(p("exact")), p("bn"), p("mw"), p("stages"),
                p("smem")]
        # EG: the probes' epilogues; KT: the threshold mode; IK: integer keys; PB: |x|^2 biased by the producer;
        # CW: consumer warpgroups; XO: the halves' products overlapping their epilogues (its rows' k-blocks); LT:
        # lean tiles; HK: half keys
        args += trailing_arguments((p("eg", 0), 0), (p("kt", 0), 0), (cpp_bool(p("ik", 0)), "false"),
                                   (cpp_bool(p("pb", 0)), "false"), (p("cw", 2), 2), (p("xo", 0), 0),
                                   (cpp_bool(p("lt", 0)), "false"), (cpp_bool(p("hk", 0)), "false"))
        return f"tinyknn::screen_hopper_kernel<{', '.join(str(a) for a in args)}>"
    if spec.variant == "screen":
        args = [element, cpp_bool(spec.metric != "l2"), cpp_bool(p("threshold")), p("kl"), p("bq"), p("bn"),
                p("bkb"), p("wq"), p("wn"), p("stages"), "true", p("smem")]
        return f"tinyknn::screen_kernel<{', '.join(str(a) for a in args)}>"
    if spec.variant == "screen_queries":
        return f"tinyknn::screen_queries_kernel<{element}>"
    if spec.variant == "screen_rows":
        return f"tinyknn::screen_rows_kernel<{_STORAGE[spec.dtype]}, {element}>"
    if spec.variant == "threshold":
        return f"tinyknn::threshold_kernel<{spec.k}>"
    if spec.variant == "range_survivors":
        return f"tinyknn::range_survivors_kernel<{_METRICS[spec.metric]}, {_STORAGE[spec.dtype]}>"
    args = [_METRICS[spec.metric], _STORAGE[spec.dtype], spec.k, p("cap"), p("warps"), p("above"), p("upto")]
    return f"tinyknn::verify_survivors_kernel<{', '.join(str(a) for a in args)}>"


def survivor_specs(metric: str, dtype: str, k: int, arch: str) -> list[KernelSpec]:
    """The verify step's launches: the queries with at most SURVIVOR_FEW survivors, then the rest (one launch
    of the whole capacity where k is too large for the first to hold a typical query's survivors)."""
    whole = step_spec("survivors", metric, dtype, k, arch)
    if not SURVIVOR_FEW or 4 * k > SURVIVOR_FEW or SURVIVOR_FEW >= SURVIVOR_CAPACITY:
        return [whole]
    few = {**dict(whole.params), "upto": SURVIVOR_FEW, "smem": SURVIVOR_FEW * 20}
    rest = {**dict(whole.params), "above": SURVIVOR_FEW}
    return [replace(whole, params=tuple(few.items())), replace(whole, params=tuple(rest.items()))]


def specs_for_screen(metric: str, dtype: str, k: int, arch: str, stride: int | None = None) -> list[KernelSpec]:
    """Every kernel a screened search of (metric, dtype, k) launches; on sm_90 / sm_90a (given the screened rows'
    stride) also the Hopper screen's: the screen, its tile bounds, its threshold mode for k and the sample's terms."""
    hopper = []
    if hopper_arch(arch) and stride is not None:
        hopper = hopper_kernels(metric, dtype, stride, arch, keeps=(min(k, HOPPER_MAX_KEEP),))
    return hopper + [
        screen_spec(metric, dtype, k, arch, threshold=True), screen_spec(metric, dtype, k, arch, threshold=False),
        step_spec("screen_queries", metric, dtype, k, arch), step_spec("screen_rows", metric, dtype, k, arch),
        step_spec("threshold", metric, dtype, k, arch), *survivor_specs(metric, dtype, k, arch)]


def specs_for_range_screen(metric: str, dtype: str, arch: str, stride: int | None = None) -> list[KernelSpec]:
    """Every kernel a screened range search of (metric, dtype) launches: the screen's steps 1 and 3 (on sm_90 /
    sm_90a, given the screened rows' stride, also the Hopper screen's two) and range_survivors."""
    hopper = []
    if hopper_arch(arch) and stride is not None:
        specs = [hopper_spec(metric, dtype, stride, arch, small=small) for small in (False, True)]
        hopper = list(dict.fromkeys(s for spec in specs for s in (spec, tiles_spec(spec.param("bn"), arch))))
    return hopper + [screen_spec(metric, dtype, 1, arch, threshold=False),
                     step_spec("screen_queries", metric, dtype, 0, arch),
                     step_spec("screen_rows", metric, dtype, 0, arch),
                     step_spec("range_survivors", metric, dtype, 0, arch)]
