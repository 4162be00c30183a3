"""`tinyknn groundtruth`: exact ground truth of vector files, and `tinyknn groundtruth check`.

    tinyknn groundtruth BASE QUERIES -k 100 --metric l2 -o gt.bin [--format bigann|cuvs|ivecs|hdf5|npy]
        [--device cpu|cuda] [--rows N] [--queries N] [--range RADIUS] [--checkpoint PATH] [--json]
        [--scheduler ADDRESS]
    tinyknn groundtruth check CANDIDATE [GT] --base B --queries Q -k K [--metric M] [--json]

The first form computes and writes the ground truth (and OUT.json, the record of what was computed); a
rich progress bar (rows/s, time left) on a terminal, a log line every LOG_SECONDS elsewhere. The second
compares a result or a published ground truth (CANDIDATE) with an exact one (GT; computed when left out)
and says how many entries differ and why: ties, float32 misorderings, real errors.

`add_arguments(parser)` and `run(args) -> int` are what the `tinyknn` command wires in; `main(argv)` runs
it alone. Exit codes: 0 done; 1 a file or the computation failed (the message says why), or `check
--strict` found real errors; 2 the command line was wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
LOG_SECONDS = 10.0
log = logging.getLogger("tinyknn.groundtruth")

USAGE = ("tinyknn groundtruth BASE QUERIES -k K -o OUT [--metric l2|ip|cosine] [--format F] [options]\n"
         "       tinyknn groundtruth check CANDIDATE [GT] --base BASE --queries QUERIES -k K [--metric M] [--json]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..io import FORMATS

    parser.usage = USAGE
    parser.description = ("Exact k-NN (or range) ground truth of vector files, in the formats of big-ann-benchmarks, "
                          "cuVS, TEXMEX, ann-benchmarks or NumPy; or, with 'check', how a result or a published "
                          "ground truth differs from the exact one.")
    parser.add_argument("inputs", nargs="+", metavar="BASE QUERIES | check CANDIDATE [GT]",
                        help="vector files (.fvecs .bvecs .fbin .u8bin .i8bin .f16bin .npy .hdf5[:train|:test]); "
                             "for check: a result or ground truth file and, optionally, the exact one")
    parser.add_argument("-k", type=int, help="neighbours per query")
    parser.add_argument("--metric", choices=("l2", "ip", "cosine"),
                        help="l2 (squared Euclidean), ip (inner product) or cosine; default l2, or what an HDF5 "
                             "file's distance attribute says")
    parser.add_argument("-o", "--output", help="the ground-truth file to write (OUT.json is written beside it)")
    parser.add_argument("--format", choices=FORMATS,
                        help="output format (default: by the output's name: .hdf5 hdf5, .npy npy, .ivecs ivecs, "
                             "*.neighbors.ibin cuvs, else bigann)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to search (default cpu)")
    parser.add_argument("--storage", choices=("device", "host"), default="device",
                        help="with --device cuda: 'host' streams a base larger than the GPU through it")
    parser.add_argument("--dtype", help="the index's storage dtype (default: the base file's)")
    parser.add_argument("--rows", type=int, help="use only the first N base rows")
    parser.add_argument("--queries", dest="queries_option", metavar="N | QUERIES",
                        help="use only the first N queries; for check: the query vectors file")
    parser.add_argument("--range", dest="radius", type=float,
                        help="range ground truth: every row with l2 distance < RADIUS (ip, cosine: > RADIUS); "
                             "formats bigann and npy")
    parser.add_argument("--checkpoint", help="save progress here after every query batch and resume from it")
    parser.add_argument("--keep-checkpoint", action="store_true", help="keep the checkpoint after success")
    parser.add_argument("--shard-rows", type=int, help="rows per index (default: a file on a GPU in about 8 "
                                                       "shards of at least 2M rows, each searched while the next "
                                                       "is read; else all that fit half the memory, 32 GiB of "
                                                       "them on a GPU)")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="a Dask scheduler (tcp://host:8786, or a scheduler file's path): the base's rows go "
                             "to its workers' shards (tinyknn.dask), for bases no single machine holds")
    parser.add_argument("--query-batch", type=int, default=4096, help="queries searched at a time (default 4096)")
    parser.add_argument("--base", dest="check_base", metavar="BASE", help="check: the base vectors")
    parser.add_argument("--strict", action="store_true", help="check: exit 1 when there are real errors")
    parser.add_argument("--json", action="store_true", help="print the record (or the comparison) as JSON on stdout")


def _error(message: str) -> None:
    print(f"tinyknn groundtruth: error: {message}", file=sys.stderr)


def run(args) -> int:
    inputs = list(args.inputs)
    try:
        if inputs[0] == "check":
            if len(inputs) not in (2, 3):
                _error("check takes CANDIDATE and optionally GT: tinyknn groundtruth check CANDIDATE [GT] --base B "
                       "--queries Q -k K")
                return EXIT_USAGE
            return _check(args, inputs[1], inputs[2] if len(inputs) == 3 else None)
        if len(inputs) != 2:
            _error(f"expected BASE QUERIES (or check CANDIDATE [GT]); got {len(inputs)} paths: {' '.join(inputs)}")
            return EXIT_USAGE
        return _compute(args, inputs[0], inputs[1])
    except (ValueError, TypeError, OSError, ImportError) as exc:
        _error(str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _error("interrupted" + (f"; rerun with --checkpoint {args.checkpoint} to resume" if args.checkpoint else ""))
        return 130


def _metric(args, *paths) -> str:
    if args.metric:
        return args.metric
    from .. import io as tio
    from . import conventions
    from ..io import hdf5

    for path in paths:
        file = tio.split_dataset(path)[0] if path else ""
        if file.lower().endswith((".hdf5", ".h5")):
            attribute = hdf5.attributes(file).get("distance")
            if attribute:
                return conventions.metric_of_hdf5(attribute, path)
    return "l2"


def _compute(args, base: str, queries: str) -> int:
    from .. import io as tio
    from . import conventions
    from .compute import groundtruth
    from .output import record_path

    if args.output is None:
        _error("-o/--output is required: where to write the ground truth")
        return EXIT_USAGE
    if (args.k is None) == (args.radius is None):
        _error("give -k K (k-NN ground truth) or --range RADIUS (range ground truth), not both")
        return EXIT_USAGE
    queries_limit = None
    if args.queries_option is not None:
        try:
            queries_limit = int(args.queries_option)
        except ValueError:
            _error(f"--queries takes a number of queries here (the query file is the second path); got "
                   f"{args.queries_option!r}")
            return EXIT_USAGE
    fmt = args.format or (tio.guess_format(args.output) if args.radius is None else
                          ("npy" if args.output.endswith(".npy") else "bigann"))
    metric = _metric(args, base, queries)
    started = time.perf_counter()
    with _client(args.scheduler) as client, _progress() as report:
        groundtruth(base, queries, args.k, metric, args.device, rows=args.rows, queries_limit=queries_limit,
                    checkpoint=args.checkpoint, progress=report, radius=args.radius, dtype=args.dtype,
                    query_batch=args.query_batch, shard_rows=args.shard_rows, storage=args.storage,
                    output=args.output, format=fmt, keep_checkpoint=args.keep_checkpoint, client=client)
    with open(record_path(args.output)) as handle:
        record = json.load(handle)
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
        return EXIT_OK
    what = f"k = {record['k']}" if args.radius is None else f"radius {args.radius:g}, {record['hits']:,} hits"
    print(f"wrote {', '.join(record['output']['files'])} (and {record_path(args.output)}): "
          f"{record['queries']['rows']:,} queries x {record['base']['rows']:,} rows, {metric}, {what}; distances: "
          f"{conventions.describe(record['output']['distance_convention'])}; {time.perf_counter() - started:.1f} s "
          f"on {args.device}")
    return EXIT_OK


@contextlib.contextmanager
def _client(scheduler: str | None):
    """A distributed.Client of the scheduler at ADDRESS (or of a scheduler file), closed afterwards; None
    without --scheduler."""
    if scheduler is None:
        yield None
        return
    try:
        from distributed import Client
    except ImportError as exc:
        raise ImportError("--scheduler needs Dask's distributed scheduler: pip install 'tinyknn[dask]'") from exc
    is_file = os.path.isfile(scheduler)
    try:
        client = Client(scheduler_file=scheduler, timeout=30) if is_file else Client(scheduler, timeout=30)
    except (OSError, TimeoutError) as exc:
        raise OSError(f"cannot reach the Dask scheduler {scheduler!r}: {exc}") from exc
    with client:
        yield client


def _check(args, candidate: str, exact: str | None) -> int:
    from .check import compare
    from .compute import groundtruth

    base, queries = args.check_base, args.queries_option
    if base is None or queries is None:
        _error("check needs --base BASE and --queries QUERIES (the vectors both ground truths are of)")
        return EXIT_USAGE
    metric = _metric(args, candidate, exact, base)
    if exact is None:
        from .recall import load_groundtruth

        k = args.k or load_groundtruth(candidate).k
        with _progress() as report:
            distances, ids = groundtruth(base, queries, k, metric, args.device, dtype=args.dtype, progress=report,
                                         queries_limit=len(load_groundtruth(candidate)), storage=args.storage)
        exact = (ids, distances)
    comparison = compare(candidate, exact, base, queries, args.k, metric, dtype=args.dtype)
    if args.json:
        print(json.dumps(comparison.as_dict(), indent=2, sort_keys=True))
    else:
        print(f"metric {metric}; " + comparison.report())
    return EXIT_FAILED if args.strict and comparison.errors else EXIT_OK


class _progress:
    """A progress callback: a rich bar on a terminal (stderr), else a log line every LOG_SECONDS."""

    def __enter__(self):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.start = self.last = time.perf_counter()
        self.bar = self.task = self.handler = None
        if self.console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.completed:,.0f}/{task.total:,.0f} rows"), _rate_column()(),
                                TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=self.console)
            self.bar.__enter__()
            self.task = self.bar.add_task("starting", total=1)
        elif not _has_handler():
            self.handler = logging.StreamHandler(sys.stderr)
            self.handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            log.addHandler(self.handler)
            self.level = log.level
            log.setLevel(logging.INFO)
        return self

    def __call__(self, done: float, total: float, stage: str) -> None:
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total, description=stage)
            return
        if now - self.last < LOG_SECONDS and done < total:
            return
        self.last = now
        elapsed = now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f", about {_duration((total - done) / rate)} left" if 0 < rate and done < total else ""
        log.info("%s: %s of %s rows (%.0f %%), %s rows/s%s", stage, f"{done:,.0f}", f"{total:,.0f}",
                 100.0 * done / total if total else 100.0, f"{rate:,.0f}", left)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
        if self.handler is not None:
            log.removeHandler(self.handler)
            log.setLevel(self.level)


def _has_handler() -> bool:
    """Whether tinyknn's log events already reach a real handler (the tinyknn command's -v, or the app's)."""
    logger = log
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return True
        if not logger.propagate:
            break
        logger = logger.parent
    return False


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _rate_column():
    """rich's column of rows per second (a class made on first use: rich is imported only then)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task):
            return Text(f"{task.speed:,.0f} rows/s" if task.speed else "- rows/s")

    return RateColumn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tinyknn groundtruth")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:       # argparse's usage errors (2) and --help (0)
        return int(exc.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
