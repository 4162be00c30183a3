"""Trace one tinyknn search: record its driver calls (for C++ to replay) and time it stage by stage.

`Recorder` patches tinyknn's runtime classes (DeviceBuffer copies, PreparedLaunch launches, graph
launches, stream synchronisations) for the duration of a `with` block and records each call with
host timestamps, optionally CUDA events, and what C++ needs to issue the same call (`to_ops`).
"""

from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np

from tinyknn.gpu import launcher, memory

import _common
from launch_bench import KINDS, LbOp, LbSearch, make_launch

_DEVICE_WORK = {"h2d", "d2h", "launch", "graph", "memset", "d2d"}


def snapshot_params(prepared) -> tuple[int, list]:
    """A frozen copy of a PreparedLaunch's current parameter values: (array address, keep-alive)."""
    copies = [type(slot).from_buffer_copy(slot) for slot in prepared.slots]
    array = (ctypes.c_void_p * max(1, len(copies)))(*[ctypes.addressof(c) for c in copies])
    return ctypes.addressof(array), [copies, array]


class Recorder:
    """Patches tinyknn's runtime classes for the duration of a `with` block and records every call.

    Each record holds the kind of call and host timestamps (perf_counter_ns) at entry and exit.
    full=True adds what C++ needs to issue the same call (parameter snapshots cost microseconds, so
    stage timing uses full=False); events=True also records a CUDA event on the op's stream before
    and after each asynchronous op, for device-side stage times.
    """

    def __init__(self, full: bool = True, events: bool = False):
        self.full = full
        self.events = events
        self.ops: list[dict] = []
        self._saved = []

    def _wrap(self, owner, name, describe):
        original = getattr(owner, name)
        ops, events = self.ops, self.events

        def wrapper(obj, *args, **kwargs):
            entry = describe(obj, *args, **kwargs)
            asynchronous = entry["kind"] in _DEVICE_WORK
            if events and asynchronous:
                entry["event_before"] = memory.Event()
                entry["event_before"].record(entry.get("stream"))
            entry["t_enter"] = time.perf_counter_ns()
            result = original(obj, *args, **kwargs)
            entry["t_exit"] = time.perf_counter_ns()
            if events and asynchronous:
                entry["event_after"] = memory.Event()
                entry["event_after"].record(entry.get("stream"))
            ops.append(entry)
            return result

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self):
        full = self.full

        def copy(to_device):
            def describe(buf, host, nbytes=None, stream=None, offset=0):
                entry = {"kind": "h2d" if to_device else "d2h", "stream": stream}
                if full:
                    host_ptr, n = memory._host_pointer(host, nbytes, not to_device, "record")
                    entry.update(device=buf.ptr + offset, host=host_ptr, nbytes=n)
                return entry
            return describe

        def launch(pl, grid, block, shared_bytes=0, stream=None):
            entry = {"kind": "launch", "stream": stream, "prepared": pl}
            if full:
                address, keep = snapshot_params(pl)
                entry.update(grid=launcher._dim3(grid, "grid"), block=launcher._dim3(block, "block"),
                             shared=shared_bytes, params=address, keep=keep)
            return entry

        def memset(buf, value, nbytes=None, stream=None, offset=0):
            return {"kind": "memset", "device": buf.ptr + offset, "byte_value": value & 0xFF,
                    "nbytes": buf.nbytes - offset if nbytes is None else nbytes, "stream": stream}

        def d2d(buf, src, nbytes, stream=None, offset=0):
            return {"kind": "d2d", "device": buf.ptr + offset, "device_src": int(src), "nbytes": nbytes,
                    "stream": stream}

        self._wrap(memory.DeviceBuffer, "copy_from_host", copy(True))
        self._wrap(memory.DeviceBuffer, "copy_to_host", copy(False))
        self._wrap(memory.DeviceBuffer, "fill_bytes", memset)
        self._wrap(memory.DeviceBuffer, "copy_from_device", d2d)
        self._wrap(launcher.PreparedLaunch, "launch", launch)
        self._wrap(launcher.PreparedLaunch, "launch_configured", lambda pl: launch(pl, *pl._config))
        self._wrap(launcher.CapturedGraph, "launch", lambda g, stream: {"kind": "graph", "graph": g.handle,
                                                                         "stream": stream})
        self._wrap(memory.Stream, "synchronize", lambda s: {"kind": "sync", "stream": s})
        self._wrap(memory.Stream, "wait", lambda s, ev: {"kind": "stream_wait", "stream": s, "event": ev.handle})
        self._wrap(memory.Event, "record", lambda ev, stream=None: {"kind": "event_record", "stream": stream,
                                                                    "event": ev.handle})
        self._wrap(memory.Event, "synchronize", lambda ev: {"kind": "event_sync", "event": ev.handle})
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def to_ops(records: list[dict]):
    """An LbOp array for lb_replay (the records keep the parameter snapshots alive)."""
    ops = (LbOp * len(records))()
    for op, rec in zip(ops, records):
        op.kind = KINDS[rec["kind"]]
        op.stream = int(memory._stream_handle(rec.get("stream")))
        if rec["kind"] == "launch":
            op.launch = make_launch(rec["prepared"].kernel.handle, rec["grid"], rec["block"], rec["shared"],
                                    op.stream, rec["params"])
        elif rec["kind"] == "graph":
            op.graph = int(rec["graph"])
        elif "event" in rec:
            op.event = int(rec["event"])
        elif rec["kind"] == "sync":
            pass
        else:
            op.device = rec["device"]
            op.device_src = rec.get("device_src", 0)
            op.host = rec.get("host", 0)
            op.nbytes = rec["nbytes"]
            op.byte_value = rec.get("byte_value", 0)
    return ops


class graphs:
    """`with graphs(index, False):` switches the searcher's graph replay off (if it has the switch)."""

    def __init__(self, index, enabled: bool):
        self.searcher, self.enabled = index._searcher, enabled
        self.available = hasattr(self.searcher, "use_graphs")

    def __enter__(self):
        if self.available:
            self.saved = self.searcher.__dict__.get("use_graphs", _MISSING)
            self.searcher.use_graphs = self.enabled
        return self

    def __exit__(self, *exc):
        if self.available:
            if self.saved is _MISSING:
                del self.searcher.use_graphs
            else:
                self.searcher.use_graphs = self.saved


_MISSING = object()


def _record(index, queries, k: int) -> list[dict]:
    for _ in range(3):                      # warm: plans built, repeated shapes captured as graphs
        index.search(queries, k)
    with Recorder(full=True) as recorder:
        index.search(queries, k)
    return recorder.ops


def trace_search(index, queries, k: int) -> dict:
    """The driver calls of a warm search as it runs ('default'), and one call at a time ('one_by_one':
    graph replay switched off, when the searcher replays graphs), with the first kernel launch."""
    default = _record(index, queries, k)
    one_by_one = default
    if any(op["kind"] == "graph" for op in default):
        with graphs(index, False) as switch:
            if not switch.available:
                raise RuntimeError("the searcher replays graphs and has no use_graphs switch to see the calls")
            one_by_one = _record(index, queries, k)
    launches = [op for op in one_by_one if op["kind"] == "launch"]
    if not launches:
        raise RuntimeError(f"a search issued no PreparedLaunch launch (calls seen: "
                           f"{[op['kind'] for op in one_by_one]})")
    return {"default": default, "one_by_one": one_by_one, "first_launch": launches[0]}


def _stage_row(t0, t1, marks, ops) -> dict:
    ops = sorted(ops, key=lambda op: op["t_enter"])
    us = lambda ns: ns * 1e-3  # noqa: E731
    spent = dict.fromkeys(KINDS, 0)
    for op in ops:
        spent[op["kind"]] += op["t_exit"] - op["t_enter"]
    row = {"total": us(t1 - t0)}
    if marks:
        first = ops[0]["t_enter"] if ops else marks["exit"]
        last = ops[-1]["t_exit"] if ops else marks["exit"]
        row.update(validation=us(marks["enter"] - t0), packing=us(first - marks["enter"]),
                   searcher_glue=us(last - first - sum(spent.values())), results=us(marks["exit"] - last),
                   index_return=us(t1 - marks["exit"]))
    row.update({f"{kind}_call": us(ns) for kind, ns in spent.items() if ns})
    return row


def stage_breakdown(index, queries, k: int, reps: int) -> dict:
    """Host clock around each stage of Index.search (wrapped calls) and CUDA events around device work."""
    cls = type(index._searcher)
    original, marks = cls.search, {}

    def timed(self, *args, **kwargs):
        marks["enter"] = time.perf_counter_ns()
        result = original(self, *args, **kwargs)
        marks["exit"] = time.perf_counter_ns()
        return result

    cls.search = timed
    rows, device = [], []
    try:
        for events in (False, True):
            for _ in range(reps if not events else max(5, reps // 4)):
                marks.clear()
                with Recorder(full=False, events=events) as recorder:
                    t0 = time.perf_counter_ns()
                    index.search(queries, k)
                    t1 = time.perf_counter_ns()
                if not events:
                    rows.append(_stage_row(t0, t1, dict(marks), recorder.ops))
                    continue
                timed_ops = [op for op in recorder.ops if "event_before" in op]
                per_kind = {}
                for op in timed_ops:
                    per_kind[op["kind"]] = per_kind.get(op["kind"], 0.0) + \
                        op["event_before"].elapsed_ms(op["event_after"]) * 1e3
                if timed_ops:
                    per_kind["device_span"] = timed_ops[0]["event_before"].elapsed_ms(timed_ops[-1]["event_after"]) * 1e3
                device.append(per_kind)
    finally:
        cls.search = original
    keys = sorted({key for row in rows for key in row})
    host = {key: statistics.median([row.get(key, 0.0) for row in rows]) for key in keys}
    dev_keys = sorted({key for row in device for key in row})
    return {"host_us_median": host, "device_us_median":
            {key: statistics.median([row.get(key, 0.0) for row in device]) for key in dev_keys},
            "note": "host stages from perf_counter_ns around tinyknn's runtime calls (wrappers add ~0.2 us per "
                    "call); device stages from CUDA events recorded around each async call in a separate pass"}


def _with_sync(ops: list[dict]) -> tuple[list[dict], bool]:
    if any(op["kind"] in ("sync", "event_sync") for op in ops):
        return ops, False
    last = next((op["stream"] for op in reversed(ops) if op.get("stream") is not None), None)
    return [*ops, {"kind": "sync", "stream": last}], True


def whole_search(index, queries, k: int, trace: dict, cpp, reps: int) -> dict:
    """Index.search wall time (graphs on, and off) and a prepared search with out= against C++ issuing the same
    driver calls (one at a time, and replaying tinyknn's graph)."""
    out = {"note": "C++ replays the recorded driver calls (copies, launches, graph launches, events, syncs) "
                   "with the same buffers; it does not copy the queries into pinned memory nor build the "
                   "result arrays. Totals include the GPU time, which is the same on both sides."}
    modes = {"tinyknn_search": True, "tinyknn_search_without_graphs": False}
    for name, enabled in modes.items():
        with graphs(index, enabled) as switch:
            if switch.available or enabled:
                out[name] = _common.summary_us(_common.time_calls(lambda: index.search(queries, k), reps, 5))
    prepared = index.prepare_search(k=k, n_queries=len(queries))     # bound once; results into the caller's arrays
    targets = np.empty((len(queries), k), np.float32), np.empty((len(queries), k), np.int64)
    out["tinyknn_prepared_out"] = _common.summary_us(_common.time_calls(lambda: prepared(queries, out=targets), reps, 5))
    prepared.close()
    probes = native_one_call(index, queries, k, cpp, reps)
    out.update(probes)
    modes = {**modes, "tinyknn_prepared_out": True, **dict.fromkeys(probes, True)}
    for name, key in (("cpp_one_by_one", "one_by_one"), ("cpp_replaying_tinyknn_calls", "default")):
        ops, appended = _with_sync(trace[key])
        array = to_ops(ops)
        cpp.replay(array, 5)
        total, issue = cpp.replay(array, reps)
        out[name] = {"calls": [op["kind"] for op in ops], "total": _common.summary_us(total),
                     "issue_only": _common.summary_us(issue), "sync_appended": appended}
    floor = out["cpp_one_by_one"]["total"]["median_us"]
    for name in modes:
        if "median_us" in out.get(name, {}):
            out[name]["ratio_to_cpp_one_by_one"] = out[name]["median_us"] / floor
            out[name]["minus_cpp_one_by_one_us"] = out[name]["median_us"] - floor
            out[name]["ratio_to_cpp_replaying_graph"] = \
                out[name]["median_us"] / out["cpp_replaying_tinyknn_calls"]["total"]["median_us"]
    return out


def native_one_call(index, queries, k: int, cpp, reps: int) -> dict:
    """Probes, not the library's path: a prepared one-query search handed whole to native code, called from
    Python, each variant's answers checked equal to Index.search's. What a search costs when Python's share is
    one ctypes call:
    - native_one_call_probe (lb_search_one): the query into the pinned stage, the search's graph, its values
      checked while it runs, the wait, the results into the caller's arrays; the three arrays' addresses taken
      per call (numpy's .ctypes: ~1 us each);
    - native_staged_probe (lb_search_staged): the query copied into the stage by np.copyto in Python, the
      caller's arrays' addresses kept from the first call, the rest as above;
    - native_staged_fresh_probe: the same, then fresh result arrays (copies), as Index.search returns."""
    from tinyknn.inputs.validate import MAX_ABS_VALUE

    searcher = index._searcher
    token = searcher.prepare_search(len(queries), k)
    for _ in range(3):                                   # bound to the token, its graph captured
        searcher.search(queries, k, prepared=token)
    batch = token.batch
    if len(queries) != 1 or batch is None or batch.graph is None or not batch.direct:
        skipped = {"skipped": "one query whose batch has a graph and writes its results into the pinned staging"}
        return {"native_one_call_probe": skipped}
    record = LbSearch(int(batch.graph.handle), int(searcher._stream.handle), batch.stage.ctypes.data,
                      batch.distances.ctypes.data, batch.ids.ctypes.data, batch.status.ctypes.data, index.dim, k,
                      MAX_ABS_VALUE)
    distances, ids = np.empty((1, k), np.float32), np.empty((1, k), np.int64)
    search_one, staged, pointer = cpp.cdll.lb_search_one, cpp.cdll.lb_search_staged, ctypes.byref(record)
    distances_at, ids_at = distances.ctypes.data, ids.ctypes.data
    stage, found_d, found_i = batch.stage, batch.distances, batch.ids
    unproven, fresh = [], []

    def checked(code: int) -> None:
        if code == -2:                      # the search could not prove its answer: the library's slow path
            unproven.append(1)
        elif code:
            raise RuntimeError(f"the native search returned {code}")

    def call():
        checked(search_one(pointer, queries.ctypes.data, distances.ctypes.data, ids.ctypes.data))

    def call_staged():
        np.copyto(stage, queries)
        checked(staged(pointer, distances_at, ids_at))

    def call_staged_fresh():
        np.copyto(stage, queries)
        checked(staged(pointer, distances_at, ids_at))
        fresh[:] = found_d.copy(), found_i.copy()

    expected = index.search(queries, k)
    out = {}
    for name, fn in (("native_one_call_probe", call), ("native_staged_probe", call_staged),
                     ("native_staged_fresh_probe", call_staged_fresh)):
        unproven.clear()
        distances.fill(0)
        ids.fill(0)
        summary = _common.summary_us(_common.time_calls(fn, reps, 5))
        fn()
        got = fresh if fn is call_staged_fresh else (distances, ids)
        summary["unproven_calls"] = len(unproven)
        summary["answers_equal_index_search"] = bool(np.array_equal(got[0].view(np.int32), expected[0].view(np.int32))
                                                     and np.array_equal(got[1], expected[1]))
        out[name] = summary
    return out
