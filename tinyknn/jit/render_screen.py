"""KernelSpecs and name expressions of the tensor-core screen and the steps around it (kernels/screen.cuh,
kernels/screen_steps.cuh); render.name_expression hands these variants here. Pure text, no NVRTC, no GPU.

- "screen":         screen_kernel: rows against queries on the tensor cores (mma.sync), a row surviving a
                    query when its rigorous lower bound is within the query's threshold; with threshold=1, the
                    K smallest upper bounds per row tile (over a strided sample) instead.
- "screen_queries": the queries rounded to the screen's element type, with their error terms.
- "screen_rows":    the rows' terms (and a float32 index's float16 shadow).
- "threshold":      each query's threshold from the threshold mode's upper bounds.
- "survivors":      the survivors verified in float64 (the exactness contract), the k best written.
"""

from __future__ import annotations

from ..spec import KernelSpec

SCREEN_ELEMENTS = {"float16": "tinyknn::ScreenF16", "bfloat16": "tinyknn::ScreenBF16",
                   "int8": "tinyknn::ScreenS8", "uint8": "tinyknn::ScreenU8"}
ELEMENT_OF_STORAGE = {"float32": "float16", "float16": "float16", "bfloat16": "bfloat16", "int8": "int8",
                      "uint8": "uint8"}        # float32 indexes screen through a float16 shadow
# Tuning, from the H200 probe (bench/NOTES_SCREEN.md): 128 x 128 tiles of 64-byte stages, 2 x 4 warps, 4 stages.
SCREEN_BQ, SCREEN_BN, SCREEN_BKB, SCREEN_WARPS_Q, SCREEN_WARPS_N, SCREEN_STAGES = 128, 128, 64, 2, 4, 4
SURVIVOR_CAPACITY = 4096        # survivors kept per query (more: the query goes to the other kernels)
SURVIVOR_WARPS = 8

_STORAGE = {"float32": "float", "float16": "tinyknn::half_bits", "bfloat16": "tinyknn::bf16_bits",
            "int8": "signed char", "uint8": "unsigned char"}
_METRICS = {"l2": "tinyknn::L2", "ip": "tinyknn::InnerProduct", "cosine": "tinyknn::Cosine"}


def screen_smem(threshold: bool, bq: int = SCREEN_BQ, bn: int = SCREEN_BN, bkb: int = SCREEN_BKB,
                stages: int = SCREEN_STAGES) -> int:
    """screen_smem_bytes of kernels/screen.cuh."""
    return stages * (bq + bn) * (bkb + 16) + (bq * (bn + 1) * 4 if threshold else 0) + stages * 8 * bn + 12 * bq


def screen_spec(metric: str, dtype: str, k: int, arch: str, *, threshold: bool) -> KernelSpec:
    """The screen (or, threshold=True, its threshold mode keeping k upper bounds per tile) of a `dtype` index."""
    params = {"threshold": int(threshold), "kl": k if threshold else 1, "bq": SCREEN_BQ, "bn": SCREEN_BN,
              "bkb": SCREEN_BKB, "wq": SCREEN_WARPS_Q, "wn": SCREEN_WARPS_N, "stages": SCREEN_STAGES,
              "smem": screen_smem(threshold)}
    return KernelSpec(metric, dtype, 1, k if threshold else 0, "screen", arch, tuple(params.items()))


def step_spec(variant: str, metric: str, dtype: str, k: int, arch: str) -> KernelSpec:
    """screen_queries / screen_rows (per dtype), threshold (per k), survivors (per metric, dtype, k)."""
    params = {}
    if variant == "survivors":
        params = {"cap": SURVIVOR_CAPACITY, "warps": SURVIVOR_WARPS, "smem": SURVIVOR_CAPACITY * 20}
    keeps_k = variant in ("threshold", "survivors")
    keeps_metric = variant == "survivors"
    return KernelSpec(metric if keeps_metric else "l2", dtype if variant != "threshold" else "float32", 1,
                      k if keeps_k else 0, variant, arch, tuple(params.items()))


def name_expression(spec: KernelSpec) -> str:
    p = spec.param
    element = SCREEN_ELEMENTS[ELEMENT_OF_STORAGE[spec.dtype]]
    if spec.variant == "screen":
        flag = lambda v: "true" if v else "false"   # noqa: E731
        args = [element, flag(spec.metric != "l2"), flag(p("threshold")), p("kl"), p("bq"), p("bn"), p("bkb"),
                p("wq"), p("wn"), p("stages"), "true", p("smem")]
        return f"tinyknn::screen_kernel<{', '.join(str(a) for a in args)}>"
    if spec.variant == "screen_queries":
        return f"tinyknn::screen_queries_kernel<{element}>"
    if spec.variant == "screen_rows":
        return f"tinyknn::screen_rows_kernel<{_STORAGE[spec.dtype]}, {element}>"
    if spec.variant == "threshold":
        return f"tinyknn::threshold_kernel<{spec.k}>"
    args = [_METRICS[spec.metric], _STORAGE[spec.dtype], spec.k, p("cap"), p("warps")]
    return f"tinyknn::verify_survivors_kernel<{', '.join(str(a) for a in args)}>"


def specs_for_screen(metric: str, dtype: str, k: int, arch: str) -> list[KernelSpec]:
    """Every kernel a screened search of (metric, dtype, k) launches."""
    return [screen_spec(metric, dtype, k, arch, threshold=True), screen_spec(metric, dtype, k, arch, threshold=False),
            step_spec("screen_queries", metric, dtype, k, arch), step_spec("screen_rows", metric, dtype, k, arch),
            step_spec("threshold", metric, dtype, k, arch), step_spec("survivors", metric, dtype, k, arch)]
