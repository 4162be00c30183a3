"""The `tinyknn` command: `cache warm|list|info|verify|clear`, `info`, `demo`, `groundtruth [check]`.

Exit codes: 0 done (bare `tinyknn` prints the help and exits 0: asking what the command does is not an
error); 1 something failed (a compile, a kernel that could not be written, a corrupt cache entry, a file
`cache clear` could not remove, a demo search); 2 the command line was wrong (argparse's convention).
Machine-readable output with --json goes to stdout; progress and the plan of `cache warm` go to stderr.
`-v` shows tinyknn's log events (compiles, cache hits and misses, repairs, the CPU library build) on
stderr, `-vv` the debug ones too.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .common import UsageError
from .._version import __version__
from ..config import _usable_cores
from ..spec import DTYPES, METRICS

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(item) for item in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from .cache import cmd_clear, cmd_info, cmd_list, cmd_verify
    from .demo import add_demo_arguments, cmd_demo
    from .info import cmd_report
    from .warm import cmd_warm
    from ..groundtruth import command as groundtruth_command

    parser = argparse.ArgumentParser(prog="tinyknn", description="Exact k-nearest-neighbour search.")
    parser.add_argument("--version", action="version", version=f"tinyknn {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show tinyknn's log events on stderr (-vv: debug events too)")
    commands = parser.add_subparsers(dest="command")

    cache = commands.add_parser("cache", help="the cubin cache: warm, list, info, verify, clear")
    actions = cache.add_subparsers(dest="action", required=True)
    warm = actions.add_parser("warm", help="compile kernels into the cache ahead of use")
    warm.add_argument("--manifest", help="a warm-up manifest (TOML); default: the shipped default.toml")
    warm.add_argument("--metric", type=_comma_list, help=f"comma list of {', '.join(METRICS)} (default: all)")
    warm.add_argument("--dtype", type=_comma_list, help=f"comma list of storage dtypes, {', '.join(DTYPES)} (default: "
                                                        "all; those but float32 also need the float32 query ingest)")
    warm.add_argument("--dim", type=_ints, help="comma list of dimensions")
    warm.add_argument("--k", type=_ints, help="comma list of k")
    warm.add_argument("--arch", type=_comma_list, help="target arch(es): sm_90, 90, sm_90a or 90a; several: "
                                                       "sm_80,sm_90 (default: the manifest's, else the current GPU's)")
    warm.add_argument("--jobs", type=int, default=_usable_cores(), help="parallel compiles (default: usable cores)")
    warm.add_argument("--json", action="store_true", help="print the summary as JSON")
    warm.set_defaults(run=cmd_warm)
    for name, run, text in (("list", cmd_list, "one line per cached cubin"),
                            ("info", cmd_info, "where the cache is and how big")):
        sub = actions.add_parser(name, help=text)
        sub.add_argument("--json", action="store_true")
        sub.set_defaults(run=run)
    actions.add_parser("verify", help="check every entry; exit 1 naming each bad one").set_defaults(run=cmd_verify)
    actions.add_parser("clear", help="remove every cached cubin, lock and the CPU library").set_defaults(run=cmd_clear)

    info = commands.add_parser("info", help="versions, NVRTC, GPU, cache, CPU library")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=cmd_report)
    demo = commands.add_parser("demo", help="search a built-in data set; print recall and time per query")
    add_demo_arguments(demo)
    demo.set_defaults(run=cmd_demo)
    truth = commands.add_parser("groundtruth", help="exact ground truth of vector files; 'check' compares one with it")
    groundtruth_command.add_arguments(truth)
    truth.set_defaults(run=groundtruth_command.run)
    return parser


def _configure_logging(verbosity: int) -> None:
    if verbosity <= 0:
        return
    from rich.console import Console
    from rich.logging import RichHandler

    console = Console(stderr=True)
    handler = RichHandler(console=console, show_path=False) if console.is_terminal else logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s" if console.is_terminal else "%(name)s: %(message)s"))
    handler.set_name("tinyknn-cli")
    logger = logging.getLogger("tinyknn")
    for old in [h for h in logger.handlers if h.get_name() == "tinyknn-cli"]:   # main() called again in-process
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    if getattr(args, "jobs", 1) < 1:
        print(f"tinyknn: error: --jobs must be a positive integer; got {args.jobs}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(args.verbose)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"tinyknn: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
