"""tinyknn.recall's rules on hand-made cases with ties, repeats and padding, and big-ann's grouping rule against
a plain loop written from its description."""

from __future__ import annotations

import numpy as np
import pytest

import tinyknn.io as tio
from tinyknn.groundtruth import groundtruth, recall


def test_ids_rule_counts_repeats_once():
    gt = np.array([[0, 1, 2, 3]])
    assert recall([[0, 0, 2, 9]], gt, k=4, rule="ids") == 0.5
    assert recall([[3, 2, 1, 0]], gt, k=4, rule="ids") == 1.0
    assert recall([[0, -1, -1, -1]], gt, k=4, rule="ids") == 0.25
    assert recall([[0, 7], [1, 0]], np.array([[0, 1], [0, 1]]), k=2, rule="ids", per_query=True).tolist() == [0.5, 1.0]


def test_bigann_rule_groups_by_distance_not_position():
    gt = (np.array([[10, 11, 12, 13, 14]]), np.array([[1.0, 1.0, 2.0, 3.0, 4.0]], np.float32))
    # k = 2: the first two groups are {1, 1} and {2}: id 12 (distance 2 > the k-th distance 1) counts too
    assert recall([[12, 10]], gt, k=2, rule="bigann") == 1.0
    assert recall([[13, 10]], gt, k=2, rule="bigann") == 0.5
    assert recall([[12, 10]], gt, k=2, rule="ids") == 0.5
    # chaining: each distance within 1e-6 of its group's first joins it
    close = (np.array([[1, 2, 3, 4]]), np.array([[1.0, 1.0 + 6e-7, 1.0 + 1.2e-6, 5.0]], np.float32))
    assert recall([[3, 9]], close, k=2, rule="bigann") == 0.5          # groups {1, 2}, {3}: id 3 counts
    assert recall([[4, 9]], close, k=2, rule="bigann") == 0.0


def _bigann_by_hand(gt_ids, gt_d, result, k):
    """big-ann's rule from its description: merge each distance within 1e-6 of the current group's first
    distance into that group, keep the first k groups, count the result's distinct ids among their ids."""
    total = 0
    for ids, dists, got in zip(gt_ids, gt_d, result):
        groups, anchor = [], None
        for i, d in zip(ids, dists):
            if anchor is not None and abs(float(d) - anchor) < 1e-6:
                groups[-1].append(int(i))
            else:
                groups.append([int(i)])
                anchor = float(d)
        allowed = {i for group in groups[:k] for i in group}
        total += len(allowed & set(int(g) for g in got[:k]))
    return total / (k * len(gt_ids))


def test_bigann_rule_matches_a_plain_loop(rng):
    nq, width, k = 60, 30, 10
    gt_d = np.sort(rng.integers(0, 12, (nq, width)) * np.float32(1e-6 * 0.7), axis=1).astype(np.float32) + 1.0
    gt_ids = np.argsort(rng.random((nq, 500)), axis=1)[:, :width]
    result = np.where(rng.random((nq, k)) < 0.5, gt_ids[:, rng.integers(0, width, k)], rng.integers(0, 500, (nq, k)))
    assert recall(result, (gt_ids, gt_d), k=k, rule="bigann") == pytest.approx(_bigann_by_hand(gt_ids, gt_d, result, k))


def test_ann_benchmarks_rules():
    truth = tio.KnnGroundTruth(np.array([[0, 1, 2]]), np.array([[1.0, 2.0, 3.0]], np.float32), "hdf5", "euclidean")
    ids = [[4, 5, 6]]
    assert recall(ids, truth, k=3, rule="ann-benchmarks", result_distances=[[1.0, 3.0005, 3.002]]) == \
        pytest.approx(2 / 3)                                            # <= 3 + 1e-3
    assert recall(ids, truth, k=3, rule="ann-benchmarks-epsilon", result_distances=[[1.0, 3.0005, 3.02]]) == 1.0
    assert recall(ids, truth, k=3, rule="ann-benchmarks-epsilon", result_distances=[[1.0, 3.0005, 3.04]]) == \
        pytest.approx(2 / 3)                                            # <= 3 x 1.01
    # ann-benchmarks counts every returned distance, repeats included
    assert recall([[0, 0, 0]], truth, k=3, rule="ann-benchmarks", result_distances=[[1.0, 1.0, 1.0]]) == 1.0
    # a similarity (inner product, as big-ann files hold it): mirrored threshold
    sims = tio.KnnGroundTruth(np.array([[0, 1, 2]]), np.array([[5.0, 4.0, 3.0]], np.float32), "bigann")
    assert recall(ids, sims, k=3, rule="ann-benchmarks", metric="ip", result_distances=[[5.0, 2.9995, 2.9]]) == \
        pytest.approx(2 / 3)


def test_exact_rule_counts_ties_not_repeats():
    base = np.array([[0.0], [1.0], [1.0], [2.0], [3.0]], np.float32)        # l2 from 0: 0, 1, 1, 4, 9
    query = np.array([[0.0]], np.float32)
    gt = groundtruth(base, query, 2, "l2")[::-1]
    assert gt[0].tolist() == [[0, 1]]
    check = dict(k=2, rule="exact", base=base, queries=query, metric="l2")
    assert recall([[0, 2]], gt, **check) == 1.0            # id 2 ties the k-th neighbour (id 1)
    assert recall([[0, 2]], gt, k=2, rule="ids") == 0.5
    assert recall([[2, 2]], gt, **check) == 0.5            # a repeat counts once
    assert recall([[0, -1]], gt, **check) == 0.5
    assert recall([[0, 3]], gt, **check) == 0.5
    sims = np.array([[1.0], [2.0], [2.0], [-1.0]], np.float32)                 # ip with 1: 1, 2, 2, -1
    gt_ip = groundtruth(sims, np.ones((1, 1), np.float32), 1, "ip")[::-1]
    assert gt_ip[0].tolist() == [[1]]
    assert recall([[2]], gt_ip, k=1, rule="exact", base=sims, queries=np.ones((1, 1), np.float32), metric="ip") == 1.0
    assert recall([[0]], gt_ip, k=1, rule="exact", base=sims, queries=np.ones((1, 1), np.float32), metric="ip") == 0.0


def test_padding_counts_against_the_real_neighbours_only():
    base = np.array([[0.0], [1.0]], np.float32)
    query = np.zeros((1, 1), np.float32)
    gt = groundtruth(base, query, 4, "l2")[::-1]
    assert gt[0].tolist() == [[0, 1, -1, -1]]
    assert recall([[1, 0, -1, -1]], gt, k=4, rule="exact", base=base, queries=query, metric="l2") == 1.0
    assert recall([[1, -1, -1, -1]], gt, k=4, rule="ids") == 0.5


def test_rules_from_files_with_their_conventions(tmp_path, rng):
    pytest.importorskip("h5py", reason="h5py (the hdf5 extra) is not installed")
    x = rng.standard_normal((400, 8)).astype(np.float32)
    q = rng.standard_normal((20, 8)).astype(np.float32)
    _, ids = groundtruth(x, q, 10, "cosine", output=tmp_path / "gt.hdf5", format="hdf5")
    path = str(tmp_path / "gt.hdf5")                        # distance 'angular': metric and convention from the file
    for rule in ("exact", "ids", "bigann", "ann-benchmarks", "ann-benchmarks-epsilon"):
        assert recall(ids, path, k=10, rule=rule, base=x, queries=q) == 1.0, rule
    shifted = ids.copy()
    shifted[:, 0] = ids[:, 9]                               # the 10th neighbour twice, the 1st missing
    assert recall(shifted, path, k=10, rule="exact", base=x, queries=q) == pytest.approx(0.9)
    assert recall(shifted, path, k=10, rule="ann-benchmarks", base=x, queries=q) == 1.0    # repeats count there


def test_groundtruths_own_return_value_is_accepted(rng):
    x = rng.standard_normal((300, 6)).astype(np.float32)
    q = rng.standard_normal((9, 6)).astype(np.float32)
    d, i = groundtruth(x, q, 5, "l2")
    for gt in ((d, i), (i, d)):
        assert recall(i, gt, k=5, rule="bigann") == 1.0
    with pytest.raises(TypeError, match="ids must be integers"):
        recall(i, (d, d), k=5, rule="ids")


def test_recall_refuses_bad_arguments():
    gt = np.array([[0, 1, 2]])
    with pytest.raises(ValueError, match="rule must be one of"):
        recall([[0, 1, 2]], gt, k=3, rule="fuzzy")
    with pytest.raises(ValueError, match="recall@4 needs k columns"):
        recall([[0, 1, 2]], gt, k=4, rule="ids")
    with pytest.raises(ValueError, match="2 result rows but the ground truth holds 1"):
        recall([[0, 1, 2], [0, 1, 2]], gt, k=3, rule="ids")
    with pytest.raises(ValueError, match="needs the ground truth's distances"):
        recall([[0, 1, 2]], gt, k=3, rule="bigann")
    with pytest.raises(ValueError, match="needs the metric"):
        recall([[0, 1, 2]], gt, k=3, rule="exact")
