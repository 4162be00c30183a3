"""Warm-up manifests: TOML files naming the (metric, dtype, dim, k) a deployment precompiles.

Format (documented in cache/README.md): an optional `arch` list, then `[[specialisations]]` tables,
each the cross product of its `metric`, `dtype`, `dim` and `k` (a value or a list); the manifest is
the union of its tables, in order, without repeats.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

from ..spec import parse_dim, parse_dtype, parse_k, parse_metric
from .compiler import normalise_arch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

FORMAT_VERSION = 1
_FIELDS = {"metric": parse_metric, "dtype": parse_dtype, "dim": parse_dim, "k": parse_k}

Combination = tuple[str, str, int, int]   # (metric, dtype, dim, k)


@dataclass(frozen=True)
class Manifest:
    path: Path
    combinations: tuple[Combination, ...]
    arches: tuple[str, ...]   # empty: the manifest leaves the arch to the command line or the GPU


def default_manifest_path() -> Path:
    from .._paths import manifests_dir

    return manifests_dir() / "default.toml"


def cross_product(metrics, dtypes, dims, ks) -> list[Combination]:
    """Every (metric, dtype, dim, k) of the given lists, validated, in order, without repeats."""
    parsed = [[parse(value) for value in values] for parse, values in zip(_FIELDS.values(), (metrics, dtypes, dims, ks))]
    return list(dict.fromkeys(itertools.product(*parsed)))


def _as_list(value) -> list:
    return list(value) if isinstance(value, list) else [value]


def read_manifest(path) -> Manifest:
    """Parse and validate a manifest; errors name the file, the table and the field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"manifest {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"manifest {path} is not valid TOML: {exc}") from None
    unknown = set(data) - {"format", "arch", "specialisations"}
    if unknown:
        raise ValueError(f"manifest {path}: unknown top-level keys {sorted(unknown)}; "
                         "allowed: 'format', 'arch', 'specialisations'")
    if data.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        raise ValueError(f"manifest {path} has format {data['format']!r}; this tinyknn reads format {FORMAT_VERSION}")
    tables = data.get("specialisations")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"manifest {path} needs at least one [[specialisations]] table")
    combinations: list[Combination] = []
    for number, table in enumerate(tables, start=1):
        missing = [name for name in _FIELDS if name not in table]
        extra = sorted(set(table) - set(_FIELDS))
        if missing or extra:
            raise ValueError(f"manifest {path}, [[specialisations]] #{number}: needs exactly the keys "
                             f"{list(_FIELDS)}; missing {missing}, unknown {extra}")
        try:
            combinations += cross_product(*(_as_list(table[name]) for name in _FIELDS))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"manifest {path}, [[specialisations]] #{number}: {exc}") from None
    try:
        arches = tuple(dict.fromkeys(normalise_arch(a) for a in _as_list(data.get("arch", []))))
    except ValueError as exc:
        raise ValueError(f"manifest {path}, arch: {exc}") from None
    return Manifest(path, tuple(dict.fromkeys(combinations)), arches)


def load_manifest(path) -> list[Combination]:
    """The (metric, dtype, dim, k) combinations a manifest lists."""
    return list(read_manifest(path).combinations)
