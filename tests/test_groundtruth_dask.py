"""tinyknn.groundtruth on a Dask cluster (`client=`, the command's --scheduler): the shards are DaskIndex
objects on a local cluster's two worker processes, and the ground truth equals the float64 oracle
(tests/reference.py) bit for bit on random, duplicated, tied and far-from-origin data, in one DaskIndex
and merged over several."""

from __future__ import annotations

import json

import numpy as np
import pytest
from reference import exact_search

import tinyknn.io as tio
from tinyknn.groundtruth import groundtruth
from tinyknn.groundtruth.command import main as command_main
from test_groundtruth import _assert_bits, _data

distributed = pytest.importorskip("distributed")
from test_dask import client  # noqa: E402,F401 - the local cluster of two worker processes, after the skip


@pytest.mark.parametrize("kind", ["random", "duplicated", "tied", "far"])
def test_dask_groundtruth_equals_the_oracle(client, rng, kind):
    x, q = _data(rng, kind, n=900, d=10, nq=30)
    want = exact_search(x, q, 15, "l2")
    _assert_bits(groundtruth(x, q, 15, "l2", client=client, batch_rows=200), want)
    if kind == "duplicated":            # merged over DaskIndexes of 300 rows, in query batches of 11
        _assert_bits(groundtruth(x, q, 15, "l2", client=client, shard_rows=300, query_batch=11), want)


def test_dask_command_writes_the_record(client, tmp_path, rng, capsys):
    address = client.scheduler.address
    x, q = _data(rng, "duplicated", n=600, d=8, nq=20)
    base, queries, out = str(tmp_path / "b.fbin"), str(tmp_path / "q.fbin"), str(tmp_path / "gt.bin")
    tio.write_vectors(base, x)
    tio.write_vectors(queries, q)
    assert command_main([base, queries, "-k", "9", "--metric", "ip", "-o", out, "--scheduler",
                         address, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["dask"] == {"scheduler": address, "workers": 2}
    truth = tio.read_knn_groundtruth(out)
    _assert_bits((truth.distances, truth.ids), exact_search(x, q, 9, "ip"))
    scheduler_file = tmp_path / "scheduler.json"         # what `dask scheduler --scheduler-file` writes
    scheduler_file.write_text(json.dumps({"address": address}))
    again = str(tmp_path / "again.bin")
    assert command_main([base, queries, "-k", "9", "--metric", "ip", "-o", again, "--scheduler",
                         str(scheduler_file)]) == 0
    assert np.array_equal(tio.read_knn_groundtruth(again).ids, truth.ids)


def test_dask_refuses_the_host_tier(client, rng):
    x, q = _data(rng, "random", n=50, d=4, nq=3)
    with pytest.raises(ValueError, match="storage='host' is not available on a Dask cluster"):
        groundtruth(x, q, 3, client=client, device="cuda", storage="host")
