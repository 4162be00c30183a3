"""KernelSpec -> CUDA source, NVRTC name expression and options (pure text; no NVRTC, no GPU).

The kernel templates live in kernels/*.cuh. `render_source` inlines them into one self-contained source
(NVRTC here has no system headers and cuda.core's cache refuses include paths), so the source text is the
same for every spec of an entry header: only the name expression (which template instantiation to build)
changes. The specs themselves come from jit/render.py (search kernels), jit/render_single.py (the one-query
kernel's) and jit/render_screen.py (the screen's); jit/search_kernels.py lists those a search may launch.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .._paths import kernels_dir
from ..spec import KernelSpec, cpp_bool, trailing_arguments
from . import render_screen

_SCREEN_VARIANTS = ("screen", "screen_queries", "screen_rows", "threshold", "survivors", "range_survivors",
                    "screen_hopper", "screen_tiles", "screen_sample")

ENTRY_HEADER = "search.cuh"
OPTIONS = ("-std=c++17",)

_METRIC_TYPES = {"l2": "tinyknn::L2", "ip": "tinyknn::InnerProduct", "cosine": "tinyknn::Cosine"}
_BOUND_TYPES = {"l2": "tinyknn::KeyBound<tinyknn::L2>", "ip": "tinyknn::KeyBound<tinyknn::InnerProduct>",
                "cosine": "tinyknn::KeyBound<tinyknn::Cosine>"}
_STORAGE_TYPES = {"float32": "float", "float16": "tinyknn::half_bits", "bfloat16": "tinyknn::bf16_bits",
                  "int8": "signed char", "uint8": "unsigned char"}
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


@dataclass(frozen=True)
class RenderedSource:
    source: str                           # self-contained: kernels/*.cuh inlined
    name_expressions: tuple[str, ...]     # the instantiation(s) to build
    options: tuple[str, ...]              # extra NVRTC options (compile_cubin adds -arch and ptxas -v)


# -- the source ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def kernel_source(entry: str = ENTRY_HEADER) -> str:
    """kernels/<entry> with every `#include "x.cuh"` inlined, each file once, in dependency order."""
    root = kernels_dir()
    seen: set[str] = set()

    def inline(name: str, stack: tuple[str, ...]) -> list[str]:
        if name in stack:
            raise ValueError(f"kernels/{name} includes itself through {' -> '.join(stack)}")
        if name in seen:
            return []
        seen.add(name)
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"kernels/{name} (included from {stack[-1] if stack else 'render'}) is missing in {root}")
        lines = [f"// ---- kernels/{name} ----"]
        for line in path.read_text().splitlines():
            if _PRAGMA_ONCE.match(line):
                continue
            match = _INCLUDE.match(line)
            if match:
                lines.extend(inline(match.group(1), stack + (name,)))
            else:
                lines.append(line)
        return lines

    return "\n".join(inline(entry, ())) + "\n"


def render_source(spec: KernelSpec) -> RenderedSource:
    """The source, name expression and options that build `spec`."""
    return RenderedSource(kernel_source(render_screen.entry_header(spec) or ENTRY_HEADER), (name_expression(spec),),
                          OPTIONS)


def render_many(specs) -> RenderedSource:
    """One program for several specs of one entry header (one NVRTC call builds them all)."""
    specs = list(specs)
    entries = {render_screen.entry_header(spec) or ENTRY_HEADER for spec in specs}
    if len(entries) > 1:
        raise ValueError(f"render_many builds specs of one entry header; got specs of {sorted(entries)}")
    names = tuple(dict.fromkeys(name_expression(spec) for spec in specs))
    return RenderedSource(kernel_source(entries.pop() if entries else ENTRY_HEADER), names, OPTIONS)


def name_expression(spec: KernelSpec) -> str:
    """The template instantiation of `spec`, e.g. 'tinyknn::merge_kernel<tinyknn::L2, 10, 8, 20480>'."""
    if spec.variant in _SCREEN_VARIANTS:
        return render_screen.name_expression(spec)
    metric, storage = _METRIC_TYPES[spec.metric], _STORAGE_TYPES[spec.dtype]
    p = spec.param
    if spec.variant == "norms":
        args = [storage]
    elif spec.variant == "scan":
        args = [metric, storage, spec.dim, p("kl", spec.k), p("qb"), p("lanes"), p("warps"), p("smem")]
        args += ["true"] if p("listed", 0) else []
    elif spec.variant == "single":
        shadow = p("shadow", 0)
        bound = "tinyknn::ShadowKeyBound" if shadow else _BOUND_TYPES[spec.metric]
        streamed = _STORAGE_TYPES["float16"] if shadow else storage
        args = [metric, bound, storage, streamed, spec.dim, spec.k, p("kl"), p("lanes"), p("warps"),
                p("rmax"), p("unroll"), p("cmax"), p("smem")]
        args += trailing_arguments((cpp_bool(p("listed", 0)), "false"), (p("stage", 0), 0),
                                   (cpp_bool(p("gt", 0)), "false"))
    elif spec.variant == "tiled":
        if p("filter", 0):
            metric = "tinyknn::L2Expanded"
        args = [metric, storage, p("kl", spec.k), p("bq"), p("bn"), p("warps"), p("depth"),
                cpp_bool(p("reglists")), p("smem")]
        args += ["true"] if p("listed", 0) else []
    elif spec.variant == "verify":
        bound = "tinyknn::FilterKeyBound" if p("filter", 0) else _BOUND_TYPES[spec.metric]
        args = [metric, bound, storage, spec.k, p("kl"), p("warps"), p("smem")]
    elif spec.variant in _PLAIN_KERNELS:
        return f"tinyknn::{_PLAIN_KERNELS[spec.variant]}"
    elif spec.variant == "range":
        args = [metric, storage, p("qb")]
    else:  # band
        args = [metric, storage]
    return f"tinyknn::{_KERNEL_NAMES[spec.variant]}<{', '.join(str(a) for a in args)}>"


_PLAIN_KERNELS = {"rows": "copy_rows_kernel", "select": "select_kernel", "scatter": "scatter_kernel",
                  "segment_sort": "segment_sort_kernel"}   # no template arguments
_KERNEL_NAMES = {"norms": "ingest_kernel", "scan": "scan_kernel", "single": "single_kernel", "tiled": "tiled_kernel",
                 "verify": "verify_kernel", "band": "band_kernel", "rows": "copy_rows_kernel", "range": "range_kernel"}


__all__ = ["ENTRY_HEADER", "OPTIONS", "RenderedSource", "kernel_source", "name_expression", "render_many",
           "render_source"]
