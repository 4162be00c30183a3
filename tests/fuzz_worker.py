"""Runs one fuzz case (a JSON program on stdin) against tinyknn and a float64 model; exit 0 when every
check held. test_fuzz.py starts one process per case, so a crash is a failed case, not a dead suite.

Program: {"dim", "metric", "dtype", "device", "ops": [...]}; ops:
  {"op": "add", "n", "ids": "auto" | "fresh" | "taken", "seed", "values": optional palette indices}
  {"op": "search", "nq", "k", "seed", "values": optional palette indices}
  {"op": "reset"} | {"op": "round_trip", "how": "file" | "pickle"}
  {"op": "remove" | "get", "count", "seed"} (only where the Index has them)
  {"op": "bad", "kind"}: a call that must raise ValueError/TypeError and change nothing (BAD_KINDS);
  {"op": "segfault"}: crash on purpose (the harness's own test).
"""

from __future__ import annotations

import json
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinyknn  # noqa: E402
from reference import assert_exact, check_search  # noqa: E402
from tinyknn import _validate  # noqa: E402

# Devices whose searches are compared bit for bit with the float64 oracle (reference.assert_exact);
# any other gets the tie-tolerant check_search until it meets the contract.
EXACT_DEVICES = ("cpu", "cuda")
# Adversarial values: zero, float64 and float32 denormals, tiny, ordinary and huge magnitudes.
PALETTE = (0.0, 5e-324, 1e-310, 1e-40, -1e-40, 1e-30, -1e-30, 1e-25, -1e-25, 3e-23, -3e-23, 1.0, -1.0, 0.5, 2.0, -3.0,
           1e15, -1e15, 7e14)


class Model:
    """What the index must hold: ids in insertion order, their vectors as stored (float64)."""

    def __init__(self, dim: int, dtype: str):
        self.dim, self.dtype = dim, dtype
        self.ids: list[int] = []
        self.rows: list[np.ndarray] = []
        self.next_auto = 0

    def arrays(self):
        rows = np.array(self.rows, dtype=np.float64).reshape(len(self.rows), self.dim)
        return rows, np.array(self.ids, dtype=np.int64)

    def accepts(self, values: np.ndarray) -> bool:
        """The definition of valid values (README): finite, |x| <= 2**50, and float16-representable."""
        limit = _validate.FLOAT16_MAX if self.dtype == "float16" else _validate.MAX_ABS_VALUE
        return bool(np.all(np.isfinite(values)) and (values.size == 0 or np.max(np.abs(values)) <= limit))

    def add(self, values: np.ndarray, ids: list[int]) -> None:
        self.rows.extend(values.astype(self.dtype).astype(np.float64))
        self.ids.extend(ids)
        self.next_auto = max([self.next_auto] + [i + 1 for i in ids])


def values_of(op: dict, shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(op.get("seed", 0))
    if op.get("values") is None:
        return rng.standard_normal(shape)
    picks = np.array(op["values"] * (shape[0] * shape[1] // max(1, len(op["values"])) + 1))[: shape[0] * shape[1]]
    values = np.array(PALETTE)[picks].reshape(shape) if picks.size else np.zeros(shape)
    if op.get("duplicate") and shape[0] > 1:
        values[1::2] = values[0::2][: len(values[1::2])]      # every other row repeats its neighbour: ties
    return values


def check_results(index, model: Model, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    distances, ids = index.search(queries, k)
    rows, user_ids = model.arrays()
    compare = assert_exact if index.device in EXACT_DEVICES else check_search
    compare(distances, ids, rows, queries, k, index.metric, index.dtype, id_map=user_ids)
    return distances, ids


def do_add(index, model: Model, op: dict) -> None:
    n = op["n"]
    values = values_of(op, (n, model.dim))
    if op["ids"] == "auto":
        ids, wanted = None, list(range(model.next_auto, model.next_auto + n))
    elif op["ids"] == "taken" and model.ids:
        wanted = [model.ids[op["seed"] % len(model.ids)]] + list(range(10**15, 10**15 + n - 1))
        ids = wanted
    else:
        wanted = (np.random.default_rng(op["seed"]).choice(10**6, n, replace=False) + 10**12 + 10**6 * len(model.ids))
        ids = wanted = wanted.tolist()
    collides = len(set(wanted)) < n or bool(set(wanted) & set(model.ids))
    if collides or not model.accepts(values):
        expect_refusal(index, model, lambda: index.add(values, ids=ids))
        return
    index.add(values, ids=ids)
    model.add(values, wanted)
    assert index.ntotal == len(model.ids), (index.ntotal, len(model.ids))


def probe(index, model: Model):
    """A search over everything the index holds, to compare before and after a refused call."""
    if index.ntotal == 0:
        return None
    queries = np.random.default_rng(7).standard_normal((3, model.dim))
    return index.search(queries, min(5, index.ntotal))


def expect_refusal(index, model: Model, call) -> None:
    before = probe(index, model)
    try:
        call()
    except (ValueError, TypeError):
        pass
    else:
        raise AssertionError("the call was accepted, but the model says it must be refused")
    assert index.ntotal == len(model.ids), (index.ntotal, len(model.ids))
    after = probe(index, model)
    if before is not None:
        same = np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
        assert same, "a refused call changed the search results"


BAD_KINDS = (
    "nan", "inf", "huge", "float16_range", "wrong_dim", "one_d", "three_d", "ints", "bools", "complex", "strings",
    "ragged", "masked", "ids_length", "ids_repeat", "ids_negative", "ids_float", "ids_int64", "ids_taken",
    "query_nan", "query_dim", "k_zero", "k_negative", "k_float", "k_bool",
)


def bad_call(index, model: Model, kind: str):
    """A call that must be refused (ValueError or TypeError); `kind` is one of BAD_KINDS."""
    dim, good = model.dim, np.ones((2, model.dim))
    nan = good.copy()
    nan[1, dim - 1] = np.nan
    calls = {
        "nan": lambda: index.add(nan), "inf": lambda: index.add(good * np.inf),
        "huge": lambda: index.add(good * 2.0**51), "float16_range": lambda: index.add(good * 7e4)
        if model.dtype == "float16" else index.add(good * 3e15),
        "wrong_dim": lambda: index.add(np.ones((2, dim + 1))), "one_d": lambda: index.add(np.ones(dim)),
        "three_d": lambda: index.add(np.ones((1, 2, dim))), "ints": lambda: index.add(np.ones((2, dim), np.int32)),
        "bools": lambda: index.add(np.ones((2, dim), bool)), "complex": lambda: index.add(good.astype(complex)),
        "strings": lambda: index.add([["a"] * dim]), "ragged": lambda: index.add([[1.0] * dim, [1.0]]),
        "masked": lambda: index.add(np.ma.masked_array(good, mask=good > 0)),
        "ids_length": lambda: index.add(good, ids=[1]), "ids_repeat": lambda: index.add(good, ids=[5, 5]),
        "ids_negative": lambda: index.add(good, ids=[-1, 3]), "ids_float": lambda: index.add(good, ids=[1.0, 2.0]),
        "ids_int64": lambda: index.add(good, ids=[2**63, 1]),
        "ids_taken": lambda: index.add(good, ids=[model.ids[0], 10**17]) if model.ids else index.add(nan),
        "query_nan": lambda: index.search(nan, 1), "query_dim": lambda: index.search(np.ones((1, dim + 2)), 1),
        "k_zero": lambda: index.search(good, 0), "k_negative": lambda: index.search(good, -3),
        "k_float": lambda: index.search(good, 1.5), "k_bool": lambda: index.search(good, True),
    }
    assert tuple(calls) == BAD_KINDS
    return calls[kind]


def round_trip(index, how: str):
    if how == "pickle":
        clone = pickle.loads(pickle.dumps(index))
    else:
        with tempfile.TemporaryDirectory() as directory:
            index.save(Path(directory) / "index.tknn")
            clone = tinyknn.Index.load(Path(directory) / "index.tknn", device=index.device)
    assert (clone.dim, clone.metric, clone.dtype, clone.ntotal) == (index.dim, index.metric, index.dtype, index.ntotal)
    index.close()
    return clone


def run(program: dict) -> None:
    dim, dtype = program["dim"], program["dtype"]
    index = tinyknn.Index(dim, metric=program["metric"], dtype=dtype, device=program.get("device", "cpu"))
    model = Model(dim, dtype)
    for op in program["ops"]:
        kind = op["op"]
        if kind == "add":
            do_add(index, model, op)
        elif kind == "search":
            queries = values_of(op, (op["nq"], dim))
            if not np.all(np.isfinite(queries)) or np.max(np.abs(queries), initial=0) > _validate.MAX_ABS_VALUE:
                expect_refusal(index, model, lambda: index.search(queries, op["k"]))
            else:
                check_results(index, model, queries, op["k"])
        elif kind == "reset":
            index.reset()
            model = Model(dim, dtype)
        elif kind == "round_trip":
            index = round_trip(index, op["how"])
            model.next_auto = max(model.ids, default=-1) + 1      # a file keeps the ids, not their history
        elif kind == "remove" and hasattr(index, "remove") and model.ids:
            chosen = sorted(set(np.random.default_rng(op["seed"]).choice(model.ids, op["count"]).tolist()))
            assert index.remove(np.array(chosen + [10**18])) == len(chosen)
            keep = [i for i, user_id in enumerate(model.ids) if user_id not in set(chosen)]
            model.ids = [model.ids[i] for i in keep]
            model.rows = [model.rows[i] for i in keep]
        elif kind == "get" and hasattr(index, "get") and model.ids:
            chosen = np.random.default_rng(op["seed"]).choice(model.ids, op["count"])
            rows = dict(zip(model.ids, model.rows))
            got = np.asarray(index.get(chosen), dtype=np.float64)
            assert np.array_equal(got, np.array([rows[int(i)] for i in chosen])), "get returned other vectors"
        elif kind == "bad":
            expect_refusal(index, model, bad_call(index, model, op["kind"]))
        elif kind == "segfault":                                  # test_fuzz's check of its own harness
            import ctypes

            ctypes.string_at(0)
        elif kind not in ("remove", "get"):
            raise ValueError(f"unknown fuzz operation {kind!r}")
        assert index.ntotal == len(model.ids), (kind, index.ntotal, len(model.ids))
    if model.ids:
        check_results(index, model, np.random.default_rng(1).standard_normal((4, dim)), min(len(model.ids) + 2, 50))


if __name__ == "__main__":
    run(json.loads(sys.stdin.read()))
