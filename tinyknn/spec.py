"""What to build: the frozen KernelSpec, and the only parsers of metric and dtype names."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

import numpy as np

METRICS = ("l2", "ip", "cosine")
DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8")
VARIANTS = ("norms", "scan", "single", "tiled", "verify", "band", "rows", "range", "select", "scatter", "segment_sort",
            "screen", "screen_queries", "screen_rows", "threshold", "survivors", "range_survivors", "screen_hopper",
            "screen_tiles", "screen_sample")
MAX_K = 2048
MAX_DIM = 65536

_ARCH_PATTERN = re.compile(r"^sm_\d{2,3}[a-z]?$")


def parse_metric(metric) -> str:
    """'l2' | 'ip' | 'cosine' (case-insensitive); anything else is a ValueError naming the choices."""
    if isinstance(metric, str) and metric.lower() in METRICS:
        return metric.lower()
    raise ValueError(f"metric must be one of 'l2', 'ip', 'cosine'; got {metric!r}")


def parse_dtype(dtype) -> str:
    """Storage dtype 'float32' | 'float16' | 'bfloat16' | 'int8' | 'uint8' from a name, a NumPy dtype or a
    scalar type (bfloat16 as ml_dtypes.bfloat16 or its name)."""
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPES:
        return dtype.strip().lower()
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else np.dtype(dtype.lower()).name
    except TypeError:
        name = None
    if name in DTYPES:
        return name
    raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}; got {dtype!r}")


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a storage dtype name; bfloat16 is ml_dtypes' (imported only when asked for)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("dtype 'bfloat16' needs the ml_dtypes package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def parse_dim(dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"dim must be a positive integer; got {dim!r} ({type(dim).__name__})")
    if not 1 <= int(dim) <= MAX_DIM:
        raise ValueError(f"dim must be between 1 and {MAX_DIM}; got {int(dim)}")
    return int(dim)


def parse_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be a positive integer; got {k!r} ({type(k).__name__})")
    if not 1 <= int(k) <= MAX_K:
        raise ValueError(f"k must be between 1 and {MAX_K}; got {int(k)}")
    return int(k)


def parse_arch(arch) -> str:
    """'sm_90' style; also accepts '90', 'compute_90', (9, 0)."""
    if isinstance(arch, tuple) and len(arch) == 2:
        arch = f"sm_{arch[0]}{arch[1]}"
    text = str(arch).strip().lower()
    if text.isdigit():
        text = f"sm_{text}"
    text = text.replace("compute_", "sm_")
    if not _ARCH_PATTERN.match(text):
        raise ValueError(f"arch must look like 'sm_90' (or '90'); got {arch!r}")
    return text


@dataclass(frozen=True, order=True)
class KernelSpec:
    """Everything that changes a kernel's machine code. Hashable; the cache key is built from its source.

    `params` holds a variant's tile parameters as sorted (name, value) pairs so that two specs that
    mean the same kernel compare equal.
    """

    metric: str
    dtype: str
    dim: int
    k: int
    variant: str
    arch: str
    params: tuple[tuple[str, int], ...] = field(default=())

    def __post_init__(self):
        # A screened batch makes several specs per search, and checking each field costs ~35 us: the checked
        # fields are kept for each distinct set of given ones (keyed with their classes, so True is not 1).
        given = tuple(getattr(self, name) for name in _SPEC_FIELDS)
        try:
            key = tuple((value.__class__, value) for value in given)
            checked = _CHECKED_SPECS.get(key)
        except TypeError:           # an unhashable field (a dict of params): checked every time
            key = checked = None
        if checked is None:
            checked = _checked_spec_fields(*given)
            if key is not None and len(_CHECKED_SPECS) < _CHECKED_SPECS_MAX:
                _CHECKED_SPECS[key] = checked
        for name, value in zip(_SPEC_FIELDS, checked):
            object.__setattr__(self, name, value)

    def param(self, name: str, default: int | None = None) -> int:
        for key, value in self.params:
            if key == name:
                return value
        if default is None:
            raise KeyError(f"{self} has no parameter {name!r}")
        return default

    def __str__(self) -> str:
        extra = "".join(f" {name}={value}" for name, value in self.params)
        return f"KernelSpec({self.variant} {self.metric} {self.dtype} dim={self.dim} k={self.k} {self.arch}{extra})"


_SPEC_FIELDS = tuple(f.name for f in fields(KernelSpec))     # _checked_spec_fields takes them in this order
_CHECKED_SPECS: dict[tuple, tuple] = {}
_CHECKED_SPECS_MAX = 4096


def cpp_bool(value) -> str:
    """A truth value as a C++ template argument."""
    return "true" if value else "false"


def trailing_arguments(*pairs: tuple) -> list:
    """A kernel template's defaulted arguments as (value, default) pairs, those still at their default at the
    end dropped: an instantiation names only what it sets, so a spec without a later knob keeps its name."""
    values = [value for value, _ in pairs]
    while values and values[-1] == pairs[len(values) - 1][1]:
        values.pop()
    return values


def _checked_spec_fields(metric, dtype, dim, k, variant, arch, params) -> tuple:
    """KernelSpec's fields checked and normalised (ValueError/TypeError naming the bad one), in _SPEC_FIELDS order."""
    metric, dtype, dim, arch = parse_metric(metric), parse_dtype(dtype), parse_dim(dim), parse_arch(arch)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}; got {variant!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= int(k) <= MAX_K:
        raise ValueError(f"k must be between 0 (variants without selection) and {MAX_K}; got {k!r}")
    params = tuple(sorted((str(name), int(value)) for name, value in dict(params).items()))
    return metric, dtype, dim, int(k), variant, arch, params
