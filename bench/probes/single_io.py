#!/usr/bin/env python3
"""Where one query's time goes around the single-query kernel: the copy engine's two copies (query in, results
out) against the kernel reading the query from pinned host memory and writing its results there itself
(zero-copy through unified addressing), with a CUDA graph or a plain launch, and how the host waits
(cuStreamSynchronize, polling cuStreamQuery, the context's spin-wait flag). Every variant's answers are checked
equal to the library's, bit for bit.

    PYTHONPATH=$PWD python3 bench/probes/single_io.py --out $OUT        # H200, about two minutes

Variants (each timed end to end from the host: the query into pinned staging, the launch, the wait, the
results copied into fresh arrays, the status read):
  api              Index.search (the library as it is)
  copies           the library's host batch as it is (its graph was copy in, kernel, copy out when this probe was
                   written; since, copy in and the kernel writing the results, as out_direct)
  out_direct       a graph of copy in and the kernel, which writes the results into pinned memory
  all_direct       a graph of the kernel alone: it reads the query from pinned memory and writes its results there
  all_direct_plain all_direct without a graph (one cuLaunchKernel)
  all_direct_poll  all_direct, the host polling cuStreamQuery (GIL held) instead of cuStreamSynchronize
  kernel_only…     timing only: the kernel without the copy in (a graph, a plain launch, a graph whose kernel node's
                   parameters are rewritten first): what the copy-in node costs, and what passing the query among
                   the kernel's parameters would
then, with the context's flags set to CU_CTX_SCHED_SPIN, copies and all_direct again (…_spin).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPES = {"20k": (20_000, 128, "float32"), "100k": (100_000, 128, "float32"),
          "1M f32": (1_000_000, 768, "float32"), "1M f16": (1_000_000, 768, "float16")}
K = 10
SLOT_QUERIES, SLOT_DISTANCES, SLOT_IDS, SLOT_STATUS = 5, 9, 10, 13     # plan.ARGUMENTS["single"]


def build(name: str, seed: int = 7):
    import tinyknn

    n, dim, dtype = SHAPES[name]
    rng = np.random.default_rng(seed)
    index = tinyknn.Index(dim, "l2", dtype, device="cuda")
    step = 250_000
    for start in range(0, n, step):
        index.add(rng.standard_normal((min(step, n - start), dim), dtype=np.float32).astype(dtype))
    queries = rng.standard_normal((64, dim), dtype=np.float32)
    return index, queries


class Variants:
    """The library's single-query plan for one index, and the probe's launches over the same kernel."""

    def __init__(self, index, dim: int):
        from tinyknn.gpu import plan as plans
        from tinyknn.gpu.launcher import CapturedGraph
        from tinyknn.gpu.memory import PinnedBuffer

        s = self.s = index._searcher
        q = np.zeros((1, dim), np.float32)
        for _ in range(3):
            index.search(q, K)          # the plan, its host batch and its graph
        with s._lock, s._reading(None):
            batch = self.batch = s._host_batch(1, K)
        plan = batch.plan
        self.stride = s._stride
        self.stage = PinnedBuffer(self.stride * 4)
        self.stage_view = self.stage.array(np.float32, (1, self.stride))
        self.stage_view[...] = 0
        ids_offset, status_offset, nbytes = plans.result_layout(1, K)
        self.out = PinnedBuffer(nbytes)
        raw = self.out.array(np.uint8, nbytes)
        self.distances = raw[:K * 4].view(np.float32)
        self.ids = raw[ids_offset:status_offset].view(np.int64)
        self.status = raw[status_offset:].view(np.int32)
        values = plan.main.values()
        grid, block, shared = plan.main_grid, plan.main_block, plan.main_shared
        stream = s._stream

        def launch_with(query_ptr):
            launch = plan.main.kernel.prepare(plans.ARGUMENTS["single"], values)
            launch.set(SLOT_QUERIES, query_ptr)
            launch.set(SLOT_DISTANCES, self.out.ptr)
            launch.set(SLOT_IDS, self.out.ptr + ids_offset)
            launch.set(SLOT_STATUS, self.out.ptr + status_offset)
            return launch

        self.out_direct = launch_with(values[SLOT_QUERIES])     # reads the device copy of the query
        self.all_direct = launch_with(self.stage.ptr)           # reads the pinned staging itself
        queries_buffer = batch.queries
        self.graph_out = CapturedGraph(stream, lambda: (
            queries_buffer.copy_from_host(self.stage, self.stride * 4, stream),
            self.out_direct.launch(grid, block, shared, stream)))
        self.graph_all = CapturedGraph(stream, lambda: self.all_direct.launch(grid, block, shared, stream))
        self.grid, self.block, self.shared, self.stream = grid, block, shared, stream
        # Timing only (the answers are the previous query's): the kernel alone, the device copy of the query
        # left as it was, to price the graph's copy-in node; and the kernel node's parameters rewritten before
        # each launch (what a query passed among the kernel's parameters would cost a graph).
        self.graph_kernel = CapturedGraph(stream, lambda: self.out_direct.launch(grid, block, shared, stream))
        self._kernel_node_graph(stream)

    def _kernel_node_graph(self, stream) -> None:
        from cuda.bindings import driver

        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        driver.cuStreamBeginCapture(stream.handle, mode)
        self.out_direct.launch(self.grid, self.block, self.shared, stream)
        err, graph = driver.cuStreamEndCapture(stream.handle)
        err, nodes, count = driver.cuGraphGetNodes(graph, 1)
        self.node = nodes[0]
        err, self.node_params = driver.cuGraphKernelNodeGetParams(self.node)
        err, self.exec_nodes = driver.cuGraphInstantiate(graph, 0)
        assert not err, err

    def run(self, variant: str, query: np.ndarray, index):
        from cuda.bindings import driver

        s, stream = self.s, self.stream
        if variant == "api":
            return index.search(query, K)
        if variant.startswith("copies"):
            batch = self.batch
            np.copyto(batch.stage[:, :query.shape[1]], query)
            batch.run(stream, True)
            stream.synchronize()
            return batch.distances.copy(), batch.ids.copy(), int(batch.status[0])
        self.stage_view[:, :query.shape[1]] = query
        if variant == "out_direct":
            self.graph_out.launch(stream)
        elif variant == "kernel_only":
            self.graph_kernel.launch(stream)
        elif variant == "kernel_only_plain":
            self.out_direct.launch(self.grid, self.block, self.shared, stream)
        elif variant == "kernel_only_setparams":
            driver.cuGraphExecKernelNodeSetParams(self.exec_nodes, self.node, self.node_params)
            driver.cuGraphLaunch(self.exec_nodes, stream.handle)
        elif variant == "all_direct_plain":
            self.all_direct.launch(self.grid, self.block, self.shared, stream)
        else:
            self.graph_all.launch(stream)
        if variant == "all_direct_poll":
            query_stream, handle, ready = driver.cuStreamQuery, stream.handle, driver.CUresult.CUDA_SUCCESS
            while query_stream(handle)[0] != ready:
                pass
        else:
            stream.synchronize()
        return self.distances.reshape(1, K).copy(), self.ids.reshape(1, K).copy(), int(self.status[0])


def time_variants(variants: Variants, index, queries, names, reps: int, rounds: int) -> dict:
    samples = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            q = queries[:1]
            for _ in range(20):
                variants.run(name, q, index)
            for r in range(reps):
                q = queries[r % len(queries)][None]
                t0 = time.perf_counter_ns()
                variants.run(name, q, index)
                samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    return {name: {"median_us": statistics.median(v), "p10_us": float(np.percentile(v, 10)),
                   "p90_us": float(np.percentile(v, 90))} for name, v in samples.items()}


def check(variants: Variants, index, queries, names) -> dict:
    differ = {}
    for name in names:
        bad = 0
        for i in range(len(queries)):
            q = queries[i][None]
            want_d, want_i = index.search(q, K)
            got = variants.run(name, q, index)
            if name == "api":
                got_d, got_i = got
            else:
                got_d, got_i, status = got
                if status:          # unproven: the library would run the band search; not compared
                    continue
            bad += int(not (np.array_equal(got_i.reshape(1, K), want_i) and
                            np.array_equal(got_d.reshape(1, K).view(np.uint32), want_d.view(np.uint32))))
        differ[name] = bad
    return differ


def set_spin(spin: bool) -> None:
    from cuda.bindings import driver

    flags = driver.CUctx_flags.CU_CTX_SCHED_SPIN if spin else driver.CUctx_flags.CU_CTX_SCHED_AUTO
    err, = driver.cuCtxSetFlags(int(flags))
    if err:
        raise RuntimeError(f"cuCtxSetFlags: {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from cuda.bindings import driver

    names = ("api", "copies", "out_direct", "all_direct", "all_direct_plain", "all_direct_poll")
    record = {"date": time.strftime("%Y-%m-%d"), "k": K, "reps": args.reps, "rounds": args.rounds, "shapes": {}}
    for shape in args.shapes.split(","):
        index, queries = build(shape)
        variants = Variants(index, SHAPES[shape][1])
        err, flags = driver.cuCtxGetFlags()
        differ = check(variants, index, queries, names)
        timing_only = ("kernel_only", "kernel_only_plain", "kernel_only_setparams")
        times = time_variants(variants, index, queries, names + timing_only, args.reps, args.rounds)
        set_spin(True)
        spin = time_variants(variants, index, queries, ("copies", "all_direct"), args.reps, args.rounds)
        set_spin(False)
        times.update({f"{name}_spin": value for name, value in spin.items()})
        record["shapes"][shape] = {"times": times, "differ": differ, "ctx_flags": int(flags)}
        print(f"{shape}: flags {int(flags)}, differ {differ}")
        for name, value in times.items():
            print(f"  {name:18s} {value['median_us']:8.2f} us  (p10 {value['p10_us']:.2f}, p90 {value['p90_us']:.2f})")
        index.close()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"single_io_{record['date']}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
