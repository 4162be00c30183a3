"""The tensor-core screen (kernels/screen.cuh) from Python: configurations, rendering, the error bound's
per-query and per-row terms, and a launch through tinyknn's launcher on torch tensors.

Kept beside the probe until the lead moves the screen's render entry into tinyknn/jit/render.py (the
proposed code is in bench/NOTES_SCREEN.md). Importing this module needs numpy only; torch and a GPU
are needed by the functions that say so.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

ELEMENTS = {"float16": "tinyknn::ScreenF16", "bfloat16": "tinyknn::ScreenBF16",
            "int8": "tinyknn::ScreenS8", "uint8": "tinyknn::ScreenU8"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}
# Input rounding of a 16-bit type: |v - v~| <= UNIT |v| + TINY (round to nearest; TINY covers subnormals,
# for bf16 also a flush to zero of its subnormals).
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
TINY = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -126}
MMA_STEP_BYTES = 32                 # K bytes one mma.sync consumes (16 fp16/bf16, 32 int8)
MMA_TRUNCATION = 2.0 ** -18         # one instruction's error over (|c| + sum |p|): 32 truncations of 2^-23
FLUSH = 2.0 ** -126                 # a flushed subnormal product or accumulator
INPUT_SLACK = 1.0 + 2.0 ** -20      # float64 -> float32 rounding of e_q, f_q (then rounded up)


@dataclass(frozen=True)
class ScreenConfig:
    """One instantiation of tinyknn::screen_kernel (see kernels/screen.cuh for each parameter)."""

    elem: str = "float16"
    metric: str = "l2"              # "l2" or "ip" (cosine = ip on normalised rows, outside)
    threshold: bool = False         # threshold mode: K smallest upper bounds per (query, row tile)
    k: int = 1
    bq: int = 128
    bn: int = 128
    bkb: int = 64
    warps_q: int = 2
    warps_n: int = 4
    stages: int = 4
    ldmatrix: bool = True

    def __post_init__(self):
        if self.elem not in ELEMENTS:
            raise ValueError(f"elem must be one of {sorted(ELEMENTS)}; got {self.elem!r}")
        if self.metric not in ("l2", "ip"):
            raise ValueError(f"metric must be 'l2' or 'ip'; got {self.metric!r}")

    @property
    def threads(self) -> int:
        return 32 * self.warps_q * self.warps_n

    @property
    def smem(self) -> int:
        """screen_smem_bytes of kernels/screen.cuh."""
        upper = self.bq * (self.bn + 1) * 4 if self.threshold else 0
        return self.stages * (self.bq + self.bn) * (self.bkb + 16) + upper + self.stages * 8 * self.bn + 12 * self.bq

    @property
    def name(self) -> str:
        def b(v):
            return "true" if v else "false"
        args = [ELEMENTS[self.elem], b(self.metric == "ip"), b(self.threshold), self.k, self.bq, self.bn, self.bkb,
                self.warps_q, self.warps_n, self.stages, b(self.ldmatrix), self.smem]
        return f"tinyknn::screen_kernel<{', '.join(str(a) for a in args)}>"

    def label(self) -> str:
        mode = f"thr{self.k}" if self.threshold else "screen"
        return (f"{self.elem}/{self.metric}/{mode} {self.bq}x{self.bn}x{self.bkb}B w{self.warps_q}x{self.warps_n}"
                f" s{self.stages}{'' if self.ldmatrix else ' no-ldmatrix'}")


def compile_screens(configs, arch: str, programs: int = 8) -> dict:
    """{name expression: tinyknn.jit.compiler.Cubin} for every config, in up to `programs` NVRTC programs
    compiled in parallel threads (nvrtcCompileProgram releases the GIL)."""
    import concurrent.futures

    from tinyknn.jit import cuda_source
    from tinyknn.jit.compiler import compile_cubin

    names = list(dict.fromkeys(c.name for c in configs))
    groups = [tuple(names[i::programs]) for i in range(min(programs, len(names)))]
    source = cuda_source.kernel_source("screen.cuh")

    def build(group):
        return compile_cubin(cuda_source.RenderedSource(source, group, cuda_source.OPTIONS), arch)

    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        return {name: cubin for group, cubin in zip(groups, pool.map(build, groups)) for name in group}


def row_bytes_for(dim: int, elem: str) -> int:
    """Padded row length in bytes: tinyknn's 16-byte chunks (the kernel zero-fills to its K step)."""
    return -(-dim * ITEMSIZE[elem] // 16) * 16


def mma_count(row_bytes: int, bkb: int) -> int:
    """mma.sync instructions accumulated into one output (zero-filled stages included)."""
    return -(-row_bytes // bkb) * (bkb // MMA_STEP_BYTES)


def round_up_f32(v) -> np.ndarray:
    """float64 -> the smallest float32 >= v."""
    v = np.asarray(v, np.float64)
    r = v.astype(np.float32)
    return np.where(r.astype(np.float64) < v, np.nextafter(r, np.float32(np.inf)), r).astype(np.float32)


def error_terms(q: np.ndarray, q_screen: np.ndarray, elem: str, metric: str, row_bytes: int, bkb: int,
                shadow: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(e_q, f_q), float32 rounded up: |key(q, x) - screened key| <= e_q r_x + f_q for every row x.

    q: the queries as searched (float32 values, any float array); q_screen: the same rounded to `elem`
    (what the kernel multiplies); shadow: the rows are float32 read through a 16-bit copy.
    bench/NOTES_SCREEN.md derives each term.
    """
    q = np.asarray(q, np.float64)
    qs = np.asarray(q_screen, np.float64)
    if q.shape != qs.shape or q.ndim != 2:
        raise ValueError(f"q and q_screen must be the same 2-d shape; got {q.shape} and {qs.shape}")
    n_q, dim = q.shape
    if elem in ("int8", "uint8"):
        if shadow or not np.array_equal(q, qs):
            raise ValueError("8-bit screens take 8-bit rows and queries of their own values (no rounding)")
        return np.zeros(n_q, np.float32), np.zeros(n_q, np.float32)
    if not np.isfinite(qs).all():
        raise ValueError(f"a query is outside the {elem} range: the screen cannot take it (scale or fall back)")
    n = mma_count(row_bytes, bkb)
    gamma = n * MMA_TRUNCATION * (1.0 + n * MMA_TRUNCATION)
    q_norm, qs_norm = np.linalg.norm(q, axis=1), np.linalg.norm(qs, axis=1)
    e = np.linalg.norm(q - qs, axis=1) + gamma * qs_norm
    f = np.full(n_q, (dim + n) * FLUSH)
    if shadow:
        e += UNIT[elem] * q_norm
        f += TINY[elem] * math.sqrt(dim) * q_norm
    scale = (2.0 if metric == "l2" else 1.0) * INPUT_SLACK
    return round_up_f32(e * scale * (1 + 4 * dim * 2.0 ** -53)), round_up_f32(f * scale)


# ---- torch side (GPU) -------------------------------------------------------------------------
def torch_round_f32(v64, up: bool):
    """A float64 tensor -> float32 rounded up (or down)."""
    import torch

    r = v64.float()
    off = r.double() < v64 if up else r.double() > v64
    return torch.where(off, torch.nextafter(r, torch.full_like(r, math.inf if up else -math.inf)), r)


def row_terms(stored, screened, chunk: int = 1 << 20):
    """(sq_lo, sq_hi, r_x) float32 per row: |x|^2 rounded down and up, max(|x|, |x~|) rounded up.

    stored: the rows as stored (the exact values the contract widens); screened: what the kernel reads
    (the same tensor unless a 16-bit shadow of float32 rows). float64 sums err by <= dim 2^-53 relative.
    """
    import torch

    n, dim = stored.shape
    slack = dim * 2.0 ** -52
    lo, hi, r = (torch.empty(n, dtype=torch.float32, device=stored.device) for _ in range(3))
    for s in range(0, n, chunk):
        x = stored[s:s + chunk].double()
        sq = (x * x).sum(1)
        xs = screened[s:s + chunk].double()
        sqs = (xs * xs).sum(1) if screened is not stored else sq
        lo[s:s + chunk] = torch_round_f32(sq * (1 - slack), up=False)
        hi[s:s + chunk] = torch_round_f32(sq * (1 + slack), up=True)
        r[s:s + chunk] = torch_round_f32(torch.sqrt(torch.maximum(sq, sqs) * (1 + slack)) * (1 + 2.0 ** -50), up=True)
    return lo, hi, r


def padded(x, row_bytes: int):
    """Rows padded with zeros to row_bytes (contiguous)."""
    import torch

    stride = row_bytes // x.element_size()
    if x.shape[1] == stride and x.is_contiguous():
        return x
    out = torch.zeros((x.shape[0], stride), dtype=x.dtype, device=x.device)
    out[:, :x.shape[1]] = x
    return out


_PARAMS = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p,
           ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
WAVES = 8    # default tiles_per_block: about this many waves of resident blocks


class ScreenLauncher:
    """One compiled config, launched on torch tensors through tinyknn.gpu.launcher (default stream)."""

    def __init__(self, cubins: dict, config: ScreenConfig):
        from tinyknn.gpu.device import current_device
        from tinyknn.gpu.launcher import load_module

        self.config = config
        self.kernel = load_module(cubins[config.name]).kernel(config.name)
        self.kernel.set_max_dynamic_shared(config.smem)
        self.resident = current_device().sm_count * max(1, self.kernel.max_active_blocks_per_sm(config.threads,
                                                                                                 config.smem))

    def tiles_per_block(self, n_rows: int, n_queries: int) -> int:
        """Row tiles per block so that the grid is about WAVES waves of resident blocks."""
        c = self.config
        blocks = -(-n_queries // c.bq) * -(-n_rows // c.bn)
        return max(1, blocks // (WAVES * self.resident))

    def bind(self, data, n_rows, row_step, sq_norms, row_norms, queries, row_bytes, thresholds, e, f,
             counts, survivors, capacity, out_upper, tiles_per_block=None):
        """A launch with these arguments packed once: calling it enqueues the kernel (default stream)."""
        c = self.config
        n_queries = queries.shape[0]
        tpb = tiles_per_block or self.tiles_per_block(n_rows, n_queries)
        row_tiles = -(-n_rows // c.bn)
        grid = -(-n_queries // c.bq) * -(-row_tiles // tpb)   # query tile fastest (kernels/screen.cuh)
        ptr = lambda t: 0 if t is None else t.data_ptr()   # noqa: E731
        launch = self.kernel.prepare(_PARAMS, [
            ptr(data), int(n_rows), int(row_step), ptr(sq_norms), ptr(row_norms), ptr(queries), n_queries,
            int(row_bytes), ptr(thresholds), ptr(e), ptr(f), ptr(counts), ptr(survivors), int(capacity),
            ptr(out_upper), int(tpb)])
        launch.configure(grid, c.threads, c.smem)
        return launch.launch_configured

    def __call__(self, *args, **kwargs):
        self.bind(*args, **kwargs)()
