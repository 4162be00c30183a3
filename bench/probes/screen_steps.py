#!/usr/bin/env python3
"""Where a screened batch spends its time: each step's CUDA-event milliseconds and the survivors per query,
for the threshold step's kept bounds per tile (KT) and sample step as knobs. By default 100k x 128 float32
(random normal), k = 10, 100 and 1,000 queries; `--dtype uint8` takes SIFT-like rows (bench/datasets.py) and
`--ks 10,100 --queries 2048` the shapes whose k = 100 costs more than k = 10 (10M x 128 uint8 on the H200).
`--epi-groups 1,2,4` times the Hopper screen with its epilogue testing that many chunks of 8 rows before each
branch (render_screen.HOPPER_EPI_GROUP; 0: the kernel's own), a fresh index each, and checks that every setting
gives the same answers (ids and distance bits) on every shape.

    PYTHONPATH=$PWD python3 bench/probes/screen_steps.py --out $OUT/screen_steps.json
    PYTHONPATH=$PWD python3 bench/probes/screen_steps.py --n 10000000 --dtype uint8 --ks 10,100 \
        --queries 2048 --keeps 2 --steps default --out $OUT/screen_steps_u8.json
    PYTHONPATH=$PWD python3 bench/probes/screen_steps.py --n 10000000 --dtype uint8 --ks 10,100 \
        --queries 2048 --keeps default --steps default --epi-groups 1,4 --out $OUT/screen_groups_u8.json
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402
import datasets  # noqa: E402
import tinyknn  # noqa: E402
from tinyknn.gpu import screen as screen_module, screen_launch  # noqa: E402
from tinyknn.jit import render_screen  # noqa: E402


# The on/off (and CW's 2/3) knobs a run compares, each a comma list of values, a fresh index each:
# (flag, module, attribute, what a value means)
SWITCHES = (
    ("--int-keys", render_screen, "HOPPER_INT_KEYS",
     "1: the 8-bit Hopper screen compares integer keys where render_screen.integer_keys allows"),
    ("--producer-bias", render_screen, "HOPPER_PRODUCER_BIAS",
     "1: with l2's integer keys the producer stores |x|^2 biased, screen_hopper.cuh's PB"),
    ("--hopper-consumers", render_screen, "HOPPER_CONSUMERS",
     "3 (the default): the 8-bit Hopper screen of one k-block with three consumer warpgroups, screen_hopper.cuh's CW; "
     "2: with two"),
    ("--hopper-overlap", render_screen, "HOPPER_OVERLAP_HALVES",
     "1: the Hopper screen of rows of one or two k-blocks with one half's products in flight during the other's "
     "epilogue, screen_hopper.cuh's XO (not with three consumers)"),
    ("--lean-tiles", render_screen, "HOPPER_LEAN_TILES",
     "1 (the default): the Hopper screen's per-tile work trimmed, screen_hopper.cuh's LT (sleeping waits, uniform "
     "descriptors, a query tile's terms loaded once, bounds a group ahead); 0: without"),
    ("--half-keys", render_screen, "HOPPER_HALF_KEYS",
     "1: with l2's biased integer keys the producer stores -(S' >> 1) and a chunk's two rows of a query take one DPX "
     "max, screen_hopper.cuh's HK"),
    ("--graphs", screen_launch, "SCREEN_GRAPHS",
     "1: a batch shape seen twice replays its steps as one CUDA graph; the whole search's time only: the steps' "
     "breakdown runs without it"),
)


def numbers(text: str) -> list:
    return [None if part == "default" else int(part) for part in text.split(",")]


def data(args):
    if args.dtype == "uint8":
        return datasets.sift_like(args.n, max(args.queries), args.dim)
    rng = np.random.default_rng(0)
    db = rng.standard_normal((args.n, args.dim)).astype(np.float32)
    return db, rng.standard_normal((max(args.queries), args.dim)).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "uint8"), default="float32")
    parser.add_argument("--metric", choices=("l2", "ip", "cosine"), default="l2")
    parser.add_argument("--ks", type=numbers, default=[10])
    parser.add_argument("--queries", type=numbers, default=[100, 1000])
    parser.add_argument("--keeps", type=numbers, default=[2, 10], help="THRESHOLD_KEEP values (default: 2,10)")
    parser.add_argument("--steps", type=numbers, default=[None, 8, 32],
                        help="sample steps, 'default' for the library's (default: default,8,32)")
    parser.add_argument("--threshold-stages", type=numbers, default=[None],
                        help="render_screen.THRESHOLD_STAGES values: the mma.sync threshold mode's ring depth "
                             "(2 lets two blocks share an SM; default: the library's)")
    parser.add_argument("--keep-rules", default="library",
                        help="comma list of threshold_keep rules: 'library' (render_screen.threshold_keep) and "
                             "'spread' (a sample of fewer tiles than k keeps the next power of two of 2k / tiles "
                             "bounds a tile, at most k, in place of all k)")
    parser.add_argument("--tiles", default="default",
                        help="mma.sync screen tiles to compare, comma-separated BQxBNxWQxWN (queries x rows a tile, "
                             "warps along each; e.g. 128x128x2x4,128x64x2x4; default: the library's)")
    parser.add_argument("--epi-groups", type=numbers, default=[0],
                        help="chunks of 8 rows the Hopper epilogue tests per branch (0: the kernel's choice); "
                             "a fresh index each")
    for flag, module, name, meaning in SWITCHES:
        parser.add_argument(flag, type=numbers, default=[None],
                            help=f"{module.__name__.rsplit('.', 1)[-1]}.{name} values ({meaning}; default: the "
                                 "library's), a fresh index each")
    parser.add_argument("--threshold-on-hopper", default="with-screen", choices=("with-screen", "always"),
                        help="screen.THRESHOLD_ON_HOPPER: 'always' runs step 2 on the Hopper threshold mode "
                             "whatever step 3 runs (compute capability 9.0)")
    parser.add_argument("--hopper-tiles", default="default",
                        help="Hopper screen tiles to compare, comma-separated BNxMW (rows x m64 blocks a warpgroup: "
                             "128 MW queries a tile; e.g. 128x2,128x1,256x1; default: the library's), a fresh index each")
    parser.add_argument("--hopper-stages", type=numbers, default=[None],
                        help="render_screen.HOPPER_STAGES values (the Hopper screen's ring; default: the library's)")
    parser.add_argument("--screen-min-rows", type=int, default=None,
                        help="screen.SCREEN_MIN_ROWS for this run (smaller databases are otherwise not screened)")
    parser.add_argument("--survivor-few", type=int, default=None,
                        help="render_screen.SURVIVOR_FEW for this run (0: the verify step in one launch)")
    parser.add_argument("--force-hopper", action="store_true",
                        help="the Hopper screen for every batch, whatever its size (screen.forced), on compute "
                             "capability 9.0")
    args = parser.parse_args()
    screen_module.THRESHOLD_ON_HOPPER = args.threshold_on_hopper
    if args.survivor_few is not None:
        render_screen.SURVIVOR_FEW = args.survivor_few
    if args.screen_min_rows is not None:
        screen_module.SCREEN_MIN_ROWS = args.screen_min_rows
    db, queries = data(args)
    rows, answers, differ = [], {}, []
    default_stages = render_screen.THRESHOLD_STAGES
    tile_names = ("SCREEN_BQ", "SCREEN_BN", "SCREEN_WARPS_Q", "SCREEN_WARPS_N")
    default_tile = tuple(getattr(render_screen, name) for name in tile_names)
    tiles = [default_tile if text == "default" else tuple(int(v) for v in text.split("x"))
             for text in args.tiles.split(",")]
    rules = {"library": _LIBRARY_KEEP, "spread": spread_keep}
    default_hopper_tile, default_hopper_stages = render_screen.hopper_tile, render_screen.HOPPER_STAGES
    hopper_tiles = [None if text == "default" else tuple(int(v) for v in text.split("x"))
                    for text in args.hopper_tiles.split(",")]
    switch_defaults = [getattr(module, name) for _, module, name, _ in SWITCHES]
    switch_values = [getattr(args, flag[2:].replace("-", "_")) for flag, _, _, _ in SWITCHES]
    for group, stages, tile, rule, hopper_tile, hopper_stages, *switched in itertools.product(
            args.epi_groups, args.threshold_stages, tiles, args.keep_rules.split(","), hopper_tiles,
            args.hopper_stages, *switch_values):
        for (_, module, name, _), default, value in zip(SWITCHES, switch_defaults, switched):
            setattr(module, name, default if value is None else type(default)(value))
        render_screen.hopper_tile = (default_hopper_tile if hopper_tile is None
                                     else (lambda e, small=False, t=hopper_tile: t))
        render_screen.HOPPER_STAGES = hopper_stages or default_hopper_stages
        render_screen.HOPPER_EPI_GROUP = group or 0
        render_screen.THRESHOLD_STAGES = stages or default_stages
        for name, value in zip(tile_names, tile):
            setattr(render_screen, name, value)
        render_screen.threshold_keep = rules[rule]
        rows += [dict(row, keep_rule=rule) for row in measure(args, db, queries, answers, differ)]
    render_screen.threshold_keep = _LIBRARY_KEEP
    render_screen.hopper_tile, render_screen.HOPPER_STAGES = default_hopper_tile, default_hopper_stages
    render_screen.HOPPER_EPI_GROUP, render_screen.THRESHOLD_STAGES = 0, default_stages
    for (_, module, name, _), default in zip(SWITCHES, switch_defaults):
        setattr(module, name, default)
    for name, value in zip(tile_names, default_tile):
        setattr(render_screen, name, value)
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows, "differ": differ}, indent=1))
    if differ:
        print(f"FAILED: answers differ between the epilogue settings on {differ}")
        sys.exit(1)


def spread_keep(k: int, sample_tiles: int | None = None) -> int:
    """A candidate threshold_keep: where the sample has fewer tiles than k, 2k / tiles bounds a tile (the next
    power of two, at most k) in place of all k. Any k bounds of distinct rows bound the k-th key, and
    tiles x KT >= 2k of them are kept; a tile holding more than KT of a query's k best sampled rows (about one
    a tile on average) only loosens T."""
    library = _LIBRARY_KEEP(k, sample_tiles)
    if sample_tiles is None or sample_tiles >= k or library < k:
        return library
    return min(k, 1 << (-(-2 * k // sample_tiles) - 1).bit_length())


_LIBRARY_KEEP = render_screen.threshold_keep


def measure(args, db, queries, answers: dict, differ: list) -> list:
    """The rows of one index (the Hopper epilogue as set): every (keep, step, k, queries); each shape's answers
    compared with those of the same shape under an earlier setting."""
    original_step, original_keep = screen_module.sample_step, render_screen.THRESHOLD_KEEP
    rows = []
    with tinyknn.Index(args.dim, args.metric, args.dtype, device="cuda") as index:
        index.add(db)
        screen = index._searcher._screen
        if args.force_hopper:
            screen.forced = bool(screen.hopper)
        for keep in args.keeps:
            for step in args.steps:
                render_screen.THRESHOLD_KEEP = original_keep if keep is None else keep
                screen_module.sample_step = original_step if step is None else (lambda n, k, s=step: s)
                for k in args.ks:
                    for nq in args.queries:
                        q = queries[:nq]
                        found = index.search(q, k)
                        shape = (keep, step, k, nq)
                        if shape in answers and not (np.array_equal(answers[shape][1], found[1]) and np.array_equal(
                                answers[shape][0].view(np.int32), found[0].view(np.int32))):
                            differ.append(list(shape))
                        answers.setdefault(shape, found)
                        for _ in range(2):
                            index.search(q, k)
                        samples = _common.time_calls(lambda: index.search(q, k), repeats=20, warmup=2)
                        again = index.search(q, k)      # a warm search's answers too (--graphs 1: a replay's)
                        if not (np.array_equal(again[1], found[1]) and
                                np.array_equal(again[0].view(np.int32), found[0].view(np.int32))):
                            differ.append(list(shape) + ["warm"])
                        screen.timings = {}
                        for _ in range(7):
                            index.search(q, k)
                        steps = {name: round(float(np.median(ms)), 4) for name, ms in screen.timings.items()}
                        screen.timings = None
                        counts = np.zeros(nq, np.int32)
                        index._searcher._buffers["screen_counts"].copy_to_host(counts, nq * 4)
                        row = {"dtype": args.dtype, "metric": args.metric, "n": args.n, "k": k, "queries": nq,
                               "epi_group": render_screen.HOPPER_EPI_GROUP, "int_keys": render_screen.HOPPER_INT_KEYS,
                               "producer_bias": render_screen.HOPPER_PRODUCER_BIAS,
                               "hopper_consumers": render_screen.HOPPER_CONSUMERS,
                               "hopper_overlap": render_screen.HOPPER_OVERLAP_HALVES,
                               "lean_tiles": render_screen.HOPPER_LEAN_TILES,
                               "half_keys": render_screen.HOPPER_HALF_KEYS,
                               "graphs": screen_launch.SCREEN_GRAPHS,
                               "threshold_stages": render_screen.THRESHOLD_STAGES,
                               "tile": "x".join(str(v) for v in (render_screen.SCREEN_BQ, render_screen.SCREEN_BN,
                                                                  render_screen.SCREEN_WARPS_Q,
                                                                  render_screen.SCREEN_WARPS_N)),
                               "hopper": bool(screen.hopper), "hopper_spec": str(getattr(screen, "hopper_spec", "")),
                               "hopper_forced": bool(screen.forced),
                               "threshold_on_hopper": screen_module.THRESHOLD_ON_HOPPER,
                               "hopper_thresholds_so_far": screen.hopper_thresholds,
                               "keep": render_screen.THRESHOLD_KEEP, "step": step or original_step(args.n, k),
                               "median_ms": round(float(np.median(samples)) * 1e3, 4), "steps_ms": steps,
                               "survivors_mean": float(counts.mean()), "survivors_max": int(counts.max()),
                               "fallbacks_so_far": screen.fallbacks}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    render_screen.THRESHOLD_KEEP, screen_module.sample_step = original_keep, original_step
    return rows


if __name__ == "__main__":
    main()
