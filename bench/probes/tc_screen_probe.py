#!/usr/bin/env python3
"""The tensor-core screen on a GPU: is it sound (every row whose float64 distance is within the threshold
survives), how many rows survive, and how fast it is next to torch.matmul of the same shapes.

    PYTHONPATH=$PWD python3 bench/probes/tc_screen_probe.py --out $OUT/screen.json [--quick]

Each case: data (normal, clustered, unit-norm clustered, duplicates, 8-bit) on the GPU, the exact k-th
float64 distance per query (torch float64 GEMM), the screen with T = that distance (key units, rounded
up), the survivors checked against the float64 set, kernel time (CUDA events, median of 20 after 3
warm-ups, a 4-byte-per-query memset included) and TFLOP/s, torch.matmul fp16/bf16 of the same shape.
Some cases also derive T from the threshold mode over a strided sample and screen with that.
Every case is caught on its own; the JSON is rewritten after each.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import tc_screen as ts  # noqa: E402

CAPACITY = 4096
DEFAULT = ts.ScreenConfig()
FOUR_WARPS = replace(DEFAULT, warps_n=2)            # 128 x 128 as 2 x 2 warps of 64 x 64 (246 registers)
SWEEP = [replace(DEFAULT, stages=3), replace(DEFAULT, bkb=128, stages=3), replace(DEFAULT, bn=256, stages=3),
         replace(DEFAULT, bq=256, warps_q=4, warps_n=2, stages=3), FOUR_WARPS, replace(FOUR_WARPS, stages=3),
         replace(DEFAULT, ldmatrix=False)]
DEVICE = "cuda"                                      # a CPU smoke test of the probe swaps in "cpu"
DIAGNOSE_K = 16                                      # tiny cases: the threshold mode's 16 smallest per row tile
SMALL_Q = replace(DEFAULT, bq=64, warps_q=1)          # 4 warps, for 100 queries


@dataclass
class Case:
    name: str
    n: int
    dim: int
    n_q: int
    elem: str = "float16"
    metric: str = "l2"
    data: str = "normal"
    k: int = 10
    shadow: bool = False            # float32 rows read through a 16-bit copy
    sample_step: int = 0            # > 0: also T from the threshold mode over rows r * step
    configs: list = field(default_factory=lambda: [DEFAULT])


def cases(quick: bool) -> list[Case]:
    small = [
        Case("tiny-odd f16 l2", 3000, 40, 37, k=5, sample_step=3),
        Case("tiny-odd bf16 ip", 3000, 40, 37, elem="bfloat16", metric="ip", k=5),
        Case("tiny-odd u8 l2", 3000, 40, 37, elem="uint8", data="uint8", k=5, sample_step=3),
        Case("tiny f16 l2 no-ldmatrix", 3000, 64, 70, configs=[replace(DEFAULT, ldmatrix=False)]),
        Case("100k x 128 f16 l2 1000q", 100_000, 128, 1000, sample_step=16),
        Case("100k x 128 bf16 ip 100q", 100_000, 128, 100, elem="bfloat16", metric="ip", configs=[SMALL_Q, DEFAULT]),
        Case("100k x 128 f32+f16 shadow l2 clustered", 100_000, 128, 1000, data="clustered", shadow=True),
        Case("100k x 128 f16 l2 duplicates", 100_000, 128, 1000, data="duplicates", k=50),
        Case("100k x 128 u8 l2 1000q", 100_000, 128, 1000, elem="uint8", data="uint8"),
        Case("100k x 128 s8 ip 1000q", 100_000, 128, 1000, elem="int8", metric="ip", data="int8"),
    ]
    if quick:
        return small
    big = [   # most telling first: a group that would start past --budget-s is skipped
        Case("1M x 768 f16 l2 1000q", 1_000_000, 768, 1000, configs=[DEFAULT, *SWEEP], sample_step=64),
        Case("10M x 128 f16 l2 2048q", 10_000_000, 128, 2048, configs=[DEFAULT, FOUR_WARPS]),
        Case("1M x 768 bf16 ip unit 1000q", 1_000_000, 768, 1000, elem="bfloat16", metric="ip", data="unit"),
        Case("1M x 768 f16 ip unit 1000q", 1_000_000, 768, 1000, metric="ip", data="unit"),
        Case("10M x 128 u8 l2 2048q", 10_000_000, 128, 2048, elem="uint8", data="uint8", configs=[DEFAULT, FOUR_WARPS]),
        Case("1M x 768 bf16 l2 100q", 1_000_000, 768, 100, elem="bfloat16", configs=[SMALL_Q, DEFAULT]),
        Case("1M x 768 f16 l2 clustered 100q", 1_000_000, 768, 100, data="clustered", configs=[SMALL_Q, DEFAULT]),
    ]
    return small + big


# ---- data ---------------------------------------------------------------------------------------
def make_data(case: Case, seed: int):
    """(rows as stored, rows the kernel reads, queries as searched (float32 values), queries the kernel reads)."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n, dim, n_q = case.n, case.dim, case.n_q
    randn = lambda *s: torch.randn(*s, generator=g, device=DEVICE)  # noqa: E731
    if case.data in ("uint8", "int8"):
        lo, hi = (0, 255) if case.data == "uint8" else (-128, 127)
        centre = 60.0 if case.data == "uint8" else 0.0
        dtype = torch.uint8 if case.data == "uint8" else torch.int8
        x = (randn(n, dim) * 40 + centre).round().clamp(lo, hi).to(dtype)
        q = (randn(n_q, dim) * 40 + centre).round().clamp(lo, hi).to(dtype)
        q[: n_q // 4] = x[torch.randint(0, n, (n_q // 4,), generator=g, device=DEVICE)]   # exact hits: ties at 0
        return x, x, q.float(), q
    if case.data == "normal":
        x, q = randn(n, dim), randn(n_q, dim)
    elif case.data in ("clustered", "unit"):
        centres = randn(1024, dim) * 3
        x = centres[torch.randint(0, 1024, (n,), generator=g, device=DEVICE)] + randn(n, dim)
        q = centres[torch.randint(0, 1024, (n_q,), generator=g, device=DEVICE)] + randn(n_q, dim)
        if case.data == "unit":
            x, q = x / x.norm(dim=1, keepdim=True), q / q.norm(dim=1, keepdim=True)
    elif case.data == "duplicates":
        base = randn(max(1, n // 40), dim)
        x = base[torch.randperm(n, generator=g, device=DEVICE) % base.shape[0]]
        q = randn(n_q, dim)
        q[: n_q // 2] = base[torch.randint(0, base.shape[0], (n_q // 2,), generator=g, device=DEVICE)]
    else:
        raise ValueError(f"unknown data kind {case.data!r}")
    half = torch.float16 if case.elem == "float16" else torch.bfloat16
    xs = x.to(half)
    stored = x if case.shadow else xs
    return stored, xs, q.float(), q.to(half)


# ---- the float64 reference --------------------------------------------------------------------
class Reference:
    """Exact float64 keys, recomputed per chunk of queries on demand: l2 the distance |q|^2 + |x|^2 - 2 q.x,
    ip the negated dot product; `offset` turns one into the screen's key (l2: minus |q|^2)."""

    def __init__(self, stored, queries, metric: str):
        import torch

        self.metric = metric
        self.x = stored.double()
        self.xn = (self.x * self.x).sum(1)
        self.q = queries.double()
        self.qn = (self.q * self.q).sum(1)
        self.offset = self.qn if metric == "l2" else torch.zeros_like(self.qn)
        n, dim = self.x.shape
        self.n = n
        self.chunk = max(1, min(self.q.shape[0], (1 << 28) // n))
        # float64 evaluation error of D (GEMM + expansion), with room: the screen's T gets it added.
        xmax = float(self.xn.max())
        self.eps = dim * 2.0 ** -48 * (self.qn + xmax + 2 * torch.sqrt(self.qn * xmax)) + 1e-300

    def blocks(self):
        for s in range(0, self.q.shape[0], self.chunk):
            q = self.q[s:s + self.chunk]
            dots = q @ self.x.T
            if self.metric == "l2":
                yield s, self.qn[s:s + self.chunk, None] + self.xn[None, :] - 2.0 * dots
            else:
                yield s, -dots

    def kth(self, k: int, step: int = 1):
        import torch

        # topk, not kthvalue: torch's kthvalue selects each row in one thread block (slow on 10M columns)
        return torch.cat([torch.topk(d[:, ::step], k, dim=1, largest=False).values[:, k - 1]
                          for _, d in self.blocks()])

    def key_threshold(self, t_dist):
        """float32 key thresholds (rounded up, float64 error added) that keep every row with D <= t_dist."""
        import torch

        return torch.from_numpy(ts.round_up_f32((t_dist - self.offset + self.eps).cpu().numpy())).to(DEVICE)

    def check(self, t_dist, counts, survivors, capacity):
        """Rows with D <= t_dist[q] that did not survive (overflowed queries excluded)."""
        import torch

        missed = total = bad_positions = 0
        worst = 0.0
        example = None
        for s, d in self.blocks():
            m = d.shape[0]
            want = d <= t_dist[s:s + m, None]
            c = counts[s:s + m].long()
            got = torch.zeros_like(want)
            ok = torch.arange(capacity, device=d.device)[None, :] < c.clamp(max=capacity)[:, None]
            rows = torch.arange(m, device=d.device)[:, None].expand(-1, capacity)
            positions = survivors[s:s + m][ok].long()
            inside = (positions >= 0) & (positions < self.n)
            bad_positions += int((~inside).sum())
            got[rows[ok][inside], positions[inside]] = True
            fine = (c <= capacity)[:, None]
            bad = want & ~got & fine
            total += int((want & fine).sum())
            nbad = int(bad.sum())
            if nbad:
                missed += nbad
                slack = (t_dist[s:s + m, None] - d)[bad]
                worst = max(worst, float(slack.max()))
                qi, ri = bad.nonzero()[0].tolist()
                example = {"query": s + qi, "row": ri, "distance": float(d[qi, ri]), "t": float(t_dist[s + qi])}
        return {"required_pairs": total, "missed": missed, "worst_missed_by": worst, "example": example,
                "bad_positions": bad_positions}


# ---- running ------------------------------------------------------------------------------------
def sync(empty_cache: bool = False) -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
        if empty_cache:
            torch.cuda.empty_cache()


def bound_terms(case, q, qs, row_bytes: int, bkb: int):
    """(e_q, f_q) of tc_screen.error_terms as float32 tensors on DEVICE."""
    import torch

    e, f = ts.error_terms(q.cpu().numpy(), qs.double().cpu().numpy(), case.elem, case.metric, row_bytes, bkb,
                          case.shadow)
    return torch.from_numpy(e).to(DEVICE), torch.from_numpy(f).to(DEVICE)


def median_ms(fn, reps: int = 20, warm: int = 3) -> float:
    """Median over `reps` of (CUDA events around `inner` back-to-back calls) / inner, inner sized so that
    one sample lasts >= ~2 ms: short kernels are then not timed as Python's launch overhead."""
    import torch

    def sample(inner):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner

    for _ in range(warm):
        fn()
    inner = max(1, min(100, int(2.0 / max(sample(1), 1e-3))))
    return statistics.median(sample(inner) for _ in range(reps))


def survivor_stats(counts, required) -> dict:
    import torch

    c = counts.double()
    return {"median": float(c.median()), "max": int(counts.max()), "mean": float(c.mean()),
            "overflowed": int((counts > CAPACITY).sum()), "required_mean": required / max(1, counts.numel())}


def run_case(case: Case, launchers, seed: int) -> dict:
    import torch

    out = {"case": asdict(case) | {"configs": [c.label() for c in case.configs]}, "seed": seed}
    t0 = time.perf_counter()
    stored, xs, q, qs = make_data(case, seed)
    row_bytes = ts.row_bytes_for(case.dim, case.elem)
    xp, qp = ts.padded(xs, row_bytes), ts.padded(qs, row_bytes)
    sq_lo, sq_hi, r_x = ts.row_terms(stored, xs if case.shadow else stored)
    ref = Reference(stored, q, case.metric)
    t_dist = ref.kth(case.k)
    t_key = ref.key_threshold(t_dist)
    out["setup_s"] = round(time.perf_counter() - t0, 2)
    flops = 2.0 * case.n * case.n_q * case.dim
    counts = torch.zeros(case.n_q, dtype=torch.int32, device=DEVICE)
    survivors = torch.empty((case.n_q, CAPACITY), dtype=torch.int32, device=DEVICE)
    results = []
    for config in case.configs:
        config = replace(config, elem=case.elem, metric=case.metric)
        res = {"config": config.label()}
        try:
            e, f = bound_terms(case, q, qs, row_bytes, config.bkb)
            res["bound_median"] = float(torch.median(e) * torch.median(r_x) + torch.median(f))
            norms = sq_lo if case.metric == "l2" else r_x
            launch = launchers[config].bind(xp, case.n, 1, norms, r_x, qp, row_bytes, t_key, e, f, counts,
                                            survivors, CAPACITY, None)

            def screen():
                counts.zero_()
                launch()
            screen()
            sync()
            res["soundness"] = ref.check(t_dist, counts, survivors, CAPACITY)
            res["survivors"] = survivor_stats(counts, res["soundness"]["required_pairs"])
            res["kernel_ms"] = median_ms(screen)
            res["tflops"] = flops / res["kernel_ms"] / 1e9
            res["tiles_per_block"] = launchers[config].tiles_per_block(case.n, case.n_q)
            if config == replace(DEFAULT, elem=case.elem, metric=case.metric):
                res["tiles_per_block_sweep"] = tpb_sweep(
                    case, flops, counts, lambda tpb: launchers[config].bind(
                        xp, case.n, 1, norms, r_x, qp, row_bytes, t_key, e, f, counts, survivors, CAPACITY, None,
                        tiles_per_block=tpb))
        except Exception as exc:  # noqa: BLE001 - one config's failure must not stop the others
            res["error"] = f"{type(exc).__name__}: {exc}"
            res["traceback"] = traceback.format_exc(limit=6)
            sync()
        results.append(res)
    out["screens"] = results
    if case.n < 100_000:
        out["tile_diagnosis"] = diagnose_tiles(case, launchers, ref, xp, qp, q, qs, sq_hi, r_x, row_bytes)
    if case.sample_step:
        out["threshold_mode"] = run_threshold(case, launchers, ref, xp, qp, q, qs, sq_hi, sq_lo, r_x, row_bytes,
                                              counts, survivors)
    out["torch_matmul_ms"] = torch_matmul_ms(case, xs, qs)
    out["torch_tflops"] = flops / out["torch_matmul_ms"] / 1e9 if out["torch_matmul_ms"] else None
    out["total_s"] = round(time.perf_counter() - t0, 2)
    return out


def tpb_sweep(case, flops, counts, bind) -> dict:
    """Kernel time per tiles_per_block; the survivor counts must not change with it (same arithmetic)."""
    import torch

    reference = counts.clone()
    out = {}
    for tpb in (1, 2, 4, 16, 64):
        try:
            launch = bind(tpb)

            def screen():
                counts.zero_()
                launch()
            screen()
            sync()
            same = bool(torch.equal(counts, reference))
            ms = median_ms(screen, reps=10)
            out[tpb] = {"kernel_ms": ms, "tflops": flops / ms / 1e9, "same_counts": same}
        except Exception as exc:  # noqa: BLE001
            out[tpb] = {"error": f"{type(exc).__name__}: {exc}"}
    counts.copy_(reference)
    return out


def diagnose_tiles(case, launchers, ref, xp, qp, q, qs, sq_hi, r_x, row_bytes) -> dict:
    """Threshold mode over every row, K = 16: per row tile the 16 smallest upper bounds against the 16
    smallest exact keys (never below them, at most twice the bound above): the dot products and the
    fragment layout checked without the survivor lists."""
    import torch

    try:
        config = replace(DEFAULT, elem=case.elem, metric=case.metric, threshold=True, k=DIAGNOSE_K)
        e, f = bound_terms(case, q, qs, row_bytes, config.bkb)
        tiles = -(-case.n // config.bn)
        upper = torch.empty((case.n_q, tiles, DIAGNOSE_K), dtype=torch.float32, device=DEVICE)
        launchers[config](xp, case.n, 1, sq_hi if case.metric == "l2" else r_x, r_x, qp, row_bytes, None, e, f,
                          None, None, 0, upper)
        sync()
        key = torch.full((case.n_q, tiles * config.bn), float("inf"), dtype=torch.float64, device=DEVICE)
        key[:, :case.n] = torch.cat([d for _, d in ref.blocks()]) - ref.offset[:, None]
        smallest = torch.sort(key.view(case.n_q, tiles, config.bn), dim=2).values[:, :, :DIAGNOSE_K]
        finite = torch.isfinite(smallest)
        gap = torch.where(finite, upper.double() - smallest, torch.zeros_like(smallest))
        norm_ulps = 2.0 ** -22 * (torch.where(finite, smallest.abs(), 0.0) + float(sq_hi.max()))   # |x|^2 rounded up
        allowed = (2 * (e.double() * float(r_x.max()) + f.double()))[:, None, None] + ref.eps[:, None, None] + norm_ulps
        return {"below_exact": int((gap < -ref.eps[:, None, None]).sum()), "above_twice_bound": int((gap > allowed).sum()),
                "worst_below": float(gap.min()), "worst_above_over_allowed": float((gap / allowed).max()),
                "inf_mismatch": int((torch.isfinite(upper) != finite).sum())}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}


def run_threshold(case, launchers, ref, xp, qp, q, qs, sq_hi, sq_lo, r_x, row_bytes, counts, survivors):
    """T from the threshold mode over rows r * step: an upper bound of the k-th key; then the screen with it."""
    import torch

    res = {}
    try:
        config = replace(DEFAULT, elem=case.elem, metric=case.metric, threshold=True, k=case.k)
        launch = launchers[config]
        step = case.sample_step
        n_sample = -(-case.n // step)
        tiles = -(-n_sample // config.bn)
        e, f = bound_terms(case, q, qs, row_bytes, config.bkb)
        upper = torch.empty((case.n_q, tiles, case.k), dtype=torch.float32, device=DEVICE)
        norms = sq_hi if case.metric == "l2" else r_x
        thresholds = launch.bind(xp, n_sample, step, norms, r_x, qp, row_bytes, None, e, f, None, None, 0, upper)
        thresholds()
        sync()
        t_thr = torch.topk(upper.view(case.n_q, -1), case.k, dim=1, largest=False).values[:, case.k - 1].double()
        true_key = ref.kth(case.k, step) - ref.offset
        res["upper_bound_holds"] = bool((t_thr >= true_key - ref.eps).all())
        res["worst_upper_minus_true"] = float((t_thr - true_key).min())
        res["median_upper_minus_true"] = float((t_thr - true_key).median())
        res["threshold_kernel_ms"] = median_ms(thresholds)
        t_key = ref.key_threshold(t_thr + ref.offset)
        screen_cfg = replace(DEFAULT, elem=case.elem, metric=case.metric)   # the same bkb: the same e, f
        counts.zero_()
        launchers[screen_cfg](xp, case.n, 1, sq_lo if case.metric == "l2" else r_x, r_x, qp, row_bytes, t_key,
                              e, f, counts, survivors, CAPACITY, None)
        sync()
        res["soundness"] = ref.check(t_thr + ref.offset, counts, survivors, CAPACITY)
        res["soundness_knn"] = ref.check(ref.kth(case.k), counts, survivors, CAPACITY)
        res["survivors"] = survivor_stats(counts, res["soundness"]["required_pairs"])
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc(limit=6)
    return res


def torch_matmul_ms(case, xs, qs):
    """torch.matmul of the same shape in the 16-bit type (8-bit cases: fp16 of the values), rows chunked to 2M."""
    import torch

    try:
        half = torch.bfloat16 if case.elem == "bfloat16" else torch.float16
        rows = min(case.n, 1 << 21)
        x, q = xs[:rows].to(half), qs.to(half)
        ms = median_ms(lambda: torch.matmul(q, x.T))
        return ms * case.n / rows
    except Exception:  # noqa: BLE001
        return None


def all_configs(case_list):
    configs = set()
    for case in case_list:
        for c in case.configs:
            configs.add(replace(c, elem=case.elem, metric=case.metric))
        configs.add(replace(DEFAULT, elem=case.elem, metric=case.metric))
        if case.sample_step:
            configs.add(replace(DEFAULT, elem=case.elem, metric=case.metric, threshold=True, k=case.k))
        if case.n < 100_000:
            configs.add(replace(DEFAULT, elem=case.elem, metric=case.metric, threshold=True, k=DIAGNOSE_K))
    return sorted(configs, key=lambda c: c.name)


def summary_line(r: dict) -> str:
    lines = [f"== {r['case']['name']}  (setup {r.get('setup_s')} s, total {r.get('total_s')} s)"]
    if "error" in r:
        return lines[0] + f"\n   ERROR {r['error']}\n" + (r.get("traceback") or r.get("log") or "")[-1500:]
    for s in r.get("screens", []):
        if "error" in s:
            lines.append(f"   {s['config']}: ERROR {s['error']}")
            continue
        snd, sv = s["soundness"], s["survivors"]
        flag = "SOUND" if snd["missed"] == 0 else (
            f"UNSOUND missed {snd['missed']} (worst by {snd['worst_missed_by']:.3g}, {snd['example']})")
        lines.append(f"   {s['config']}: {flag}; survivors median {sv['median']:.0f} max {sv['max']} "
                     f"(required {sv['required_mean']:.1f}/q, overflowed {sv['overflowed']}); "
                     f"{s['kernel_ms']:.3f} ms = {s['tflops']:.0f} TFLOP/s (tpb {s['tiles_per_block']}); "
                     f"bound ~{s['bound_median']:.3g}")
        if "tiles_per_block_sweep" in s:
            lines.append("      tiles/block: " + ", ".join(
                f"{k}: {v['kernel_ms']:.3f} ms{'' if v['same_counts'] else ' COUNTS DIFFER'}" if "kernel_ms" in v
                else f"{k}: {v['error']}" for k, v in s["tiles_per_block_sweep"].items()))
    if "tile_diagnosis" in r:
        lines.append(f"   tile diagnosis (threshold mode, 16 smallest per tile vs exact): {r['tile_diagnosis']}")
    if "threshold_mode" in r:
        t = r["threshold_mode"]
        if "error" in t:
            lines.append(f"   threshold mode: ERROR {t['error']}")
        else:
            lines.append(f"   threshold mode: upper bound holds {t['upper_bound_holds']} "
                         f"(min slack {t['worst_upper_minus_true']:.3g}), {t['threshold_kernel_ms']:.3f} ms; "
                         f"screen with it: missed {t['soundness']['missed']}/{t['soundness_knn']['missed']} (knn), "
                         f"survivors median {t['survivors']['median']:.0f} max {t['survivors']['max']}")
    if r.get("torch_matmul_ms"):
        lines.append(f"   torch.matmul same shape: {r['torch_matmul_ms']:.3f} ms = {r['torch_tflops']:.0f} TFLOP/s")
    return "\n".join(lines)


def groups(case_list) -> list[list[int]]:
    """Case indices per child process: the tiny cases, the 100k cases, then each large case alone (a
    kernel fault poisons its CUDA context, so it costs only its own group)."""
    small = [i for i, c in enumerate(case_list) if c.n <= 100_000]
    tiny = [i for i in small if case_list[i].n < 100_000]
    rest = [i for i in small if i not in tiny]
    return [g for g in (tiny, rest) if g] + [[i] for i, c in enumerate(case_list) if c.n > 100_000]


def child(args) -> int:
    """Run the cases args.child names with the cubin the parent compiled; results to args.out."""
    import torch

    with open(args.cubin, "rb") as fh:
        cubins = pickle.load(fh)
    case_list = cases(args.quick)
    launchers = {}
    for c in all_configs(case_list):
        try:
            launchers[c] = ts.ScreenLauncher(cubins, c)
        except Exception:  # noqa: BLE001 - reported by the parent's load check; cases using it fail alone
            pass
    results = []
    for i in (int(v) for v in args.child.split(",")):
        case = case_list[i]
        try:
            r = run_case(case, launchers, args.seed + i)
        except Exception as exc:  # noqa: BLE001
            r = {"case": {"name": case.name}, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc(limit=8)}
        results.append(r)
        args.out.write_text(json.dumps(results, default=str))
        sync(empty_cache=True)   # a sticky CUDA error ends this child here; the parent records the rest
    return 0


def device_report(cubins, configs) -> dict:
    """Device, ptxas numbers, occupancy and torch's fp16 GEMM ceiling (8192^3), in a child of its own."""
    import torch

    props = torch.cuda.get_device_properties(0)
    out = {"device": {"name": props.name, "sms": props.multi_processor_count}, "ptxas": {}}
    for c in configs:
        entry = out["ptxas"][c.label()] = asdict(cubins[c.name].reports[c.name]) | {"smem": c.smem}
        try:
            entry["blocks_per_sm"] = ts.ScreenLauncher(cubins, c).kernel.max_active_blocks_per_sm(c.threads, c.smem)
        except Exception as exc:  # noqa: BLE001
            entry["load_error"] = f"{type(exc).__name__}: {exc}"
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.float16)
    out["fp16_8192_cubed_tflops"] = 2 * 8192 ** 3 / median_ms(lambda: a @ a, reps=10) / 1e9
    del a
    sync(empty_cache=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("screen.json"))
    parser.add_argument("--quick", action="store_true", help="only the small cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no case group after this")
    parser.add_argument("--compile-only", metavar="ARCH", help="compile every kernel for ARCH, print ptxas, stop")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cubin", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args)
    t0 = time.perf_counter()
    if args.compile_only:
        configs = all_configs(cases(args.quick))
        cubins = ts.compile_screens(configs, args.compile_only)
        for c in configs:
            print(f"{c.label()}: smem {c.smem} {cubins[c.name].reports[c.name]}")
        print(f"{len(configs)} kernels for {args.compile_only} in {time.perf_counter() - t0:.1f} s")
        return 0
    from tinyknn.gpu.device import current_device

    arch = current_device().arch
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "arch": arch, "cases": []}
    case_list = cases(args.quick)
    configs = all_configs(case_list)
    cubins = ts.compile_screens(configs, arch)
    report["compile_s"] = round(time.perf_counter() - t0, 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cubin_path = Path(tmp) / "screen.cubin.pickle"
        cubin_path.write_bytes(pickle.dumps(cubins))
        try:
            report |= device_report(cubins, configs)
        except Exception as exc:  # noqa: BLE001
            report["device_error"] = f"{type(exc).__name__}: {exc}"
        print(f"{report.get('device')} {arch}; {len(configs)} screen kernels compiled in {report['compile_s']} s; "
              f"torch fp16 8192^3: {report.get('fp16_8192_cubed_tflops', 0):.0f} TFLOP/s")
        for label, entry in report.get("ptxas", {}).items():
            print(f"   {label}: {entry}")
        for group in groups(case_list):
            if time.perf_counter() - t0 > args.budget_s:
                report["cases"] += [{"case": {"name": case_list[i].name}, "error": "skipped: out of time"} for i in group]
                continue
            part = Path(tmp) / f"part{group[0]}.json"
            command = [sys.executable, __file__, "--child", ",".join(map(str, group)), "--cubin", str(cubin_path),
                       "--out", str(part), "--seed", str(args.seed)] + (["--quick"] if args.quick else [])
            try:
                done = subprocess.run(command, capture_output=True, text=True,
                                      timeout=max(30.0, args.budget_s + 60 - (time.perf_counter() - t0)))
                rc, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
            except subprocess.TimeoutExpired as exc:
                rc, tail = "timeout", str(exc)[-3000:]
            results = json.loads(part.read_text()) if part.exists() else []
            finished = {r["case"]["name"] for r in results}
            for i in group:
                if case_list[i].name not in finished:
                    results.append({"case": {"name": case_list[i].name}, "error": f"child exit {rc}", "log": tail})
            for r in results:
                report["cases"].append(r)
                print(summary_line(r), flush=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))
    missed = sum(s.get("soundness", {}).get("missed", 0) for r in report["cases"] for s in r.get("screens", []))
    missed += sum(r.get("threshold_mode", {}).get("soundness", {}).get("missed", 0) for r in report["cases"])
    report["total_missed"] = missed
    report["total_s"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"total missed (must be 0): {missed}; {report['total_s']} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
