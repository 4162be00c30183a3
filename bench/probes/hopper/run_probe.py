#!/usr/bin/env python3
"""Probe of a Hopper (sm_90a) tensor-core screen: wgmma.mma_async fed by TMA through an mbarrier ring
(hopper_screen.cuh beside this file), against torch.matmul of the same shapes.

    python3 run_probe.py --compile-only [--cubin-dir DIR]   # no GPU: NVRTC for sm_90a, ptxas report, SASS counts
    python3 run_probe.py --fake [--quick]                   # no GPU: the whole harness on a CPU stand-in kernel
    PYTHONUNBUFFERED=1 python3 run_probe.py --out $OUT      # GPU: correctness, then timing; JSON + log to $OUT

On the GPU the parent compiles every variant with NVRTC (threads), then runs groups of cases in child
processes (a kernel that traps poisons its CUDA context; the watchdog code it left in pinned host memory
says which wait gave up): "check" (small shapes, every variant: raw accumulators against float64 within
the proven bound, survivor lists against the float64 keys, poisoned outputs), then the timed shapes
(1M x 768 x 1,000 fp16, 10M x 128 x 2,048 fp16 and uint8) with torch.matmul of the same shape timed in
the same process. A short table is printed last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import math
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = "hopper_screen.cuh"
ELEMS = {"f16": 0, "u8": 1, "s8": 2, "u8x": 3, "s8x": 4}   # x: every |dot| < 2^24, exact cvt.rn (the host checks)
ITEMSIZE = {"f16": 2, "u8": 1, "s8": 1, "u8x": 1, "s8x": 1}
THREADS = 384
SCALAR_SLOTS = 8
MAX_SMEM = 232448
CAPACITY = 4096
POISON = 0x7FFFFFFF        # an 8-bit dump's unwritten marker (|dot| < 2^31 - 1 always)


# ---- variants ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One instantiation of hs::screen_body (hopper_screen.cuh says what each parameter does)."""

    elem: str = "f16"
    ip: bool = False
    bn: int = 256           # rows per tile = wgmma N
    mw: int = 1             # m64 blocks per consumer warpgroup
    coop: bool = True       # both consumer WGs on one tile (else pingpong: alternate tiles)
    stages: int = 4
    epi: int = 1            # 0: per-row bound (screen.cuh's structure); 1: tile bound folded into the threshold
    dump: bool = False      # also write every accumulator (checks only)
    cl: int = 1             # CTAs per cluster sharing the row tile through TMA multicast

    @property
    def tile_q(self) -> int:
        return 64 * self.mw * (2 if self.coop else 1)

    @property
    def smem(self) -> int:
        return (1024 + self.stages * (self.tile_q + self.bn) * 128 + SCALAR_SLOTS * 2 * self.bn * 4
                + 8 * (2 * self.stages + 2 * SCALAR_SLOTS + 2))

    @property
    def bk(self) -> int:
        """Elements of K per k-block (128 bytes)."""
        return 128 // ITEMSIZE[self.elem]

    @property
    def name(self) -> str:
        return (f"hs_{self.elem}_{'ip' if self.ip else 'l2'}_{'coop' if self.coop else 'pp'}_q{self.tile_q}"
                f"_n{self.bn}_s{self.stages}_e{self.epi}{f'_cl{self.cl}' if self.cl > 1 else ''}"
                f"{'_dump' if self.dump else ''}")

    def label(self) -> str:
        kind = "coop" if self.coop else "pingpong"
        return (f"{self.elem} {'ip' if self.ip else 'l2'} {kind} {self.tile_q}x{self.bn} (wgmma m64n{self.bn}"
                f"{'x2' if self.mw == 2 else ''}) {self.stages} stages epi{self.epi}"
                f"{f' cluster{self.cl} multicast' if self.cl > 1 else ''}{' dump' if self.dump else ''}")

    def macro(self) -> str:
        b = lambda v: "true" if v else "false"   # noqa: E731
        attributes = f"__cluster_dims__({self.cl}, 1, 1)" if self.cl > 1 else ""
        return (f"HS_KERNEL({self.name}, {attributes}, {self.cl}, {ELEMS[self.elem]}, {b(self.ip)}, {self.bn}, "
                f"{self.mw}, {b(self.coop)}, {self.stages}, {self.epi}, {b(self.dump)})")

    def check(self) -> None:
        if self.bn not in (64, 128, 256) or self.mw * self.bn // 2 > 128 or self.tile_q > 256:
            raise ValueError(f"{self.name}: unsupported tile")
        if self.smem > MAX_SMEM:
            raise ValueError(f"{self.name}: {self.smem} bytes of shared memory > {MAX_SMEM}")
        if self.cl > 1 and not self.coop:
            raise ValueError(f"{self.name}: clusters are COOP only")


COOP = Variant()                                              # 128 x 256, two WGs of m64n256
F16_TIMED = [
    COOP,
    replace(COOP, epi=0),
    replace(COOP, stages=3),
    replace(COOP, cl=2),
    replace(COOP, mw=2, bn=128),                              # 256 x 128, each WG 2 x m64n128
    replace(COOP, mw=2, bn=128, cl=2),
    replace(COOP, bn=128, stages=6),                          # 128 x 128
    replace(COOP, coop=False, stages=5),                      # pingpong 64 x 256
    replace(COOP, coop=False, mw=2, bn=128, stages=6),        # pingpong 128 x 128
]
U8_TIMED = [replace(v, elem="u8x") for v in (COOP, replace(COOP, cl=2), replace(COOP, coop=False, stages=5))] + [
    replace(COOP, elem="u8")]                                 # the slow upward conversion (I2F.RP), for its cost
CHECK_ONLY = [
    replace(COOP, ip=True), replace(COOP, ip=True, epi=0), replace(COOP, coop=False, stages=5, ip=True),
    replace(COOP, elem="s8x", ip=True), replace(COOP, elem="s8"), replace(COOP, elem="u8x", ip=True, epi=0),
    replace(COOP, stages=2),
]
DUMPS = [replace(COOP, dump=True, epi=0), replace(COOP, dump=True, mw=2, bn=128, coop=False, stages=6),
         replace(COOP, dump=True, cl=2), replace(COOP, dump=True, mw=2, bn=128, cl=2),
         replace(COOP, dump=True, elem="u8x"), replace(COOP, dump=True, elem="s8x")]


def all_variants() -> list[Variant]:
    out = list(dict.fromkeys(F16_TIMED + U8_TIMED + CHECK_ONLY + DUMPS))
    for v in out:
        v.check()
    return out


# ---- NVRTC -------------------------------------------------------------------------------------------
def render(variants) -> str:
    return f'#include "{HEADER}"\n' + "\n".join(v.macro() for v in variants) + "\n"


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> dict:
    """ptxas -v lines -> {kernel: {registers, stack, spill_stores, spill_loads, warnings}}."""
    out: dict = {}
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            out.setdefault(entry, {"warnings": []})
        elif m := _PROPS.search(line):
            props = m.group(1)
        elif (m := _FRAME.search(line)) and props in out:
            out[props].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif (m := _REGS.search(line)) and entry in out:
            out[entry]["registers"] = int(m.group(1))
        elif ("warning" in line.lower() or "wgmma" in line.lower()) and entry in out:
            out[entry]["warnings"].append(line.strip())
    return out


def compile_variant(v: Variant, arch: str = "sm_90a") -> tuple[bytes, dict, str]:
    """(cubin, ptxas report of the kernel, NVRTC log) for one variant."""
    from cuda.bindings import nvrtc

    def check(result, what):
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return rest[0] if rest else None

    source = render([v]).encode()
    program = check(nvrtc.nvrtcCreateProgram(source, f"{v.name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={arch}", "-std=c++17", f"-I{HERE}", "--ptxas-options=-v",
                   "-default-device"]
        encoded = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        buffer = bytearray(size)
        check(nvrtc.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
        log = buffer.rstrip(b"\0").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed for {v.name}:\n{log}")
        size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        image = bytearray(size)
        check(nvrtc.nvrtcGetCUBIN(program, image), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    report = parse_ptxas(log).get(v.name, {})
    return bytes(image), report, log


def compile_all(variants, arch="sm_90a") -> dict:
    """{name: (cubin, report)} compiled in parallel threads (nvrtcCompileProgram releases the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(min(16, len(variants))) as pool:
        results = list(pool.map(lambda v: compile_variant(v, arch), variants))
    return {v.name: (image, report) for v, (image, report, _log) in zip(variants, results)}


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for candidate in ["/usr/local/cuda/bin/cuobjdump"] + [
            str(p) for p in Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump")]:
        if os.path.exists(candidate):
            return candidate
    try:
        import nvidia  # noqa: F401
        for root in nvidia.__path__:
            for p in Path(root).glob("**/bin/cuobjdump"):
                return str(p)
    except Exception:  # noqa: BLE001
        pass
    return None


SASS_KINDS = ["HGMMA", "IGMMA", "UTMALDG", "UBLKCP", "SYNCS", "WARPGROUP", "USETMAXREG", "UCGABAR", "LDL", "STL",
              "ATOMG", "FSETP", "FFMA", "I2F", "I2FP", "LDS", "BAR"]


def sass_summary(image: bytes, tool: str | None) -> dict:
    """Counts of the instructions that tell the story (HGMMA/IGMMA, UTMALDG, UBLKCP, SYNCS, LDL/STL...)."""
    if not tool:
        return {"error": "no cuobjdump"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(image)
        done = subprocess.run([tool, "--dump-sass", str(path)], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr[-500:]}
    counts: dict = {}
    shapes: dict = {}
    for line in done.stdout.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.x]+)?", line)
        if not m:
            continue
        op = m.group(2)
        if op in ("I2F",) and (m.group(3) or "").startswith(".P"):
            op = "I2FP"
        if op in SASS_KINDS:
            counts[op] = counts.get(op, 0) + 1
        if op in ("HGMMA", "IGMMA", "UTMALDG"):
            shapes[op + (m.group(3) or "")] = shapes.get(op + (m.group(3) or ""), 0) + 1
    return {"counts": counts, "forms": shapes, "lines": done.stdout.count("\n")}


# ---- the bound (float64 on the host side, as tinyknn's screen_steps.cuh computes it) -----------------
def round_f32(v64, up: bool):
    import torch

    r = v64.float()
    off = r.double() < v64 if up else r.double() > v64
    return torch.where(off, torch.nextafter(r, torch.full_like(r, math.inf if up else -math.inf)), r)


def error_terms(q32, q_screen, elem: str, ip: bool, k_blocks: int, dim: int):
    """(e_q, f_q) float32 rounded up: |key - screened key| <= e_q r_x + f_q (bench/NOTES_SCREEN.md's model,
    n = the number of wgmma instructions per dot product: 4 per 128-byte k-block, zero-filled ones included)."""
    import torch

    n_q = q32.shape[0]
    if elem != "f16":
        return (torch.zeros(n_q, dtype=torch.float32, device=q32.device),) * 2
    q, qs = q32.double(), q_screen.double()
    n = 4 * k_blocks
    gamma = n * 2.0 ** -18 * (1.0 + n * 2.0 ** -18)
    e = torch.linalg.norm(q - qs, dim=1) + gamma * torch.linalg.norm(qs, dim=1)
    f = torch.full_like(e, (k_blocks * 64 + n) * 2.0 ** -126)
    scale = (1.0 if ip else 2.0) * (1.0 + 2.0 ** -20)
    return round_f32(e * scale * (1 + 4 * dim * 2.0 ** -53), True), round_f32(f * scale, True)


def row_terms(x, pad_to: int):
    """(sq_lo, r_x) float32, padded with zeros to a multiple of pad_to rows: |x|^2 rounded down, |x| up."""
    import torch

    n, dim = x.shape
    rows = -(-n // pad_to) * pad_to
    sq_lo = torch.zeros(rows, dtype=torch.float32, device=x.device)
    r_x = torch.zeros(rows, dtype=torch.float32, device=x.device)
    slack = dim * 2.0 ** -52
    for s in range(0, n, 1 << 20):
        sq = x[s:s + (1 << 20)].double().square().sum(1)
        sq_lo[s:s + len(sq)] = round_f32(sq * (1 - slack), False)
        r_x[s:s + len(sq)] = round_f32(torch.sqrt(sq * (1 + slack)) * (1 + 2.0 ** -50), True)
    return sq_lo, r_x


# ---- data and the float64 reference ------------------------------------------------------------
@dataclass
class Data:
    elem: str
    ip: bool
    x: object           # rows as the kernel reads them (n x stride, zero padded)
    q32: object         # queries as searched (float32, n_q x dim)
    qs: object          # queries as the kernel reads them (n_q x stride)
    dim: int
    sq_lo: object
    r_x: object
    k_blocks: int

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def n_q(self) -> int:
        return self.qs.shape[0]


def make_data(elem: str, ip: bool, n: int, dim: int, n_q: int, seed: int, device: str) -> Data:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    item = ITEMSIZE[elem]
    stride = -(-dim * item // 16) * 16 // item
    if elem == "f16":
        x = torch.zeros((n, stride), dtype=torch.float16, device=device)
        x[:, :dim] = torch.randn((n, dim), generator=g, device=device).half()
        q32 = torch.randn((n_q, dim), generator=g, device=device)
        q32[: n_q // 4] = x[torch.randint(0, n, (n_q // 4,), generator=g, device=device), :dim].float()
        q32[n_q // 4: n_q // 2] += 1e-3 * torch.randn((n_q // 2 - n_q // 4, dim), generator=g, device=device)
        qs = torch.zeros((n_q, stride), dtype=torch.float16, device=device)
        qs[:, :dim] = q32.half()
    else:
        unsigned = elem.startswith("u")
        lo, hi, centre = (0, 255, 60.0) if unsigned else (-128, 127, 0.0)
        dtype = torch.uint8 if unsigned else torch.int8
        x = torch.zeros((n, stride), dtype=dtype, device=device)
        x[:, :dim] = (torch.randn((n, dim), generator=g, device=device) * 40 + centre).round().clamp(lo, hi).to(dtype)
        qv = (torch.randn((n_q, dim), generator=g, device=device) * 40 + centre).round().clamp(lo, hi)
        qv[: n_q // 4] = x[torch.randint(0, n, (n_q // 4,), generator=g, device=device), :dim].float()
        q32 = qv.float()
        qs = torch.zeros((n_q, stride), dtype=dtype, device=device)
        qs[:, :dim] = qv.to(dtype)
        big = 255 * 255 if unsigned else 128 * 128
        if elem.endswith("x") and big * stride >= 2 ** 24:
            raise ValueError(f"{elem}: dim {dim} lets a dot product reach 2^24 (use {elem[:-1]})")
    sq_lo, r_x = row_terms(x, 512)
    k_blocks = -(-stride * item // 128)
    return Data(elem, ip, x, q32, qs, dim, sq_lo, r_x, k_blocks)


class Reference:
    """Exact float64 keys (the query as searched against the stored rows): l2 |x|^2 - 2 q.x, ip -q.x; per
    chunk of queries. Also sum_i |q~_i x~_i| for the accumulation bound of raw dumps."""

    def __init__(self, d: Data, chunk_bytes: int = 1 << 31):
        import torch

        self.d = d
        self.x64 = d.x[:, :d.dim].double()
        self.xn = self.x64.square().sum(1)
        self.q64 = d.q32.double()
        self.chunk = max(1, min(d.n_q, chunk_bytes // (8 * d.n)))
        qn = self.q64.square().sum(1)
        # float64 evaluation error of a key (GEMM + expansion), generous
        self.eps = d.dim * 2.0 ** -48 * (qn + float(self.xn.max()) + 2 * torch.sqrt(qn * float(self.xn.max()))) + 1e-300

    def keys(self, s: int, e: int):
        dots = self.q64[s:e] @ self.x64.T
        return -dots if self.d.ip else self.xn[None, :] - 2.0 * dots

    def blocks(self, queries=None):
        n_q = self.d.n_q if queries is None else queries
        for s in range(0, n_q, self.chunk):
            e = min(n_q, s + self.chunk)
            yield s, e, self.keys(s, e)

    def kth(self, ks, block_bytes: int = 1 << 32) -> dict:
        """{k: float64 k-th smallest key per query} for every k in ks: blocks of rows against every query
        (each row read once), the `top` smallest of each block merged."""
        import torch

        top = max(ks)
        rows = max(top, block_bytes // (8 * self.d.n_q))
        best = None
        for s in range(0, self.d.n, rows):
            x = self.x64[s:s + rows]
            dots = self.q64 @ x.T
            keys = -dots if self.d.ip else self.xn[None, s:s + rows] - 2.0 * dots
            del dots
            part = torch.topk(keys, min(top, keys.shape[1]), dim=1, largest=False).values
            best = part if best is None else torch.topk(torch.cat([best, part], 1), top, dim=1, largest=False).values
            del keys
        return {k: best[:, k - 1] for k in ks}

    def thresholds(self, kth):
        """float32 key thresholds (rounded up, float64 evaluation error added)."""
        return round_f32(kth + self.eps[: len(kth)], True)


def bound_used(d: Data, v: Variant, e, f, rows):
    """float64 per (query, row) bound the kernel subtracts (EPI 0: per row, EPI 1: the tile's largest r_x)."""
    import torch

    if v.epi == 0:
        r = d.r_x[rows].double()
    else:
        tiles = d.r_x.view(-1, v.bn).amax(1).double()
        r = tiles[torch.div(rows, v.bn, rounding_mode="floor")]
    return e.double()[:, None] * r[None, :] + f.double()[:, None]


def check_survivors(d: Data, v: Variant, ref: Reference, thr, e, f, counts, survivors, capacity, queries=None) -> dict:
    """must (exact key + eps <= T) must all survive; every survivor must be possible (key - 2 bound - slop <= T),
    distinct and in range; when no overflow, the count is the list's length."""
    import torch

    missed = impossible = dups = bad = required = listed_total = overflowed = 0
    example = None
    for s, e_, keys in ref.blocks(queries):
        m = e_ - s
        c = counts[s:e_].long()
        overflowed += int((c > capacity).sum())
        n_list = c.clamp(max=capacity)
        ok = torch.arange(capacity, device=keys.device)[None, :] < n_list[:, None]
        pos = survivors[s:e_].long()
        inside = (pos >= 0) & (pos < d.n)
        bad += int((ok & ~inside).sum())
        valid = ok & inside
        hits = torch.zeros((m, d.n), dtype=torch.int32, device=keys.device)
        rows_idx = torch.arange(m, device=keys.device)[:, None].expand(-1, capacity)
        hits.index_put_((rows_idx[valid], pos[valid]), torch.ones_like(pos[valid], dtype=torch.int32), accumulate=True)
        dups += int((hits > 1).sum())
        got = hits > 0
        listed_total += int(valid.sum())
        t = thr[s:e_].double()[:, None]
        fine = (c <= capacity)[:, None]
        must = (keys + ref.eps[s:e_, None] <= t) & fine
        required += int(must.sum())
        miss = must & ~got
        if int(miss.sum()):
            missed += int(miss.sum())
            qi, ri = miss.nonzero()[0].tolist()
            example = {"query": s + qi, "row": ri, "key": float(keys[qi, ri]), "t": float(t[qi, 0])}
        all_rows = torch.arange(d.n, device=keys.device)
        b = bound_used(d, v, e[s:e_], f[s:e_], all_rows)
        slop = 2.0 ** -20 * (keys.abs() + (0 if d.ip else ref.xn[None, :]) + t.abs()) + 1e-30
        possible = keys - 2.0 * b - slop <= t
        impossible += int((got & ~possible).sum())
        if example is None and int((got & ~possible).sum()):
            qi, ri = (got & ~possible).nonzero()[0].tolist()
            example = {"impossible_query": s + qi, "row": ri, "key": float(keys[qi, ri]), "t": float(t[qi, 0]),
                       "bound": float(b[qi, ri])}
        del hits, got, must, possible
    return {"required": required, "missed": missed, "impossible": impossible, "duplicates": dups,
            "bad_positions": bad, "listed": listed_total, "overflowed_queries": overflowed, "example": example}


def diagnose(got, exact, wrong, limit: int = 6) -> list:
    """For a few wrong elements: where (query, row) in the exact product the dumped value sits, if anywhere
    (a mapping error moves values; a layout/swizzle error makes values that are nowhere)."""
    import torch

    out = []
    for qi, ri in wrong.nonzero()[:limit].tolist():
        value = float(got[qi, ri])
        dist = (exact - value).abs()
        where = (dist == dist.min()).nonzero()[0].tolist()
        out.append({"at": [qi, ri], "got": value, "want": float(exact[qi, ri]), "closest_at": where,
                    "closest_diff": float(dist.min())})
    return out


def check_dump(d: Data, ref: Reference, dump) -> dict:
    """Raw accumulators against float64 dot products of the kernel's inputs: every element written,
    |acc - dot| <= gamma sum|q~ x~| + flush (f16), equal (8-bit)."""
    import torch

    qs = d.qs[:, :d.dim].double()
    unwritten = int(torch.isnan(dump).sum()) if d.elem == "f16" else int((dump.view(torch.int32) == POISON).sum())
    exact = qs @ ref.x64.T
    if d.elem == "f16":
        n = 4 * d.k_blocks
        gamma = n * 2.0 ** -18 * (1.0 + n * 2.0 ** -18)
        magnitude = qs.abs() @ ref.x64.abs().T
        err = (dump.double() - exact).abs()
        allowed = gamma * magnitude + (d.k_blocks * 64 + n) * 2.0 ** -126
        ratio = err / allowed
        finite = torch.isfinite(ratio)
        worst = float(ratio[finite].max()) if bool(finite.any()) else None
        ulps = err / (2.0 ** -24 * magnitude.clamp(min=1e-30))
        wrong = ~(err <= allowed)
        out = {"unwritten": unwritten, "over_bound": int(wrong.sum()), "worst_err_over_bound": worst,
               "median_err_over_bound": float(ratio[finite].median()) if bool(finite.any()) else None,
               "worst_err_in_2^-24_of_sum|p|": float(ulps[torch.isfinite(ulps)].max()) if bool(torch.isfinite(ulps).any()) else None,
               "max_abs_err": float(err[torch.isfinite(err)].max()) if bool(torch.isfinite(err).any()) else None}
        if int(wrong.sum()):
            out["diagnosis"] = diagnose(dump.double(), exact, wrong)
        return out
    got = dump.view(torch.int32).double()
    wrong = got != exact
    out = {"unwritten": unwritten, "mismatches": int(wrong.sum())}
    if int(wrong.sum()):
        out["diagnosis"] = diagnose(got, exact, wrong)
    return out


# ---- back ends ----------------------------------------------------------------------------------
class GpuBackend:
    """Cubins loaded with cuda.bindings into torch's (primary) context; TMA descriptors with
    cuTensorMapEncodeTiled; launches with cuLaunchKernel on torch's current stream."""

    def __init__(self, cubins: dict, variants):
        import torch
        from cuda.bindings import driver as cu

        self.cu = cu
        torch.cuda.init()
        torch.empty(1, device="cuda")
        self.check(cu.cuInit(0), "cuInit")
        ctx = self.check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if not int(ctx):
            dev = self.check(cu.cuDeviceGet(0), "cuDeviceGet")
            ctx = self.check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self.check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        props = torch.cuda.get_device_properties(0)
        self.sms = props.multi_processor_count
        self.device_name = props.name
        self.functions = {}
        self.variants = {v.name: v for v in variants}
        self.errors = {}
        self.max_clusters = {}
        for v in variants:
            try:
                module = self.check(cu.cuModuleLoadData(cubins[v.name][0]), f"cuModuleLoadData({v.name})")
                fn = self.check(cu.cuModuleGetFunction(module, v.name.encode()), "cuModuleGetFunction")
                self.check(cu.cuFuncSetAttribute(
                    fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, v.smem),
                    "cuFuncSetAttribute")
                self.functions[v.name] = fn
                if v.cl > 1:
                    self.max_clusters[v.name] = self._max_clusters(fn, v)
            except Exception as exc:  # noqa: BLE001
                self.errors[v.name] = f"{type(exc).__name__}: {exc}"
        self.watchdog = torch.zeros(1, dtype=torch.int32).pin_memory()   # mapped host memory (UVA)
        self._maps = {}

    def check(self, result, what):
        cu = self.cu
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != cu.CUresult.CUDA_SUCCESS:
            _, text = cu.cuGetErrorString(err)
            raise RuntimeError(f"{what}: {err.name} ({text.decode() if text else ''})")
        return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)

    def _max_clusters(self, fn, v) -> int:
        cu = self.cu
        try:
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = v.cl * self.sms, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
            config.sharedMemBytes = v.smem
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = v.cl, 1, 1
            config.attrs = [attr]
            config.numAttrs = 1
            return int(self.check(cu.cuOccupancyMaxActiveClusters(fn, config), "cuOccupancyMaxActiveClusters"))
        except Exception as exc:  # noqa: BLE001
            self.errors[v.name + ":occupancy"] = f"{type(exc).__name__}: {exc}"
            return self.sms // v.cl

    def tensor_map(self, t, box_cols: int, box_rows: int):
        cu = self.cu
        key = (t.data_ptr(), tuple(t.shape), box_cols, box_rows)
        if key in self._maps:
            return self._maps[key][0]
        rows, cols = t.shape
        dtype = (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16 if t.element_size() == 2
                 else cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8)
        tmap = self.check(cu.cuTensorMapEncodeTiled(
            dtype, 2, t.data_ptr(), [cu.cuuint64_t(cols), cu.cuuint64_t(rows)],
            [cu.cuuint64_t(cols * t.element_size())], [cu.cuuint32_t(box_cols), cu.cuuint32_t(box_rows)],
            [cu.cuuint32_t(1), cu.cuuint32_t(1)], cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        self._maps[key] = (tmap, t)    # keep the tensor alive with its descriptor
        return tmap

    def grid(self, v: Variant, d: Data, grid: int | None = None) -> int:
        n_qt = -(-d.n_q // v.tile_q)
        work = -(-n_qt // v.cl) * -(-d.n // v.bn)
        if grid is not None:
            return grid
        if v.cl > 1:
            return v.cl * max(1, min(work, self.max_clusters.get(v.name, self.sms // v.cl)))
        return max(1, min(work, self.sms))

    def bind(self, v: Variant, d: Data, tile_rmax, thr, e, f, counts, survivors, capacity, dump=None, grid=None):
        """A function that enqueues the kernel with these arguments (packed once)."""
        import torch

        cu = self.cu
        if v.name not in self.functions:
            raise RuntimeError(f"{v.name} not loaded: {self.errors.get(v.name)}")
        tq = self.tensor_map(d.qs, v.bk, v.tile_q)
        tx = self.tensor_map(d.x, v.bk, v.bn // v.cl)
        ptr = lambda t: 0 if t is None else t.data_ptr()   # noqa: E731
        scalars = [ctypes.c_int(d.n_q), ctypes.c_int(d.n), ctypes.c_int(d.k_blocks),
                   ctypes.c_void_p(ptr(d.sq_lo)), ctypes.c_void_p(ptr(d.r_x)), ctypes.c_void_p(ptr(tile_rmax)),
                   ctypes.c_void_p(ptr(thr)), ctypes.c_void_p(ptr(e)), ctypes.c_void_p(ptr(f)),
                   ctypes.c_void_p(ptr(counts)), ctypes.c_void_p(ptr(survivors)), ctypes.c_int(capacity),
                   ctypes.c_void_p(ptr(dump)), ctypes.c_void_p(self.watchdog.data_ptr())]
        addresses = [tq.getPtr(), tx.getPtr()] + [ctypes.addressof(s) for s in scalars]
        array = (ctypes.c_void_p * len(addresses))(*addresses)
        fn = self.functions[v.name]
        g = self.grid(v, d, grid)
        keep = (scalars, array, tq, tx)

        def launch():
            stream = torch.cuda.current_stream().cuda_stream
            err, = cu.cuLaunchKernel(fn, g, 1, 1, THREADS, 1, 1, v.smem, stream, ctypes.addressof(array), 0)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchKernel({v.name}, grid {g}): {err.name}")
            return keep
        launch.grid = g
        return launch

    def param_sizes(self, v: Variant):
        cu = self.cu
        sizes = []
        for i in range(32):
            try:
                err, _off, size = cu.cuFuncGetParamInfo(self.functions[v.name], i)
            except Exception:  # noqa: BLE001
                return None
            if err != cu.CUresult.CUDA_SUCCESS:
                break
            sizes.append(int(size))
        return sizes


class FakeBackend:
    """The kernel's semantics in torch on the CPU (no directed rounding, float32 from float64): tests the
    harness without a GPU. Its survivors are in row order; its dump is the float64 dot rounded."""

    sms = 4
    device_name = "cpu stand-in"

    def __init__(self, cubins, variants):
        self.functions = {v.name: None for v in variants}
        self.errors = {}

    def grid(self, v, d, grid=None):
        return grid or 1

    def param_sizes(self, v):
        return None

    def bind(self, v, d, tile_rmax, thr, e, f, counts, survivors, capacity, dump=None, grid=None):
        import torch

        def launch():
            qs, x = d.qs[:, :d.dim].double(), d.x[:, :d.dim].double()
            acc = (qs @ x.T).float()
            hi = acc.double()
            if d.ip:
                key = -hi
            else:
                key = d.sq_lo[:d.n].double()[None, :] - 2 * hi
            rows = torch.arange(d.n)
            if v.epi == 0:
                low = key - (e.double()[:, None] * d.r_x[:d.n].double()[None, :] + f.double()[:, None])
                tq = thr.double()[:, None]
            else:
                low = key
                rmax = tile_rmax.double()[torch.div(rows, v.bn, rounding_mode="floor")]
                tq = thr.double()[:, None] + e.double()[:, None] * rmax[None, :] + f.double()[:, None]
            passed = ~(low.float() > tq.float())
            for q in range(d.n_q):
                hit = passed[q].nonzero().flatten()
                counts[q] += len(hit)
                k = min(len(hit), capacity)
                survivors[q, :k] = hit[:k].int()
            if dump is not None:
                if d.elem == "f16":
                    dump.copy_(acc)
                else:
                    dump.view(torch.int32).copy_((qs @ x.T).round().int())
        launch.grid = self.grid(v, d, grid)
        return launch


# ---- running --------------------------------------------------------------------------------------
def sync(device):
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def median_ms(fn, device, reps=20, warm=3) -> float:
    """Median of `reps` timings (CUDA events around each), after `warm` untimed runs."""
    import torch

    for _ in range(warm):
        fn()
    if device != "cuda":
        t = []
        for _ in range(reps):
            s = time.perf_counter()
            fn()
            t.append((time.perf_counter() - s) * 1e3)
        return statistics.median(t)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def screen_run(backend, v, d, ref, thr, e, f, capacity, device, grid=None, want_dump=False):
    """One poisoned launch: counts zeroed, survivors and dump poisoned; returns (counts, survivors, dump)."""
    import torch

    counts = torch.zeros(d.n_q, dtype=torch.int32, device=device)
    survivors = torch.full((d.n_q, capacity), -7, dtype=torch.int32, device=device)
    dump = None
    if want_dump:
        dump = torch.full((d.n_q, d.n), float("nan"), dtype=torch.float32, device=device)
        if d.elem != "f16":
            dump.view(torch.int32).fill_(POISON)
    tile_rmax = d.r_x.view(-1, v.bn).amax(1).contiguous()
    launch = backend.bind(v, d, tile_rmax, thr, e, f, counts, survivors, capacity, dump, grid)
    launch()
    sync(device)
    return counts, survivors, dump, launch.grid


def context_alive(device) -> bool:
    """False once a kernel fault (trap, illegal address) has poisoned the CUDA context."""
    if device != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False


def check_variant(backend, v, device, quick: bool, cache: dict) -> dict:
    """Small shapes: a dump variant's raw accumulators against float64; a screen variant's survivor lists
    at k = 10 and 200, with the default grid and with one CTA (cluster) walking every tile through the
    rings, and with a 64-entry capacity that overflows."""
    import torch

    shapes = [(3000, 100, 200), (5000, 768, 300)] if not quick else [(3000, 100, 200)]
    out = {"label": v.label(), "shapes": {}}
    ok = True
    for n, dim, n_q in shapes:
        if v.elem == "u8x" and dim > 256:
            dim = 200                           # uint8's exact conversion needs 65025 x stride < 2^24
        key = (v.elem, v.ip, n, dim, n_q)
        if key not in cache:
            d = make_data(v.elem, v.ip, n, dim, n_q, seed=len(cache) + 1, device=device)
            ref = Reference(d)
            ks = ref.kth([10, 200])
            e, f = error_terms(d.q32, d.qs[:, :dim], v.elem, v.ip, d.k_blocks, dim)
            cache[key] = (d, ref, ks, e, f)
        d, ref, ks, e, f = cache[key]
        r = {"k_blocks": d.k_blocks}
        if v.dump:
            thr = torch.full((n_q,), -math.inf, dtype=torch.float32, device=device)
            counts, _s, dump, g = screen_run(backend, v, d, ref, thr, e, f, 16, device, want_dump=True)
            r["dump"] = check_dump(d, ref, dump)
            r["dump"]["survivors_with_-inf"] = int(counts.sum())
            r["grid"] = g
            r["ok"] = r["dump"]["unwritten"] == 0 and r["dump"].get("over_bound", 0) == 0 and \
                r["dump"].get("mismatches", 0) == 0 and r["dump"]["survivors_with_-inf"] == 0
            del dump
        else:
            runs = {}
            for label, k, cap, grid in (("k10", 10, CAPACITY, None), ("k200", 200, CAPACITY, None),
                                        ("k10 one-cta", 10, CAPACITY, v.cl), ("k200 cap64", 200, 64, None)):
                thr = ref.thresholds(ks[k])
                counts, surv, _d, g = screen_run(backend, v, d, ref, thr, e, f, cap, device, grid=grid)
                res = check_survivors(d, v, ref, thr, e, f, counts, surv, cap)
                res["grid"] = g
                res["survivors_median"] = float(counts.double().median())
                res["survivors_max"] = int(counts.max())
                runs[label] = res
            r["screen"] = runs
            r["ok"] = all(x["missed"] == 0 and x["impossible"] == 0 and x["duplicates"] == 0 and
                          x["bad_positions"] == 0 for x in runs.values()) and runs["k200 cap64"]["overflowed_queries"] > 0
        out["shapes"][f"{n}x{dim}x{n_q}"] = r
        ok = ok and r["ok"]
        brief = r.get("dump") or {k: (x["missed"], x["impossible"], x["survivors_median"]) for k, x in r["screen"].items()}
        print(f"   check {v.name} {n}x{dim}x{n_q}: {'ok' if r['ok'] else 'FAIL'} {brief}", flush=True)
    out["ok"] = ok
    return out


def torch_matmul_ms(d: Data, device) -> float | None:
    """torch.matmul fp16 (8-bit: torch._int_mm of int8 values) of the same shape, rows chunked to 2M."""
    import torch

    try:
        rows = min(d.n, 1 << 21)
        if d.elem == "f16":
            x, q = d.x[:rows, :d.dim], d.qs[:, :d.dim]
            ms = median_ms(lambda: torch.matmul(q, x.T), device, reps=10)
        else:
            x = d.x[:rows, :d.dim].view(torch.int8) if d.x.dtype == torch.uint8 else d.x[:rows, :d.dim]
            q = d.qs[:, :d.dim].view(torch.int8) if d.qs.dtype == torch.uint8 else d.qs[:, :d.dim]
            x, q = x.contiguous(), q.contiguous()
            ms = median_ms(lambda: torch._int_mm(q, x.T), device, reps=10)
        return ms * d.n / rows
    except Exception as exc:  # noqa: BLE001
        print(f"   torch matmul failed: {exc}")
        return None




class TimedCase:
    """One timed shape: data on the device, exact k-th keys for every query, error terms, torch's time."""

    def __init__(self, backend, elem, n, dim, n_q, device, sub_queries, ks=(10, 100)):
        t0 = time.perf_counter()
        self.ks, self.sub, self.device = ks, sub_queries, device
        self.d = make_data(elem, False, n, dim, n_q, seed=11, device=device)
        self.ref = Reference(self.d)
        self.kth = self.ref.kth(list(ks))
        self.e, self.f = error_terms(self.d.q32, self.d.qs[:, :dim], elem, False, self.d.k_blocks, dim)
        self.flops = 2.0 * n * n_q * dim
        self.info = {"shape": [n, dim, n_q], "elem": elem, "tflop": self.flops / 1e12,
                     "setup_s": round(time.perf_counter() - t0, 1)}
        self.info["torch_ms"] = torch_matmul_ms(self.d, device)
        self.info["torch_tflops"] = self.flops / self.info["torch_ms"] / 1e9 if self.info["torch_ms"] else None
        print(f"   data + reference {self.info['setup_s']} s; torch {self.info['torch_ms']} ms", flush=True)

    def run(self, backend, v) -> dict:
        """A poisoned launch checked against the float64 keys of the first `sub` queries (counts of all),
        then the kernel's time (a 4-byte-per-query memset included), at each k."""
        d, ref = self.d, self.ref
        r = {"label": v.label()}
        for k in self.ks:
            thr = ref.thresholds(self.kth[k])
            counts, surv, _d, g = screen_run(backend, v, d, ref, thr, self.e, self.f, CAPACITY, self.device)
            res = check_survivors(d, v, ref, thr, self.e, self.f, counts, surv, CAPACITY, queries=self.sub)
            res["survivors_median"] = float(counts.double().median())
            res["survivors_mean"] = float(counts.double().mean())
            res["survivors_max"] = int(counts.max())
            res["overflowed_all"] = int((counts > CAPACITY).sum())
            tile_rmax = d.r_x.view(-1, v.bn).amax(1).contiguous()
            launch = backend.bind(v, d, tile_rmax, thr, self.e, self.f, counts, surv, CAPACITY)

            def screen():
                counts.zero_()
                launch()
            ms = median_ms(screen, self.device)
            res["ms"], res["tflops"], res["grid"] = ms, self.flops / ms / 1e9, g
            r[f"k{k}"] = res
        r["ok"] = all(r[f"k{k}"]["missed"] == 0 and r[f"k{k}"]["impossible"] == 0 and r[f"k{k}"]["duplicates"] == 0
                      and r[f"k{k}"]["bad_positions"] == 0 for k in self.ks)
        print(f"   {v.name}: " + "; ".join(
            f"k{k} {r[f'k{k}']['ms']:.3f} ms {r[f'k{k}']['tflops']:.0f} TFLOP/s surv med "
            f"{r[f'k{k}']['survivors_median']:.0f} missed {r[f'k{k}']['missed']}" for k in self.ks), flush=True)
        return r


GROUPS = {   # name: (elem, n, dim, n_q, queries checked against float64) of a timed shape; "check*": small shapes
    "f16_768": lambda q: ("f16", 1_000_000, 768, 1000, 128) if not q else ("f16", 20_000, 768, 300, 64),
    "f16_128": lambda q: ("f16", 10_000_000, 128, 2048, 48) if not q else ("f16", 30_000, 128, 500, 64),
    "u8_128": lambda q: ("u8x", 10_000_000, 128, 2048, 48) if not q else ("u8x", 30_000, 128, 500, 64),
}


def group_variants(group: str, skip=()) -> list[Variant]:
    """The variants a group runs: check (CL = 1), check_cluster (CL > 1), or a timed shape's."""
    every = all_variants()
    if group == "check":
        return [v for v in every if v.cl == 1]
    if group == "check_cluster":
        return [v for v in every if v.cl > 1]
    elem = GROUPS[group](False)[0]
    return [v for v in (F16_TIMED if elem == "f16" else U8_TIMED) if v.name not in skip]


def child(args) -> int:
    """Run args.variants of group args.child with the parent's cubins; after each variant the result file
    is rewritten, so a kernel that kills this process still leaves the others' results (and its name)."""
    device = "cpu" if args.fake else "cuda"
    with open(args.cubins, "rb") as fh:
        cubins = pickle.load(fh)
    names = args.variants.split(",")
    variants = [v for v in all_variants() if v.name in names]
    variants.sort(key=lambda v: names.index(v.name))
    backend = (FakeBackend if args.fake else GpuBackend)(cubins, variants)
    state = {"results": {}, "current": None, "info": {}, "load_errors": backend.errors}
    if not args.fake:
        state["info"]["param_sizes"] = backend.param_sizes(variants[0]) if variants and variants[0].name in backend.functions else None
        state["info"]["max_clusters"] = backend.max_clusters
    path = Path(args.result)

    def save():
        path.write_text(json.dumps(state, default=str))
    save()
    timed = None
    if args.child in GROUPS:
        try:
            elem, n, dim, n_q, sub = GROUPS[args.child](args.quick)
            timed = TimedCase(backend, elem, n, dim, n_q, device, sub)
            state["info"].update(timed.info)
        except Exception as exc:  # noqa: BLE001
            state["error"] = f"setup: {type(exc).__name__}: {exc}"
            state["traceback"] = traceback.format_exc(limit=8)
            save()
            return 1
    cache: dict = {}
    for v in variants:
        state["current"] = v.name
        save()
        try:
            r = timed.run(backend, v) if timed else check_variant(backend, v, device, args.quick, cache)
        except Exception as exc:  # noqa: BLE001
            r = {"label": v.label(), "ok": False, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc(limit=6)}
            print(f"   {v.name}: ERROR {r['error']}", flush=True)
            if not context_alive(device):
                r["watchdog"] = int(backend.watchdog[0])
                r["context"] = "lost"
                state["results"][v.name] = r
                state["current"] = None
                save()
                return 3
        state["results"][v.name] = r
        state["current"] = None
        save()
    return 0


def run_group(group: str, names: list, blob: Path, tmp: Path, args, t0: float) -> dict:
    """The group's variants in child processes; a child whose context died is replaced by a fresh one for
    the variants still to run (at most 4 children per group)."""
    merged = {"results": {}, "info": {}}
    remaining = list(names)
    for attempt in range(4):
        if not remaining or time.perf_counter() - t0 > args.budget_s:
            break
        part = tmp / f"{group}.{attempt}.json"
        command = [sys.executable, __file__, "--child", group, "--cubins", str(blob), "--result", str(part),
                   "--variants", ",".join(remaining)] + (["--fake"] if args.fake else []) + \
                  (["--quick"] if args.quick else [])
        try:
            done = subprocess.run(command, timeout=max(60.0, args.budget_s + 150 - (time.perf_counter() - t0)))
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        state = json.loads(part.read_text()) if part.exists() else {}
        merged["results"].update(state.get("results", {}))
        merged["info"].update(state.get("info", {}))
        if state.get("load_errors"):
            merged.setdefault("load_errors", {}).update(state["load_errors"])
        if state.get("error"):
            merged["error"] = state["error"]
            merged["traceback"] = state.get("traceback")
            break
        current = state.get("current")
        if current and current not in merged["results"]:
            merged["results"][current] = {"ok": False, "error": f"child ended ({rc}) while running it"}
        remaining = [n for n in remaining if n not in merged["results"]]
        if rc not in (0, 3) and not current:
            merged["error"] = f"child exit {rc}"
            break
    for n in remaining:
        merged["results"].setdefault(n, {"ok": False, "error": "not run (time or restarts)"})
    return merged


def table(report: dict) -> str:
    lines = ["", "== Hopper screen probe: summary =="]
    if report.get("device"):
        lines.append(f"device {report['device']}; torch fp16 8192^3: {report.get('torch_8192_tflops', 0):.0f} TFLOP/s")
    for group in ("check", "check_cluster"):
        res = report.get("groups", {}).get(group, {}).get("results", {})
        if res:
            bad = [n for n, r in res.items() if not r.get("ok")]
            lines.append(f"{group}: {len(res) - len(bad)}/{len(res)} variants ok" +
                         ("; FAILED: " + ", ".join(f"{n} ({(res[n].get('error') or 'wrong')[:50]})" for n in bad)
                          if bad else ""))
    for name in GROUPS:
        g = report.get("groups", {}).get(name)
        if not g:
            continue
        t = g.get("info", {})
        if "shape" not in t:
            lines.append(f"{name}: ERROR {g.get('error')}")
            continue
        unit = "TOPS" if t["elem"] != "f16" else "TFLOP/s"
        torch_ms = t.get("torch_ms") or float("nan")
        lines.append(f"{t['shape'][0]:,} x {t['shape'][1]} x {t['shape'][2]:,} {t['elem']}: torch matmul "
                     f"{torch_ms:.3f} ms = {t.get('torch_tflops') or 0:.0f} {unit}")
        lines.append(f"   {'variant':62s} {'k=10 ms':>8s} {unit:>7s} {'k=100 ms':>9s} {unit:>7s} {'surv':>5s} sound")
        for vname, r in g.get("results", {}).items():
            if "error" in r or "k10" not in r:
                lines.append(f"   {r.get('label', vname)[:62]:62s} ERROR {str(r.get('error'))[:70]}"
                             f"{' watchdog ' + str(r['watchdog']) if r.get('watchdog') else ''}")
                continue
            a, b = r["k10"], r["k100"]
            lines.append(f"   {r['label'][:62]:62s} {a['ms']:8.3f} {a['tflops']:7.0f} {b['ms']:9.3f} {b['tflops']:7.0f} "
                         f"{b['survivors_median']:5.0f} {'yes' if r['ok'] else 'NO'}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for hopper_probe.json")
    parser.add_argument("--compile-only", action="store_true", help="NVRTC compile + ptxas report + SASS counts")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--cubin-dir", type=Path, default=None, help="also write the cubins here")
    parser.add_argument("--fake", action="store_true", help="no GPU: a CPU stand-in for the kernel")
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--groups", default="check,check_cluster,f16_768,f16_128,u8_128")
    parser.add_argument("--only", default="", help="variants whose name contains one of these (comma list)")
    parser.add_argument("--budget-s", type=float, default=280.0, help="start no child after this many seconds")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cubins", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--variants", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    t0 = time.perf_counter()
    variants = all_variants()
    if args.only:
        variants = [v for v in variants if any(s in v.name for s in args.only.split(","))]
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "variants": {}}
    out_json = (args.out / "hopper_probe.json") if args.out else None

    def save():
        if out_json:
            out_json.parent.mkdir(parents=True, exist_ok=True)
            out_json.write_text(json.dumps(report, indent=1, default=str))
    try:
        from cuda.bindings import nvrtc
        report["nvrtc"] = ".".join(map(str, nvrtc.nvrtcVersion()[1:]))
    except Exception as exc:  # noqa: BLE001
        report["nvrtc"] = f"unavailable: {exc}"
    if args.fake and not args.compile_only:
        cubins = {v.name: (b"", {}) for v in variants}
    else:
        cubins = compile_all(variants, args.arch)
        report["compile_s"] = round(time.perf_counter() - t0, 1)
        tool = find_cuobjdump()
        for v in variants:
            image, rep = cubins[v.name]
            report["variants"][v.name] = {"label": v.label(), "smem": v.smem, "ptxas": rep,
                                          "sass": sass_summary(image, tool)}
        print(f"NVRTC {report['nvrtc']} {args.arch}: {len(variants)} kernels in {report['compile_s']} s "
              f"(cuobjdump: {tool})")
        for name, info in report["variants"].items():
            p, s = info["ptxas"], info["sass"]
            print(f"   {name:44s} smem {info['smem']:6d} regs {p.get('registers')} stack {p.get('stack')} "
                  f"spills {p.get('spill_stores')}/{p.get('spill_loads')} {p.get('warnings') or ''} "
                  f"sass {s.get('counts', s.get('error'))}")
        if args.cubin_dir:
            args.cubin_dir.mkdir(parents=True, exist_ok=True)
            for name, (image, _) in cubins.items():
                (args.cubin_dir / f"{name}.cubin").write_bytes(image)
        save()
    bad = [n for n, i in report["variants"].items()
           if i["ptxas"].get("stack") or i["ptxas"].get("spill_stores") or i["ptxas"].get("spill_loads")]
    if args.compile_only:
        print(f"stack/spills in: {bad or 'none'}")
        return 1 if bad else 0

    if not args.fake:
        import torch

        props = torch.cuda.get_device_properties(0)
        report["device"] = f"{props.name}, {props.multi_processor_count} SMs"
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
        report["torch_8192_tflops"] = 2 * 8192 ** 3 / median_ms(lambda: a @ a, "cuda", reps=10) / 1e9
        del a
        torch.cuda.empty_cache()
        print(f"{report['device']}; torch fp16 8192^3 {report['torch_8192_tflops']:.0f} TFLOP/s", flush=True)
    report["groups"] = {}
    failed: set = set()
    names = {v.name for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp) / "cubins.pickle"
        blob.write_bytes(pickle.dumps(cubins))
        for group in args.groups.split(","):
            chosen = [v.name for v in group_variants(group) if v.name in names]
            if group in GROUPS:
                # a variant that failed its check (or whose cluster twin did) is not timed
                chosen = [n for n in chosen if n not in failed]
            if not chosen:
                continue
            if time.perf_counter() - t0 > args.budget_s:
                report["groups"][group] = {"error": "skipped: out of time"}
                continue
            print(f"== group {group}: {len(chosen)} variants ({time.perf_counter() - t0:.0f} s)", flush=True)
            result = run_group(group, chosen, blob, Path(tmp), args, t0)
            report["groups"][group] = result
            if group.startswith("check"):
                failed |= {n for n, r in result["results"].items() if not r.get("ok")}
            if result.get("error"):
                print(f"   group {group}: ERROR {result['error']}\n{result.get('traceback') or ''}", flush=True)
            save()
    report["total_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(table(report))
    print(f"total {report['total_s']} s" + (f"; wrote {out_json}" if out_json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
