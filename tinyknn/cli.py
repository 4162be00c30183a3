"""The `tinyknn` command: `cache warm|list|info|verify|clear`, `info`, `demo`.

Exit codes: 0 done; 1 something failed (a compile, a corrupt cache entry, a demo search); 2 the
command line was wrong (argparse's convention). Machine-readable output with --json goes to stdout;
progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from .config import _usable_cores, get_config
from .spec import parse_arch

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A command line that cannot be carried out as given; main() prints it and exits 2."""


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(item) for item in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None


def _cache():
    from .jit.cache import default_cache

    return default_cache()


def _print_json(data) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


# -- cache warm ----------------------------------------------------------------------------------
def _combinations(args) -> tuple[list, tuple[str, ...], str]:
    """(combinations, the manifest's arches, a description of where they came from)."""
    from .jit.manifest import cross_product, default_manifest_path, read_manifest

    flags = {"--metric": args.metric, "--dtype": args.dtype, "--dim": args.dim, "--k": args.k}
    if any(value is not None for value in flags.values()):
        if args.manifest is not None:
            raise UsageError("give either --manifest or --metric/--dtype/--dim/--k, not both")
        if args.dim is None or args.k is None:
            raise UsageError("a cross product needs --dim and --k (--metric and --dtype default to all)")
        metrics = args.metric or ["l2", "ip", "cosine"]
        dtypes = args.dtype or ["float32", "float16"]
        try:
            return cross_product(metrics, dtypes, args.dim, args.k), (), "the command line"
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
    try:
        if given:
            return list(dict.fromkeys(parse_arch(arch) for arch in given))
        if manifest_arches:
            return list(manifest_arches)
        if get_config().arch:
            return [parse_arch(get_config().arch)]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    reason = "tinyknn.gpu is not available"
    try:
        from .gpu.device import current_device, has_gpu, why_no_gpu

        if has_gpu():
            return [current_device().arch]
        reason = why_no_gpu()
    except ImportError as exc:
        reason = f"tinyknn.gpu cannot be imported ({exc})"
    raise UsageError(f"no GPU to take the target arch from ({reason}); name it, e.g. --arch sm_90 "
                     "(several: --arch sm_80,sm_90)")


def cmd_warm(args) -> int:
    from .jit.warm import plan_specs

    combinations, manifest_arches, source = _combinations(args)
    arches = resolve_arches(args.arch, manifest_arches)
    try:
        specs = plan_specs(combinations, arches)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    cache = _cache()
    start = time.perf_counter()
    outcomes = _run_with_progress(cache, specs, args.jobs, quiet=args.json)
    seconds = time.perf_counter() - start
    count = {status: sum(o.status == status for o in outcomes) for status in ("compiled", "cached", "failed")}
    failures = [{"spec": str(o.spec), "error": o.error} for o in outcomes if o.status == "failed"]
    if args.json:
        _print_json({**count, "kernels": len(specs), "combinations": len(combinations), "arches": arches,
                     "seconds": round(seconds, 3), "jobs": args.jobs, "source": source,
                     "location": str(cache.directory), "failures": failures})
    else:
        for failure in failures:
            print(f"FAILED {failure['spec']}\n{failure['error']}\n", file=sys.stderr)
        print(f"{len(specs)} kernels for {len(combinations)} combinations from {source} on {', '.join(arches)}: "
              f"compiled {count['compiled']}, already cached {count['cached']}, failed {count['failed']} "
              f"in {seconds:.1f} s ({args.jobs} jobs); cache: {cache.directory}")
    return EXIT_FAILED if failures else EXIT_OK


def _run_with_progress(cache, specs, jobs: int, *, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .jit.warm import warm_specs

    console = Console(stderr=True)
    with Progress(TextColumn("warming"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=quiet or not console.is_terminal, transient=True) as progress:
        task = progress.add_task("warm", total=len(specs))
        return warm_specs(cache, specs, jobs=jobs, on_done=lambda _: progress.advance(task))


# -- cache list / info / verify / clear ----------------------------------------------------------
def _iso(timestamp) -> str | None:
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="seconds")


LIST_COLUMNS = ("metric", "dtype", "dim", "k", "variant", "arch", "size", "registers", "stack_bytes",
                "spill_bytes", "created")


def cmd_list(args) -> int:
    rows = [{**row, "created": _iso(row.get("created"))} for row in _cache().list_entries()]
    rows.sort(key=lambda r: (str(r.get("arch")), str(r.get("metric")), str(r.get("dtype")), r.get("dim") or 0,
                             r.get("k") or 0, str(r.get("variant"))))
    if args.json:
        _print_json(rows)
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(*LIST_COLUMNS, title=f"{len(rows)} cubins in {_cache().directory}")
    for row in rows:
        cells = [str(row.get(column, "")) for column in LIST_COLUMNS]
        table.add_row(*(cells if "problem" not in row else [row["file"], f"unreadable: {row['problem']}"]))
    Console(width=160).print(table)
    return EXIT_OK


def cmd_info(args) -> int:
    info = _cache().info()
    if args.json:
        _print_json(info)
    else:
        print(f"location: {info['location']}\nentries:  {info['entries']}\nbytes:    {info['bytes']:,}")
    return EXIT_OK


def cmd_verify(args) -> int:
    cache = _cache()
    problems = cache.verify()
    for path, problem in problems:
        print(f"CORRUPT {path}: {problem}")
    print(f"{len(cache.entry_paths())} entries checked in {cache.directory}, {len(problems)} bad"
          + ("; `tinyknn cache clear` removes them, or the next use replaces them" if problems else ""))
    return EXIT_FAILED if problems else EXIT_OK


def cmd_clear(args) -> int:
    cache = _cache()
    print(f"removed {cache.clear()} cubins from {cache.directory}")
    return EXIT_OK


# -- the parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__
    from ._cli_demo import add_demo_arguments, cmd_demo
    from ._cli_info import cmd_report

    parser = argparse.ArgumentParser(prog="tinyknn", description="Exact k-nearest-neighbour search.")
    parser.add_argument("--version", action="version", version=f"tinyknn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    cache = commands.add_parser("cache", help="the cubin cache: warm, list, info, verify, clear")
    actions = cache.add_subparsers(dest="action", required=True)
    warm = actions.add_parser("warm", help="compile kernels into the cache ahead of use")
    warm.add_argument("--manifest", help="a warm-up manifest (TOML); default: the shipped default.toml")
    warm.add_argument("--metric", type=_comma_list, help="comma list of l2, ip, cosine (default: all)")
    warm.add_argument("--dtype", type=_comma_list, help="comma list of float32, float16 (default: both)")
    warm.add_argument("--dim", type=_ints, help="comma list of dimensions")
    warm.add_argument("--k", type=_ints, help="comma list of k")
    warm.add_argument("--arch", type=_comma_list, help="target arch(es), e.g. sm_90 or sm_80,sm_90 "
                                                       "(default: the manifest's, else the current GPU's)")
    warm.add_argument("--jobs", type=int, default=_usable_cores(), help="parallel compiles (default: usable cores)")
    warm.add_argument("--json", action="store_true", help="print the summary as JSON")
    warm.set_defaults(run=cmd_warm)
    for name, run, text in (("list", cmd_list, "one line per cached cubin"),
                            ("info", cmd_info, "where the cache is and how big")):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--json", action="store_true")
        sub.set_defaults(run=run)
    actions.add_parser("verify", help="check every entry; exit 1 naming each bad one").set_defaults(run=cmd_verify)
    actions.add_parser("clear", help="remove every cached cubin").set_defaults(run=cmd_clear)

    info = commands.add_parser("info", help="versions, NVRTC, GPU, cache, CPU library")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=cmd_report)
    demo = commands.add_parser("demo", help="search a built-in data set; print recall and time per query")
    add_demo_arguments(demo)
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        print(f"tinyknn: error: --jobs must be a positive integer; got {args.jobs}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"tinyknn: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
