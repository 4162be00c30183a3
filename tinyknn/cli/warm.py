"""`tinyknn cache warm`: compile the kernels a set of (metric, dtype, dim, k) needs, ahead of use.

Says up front how many kernels it will compile (and what for), shows progress (a rich bar in a terminal,
plain lines on stderr elsewhere), and ends with what it compiled, found, failed to compile or could not
write, and how long it took. Exit 1 if any kernel failed or is not on disk.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time

from .common import UsageError, count, print_json
from ..config import get_config
from ..spec import DTYPES, METRICS


def normalise_arch(text: str) -> str:
    from ..jit.compiler import normalise_arch as normalise

    try:
        return normalise(text)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None


def check_arches(arches: list[str]) -> None:
    """Refuse, once and up front, an arch this NVRTC cannot compile for, listing those it can."""
    from ..errors import TinyKnnError
    from ..jit.compiler import arch_problem, supported_arches

    try:
        problems = {arch: arch_problem(arch) for arch in arches}
        supported = supported_arches()
    except TinyKnnError as exc:   # no NVRTC: every compile fails anyway, with this reason
        raise UsageError(str(exc)) from None
    bad = {arch: problem for arch, problem in problems.items() if problem}
    if bad:
        named = ", ".join(f"{arch} ({problem})" for arch, problem in bad.items())
        raise UsageError(f"this NVRTC cannot compile for {named}; it supports {', '.join(supported)} "
                         "(and their 'a'/'f' forms where the arch has them, e.g. sm_90a)")


def _combinations(args) -> tuple[list, tuple[str, ...], str]:
    """(combinations, the manifest's arches, where they came from)."""
    from ..jit.manifest import cross_product, default_manifest_path, read_manifest

    flags = (args.metric, args.dtype, args.dim, args.k)
    if any(value is not None for value in flags):
        if args.manifest is not None:
            raise UsageError("give either --manifest or --metric/--dtype/--dim/--k, not both")
        if args.dim is None or args.k is None:
            raise UsageError("a cross product needs --dim and --k (--metric and --dtype default to all)")
        try:
            return (cross_product(args.metric or list(METRICS), args.dtype or list(DTYPES), args.dim, args.k), (),
                    "the command line")
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    path = args.manifest or default_manifest_path()
    try:
        manifest = read_manifest(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return list(manifest.combinations), manifest.arches, str(path)


def resolve_arches(given: list[str] | None, manifest_arches: tuple[str, ...]) -> list[str]:
    """--arch, else the manifest's, else TINYKNN_ARCH, else the current GPU's; else a UsageError."""
    if given:
        return list(dict.fromkeys(normalise_arch(arch) for arch in given))
    if manifest_arches:
        return list(manifest_arches)
    if get_config().arch:
        return [normalise_arch(get_config().arch)]
    try:
        from ..gpu.device import current_device, has_gpu, why_no_gpu

        if has_gpu():
            return [current_device().arch]
        reason = why_no_gpu()
    except ImportError as exc:
        reason = f"tinyknn.gpu cannot be imported ({exc})"
    raise UsageError(f"no GPU to take the target arch from ({reason}); name it, e.g. --arch sm_90 "
                     "(several: --arch sm_80,sm_90)")


def describe(specs) -> str:
    """'11 kernels: 2 norms (float16, float32), 2 scan, ...' - what the count is made of."""
    variants = collections.Counter(spec.variant for spec in specs)
    parts = []
    for variant, n in variants.items():
        dtypes = sorted({spec.dtype for spec in specs if spec.variant == variant})
        parts.append(f"{n} {variant}" + (f" ({', '.join(dtypes)})" if variant == "norms" else ""))
    return f"{count(len(specs), 'kernel')}: {', '.join(parts)}"


def cmd_warm(args) -> int:
    from ..jit.cache import default_cache
    from ..jit.warm import plan_specs

    combinations, manifest_arches, source = _combinations(args)
    arches = resolve_arches(args.arch, manifest_arches)
    check_arches(arches)
    try:
        specs = plan_specs(combinations, arches)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    cache = default_cache()
    stored = sorted({c[1] for c in combinations} - {"float32"})
    note = f"; {', '.join(stored)} data also need the float32 query ingest" if stored else ""
    print(f"tinyknn cache warm: {describe(specs)}; for {count(len(combinations), 'combination')} from {source} "
          f"on {', '.join(arches)}, {count(args.jobs, 'job')}, into {cache.directory} (kernels already cached "
          f"are only read{note})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    outcomes = [_with_write(cache, o) for o in _run_with_progress(cache, specs, args.jobs)]
    seconds = time.perf_counter() - start
    tally = {status: sum(o.status == status for o in outcomes) for status in ("compiled", "cached", "failed", "unsaved")}
    failures = [{"spec": str(o.spec), "error": o.error} for o in outcomes if o.status == "failed"]
    unsaved = sorted({o.error for o in outcomes if o.status == "unsaved"})
    if args.json:
        print_json({**tally, "kernels": len(specs), "combinations": len(combinations), "arches": arches,
                    "seconds": round(seconds, 3), "jobs": args.jobs, "source": source,
                    "location": str(cache.directory), "failures": failures, "not_written": unsaved})
    else:
        for failure in failures:
            print(f"FAILED {failure['spec']}\n{failure['error']}\n", file=sys.stderr)
        written = f"compiled and written {tally['compiled']}"
        if tally["unsaved"]:
            written += f", compiled but NOT written {tally['unsaved']} ({'; '.join(unsaved)})"
        print(f"{count(len(specs), 'kernel')} on {', '.join(arches)}: {written}, already cached {tally['cached']}, "
              f"failed {tally['failed']}, in {seconds:.1f} s; cache: {cache.directory}")
    return 1 if failures or tally["unsaved"] else 0


def _with_write(cache, outcome):
    """A compiled kernel the cache could not write (a full or read-only disk) is "unsaved", with the reason."""
    problem = cache.unsaved(outcome.spec) if outcome.status == "compiled" else None
    return outcome if problem is None else dataclasses.replace(outcome, status="unsaved", error=problem)


class _PlainProgress:
    """Progress lines on stderr where there is no terminal: about every 10 % and at least every 30 s."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.step, self.last = max(1, total // 10), self.start

    def advance(self, _outcome=None) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.done == self.total or self.done % self.step == 0 or now - self.last >= 30:
            self.last, elapsed = now, now - self.start
            left = elapsed / self.done * (self.total - self.done)
            eta = f", about {_duration(left)} left" if self.done < self.total else ""
            print(f"warm: {self.done}/{self.total} kernels, {elapsed:.1f} s{eta}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _run_with_progress(cache, specs, jobs: int):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from ..jit.warm import warm_specs

    console = Console(stderr=True)
    if not console.is_terminal:
        return warm_specs(cache, specs, jobs=jobs, on_done=_PlainProgress(len(specs)).advance)
    with Progress(TextColumn("warming"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("left"), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("warm", total=len(specs))
        return warm_specs(cache, specs, jobs=jobs, on_done=lambda _: bar.advance(task))
