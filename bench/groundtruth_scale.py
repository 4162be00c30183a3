"""Ground truth at scale: tinyknn's `groundtruth` from a file to a ground-truth file, against the file's read
time and one host-to-device pass of the same bytes measured in the same run, and the CPU against FAISS.

Length: one script per published experiment (bench/README.md); its rows share the data, the oracle check
and the record, so they stay together.

Rows (--run, comma-separated; default: file,fbin,device where there is a GPU, else cpu):
- synth: only write a SIFT-like big-ann base (--synth PATH) and its query file (PATH's stem + .query), then stop.
- file:  --rows x 128 uint8 (.u8bin, SIFT-like: see synth), --queries queries, k = --k, l2. Measured in one
         run: (a) the file's read time, one sequential pass of 64 MiB read()s after posix_fadvise(DONTNEED)
         (the file was fsynced after writing, and nothing maps it, so the kernel can drop its pages; a second,
         warm pass from the page cache shows whether it did), (b) one host-to-device pass of the same bytes
         (each 256 MiB chunk read into pinned memory, then copied by cuMemcpyHtoDAsync, CUDA events around
         the copies only), (c) `python3 -m tinyknn.cli groundtruth BASE QUERIES -k K --metric l2 -o gt.bin
         --device D` in a subprocess (wall time, after an untimed run of the same command on a twentieth of
         the rows compiled its kernels; the record's shard count is kept: on a GPU a file is cut into about 8
         shards, each searched while the next is read), and (d) the same through the API. Before (c) and (d)
         the base is dropped from the page cache again (--cache cold, the default, unless the cold read took
         longer than --cold-limit-s: then both runs and the read they are compared with are warm). A sample of queries
         (--check-queries) is checked against the float64 oracle (bench/oracle.py: ids and distance bits).
         Reports (c) / (a + b) and (d) / (a + b), when (d)'s stages (each shard's adds, its answers taken)
         began and ended, and each of its reads of an add batch and searches of a query batch (api_calls_s).
- fbin:  --fbin-rows x 128 float32 (.fbin, the same centres, noise not rounded), queries drawn the same way:
         as the file row (read, H2D, the command end to end, the API, the oracle check).
- device: the first --device-rows rows of the uint8 file in device memory: tinyknn's search of the queries
         (host in and out, median of --repeats after one warm-up) against a float32 brute force as
         benchmark suites run it (torch: the base as float32 on the GPU, 500,000-row batches, |x|^2 - 2 q.x
         by addmm without TF32, topk per batch, topk of the batches' candidates), both checked on the sample.
- cpu:   --cpu-rows x 128 float32 (.fbin), --cpu-queries queries, k = --k: tinyknn.groundtruth on the CPU
         against FAISS's `contrib.exhaustive_search.knn_ground_truth` (IndexFlatL2 over blocks of the memory-
         mapped file, ResultHeap merge) on the same --threads cores, alternated --repeats times; both checked
         on the sample.

    PYTHONPATH=$PWD python3 bench/groundtruth_scale.py --out $OUT                          # the GPU rows
    PYTHONPATH=$PWD python3 bench/groundtruth_scale.py --run cpu --out bench/results      # the CPU row
    PYTHONPATH=$PWD python3 bench/groundtruth_scale.py --synth /data/base.u8bin --rows 100000000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import NormalDist

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bench helpers, then the checkout's tinyknn
import _common  # noqa: E402 - bench modules import each other by name
import oracle  # noqa: E402

REPO = HERE.parent
CLUSTERS = 1024
BLOCK_ROWS = 1 << 14          # rows one generator task writes
READ_CHUNK = 64 << 20         # bytes of one read() of the read pass
H2D_CHUNK = 256 << 20         # bytes of one pinned chunk of the host-to-device pass
PEER_BATCH = 500_000          # rows of one batch of the benchmark suites' float32 brute force
DTYPES = {"uint8": (np.uint8, ".u8bin"), "float32": (np.float32, ".fbin")}


# -- data --------------------------------------------------------------------------------------------------
def synth(path: Path, rows: int, dim: int, dtype: str, seed: int, threads: int) -> dict:
    """A SIFT-like big-ann file: 1,024 centres with exponential coordinates (mean 25, a third of them 0), each
    row a centre plus noise of sd 8 (a normal's 65,536 quantiles, one drawn per value: a table lookup is ten
    times cheaper than a normal draw); uint8 rounds and clips to 0..255. Blocks of BLOCK_ROWS rows are made
    from their own seeds by `threads` threads, each with its own buffers, and written with pwrite, so a
    file's first rows do not depend on its length. fsynced (so that dropping it from the page cache can
    work); written beside, then renamed."""
    kind, _ = DTYPES[dtype]
    centre_rng = np.random.default_rng([seed, dim, 99])
    centres = centre_rng.exponential(25.0, (CLUSTERS, dim))
    centres[centre_rng.random((CLUSTERS, dim)) < 1 / 3] = 0.0
    quantiles = np.array([NormalDist(0.0, 8.0).inv_cdf((i + 0.5) / 65536) for i in range(65536)])
    if kind == np.uint8:
        centres, noise, work = np.rint(centres).astype(np.int16), np.rint(quantiles).astype(np.int16), np.int16
    else:
        centres, noise, work = centres.astype(np.float32), quantiles.astype(np.float32), np.float32
    itemsize = np.dtype(kind).itemsize
    n_blocks = -(-rows // BLOCK_ROWS)
    local = threading.local()
    temporary = path.with_name(path.name + ".tmp")
    started = time.perf_counter()
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, 8 + rows * dim * itemsize)
        os.pwrite(fd, struct.pack("<II", rows, dim), 0)

        def block(i: int) -> None:
            if not hasattr(local, "values"):
                local.values = np.empty((BLOCK_ROWS, dim), dtype=work)
                local.out = np.empty((BLOCK_ROWS, dim), dtype=kind)
            count = min(BLOCK_ROWS, rows - i * BLOCK_ROWS)      # two generators: prefixes do not depend on count
            which, rng = (np.random.default_rng([seed, dim, i, part]) for part in (0, 1))
            values, out = local.values[:count], local.out[:count]
            bits = rng.bit_generator.random_raw(-(-count * dim // 4)).view(np.uint16)[:count * dim]
            np.take(noise, bits.reshape(count, dim), out=values, mode="clip")
            np.add(values, centres[which.integers(0, CLUSTERS, count)], out=values)
            if kind == np.uint8:
                np.clip(values, 0, 255, out=values)
            out[...] = values
            data, offset = memoryview(out).cast("B"), 8 + i * BLOCK_ROWS * dim * itemsize
            while len(data):
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written

        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(block, range(n_blocks)))
        generated = time.perf_counter() - started
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    seconds = time.perf_counter() - started
    nbytes = 8 + rows * dim * itemsize
    return {"path": str(path), "rows": rows, "dim": dim, "dtype": dtype, "bytes": nbytes, "threads": threads,
            "generate_s": round(generated, 3), "fsync_s": round(seconds - generated, 3), "seconds": round(seconds, 3),
            "gb_per_s": round(nbytes / seconds / 1e9, 3)}


def data_files(args, dtype: str, rows: int, queries: int, tag: str) -> tuple[Path, Path, list]:
    """(base, queries) of `dtype` in --workdir, written unless already there with the same header."""
    _, extension = DTYPES[dtype]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    made = []
    paths = (work / f"{tag}_base_{rows}{extension}", work / f"{tag}_query_{queries}{extension}")
    for path, n, seed in ((paths[0], rows, args.seed), (paths[1], queries, args.seed + 1)):
        if not (path.exists() and _header(path) == (n, args.dim)):
            made.append(synth(path, n, args.dim, dtype, seed, args.threads))
    return paths[0], paths[1], made


def _header(path: Path) -> tuple[int, int]:
    with open(path, "rb") as handle:
        return struct.unpack("<II", handle.read(8))


def drop_from_cache(path: Path) -> None:
    """Ask the kernel to drop the file's pages (clean pages only: the writer fsynced it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_pass(path: Path, cold: bool) -> dict:
    """One sequential pass of READ_CHUNK read()s over the whole file (after dropping it when `cold`)."""
    if cold:
        drop_from_cache(path)
    buffer = memoryview(bytearray(READ_CHUNK))
    total, started = 0, time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while True:
            got = handle.readinto(buffer)
            if not got:
                break
            total += got
    seconds = time.perf_counter() - started
    return {"bytes": total, "seconds": round(seconds, 3), "gb_per_s": round(total / seconds / 1e9, 3)}


def h2d_pass(path: Path) -> dict:
    """One host-to-device pass of the file's bytes: each H2D_CHUNK read into pinned memory (timed apart: a
    read from the page cache), then copied to its place in one device buffer, CUDA events around each copy."""
    from tinyknn.gpu.memory import DeviceBuffer, Event, PinnedBuffer, Stream

    size = os.path.getsize(path)
    copy_s, read_s = 0.0, 0.0
    with PinnedBuffer(H2D_CHUNK) as pinned, DeviceBuffer(size) as device, Stream() as stream, \
            Event() as start, Event() as end, open(path, "rb", buffering=0) as handle:
        host = pinned.array(np.uint8, H2D_CHUNK)
        offset = 0
        while offset < size:
            t0 = time.perf_counter()
            got = handle.readinto(memoryview(host))
            read_s += time.perf_counter() - t0
            start.record(stream)
            device.copy_from_host(host, got, stream, offset=offset)
            end.record(stream)
            end.synchronize()
            copy_s += start.elapsed_ms(end) / 1e3
            offset += got
    return {"bytes": size, "chunk_bytes": H2D_CHUNK, "seconds": round(copy_s, 4),
            "gb_per_s": round(size / copy_s / 1e9, 2), "read_to_pinned_s": round(read_s, 3)}


# -- ground truth and its check ----------------------------------------------------------------------------
def command(base: Path, queries: Path, out: Path, k: int, device: str, rows: int | None = None) -> dict:
    """`python3 -m tinyknn.cli groundtruth ...` in a subprocess: wall seconds and the record it wrote."""
    argv = [sys.executable, "-m", "tinyknn.cli", "groundtruth", str(base), str(queries), "-k", str(k),
            "--metric", "l2", "-o", str(out), "--device", device] + (["--rows", str(rows)] if rows else [])
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _pythonpath()})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    record = json.loads(Path(f"{out}.json").read_text())
    return {"argv": argv[1:], "seconds": round(seconds, 3), "record_seconds": record["seconds"],
            "shards": record.get("shards"), "shard_rows": record.get("shard_rows"),
            "record_stages": record.get("stages_seconds"), "stdout": done.stdout.strip()[-500:]}


def _pythonpath() -> str:
    parts = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def sample_of(nq: int, count: int) -> np.ndarray:
    return np.unique(np.linspace(0, nq - 1, num=min(count, nq)).astype(np.int64))


def check(base: Path, queries: Path, ids: np.ndarray, distances: np.ndarray | None, sample: np.ndarray, k: int,
          dtype: str) -> dict:
    """The sample's ids (and float32 distances' bits) against the float64 oracle of bench/oracle.py."""
    import tinyknn.io as tio

    source = tio.open_vectors(base)
    exact = oracle.exact_neighbours(source, dtype, tio.read_vectors(queries)[sample].astype(np.float32), k, "l2")
    out = {"queries": len(sample), "backend": exact.backend, "oracle_s": round(exact.seconds, 2),
           "ids_equal": bool(np.array_equal(ids[sample], exact.ids)),
           "agreement": oracle.agreement(ids[sample], exact, k)}
    if distances is not None:
        want = exact.distances.astype(np.float32).view(np.uint32)
        out["distance_bits_equal"] = bool(np.array_equal(distances[sample].astype(np.float32).view(np.uint32), want))
    return out


@contextlib.contextmanager
def calls_timed(started: float):
    """When each read of an add batch (the reader threads') and each search of a query batch (the search
    thread's, on a GPU) began and ended, in seconds from `started`: whether the reads go on while a shard
    is searched, and the next shard's adds ("adding shard ..." in the stages) run under its search."""
    from tinyknn.groundtruth.inputs import Source
    from tinyknn.index import Index

    calls: dict[str, list] = {"read": [], "search": []}
    real = {"read": Source.read, "search": Index.search}

    def timed(name):
        def call(*args, **kwargs):
            began = time.perf_counter()
            try:
                return real[name](*args, **kwargs)
            finally:
                calls[name].append([round(began - started, 3), round(time.perf_counter() - started, 3)])
        return call

    Source.read, Index.search = timed("read"), timed("search")
    try:
        yield calls
    finally:
        Source.read, Index.search = real["read"], real["search"]


def api_by_readers(args, base: Path, queries: Path, device: str, cold: bool, want) -> dict:
    """The API again with each --readers count other than the library's (the same bits asked for)."""
    import tinyknn
    from tinyknn.groundtruth import batches

    default, out = batches.READERS, {}
    try:
        for readers in (int(r) for r in args.readers.split(",")):
            if readers == default:
                continue
            batches.READERS = readers
            if cold:
                drop_from_cache(base)
            started = time.perf_counter()
            d, i = tinyknn.groundtruth(str(base), str(queries), args.k, "l2", device=device)
            out[str(readers)] = round(time.perf_counter() - started, 3)
            if not (np.array_equal(i, want[1]) and np.array_equal(d.view(np.uint32), want[0].view(np.uint32))):
                raise RuntimeError(f"the API with {readers} readers differs from the API with {default}")
    finally:
        batches.READERS = default
    return out


def file_row(args, name: str, dtype: str, rows: int, device: str) -> dict:
    """A base file to a ground-truth file through the command and the API, against read (+ H2D) time."""
    import tinyknn
    import tinyknn.io as tio

    base, queries, made = data_files(args, dtype, rows, args.queries, name)
    row = {"rows": rows, "dim": args.dim, "dtype": dtype, "queries": args.queries, "k": args.k, "device": device,
           "files_written": made, "base_bytes": os.path.getsize(base)}
    row["read_cold"] = read_pass(base, True)
    row["read_warm"] = read_pass(base, False)
    cold = args.cache == "cold" and row["read_cold"]["seconds"] <= args.cold_limit_s
    row["cache"] = "cold" if cold else "warm" + (f" (a cold read took {row['read_cold']['seconds']} s, over "
                                                 f"--cold-limit-s)" if args.cache == "cold" else "")
    row["read"] = row["read_cold"] if cold else row["read_warm"]
    if device == "cuda":
        row["h2d"] = h2d_pass(base)
    warm_rows = min(rows, max(1, rows // 20))
    row["compile_run"] = command(base, queries, args.work / f"{name}_warm.bin", args.k, device, rows=warm_rows)
    out = args.work / f"{name}_gt.bin"
    if cold:
        drop_from_cache(base)
    row["command"] = command(base, queries, out, args.k, device)
    if cold:
        drop_from_cache(base)
    stages: dict[str, list[float]] = {}

    def progress(_done, _total, stage):       # when each stage (a shard's adds, its answers taken) began and ended
        now = round(time.perf_counter() - started, 3)
        stages.setdefault(stage, [now, now])[1] = now

    started = time.perf_counter()
    with calls_timed(started) as calls:
        api_d, api_i = tinyknn.groundtruth(str(base), str(queries), args.k, "l2", device=device, progress=progress)
    row["api_s"] = round(time.perf_counter() - started, 3)
    row["api_stages_s"] = stages
    row["api_calls_s"] = calls
    row["api_s_by_readers"] = api_by_readers(args, base, queries, device, cold, (api_d, api_i))
    truth = tio.read_knn_groundtruth(out)
    row["api_equals_command"] = bool(np.array_equal(api_i, truth.ids)
                                     and np.array_equal(api_d.view(np.uint32), truth.distances.view(np.uint32)))
    row["check"] = check(base, queries, truth.ids, truth.distances, sample_of(args.queries, args.check_queries),
                         args.k, dtype)
    floor = row["read"]["seconds"] + row.get("h2d", {}).get("seconds", 0.0)
    row["read_plus_h2d_s"] = round(floor, 3)
    row["command_over_read_plus_h2d"] = round(row["command"]["seconds"] / floor, 3)
    row["api_over_read_plus_h2d"] = round(row["api_s"] / floor, 3)
    if not args.keep_files:
        for path in (out, Path(f"{out}.json"), args.work / f"{name}_warm.bin", args.work / f"{name}_warm.bin.json"):
            path.unlink(missing_ok=True)
    return row


# -- tinyknn in device memory against the benchmark suites' float32 brute force ----------------------------
def brute_force_float32(torch, x32, norms, q, k: int):
    """The suites' float32 brute force: per PEER_BATCH rows |x|^2 - 2 q.x (addmm, no TF32), topk; then the
    topk of every batch's candidates. Returns host (distances + |q|^2, ids)."""
    values, ids = [], []
    for first in range(0, x32.shape[0], PEER_BATCH):
        block = torch.addmm(norms[first:first + PEER_BATCH], q, x32[first:first + PEER_BATCH].T, alpha=-2.0)
        best = torch.topk(block, k, dim=1, largest=False)
        values.append(best.values)
        ids.append(best.indices + first)
        del block
    values, ids = torch.cat(values, dim=1), torch.cat(ids, dim=1)
    best = torch.topk(values, k, dim=1, largest=False)
    found = torch.gather(ids, 1, best.indices)
    distances = best.values + (q * q).sum(dim=1, keepdim=True)
    return distances.cpu().numpy(), found.cpu().numpy()


def device_row(args) -> dict:
    import torch

    import tinyknn
    import tinyknn.io as tio

    base, queries, made = data_files(args, "uint8", args.rows, args.queries, "file")
    n = min(args.device_rows, args.rows)
    x = np.asarray(tio.open_vectors(base)[:n])
    q = tio.read_vectors(queries).astype(np.float32)
    sample = sample_of(len(q), args.check_queries)
    row = {"rows": n, "dim": args.dim, "dtype": "uint8", "queries": len(q), "k": args.k, "files_written": made,
           "peer": f"torch float32 brute force, {PEER_BATCH:,}-row batches, addmm + topk, topk merge (no TF32)"}
    index = tinyknn.Index(args.dim, "l2", "uint8", device="cuda")
    started = time.perf_counter()
    index.add(x)
    row["tinyknn_add_s"] = round(time.perf_counter() - started, 3)
    times = []
    for i in range(args.repeats + 1):
        started = time.perf_counter()
        d, ids = index.search(q, args.k)
        if i:
            times.append(time.perf_counter() - started)
    index.close()
    row["tinyknn_s"] = sorted(times)
    row["tinyknn_median_s"] = round(float(np.median(times)), 4)
    row["tinyknn_check"] = _check_prefix(x, q, ids, d, sample, args.k)
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        x32 = torch.from_numpy(x).cuda().float()
        norms = (x32 * x32).sum(dim=1)
        qd = torch.from_numpy(q).cuda()
        times = []
        for i in range(args.repeats + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            peer_d, peer_i = brute_force_float32(torch, x32, norms, qd, args.k)
            if i:
                times.append(time.perf_counter() - started)
        del x32, norms, qd
    torch.cuda.empty_cache()
    row["peer_s"] = sorted(times)
    row["peer_median_s"] = round(float(np.median(times)), 4)
    row["peer_check"] = _check_prefix(x, q, peer_i, None, sample, args.k)
    row["speedup"] = round(row["peer_median_s"] / row["tinyknn_median_s"], 2)
    return row


def _check_prefix(x, q, ids, distances, sample, k: int) -> dict:
    exact = oracle.exact_neighbours(x, "uint8", q[sample], k, "l2")
    out = {"queries": len(sample), "backend": exact.backend, "ids_equal": bool(np.array_equal(ids[sample], exact.ids)),
           "agreement": oracle.agreement(ids[sample], exact, k)}
    if distances is not None:
        out["distance_bits_equal"] = bool(np.array_equal(
            distances[sample].astype(np.float32).view(np.uint32), exact.distances.astype(np.float32).view(np.uint32)))
    return out


# -- the CPU against FAISS ---------------------------------------------------------------------------------
def cpu_row(args) -> dict:
    import tinyknn
    import tinyknn.io as tio
    from tinyknn.config import set_cpu_threads

    base, queries, made = data_files(args, "float32", args.cpu_rows, args.cpu_queries, "cpu")
    nq = args.cpu_queries
    set_cpu_threads(args.threads)
    row = {"rows": args.cpu_rows, "dim": args.dim, "dtype": "float32", "queries": nq, "k": args.k,
           "threads": args.threads, "files_written": made, "tinyknn_s": [], "faiss_s": [],
           "load_average_before": os.getloadavg()}
    try:
        import faiss
        from faiss.contrib.exhaustive_search import knn_ground_truth
        faiss.omp_set_num_threads(args.threads)
        row["faiss_block_rows"] = args.faiss_block
    except ImportError as exc:
        faiss, row["faiss_skipped"] = None, f"faiss is not installed: {exc}"
    source = tio.open_vectors(base)
    q = tio.read_vectors(queries)
    for _ in range(args.repeats):          # alternated, so both see the same machine
        started = time.perf_counter()
        d, ids = tinyknn.groundtruth(str(base), str(queries), args.k, "l2", device="cpu")
        row["tinyknn_s"].append(round(time.perf_counter() - started, 3))
        if faiss is not None:
            started = time.perf_counter()
            blocks = (np.asarray(source[a:a + args.faiss_block]) for a in range(0, args.cpu_rows, args.faiss_block))
            faiss_d, faiss_i = knn_ground_truth(np.ascontiguousarray(q), blocks, args.k, ngpu=0)
            row["faiss_s"].append(round(time.perf_counter() - started, 3))
    row["load_average_after"] = os.getloadavg()          # other work on the machine shows here
    sample = sample_of(nq, args.check_queries)
    row["tinyknn_check"] = check(base, queries, ids, d, sample, args.k, "float32")
    row["tinyknn_median_s"] = float(np.median(row["tinyknn_s"]))
    if faiss is not None:
        row["faiss_check"] = check(base, queries, faiss_i.astype(np.int64), None, sample, args.k, "float32")
        row["faiss_median_s"] = float(np.median(row["faiss_s"]))
        row["tinyknn_over_faiss"] = round(row["tinyknn_median_s"] / row["faiss_median_s"], 3)
    return row


# -- the run -----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="rows to run: file,fbin,device,cpu (default: file,fbin,device with a GPU, "
                                      "else cpu)")
    parser.add_argument("--synth", type=Path, metavar="PATH", help="only write a SIFT-like base at PATH and "
                                                                   "--queries queries beside it")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="uint8", help="--synth's element type")
    parser.add_argument("--rows", type=int, default=100_000_000, help="rows of the uint8 file (row file)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("-k", "--k", type=int, default=100)
    parser.add_argument("--fbin-rows", type=int, default=10_000_000)
    parser.add_argument("--device-rows", type=int, default=10_000_000)
    parser.add_argument("--cpu-rows", type=int, default=1_000_000)
    parser.add_argument("--cpu-queries", type=int, default=10_000)
    parser.add_argument("--file-device", choices=("cuda", "cpu"), default="cuda",
                        help="where the file and fbin rows compute (cpu: the flow without a GPU, for tests)")
    parser.add_argument("--faiss-block", type=int, default=1_000_000, help="rows per block FAISS is handed")
    parser.add_argument("--check-queries", type=int, default=16, help="queries checked against float64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--readers", default="4", help="comma-separated reads in flight for extra API runs of the "
                        "file row, each from a cold cache (tinyknn.groundtruth.batches.READERS; default: 4, the "
                        "library's own, no extra run)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold",
                        help="cold: drop the base from the page cache before the read pass and each run")
    parser.add_argument("--cold-limit-s", type=float, default=40.0,
                        help="where a cold read of the base takes longer, the runs read it warm (and are compared "
                             "with the warm read)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "tinyknn-gt-scale")
    parser.add_argument("--keep-files", action="store_true", help="keep the data and ground-truth files")
    parser.add_argument("--out", "--out-dir", dest="out", type=Path, default=_common.RESULTS_DIR)
    parser.add_argument("--label", help="the device part of the result's name (default: the machine's)")
    args = parser.parse_args(argv)
    args.work = args.workdir
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.synth is not None:
        stem = args.synth.name[: -len(args.synth.suffix)] if args.synth.suffix else args.synth.name
        made = [synth(args.synth, args.rows, args.dim, args.dtype, args.seed, args.threads),
                synth(args.synth.with_name(f"{stem}.query{args.synth.suffix}"), args.queries, args.dim, args.dtype,
                      args.seed + 1, args.threads)]
        print(json.dumps(made, indent=2))
        return 0
    from tinyknn.gpu import has_gpu, why_no_gpu

    gpu = has_gpu()
    wanted = (args.run or ("file,fbin,device" if gpu else "cpu")).split(",")
    unknown = set(wanted) - {"file", "fbin", "device", "cpu"}
    if unknown:
        print(f"--run takes file, fbin, device and cpu; got {sorted(unknown)}", file=sys.stderr)
        return 2
    env = _common.environment()
    results, skipped, began = {}, {}, time.perf_counter()
    for name in wanted:
        needs_gpu = name == "device" or (name in ("file", "fbin") and args.file_device == "cuda")
        if needs_gpu and not gpu:
            skipped[name] = f"no GPU: {why_no_gpu()}"
            print(f"{name}: skipped ({skipped[name]})", flush=True)
            continue
        started = time.perf_counter()
        if name == "file":
            results[name] = file_row(args, "file", "uint8", args.rows, args.file_device)
        elif name == "fbin":
            results[name] = file_row(args, "fbin", "float32", args.fbin_rows, args.file_device)
        elif name == "device":
            results[name] = device_row(args)
        else:
            results[name] = cpu_row(args)
        results[name]["row_s"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {json.dumps(summary(name, results[name]))}", flush=True)
        write(args, env, results, skipped, began, final=False)     # a run cut short keeps its finished rows
    if not args.keep_files:
        for path in args.workdir.glob("*bin"):
            path.unlink()
    paths = write(args, env, results, skipped, began, final=True)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    failed = [n for n, r in results.items() for key in ("check", "tinyknn_check")
              if key in r and not (r[key]["ids_equal"] and r[key].get("distance_bits_equal", True))]
    failed += [n for n, r in results.items() if r.get("api_equals_command") is False]
    if failed:
        print(f"NOT EXACT: {failed}", file=sys.stderr)
        return 1
    return 0


def write(args, env: dict, results: dict, skipped: dict, began: float, final: bool) -> dict:
    payload = {"rows": results, "skipped": skipped, "total_s": round(time.perf_counter() - began, 1),
               "finished": final, "settings": {k: str(v) for k, v in vars(args).items()}}
    name = "groundtruth_cpu" if set(results) == {"cpu"} else "groundtruth_scale"
    return _common.write_results(name, payload, figure(results) if final else None, env=env, out_dir=args.out,
                                 label=args.label)


def summary(name: str, row: dict) -> dict:
    keys = {"file": ("read_plus_h2d_s", "command_over_read_plus_h2d", "api_s"), "fbin": ("api_s",),
            "device": ("tinyknn_median_s", "peer_median_s", "speedup"),
            "cpu": ("tinyknn_median_s", "faiss_median_s", "tinyknn_over_faiss")}[name]
    out = {key: row.get(key) for key in keys}
    if "command" in row:
        out["command_s"] = row["command"]["seconds"]
        out["read_s"], out["h2d_s"] = row["read"]["seconds"], row.get("h2d", {}).get("seconds")
        out["shards"] = row["command"]["shards"]
    out["exact"] = {key: row[key]["ids_equal"] for key in ("check", "tinyknn_check") if key in row}
    return out


def figure(results: dict):
    """Bars of each row's measured seconds (None where matplotlib is missing)."""
    try:
        plt = _common.pyplot()
    except ImportError:
        return None
    bars = []
    for name, row in results.items():
        if "command" in row:
            bars += [(f"{name}: read", row["read"]["seconds"]), (f"{name}: H2D", row.get("h2d", {}).get("seconds", 0)),
                     (f"{name}: command", row["command"]["seconds"]), (f"{name}: API", row["api_s"])]
        elif name == "device":
            bars += [("device: tinyknn", row["tinyknn_median_s"]), ("device: float32 batches", row["peer_median_s"])]
        elif name == "cpu":
            bars += [("cpu: tinyknn", row["tinyknn_median_s"])] + \
                ([("cpu: FAISS", row["faiss_median_s"])] if "faiss_median_s" in row else [])
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(bars) + 1.2))
    ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1], color="#1f77b4")
    ax.set_xlabel("seconds")
    ax.set_title("tinyknn ground truth at scale")
    return fig


if __name__ == "__main__":
    sys.exit(main())
