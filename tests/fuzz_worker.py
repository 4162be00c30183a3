"""Runs one fuzz case (a JSON program on stdin) against tinyknn and a float64 model; exit 0 when every
check held. test_fuzz.py starts one process per case, so a crash is a failed case, not a dead suite.

Program: {"dim", "metric", "dtype", "device" ("cpu", "cuda" or "model": tests/model_searcher.py), "ops": [...]}; ops:
  {"op": "add", "n", "ids": "auto" | "fresh" | "taken", "seed", "values": optional palette indices,
   "labels": optional bool (one of 3 labels per row)}
  {"op": "search", "nq", "k", "seed", "values": optional palette indices, "filter": optional bool (a random
   half of the ids, plus ids not in the index), "labels": optional bool (a label per query)}
  {"op": "range", "nq", "seed", "filter", "labels"}: range_search at the radius of the oracle's 3rd nearest
  {"op": "reset"} | {"op": "round_trip", "how": "file" | "pickle" | "stream" | "copy"} ("stream": saved into one
  io.BytesIO between two other indexes, loaded from its position, which must then be the next index's)
  {"op": "remove" | "get", "count", "seed"}
  filter, labels, range, remove and get run where the device's searcher has the protocol's new methods
  (remove_rows, get_rows, range_search); elsewhere they are skipped.
  {"op": "bad", "kind"}: a call that must raise ValueError/TypeError and change nothing (BAD_KINDS);
  {"op": "segfault"}: crash on purpose (the harness's own test).
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinyknn  # noqa: E402
from reference import LARGER_IS_BETTER, assert_exact, check_search, contract_distances, searched, stored  # noqa: E402
from tinyknn.inputs import validate as _validate  # noqa: E402

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
        self.labels: list[int | None] = []
        self.next_auto = 0

    def arrays(self, allowed=None, label=None):
        """(rows float64, ids) of everything held, or of the allowed ids / one label's rows only."""
        keep = [i for i, user_id in enumerate(self.ids)
                if (allowed is None or user_id in allowed) and (label is None or self.labels[i] == label)]
        rows = np.array([self.rows[i] for i in keep], dtype=np.float64).reshape(len(keep), self.dim)
        return rows, np.array([self.ids[i] for i in keep], dtype=np.int64)

    def remove(self, chosen) -> None:
        keep = [i for i, user_id in enumerate(self.ids) if user_id not in set(chosen)]
        self.ids, self.rows, self.labels = ([column[i] for i in keep] for column in (self.ids, self.rows, self.labels))

    def accepts(self, values: np.ndarray) -> bool:
        """The definition of valid values (docs/index-operations.md, "Input conversion"): finite, |x| <= 2**50, and float16-representable."""
        limit = _validate.FLOAT16_MAX if self.dtype == "float16" else _validate.MAX_ABS_VALUE
        return bool(np.all(np.isfinite(values)) and (values.size == 0 or np.max(np.abs(values)) <= limit))

    def add(self, values: np.ndarray, ids: list[int], labels=None) -> None:
        self.rows.extend(values.astype(self.dtype).astype(np.float64))
        self.ids.extend(ids)
        self.labels.extend([None] * len(ids) if labels is None else [int(label) for label in labels])
        self.next_auto = max([self.next_auto] + [i + 1 for i in ids])


def has_operations(index) -> bool:
    """Whether the device's searcher implements remove_rows, get_rows and range_search."""
    return all(hasattr(index._searcher, name) for name in ("remove_rows", "get_rows", "range_search"))


def selection(index, model: Model, op: dict, nq: int) -> dict:
    """The filter / labels keyword arguments an op asks for (none where the searcher lacks them)."""
    rng, kwargs = np.random.default_rng(op.get("seed", 0) + 1), {}
    if not has_operations(index):
        return kwargs
    if op.get("filter"):
        held = np.array(model.ids, dtype=np.int64)
        kwargs["filter"] = np.concatenate([rng.permutation(held)[:len(held) // 2], [10**17, 5 * 10**17]]).astype(np.int64)
    if op.get("labels"):
        kwargs["labels"] = rng.integers(0, 3, nq)
    return kwargs


def values_of(op: dict, shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(op.get("seed", 0))
    if op.get("values") is None:
        return rng.standard_normal(shape)
    picks = np.array(op["values"] * (shape[0] * shape[1] // max(1, len(op["values"])) + 1))[: shape[0] * shape[1]]
    values = np.array(PALETTE)[picks].reshape(shape) if picks.size else np.zeros(shape)
    if op.get("duplicate") and shape[0] > 1:
        values[1::2] = values[0::2][: len(values[1::2])]      # every other row repeats its neighbour: ties
    return values


def check_results(index, model: Model, queries: np.ndarray, k: int, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    distances, ids = index.search(queries, k, **kwargs)
    compare = assert_exact if index.device in EXACT_DEVICES else check_search
    if not kwargs:
        rows, user_ids = model.arrays()
        compare(distances, ids, rows, queries, k, index.metric, index.dtype, id_map=user_ids)
        return distances, ids
    allowed = None if kwargs.get("filter") is None else set(kwargs["filter"].tolist())
    for i in range(len(queries)):                      # each query against its own allowed set
        label = None if kwargs.get("labels") is None else int(kwargs["labels"][i])
        rows, user_ids = model.arrays(allowed, label)
        compare(distances[i:i + 1], ids[i:i + 1], rows, queries[i:i + 1], k, index.metric, index.dtype, id_map=user_ids)
    return distances, ids


def check_ranges(index, model: Model, queries: np.ndarray, **kwargs) -> None:
    """range_search at the radius of each call's 3rd nearest row against the oracle's (lims, distances, ids)."""
    larger = LARGER_IS_BETTER[index.metric]
    allowed = None if kwargs.get("filter") is None else set(kwargs["filter"].tolist())
    answers, radius = [], None
    for i in range(len(queries)):
        rows, user_ids = model.arrays(allowed, None if kwargs.get("labels") is None else int(kwargs["labels"][i]))
        d = contract_distances(stored(rows, index.dtype), searched(queries[i:i + 1]), index.metric)[0] \
            if len(user_ids) else np.zeros(0)
        answers.append((d, user_ids))
        if radius is None and len(d) >= 3:
            radius = float(np.sort(-d if larger else d)[2]) * (-1 if larger else 1)
    radius = (0.0 if index.metric == "l2" else 0.5) if radius is None else radius
    lims, distances, ids = index.range_search(queries, radius, **kwargs)
    start = 0
    for i, (d, user_ids) in enumerate(answers):
        hits = np.flatnonzero(d > radius if larger else d < radius)
        order = hits[np.lexsort((user_ids[hits], -d[hits] if larger else d[hits]))]
        assert lims[i] == start and lims[i + 1] == start + len(order), (i, lims, len(order))
        assert np.array_equal(ids[start:lims[i + 1]], user_ids[order]), (i, ids[start:lims[i + 1]], user_ids[order])
        assert np.array_equal(distances[start:lims[i + 1]].view(np.uint32), d[order].astype(np.float32).view(np.uint32))
        start += len(order)


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
    labels = np.random.default_rng(op["seed"] + 2).integers(0, 3, n) if op.get("labels") else None
    if collides or not model.accepts(values):
        expect_refusal(index, model, lambda: index.add(values, ids=ids, labels=labels))
        return
    index.add(values, ids=ids, labels=labels)
    model.add(values, wanted, labels)
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
    "labels_length", "labels_float", "labels_bool", "filter_float", "filter_2d", "query_labels_length",
    "radius_nan", "radius_negative", "remove_float", "get_missing",
    # odd Python and NumPy integers, and float64 values beyond float32
    "contains_2_64", "contains_below_int64", "contains_uint64_max", "get_true", "get_2_64", "remove_2_64",
    "ids_uint64_max", "labels_2_64", "filter_2_64", "k_2_64", "beyond_float32", "query_beyond_float32",
    # sources load must refuse without touching anything: not a path or file, a FIFO (it used to block)
    "load_int", "load_none", "load_bytes", "load_fifo",
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
        "strings": lambda: index.add([["a"] * dim]), "ragged": lambda: index.add([[1.0] * dim, [1.0] * (dim + 1)]),
        "masked": lambda: index.add(np.ma.masked_array(good, mask=good > 0)),
        "ids_length": lambda: index.add(good, ids=[1]), "ids_repeat": lambda: index.add(good, ids=[5, 5]),
        "ids_negative": lambda: index.add(good, ids=[-1, 3]), "ids_float": lambda: index.add(good, ids=[1.0, 2.0]),
        "ids_int64": lambda: index.add(good, ids=[2**63, 1]),
        "ids_taken": lambda: index.add(good, ids=[model.ids[0], 10**17]) if model.ids else index.add(nan),
        "query_nan": lambda: index.search(nan, 1), "query_dim": lambda: index.search(np.ones((1, dim + 2)), 1),
        "k_zero": lambda: index.search(good, 0), "k_negative": lambda: index.search(good, -3),
        "k_float": lambda: index.search(good, 1.5), "k_bool": lambda: index.search(good, True),
        "labels_length": lambda: index.add(good, labels=[1]), "labels_float": lambda: index.add(good, labels=[1.0, 2.0]),
        "labels_bool": lambda: index.add(good, labels=np.array([True, False])),
        "filter_float": lambda: index.search(good, 1, filter=np.array([1.0])),
        "filter_2d": lambda: index.search(good, 1, filter=np.array([[1]])),
        "query_labels_length": lambda: index.search(good, 1, labels=[1, 2, 3]),
        "radius_nan": lambda: index.range_search(good, float("nan")),
        "radius_negative": lambda: index.range_search(good, -1.0) if model.metric == "l2" else index.range_search(good, np.inf),
        "remove_float": lambda: index.remove(np.array([1.5])),
        "get_missing": lambda: index.get([10**18]),
        "contains_2_64": lambda: 2**64 in index, "contains_below_int64": lambda: -2**63 - 1 in index,
        "contains_uint64_max": lambda: np.uint64(2**64 - 1) in index, "get_true": lambda: index.get(True),
        "get_2_64": lambda: index.get(2**64), "remove_2_64": lambda: index.remove([2**64]),
        "ids_uint64_max": lambda: index.add(good, ids=np.array([2**64 - 1, 1], np.uint64)),
        "labels_2_64": lambda: index.add(good, labels=[2**64, 1]),
        "filter_2_64": lambda: index.search(good, 1, filter=[2**64]), "k_2_64": lambda: index.search(good, 2**64),
        "beyond_float32": lambda: index.add(good * 1e39), "query_beyond_float32": lambda: index.search(good * -1e39, 1),
        "load_int": lambda: tinyknn.Index.load(3), "load_none": lambda: tinyknn.Index.load(None),
        "load_bytes": lambda: tinyknn.Index.load(b"PK\x03\x04"), "load_fifo": lambda: load_a_fifo(),
    }
    assert tuple(calls) == BAD_KINDS
    return calls[kind]


def load_a_fifo():
    """Index.load of a FIFO: refused from os.stat (opening it would block until a writer comes)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "pipe")
        os.mkfifo(path)
        tinyknn.Index.load(path)


def round_trip(index, how: str):
    if how == "pickle":
        clone = pickle.loads(pickle.dumps(index))
    elif how == "copy":
        clone = copy.deepcopy(index)
    elif how == "stream":                   # between two other indexes in one stream
        before, after = tinyknn.Index(index.dim + 1), tinyknn.Index(2, metric="ip")
        before.add(np.ones((3, index.dim + 1)))
        after.add(np.eye(2))
        stream = io.BytesIO()
        before.save(stream)
        start = stream.tell()
        index.save(stream)
        end = stream.tell()
        after.save(stream)
        stream.seek(start)
        clone = tinyknn.Index.load(stream, device=index.device)
        assert stream.tell() == end, (start, stream.tell(), end)
        assert tinyknn.Index.load(stream).ntotal == 2 and stream.tell() == len(stream.getvalue())
    else:
        with tempfile.TemporaryDirectory() as directory:
            index.save(Path(directory) / "index.tknn")
            clone = tinyknn.Index.load(Path(directory) / "index.tknn", device=index.device)
    assert (clone.dim, clone.metric, clone.dtype, clone.ntotal) == (index.dim, index.metric, index.dtype, index.ntotal)
    index.close()
    return clone


def run(program: dict) -> None:
    dim, dtype = program["dim"], program["dtype"]
    device = program.get("device", "cpu")
    if device == "model":                    # the Index's own logic over tests/model_searcher.py
        import tinyknn.index.index as index_module
        from model_searcher import ModelSearcher

        index_module._make_searcher = lambda _device, *args: ModelSearcher(*args)
        device = "cpu"
    index = tinyknn.Index(dim, metric=program["metric"], dtype=dtype, device=device)
    model = Model(dim, dtype)
    model.metric = index.metric
    for op in program["ops"]:
        kind = op["op"]
        if kind == "add":
            do_add(index, model, op)
        elif kind == "search":
            queries = values_of(op, (op["nq"], dim))
            if not np.all(np.isfinite(queries)) or np.max(np.abs(queries), initial=0) > _validate.MAX_ABS_VALUE:
                expect_refusal(index, model, lambda: index.search(queries, op["k"]))
            else:
                check_results(index, model, queries, op["k"], **selection(index, model, op, op["nq"]))
        elif kind == "range" and has_operations(index):
            check_ranges(index, model, values_of(op, (op["nq"], dim)), **selection(index, model, op, op["nq"]))
        elif kind == "reset":
            index.reset()
            model = Model(dim, dtype)
            model.metric = index.metric
        elif kind == "round_trip":
            index = round_trip(index, op["how"])
            model.next_auto = max(model.ids, default=-1) + 1      # a file keeps the ids, not their history
        elif kind == "remove" and has_operations(index) and model.ids:
            chosen = sorted(set(np.random.default_rng(op["seed"]).choice(model.ids, op["count"]).tolist()))
            assert index.remove(np.array(chosen + [10**18])) == len(chosen)
            assert not index.contains(chosen).any()
            model.remove(chosen)
        elif kind == "get" and has_operations(index) and model.ids:
            chosen = np.random.default_rng(op["seed"]).choice(model.ids, op["count"])
            rows = dict(zip(model.ids, model.rows))
            got = np.asarray(index.get(chosen), dtype=np.float64)
            assert np.array_equal(got, np.array([rows[int(i)] for i in chosen])), "get returned other vectors"
        elif kind == "bad":
            expect_refusal(index, model, bad_call(index, model, op["kind"]))
        elif kind == "segfault":                                  # test_fuzz's check of its own harness
            import ctypes

            ctypes.string_at(0)
        elif kind not in ("remove", "get", "range"):
            raise ValueError(f"unknown fuzz operation {kind!r}")
        assert index.ntotal == len(model.ids), (kind, index.ntotal, len(model.ids))
    if model.ids:
        check_results(index, model, np.random.default_rng(1).standard_normal((4, dim)), min(len(model.ids) + 2, 50))


if __name__ == "__main__":
    run(json.loads(sys.stdin.read()))
