"""Python side of the C++ launcher: build it with this machine's toolchain, call it through ctypes.

`build()` compiles launch_bench.cpp (build.sh); `CppLauncher` wraps the library, loaded twice: as a
CDLL (ctypes releases the GIL around each call) and as a PyDLL (it keeps the GIL), so the cost of the
GIL hand-off shows up as the difference. The structures mirror lb_launch and lb_op in the C++.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from cuda.bindings import driver

from tinyknn.gpu.device import raise_error

HERE = Path(__file__).resolve().parent
KINDS = {"launch": 0, "h2d": 1, "d2h": 2, "sync": 3, "memset": 4, "d2d": 5, "graph": 6, "event_record": 7,
         "event_sync": 8, "stream_wait": 9}


class LbLaunch(ctypes.Structure):
    _fields_ = [("function", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p), ("params", ctypes.c_void_p)]


class LbOp(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("launch", LbLaunch), ("device", ctypes.c_uint64),
                ("device_src", ctypes.c_uint64), ("host", ctypes.c_void_p), ("nbytes", ctypes.c_size_t),
                ("byte_value", ctypes.c_uint), ("stream", ctypes.c_void_p), ("graph", ctypes.c_void_p),
                ("event", ctypes.c_void_p)]


class LbSearch(ctypes.Structure):
    _fields_ = [("graph", ctypes.c_void_p), ("stream", ctypes.c_void_p), ("stage", ctypes.c_void_p),
                ("distances", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("status", ctypes.c_void_p),
                ("dim", ctypes.c_int), ("k", ctypes.c_int), ("max_abs", ctypes.c_float)]


def build(out_dir: Path) -> Path:
    """Compile liblaunch_bench.so into out_dir with build.sh; raises with the compiler's output."""
    done = subprocess.run(["bash", str(HERE / "build.sh"), str(out_dir)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench/cpp/build.sh failed:\n{done.stdout}\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def make_launch(function, grid, block, shared_bytes, stream, params_address: int) -> LbLaunch:
    return LbLaunch(int(function), (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes,
                    int(stream), params_address)


def _check(code: int, call: str) -> None:
    if code:
        raise_error(driver.CUresult(code), call)


class CppLauncher:
    """liblaunch_bench.so, loaded twice: CDLL (releases the GIL per call) and PyDLL (keeps it)."""

    def __init__(self, path: Path):
        self.cdll = ctypes.CDLL(str(path))
        self.pydll = ctypes.PyDLL(str(path))
        for lib in (self.cdll, self.pydll):
            lib.lb_noop.argtypes, lib.lb_noop.restype = [], ctypes.c_int
            lib.lb_launch_record.argtypes, lib.lb_launch_record.restype = [ctypes.POINTER(LbLaunch)], ctypes.c_int
            lib.lb_launch_args.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2
            lib.lb_launch_args.restype = ctypes.c_int
        lib = self.cdll
        lib.lb_bursts.argtypes = [ctypes.POINTER(LbLaunch), ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        lib.lb_sustained.argtypes = [ctypes.POINTER(LbLaunch), ctypes.c_longlong, ctypes.POINTER(ctypes.c_double)]
        lib.lb_graph_bursts.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_double)]
        lib.lb_search_one.argtypes = [ctypes.POINTER(LbSearch)] + [ctypes.c_void_p] * 3
        lib.lb_search_one.restype = ctypes.c_int
        lib.lb_search_staged.argtypes = [ctypes.POINTER(LbSearch), ctypes.c_void_p, ctypes.c_void_p]
        lib.lb_search_staged.restype = ctypes.c_int
        lib.lb_replay.argtypes = [ctypes.POINTER(LbOp), ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                                  ctypes.POINTER(ctypes.c_double)]

    def bursts(self, record: LbLaunch, per_burst: int, bursts: int) -> list[float]:
        """Seconds per launch, one value per burst, timed inside C++."""
        out = (ctypes.c_double * bursts)()
        _check(self.cdll.lb_bursts(ctypes.byref(record), per_burst, bursts, out), "lb_bursts")
        return [ns * 1e-9 for ns in out]

    def sustained(self, record: LbLaunch, count: int) -> float:
        seconds = ctypes.c_double()
        _check(self.cdll.lb_sustained(ctypes.byref(record), count, ctypes.byref(seconds)), "lb_sustained")
        return seconds.value

    def graph_bursts(self, graph_exec, stream, per_burst: int, bursts: int) -> list[float]:
        out = (ctypes.c_double * bursts)()
        _check(self.cdll.lb_graph_bursts(int(graph_exec), int(stream), per_burst, bursts, out), "lb_graph_bursts")
        return [ns * 1e-9 for ns in out]

    def replay(self, ops, reps: int) -> tuple[list[float], list[float]]:
        """(total seconds, issuing seconds) per replay of a recorded op array."""
        total, issue = (ctypes.c_double * reps)(), (ctypes.c_double * reps)()
        _check(self.cdll.lb_replay(ops, len(ops), reps, total, issue), "lb_replay")
        return [t * 1e-9 for t in total], [t * 1e-9 for t in issue]
