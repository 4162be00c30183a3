"""tinyknn.faiss against the float64 oracle and, where it is installed, against FAISS itself.

Answers are checked bit for bit against the float64 oracle (reference.assert_exact, the exactness contract).
The operations of the index-operations issue run on two backends (adapter_index_model.backend_fixture):
the real tinyknn.Index (skipped, naming the method, while it lacks one) and a model of those
operations, so the adapter's own mapping (selectors to allow-lists, FLT_MAX, renumbering, uint64 lims)
is tested either way. FAISS's own tests run through the import shim in test_faiss_upstream.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from adapter_index_model import backend_fixture
from reference import assert_exact, contract_distances

import tinyknn.faiss as tkfaiss

backend = backend_fixture("tinyknn.faiss.index")
METRICS = {tkfaiss.METRIC_L2: "l2", tkfaiss.METRIC_INNER_PRODUCT: "ip"}


@pytest.fixture(scope="module")
def real_faiss():
    return pytest.importorskip("faiss", reason="FAISS (faiss-cpu, the bench extra) is not installed")


def data(rng, n=300, nq=7, d=12):
    return rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((nq, d)).astype(np.float32)


def as_inf(distances, ids, metric_type):
    """FAISS's padding (+-FLT_MAX) back to the oracle's (+-inf)."""
    out = distances.copy()
    out[ids < 0] = np.inf if metric_type == tkfaiss.METRIC_L2 else -np.inf
    return out


@pytest.mark.parametrize("metric_type", list(METRICS))
@pytest.mark.parametrize("k", [1, 10, 350])
def test_flat_search_is_exact_and_agrees_with_faiss(rng, real_faiss, metric_type, k):
    xb, xq = data(rng)
    index = tkfaiss.IndexFlat(xb.shape[1], metric_type)
    index.add(xb[:200])
    index.add(xb[200:].astype(np.float64))   # FAISS's Python layer converts other float types
    D, I = index.search(xq, k)
    assert_exact(as_inf(D, I, metric_type), I, xb, xq, k, METRICS[metric_type])
    theirs = real_faiss.IndexFlat(xb.shape[1], metric_type)
    theirs.add(xb)
    D_ref, I_ref = theirs.search(xq, k)
    assert (I != I_ref).sum() <= I.size * 0.001
    np.testing.assert_allclose(D, D_ref, rtol=1e-5, atol=1e-4)
    assert D.dtype == np.float32 and I.dtype == np.int64


@pytest.mark.parametrize("metric_type, pad", [(tkfaiss.METRIC_L2, tkfaiss.FLT_MAX),
                                              (tkfaiss.METRIC_INNER_PRODUCT, -tkfaiss.FLT_MAX)])
def test_missing_results_are_minus_one_and_flt_max_as_in_faiss(rng, real_faiss, metric_type, pad):
    xb, xq = data(rng, n=3)
    index, theirs = tkfaiss.IndexFlat(12, metric_type), real_faiss.IndexFlat(12, metric_type)
    D, I = index.search(xq, 4)   # empty
    D_ref, I_ref = theirs.search(xq, 4)
    assert np.all(I == -1) and np.all(D == np.float32(pad)) and np.array_equal(D, D_ref) and np.array_equal(I, I_ref)
    index.add(xb)
    theirs.add(xb)
    D, I = index.search(xq, 5)
    D_ref, I_ref = theirs.search(xq, 5)
    assert np.array_equal(I[:, 3:], I_ref[:, 3:]) and np.array_equal(D[:, 3:], D_ref[:, 3:])
    assert np.all(np.isfinite(D)) and float(np.abs(pad)) == float(np.finfo(np.float32).max)


def test_attributes_and_output_arrays(rng):
    xb, xq = data(rng)
    index = tkfaiss.IndexFlatIP(12)
    assert (index.d, index.ntotal, index.metric_type, index.is_trained) == (12, 0, tkfaiss.METRIC_INNER_PRODUCT, True)
    assert (tkfaiss.METRIC_INNER_PRODUCT, tkfaiss.METRIC_L2) == (0, 1)   # FAISS's numbering
    index.train(xb)   # a no-op for flat indexes, as in FAISS
    index.add(xb)
    assert index.ntotal == 300 and index.device == "cpu"
    D_out, I_out = np.zeros((7, 3), np.float32), np.zeros((7, 3), np.int64)
    D, I = index.search(xq, 3, D=D_out, I=I_out)
    assert D is D_out and I is I_out
    assert np.array_equal((D, I), index.search(xq, 3))
    index.reset()
    assert index.ntotal == 0


def test_selectors_agree_with_faiss_is_member(real_faiss):
    ids = np.arange(-3, 90, dtype=np.int64)
    subset = np.array([0, 5, 17, 64, 80], dtype=np.int64)
    bitmap = np.packbits(np.isin(np.arange(70), subset), bitorder="little")
    pairs = [
        (tkfaiss.IDSelectorBatch(subset), real_faiss.IDSelectorBatch(subset)),
        (tkfaiss.IDSelectorArray(subset), real_faiss.IDSelectorArray(subset)),
        (tkfaiss.IDSelectorRange(10, 40), real_faiss.IDSelectorRange(10, 40)),
        (tkfaiss.IDSelectorBitmap(bitmap), real_faiss.IDSelectorBitmap(bitmap)),
        (tkfaiss.IDSelectorNot(tkfaiss.IDSelectorRange(10, 40)),
         real_faiss.IDSelectorNot(real_faiss.IDSelectorRange(10, 40))),
    ]
    for ours, theirs in pairs:
        assert [ours.is_member(int(i)) for i in ids] == [theirs.is_member(int(i)) for i in ids], type(ours).__name__
    batch, window = tkfaiss.IDSelectorBatch(subset), tkfaiss.IDSelectorRange(10, 70)
    assert np.array_equal(tkfaiss.IDSelectorAnd(batch, window).members(ids), np.isin(ids, [17, 64]))
    assert np.array_equal(tkfaiss.IDSelectorOr(batch, window).members(ids),
                          np.isin(ids, subset) | ((ids >= 10) & (ids < 70)))
    assert np.array_equal(tkfaiss.IDSelectorXOr(batch, window).members(ids),
                          np.isin(ids, subset) ^ ((ids >= 10) & (ids < 70)))
    assert np.array_equal(tkfaiss.IDSelectorBatch(2, subset).ids, subset[:2])   # FAISS's (n, pointer) form


@pytest.mark.parametrize("metric_type", list(METRICS))
def test_search_with_a_selector_sees_only_selected_ids(rng, backend, metric_type):
    backend("search(filter=)")
    xb, xq = data(rng)
    index = tkfaiss.IndexFlat(12, metric_type)
    index.add(xb)
    subset = np.sort(rng.choice(300, 40, replace=False)).astype(np.int64)
    for sel in (tkfaiss.IDSelectorBatch(subset), tkfaiss.IDSelectorNot(tkfaiss.IDSelectorBatch(
            np.setdiff1d(np.arange(300), subset)))):
        D, I = index.search(xq, 45, params=tkfaiss.SearchParameters(sel=sel))
        assert_exact(as_inf(D, I, metric_type), I, xb[subset], xq, 45, METRICS[metric_type], id_map=subset)
        assert np.all(I[:, 40:] == -1)


@pytest.mark.parametrize("metric_type", list(METRICS))
def test_range_search_follows_faiss(rng, real_faiss, backend, metric_type):
    backend("range_search", "search(filter=)")
    xb, xq = data(rng)
    index, theirs = tkfaiss.IndexFlat(12, metric_type), real_faiss.IndexFlat(12, metric_type)
    index.add(xb)
    theirs.add(xb)
    D_knn, _ = index.search(xq, 20)
    radius = float(np.median(D_knn[:, -1]))
    for params, faiss_params in ((None, None), (tkfaiss.SearchParameters(sel=tkfaiss.IDSelectorRange(50, 250)),
                                                real_faiss.SearchParameters(sel=real_faiss.IDSelectorRange(50, 250)))):
        lims, D, I = index.range_search(xq, radius, params=params)
        lims_ref, D_ref, I_ref = theirs.range_search(xq, radius, params=faiss_params)
        assert lims.dtype == np.uint64 and D.dtype == np.float32 and I.dtype == np.int64
        exact = contract_distances(xb.astype(np.float64), xq.astype(np.float64), METRICS[metric_type])
        for q in range(len(xq)):
            hits, dists = I[lims[q]:lims[q + 1]], D[lims[q]:lims[q + 1]]
            allowed = np.arange(300) if params is None else np.arange(50, 250)
            inside = exact[q, allowed] < radius if metric_type == tkfaiss.METRIC_L2 else exact[q, allowed] > radius
            assert np.array_equal(np.sort(hits), allowed[inside])
            assert np.array_equal(dists, exact[q, hits].astype(np.float32))
            assert np.all(np.diff(hits) > 0)   # storage order, as FAISS's flat index returns them
            ref = I_ref[lims_ref[q]:lims_ref[q + 1]]
            assert len(np.setxor1d(hits, ref)) <= 1   # FAISS's BLAS distances may put one border row either side
            if len(ref) == len(hits):
                assert np.array_equal(hits, ref)


def test_flat_remove_ids_renumbers_as_faiss_does(rng, real_faiss, backend):
    backend("remove", "get")
    xb, xq = data(rng, n=40)
    index, theirs = tkfaiss.IndexFlatL2(12), real_faiss.IndexFlatL2(12)
    index.add(xb)
    theirs.add(xb)
    assert index.remove_ids(np.array([0, 7, 8, 39, 1000])) == theirs.remove_ids(np.array([0, 7, 8, 39, 1000])) == 4
    assert index.remove_ids(tkfaiss.IDSelectorRange(30, 33)) == 3
    theirs.remove_ids(real_faiss.IDSelectorRange(30, 33))
    assert index.ntotal == theirs.ntotal == 33
    assert np.array_equal(index.reconstruct_n(0, index.ntotal), theirs.reconstruct_n(0, theirs.ntotal))
    assert np.array_equal(index.reconstruct(5), theirs.reconstruct(5))
    assert np.array_equal(index.reconstruct_batch([3, 1]), theirs.reconstruct_n(0, 33)[[3, 1]])
    _, I = index.search(xq, 5)
    _, I_ref = theirs.search(xq, 5)
    assert np.array_equal(I, I_ref)
    with pytest.raises(RuntimeError, match="key 33 not found"):
        index.reconstruct(33)
    index.add(xb[:5])   # new rows take positions 33..37, as in FAISS
    theirs.add(xb[:5])
    assert np.array_equal(index.search(xq, 8)[1], theirs.search(xq, 8)[1])
    assert np.array_equal(index.reconstruct(35), xb[2])


@pytest.mark.parametrize("description", ["IDMap,Flat", "IDMap2,Flat", "Flat,IDMap2"])
def test_id_maps(rng, backend, description):
    backend("remove", "get", "contains")
    xb, xq = data(rng, n=50)
    ids = rng.choice(10**12, 50, replace=False).astype(np.int64)
    index = tkfaiss.index_factory(12, description)
    assert isinstance(index, tkfaiss.IndexIDMap2 if "IDMap2" in description else tkfaiss.IndexIDMap)
    index.add_with_ids(xb[:20], ids[:20])
    index.add_with_ids(xb[20:], ids[20:])
    assert index.ntotal == 50 and np.array_equal(index.id_map, ids)
    D, I = index.search(xq, 8)
    assert_exact(D, I, xb, xq, 8, "l2", id_map=ids)
    assert index.remove_ids(np.array([ids[3], ids[40], -5])) == 2
    assert index.ntotal == 49 - 1 and ids[3] not in index.id_map
    D, I = index.search(xq, 8)
    keep = np.setdiff1d(np.arange(50), [3, 40])
    assert_exact(D, I, xb[keep], xq, 8, "l2", id_map=ids[keep])
    if isinstance(index, tkfaiss.IndexIDMap2):
        assert np.array_equal(index.reconstruct(int(ids[4])), xb[4])
        with pytest.raises(RuntimeError, match=f"key {ids[3]} not found"):
            index.reconstruct(int(ids[3]))
    else:
        with pytest.raises(RuntimeError, match="reconstruct not implemented"):
            index.reconstruct(int(ids[4]))
    index.add_with_ids(xb[3:4], ids[3:4])   # a removed id may come back
    assert index.ntotal == 49


def test_id_map_with_selector(rng, backend):
    backend("search(filter=)")
    xb, xq = data(rng, n=60)
    ids = (np.arange(60, dtype=np.int64) * 7 + 100)
    index = tkfaiss.IndexIDMap(tkfaiss.IndexFlatIP(12))
    index.add_with_ids(xb, ids)
    sel = tkfaiss.IDSelectorRange(200, 400)
    D, I = index.search(xq, 5, params=tkfaiss.SearchParameters(sel=sel))
    keep = (ids >= 200) & (ids < 400)
    assert_exact(as_inf(D, I, tkfaiss.METRIC_INNER_PRODUCT), I, xb[keep], xq, 5, "ip", id_map=ids[keep])


def test_bad_calls_are_refused_clearly_and_change_nothing(rng):
    xb, xq = data(rng, n=10)
    index = tkfaiss.IndexFlatL2(12)
    index.add(xb)
    with pytest.raises(ValueError, match=r"shape \(n, 12\); got shape \(10, 5\)"):
        index.add(xb[:, :5])
    with pytest.raises(ValueError, match="shape"):
        index.search(xq[:, :3], 1)
    with pytest.raises(RuntimeError, match="add_with_ids not implemented"):
        index.add_with_ids(xb, np.arange(10))
    with pytest.raises(ValueError, match="METRIC_L2"):
        tkfaiss.IndexFlat(12, 2)   # FAISS's METRIC_L1
    with pytest.raises(ValueError, match="'Flat', 'IDMap,Flat'"):
        tkfaiss.index_factory(12, "IVF100,Flat")
    with pytest.raises(ValueError, match="empty"):
        tkfaiss.IndexIDMap(index)
    with pytest.raises(TypeError, match="only sel="):
        tkfaiss.SearchParameters(nprobe=4)
    with pytest.raises(TypeError, match="SearchParameters"):
        index.search(xq, 1, params={"sel": None})
    idmap = tkfaiss.IndexIDMap(tkfaiss.IndexFlatL2(12))
    with pytest.raises(RuntimeError, match="use add_with_ids"):
        idmap.add(xb)
    with pytest.raises(ValueError, match="one id per vector"):
        idmap.add_with_ids(xb, np.arange(9))
    with pytest.raises(ValueError):
        idmap.add_with_ids(xb, np.zeros(10, dtype=np.int64))   # duplicated ids
    assert index.ntotal == 10 and idmap.ntotal == 0 and len(idmap.id_map) == 0
    with pytest.raises(TypeError, match="uint8"):
        tkfaiss.IDSelectorBitmap(np.zeros(3, dtype=np.int32))

    class OnTheGpu:   # what a CuPy or torch CUDA array shows
        shape = (2, 12)
        __cuda_array_interface__ = {"shape": (2, 12), "typestr": "<f4", "data": (0, False), "version": 3}

    with pytest.raises(TypeError, match="host arrays for queries"):
        index.search(OnTheGpu(), 1)


@pytest.mark.parametrize("kind", [tkfaiss.IndexIDMap, tkfaiss.IndexIDMap2])
def test_the_flat_index_inside_an_id_map_answers_in_its_own_positions(rng, kind):
    """As in FAISS: the wrapped flat index holds the vectors and answers in its own sequential ids
    0..ntotal-1, which the map translates. Its search used to answer [[0, 0]] and reconstruct(0) raised
    IndexError, as it shared the storage but not the positions."""
    xb = np.array([[0, 0, 0, 0], [1, 0, 0, 0], [5, 5, 5, 5]], np.float32)
    flat = tkfaiss.IndexFlatL2(4)
    mapped = kind(flat)
    mapped.add_with_ids(xb, np.array([7, 8, 9]))
    q = np.array([[0.1, 0, 0, 0]], np.float32)
    D, I = flat.search(q, 2)
    assert flat.ntotal == 3 and I.tolist() == [[0, 1]]
    D_map, I_map = mapped.search(q, 2)
    assert I_map.tolist() == [[7, 8]] and np.array_equal(D, D_map)
    assert np.array_equal(flat.reconstruct(0), xb[0]) and np.array_equal(flat.reconstruct_n(0, 3), xb)
    lims, _, hits = flat.range_search(q, 2.0)
    assert lims.tolist() == [0, 2] and hits.tolist() == [0, 1]
    selected = flat.search(q, 3, params=tkfaiss.SearchParameters(sel=tkfaiss.IDSelectorRange(1, 3)))[1]
    assert selected.tolist() == [[1, 2, -1]]
    assert mapped.remove_ids(np.array([7])) == 1                     # positions shift down, as in FAISS
    assert flat.ntotal == 2 and flat.search(q, 2)[1].tolist() == [[0, 1]]
    assert np.array_equal(flat.reconstruct(1), xb[2])
    with pytest.raises(RuntimeError, match="key 2 not found"):
        flat.reconstruct(2)
    for change in (lambda: flat.add(xb), lambda: flat.remove_ids(np.array([0])), flat.reset):
        with pytest.raises(RuntimeError, match=f"this IndexFlatL2 is wrapped by an {kind.__name__}, which holds its "
                                               f"vectors: change them through the {kind.__name__}"):
            change()
    assert flat.ntotal == 2 and mapped.id_map.tolist() == [8, 9]
    mapped.reset()
    assert flat.ntotal == 0 and flat.search(q, 1)[1].tolist() == [[-1]]
    mapped.add_with_ids(xb[:2], np.array([40, 30]))
    assert flat.search(q, 2)[1].tolist() == [[0, 1]] and mapped.search(q, 2)[1].tolist() == [[40, 30]]
    copied = tkfaiss.index_gpu_to_cpu(mapped)                        # the copy's flat index too
    assert copied.index.search(q, 2)[1].tolist() == [[0, 1]] and copied.search(q, 2)[1].tolist() == [[40, 30]]


@pytest.mark.parametrize("call, error, text", [
    (lambda index, xb: tkfaiss.knn(xb[:2], xb[0], 3), ValueError,
     r"xb \(the database\) must be a 2-D array of shape \(n, d\); got shape \(12,\)"),
    (lambda index, xb: tkfaiss.knn(xb[:2], 5.0, 3), ValueError, r"got shape \(\)"),
    (lambda index, xb: index.reconstruct(10**30), ValueError, "key must lie in int64's range; got 10{30}"),
    (lambda index, xb: index.reconstruct(2**63), ValueError, "int64's range"),
    (lambda index, xb: index.reconstruct(1.7), TypeError, r"key must be an integer id; got 1.7 \(float\)"),
    (lambda index, xb: index.reconstruct(np.float32(1)), TypeError, "key must be an integer id"),
    (lambda index, xb: index.reconstruct(True), TypeError, "key must be an integer id; got True"),
    (lambda index, xb: index.reconstruct_n(1.5, 2), TypeError, "n0 must be an integer"),
    (lambda index, xb: index.reconstruct_n(0, 2.0), TypeError, "ni must be an integer"),
    (lambda index, xb: index.reconstruct_batch([1.7, 2]), TypeError, "keys must be integers"),
    (lambda index, xb: index.reconstruct_batch(np.array([1.7])), TypeError, "keys must be integers"),
    (lambda index, xb: index.reconstruct_batch([2**64]), ValueError, "int64's range"),
])
def test_bad_keys_and_shapes_are_clear_errors(rng, call, error, text):
    """knn of a 1-D database was IndexError (tuple index out of range), reconstruct(10**30) OverflowError,
    and reconstruct(1.7) silently read key 1."""
    xb, _ = data(rng, n=10)
    index = tkfaiss.IndexFlatL2(12)
    index.add(xb)
    with pytest.raises(error, match=text):
        call(index, xb)
    assert index.ntotal == 10 and np.array_equal(index.reconstruct(np.int64(1)), xb[1])
    assert np.array_equal(index.reconstruct_batch(np.array([[3], [1]])), xb[[3, 1]])


def test_knn_and_normalize_agree_with_faiss(rng, real_faiss):
    xb, xq = data(rng)
    D, I = tkfaiss.knn(xq, xb, 6, tkfaiss.METRIC_INNER_PRODUCT)
    D_ref, I_ref = real_faiss.knn(xq, xb, 6, real_faiss.METRIC_INNER_PRODUCT)
    assert np.array_equal(I, I_ref) and np.allclose(D, D_ref, rtol=1e-5, atol=1e-5)
    x = xb.copy()
    x[3] = 0
    theirs = x.copy()
    tkfaiss.normalize_L2(x)
    real_faiss.normalize_L2(theirs)
    np.testing.assert_allclose(x, theirs, rtol=1e-6, atol=1e-7)
    assert np.all(x[3] == 0)
    with pytest.raises(TypeError, match="float32"):
        tkfaiss.normalize_L2(xb.astype(np.float64))


@pytest.mark.parametrize("make", [lambda: tkfaiss.IndexFlatIP(12), lambda: tkfaiss.IndexIDMap2(tkfaiss.IndexFlatL2(12))])
def test_device_copy_keeps_ids_and_answers(rng, make):
    xb, xq = data(rng, n=30)
    index = make()
    if isinstance(index, tkfaiss.IndexIDMap):
        index.add_with_ids(xb, np.arange(30) * 3 + 1)
    else:
        index.add(xb)
    copy = tkfaiss.index_gpu_to_cpu(index)   # to the CPU: the same path as to the GPU, runnable anywhere
    assert type(copy) is type(index) and copy.ntotal == 30 and copy.metric_type == index.metric_type
    assert np.array_equal(copy.search(xq, 4)[1], index.search(xq, 4)[1])
    with pytest.raises(ValueError, match="current CUDA device"):
        tkfaiss.index_cpu_to_gpu(tkfaiss.StandardGpuResources(), 1, index)


@pytest.mark.gpu
def test_index_cpu_to_gpu_answers_as_the_cpu_index(rng):
    xb, xq = data(rng)
    index = tkfaiss.IndexFlatL2(12)
    index.add(xb)
    gpu = tkfaiss.index_cpu_to_gpu(tkfaiss.StandardGpuResources(), 0, index)
    assert gpu.device == "cuda"
    D, I = gpu.search(xq, 10)
    assert_exact(D, I, xb, xq, 10, "l2")
    on_gpu = tkfaiss.GpuIndexFlatL2(tkfaiss.StandardGpuResources(), 12)
    on_gpu.add(xb)
    assert np.array_equal(on_gpu.search(xq, 5)[1], index.search(xq, 5)[1])


def test_import_tinyknn_does_not_import_the_adapters():
    code = "import sys, tinyknn; print(sorted(m for m in sys.modules if m.startswith(('tinyknn.faiss', 'tinyknn.sklearn', 'faiss', 'sklearn'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_omp_thread_settings_reach_the_cpu_library(monkeypatch):
    """FAISS scripts begin with faiss.omp_set_num_threads(n): it sets the CPU library's threads for every
    index from the next call on, and omp_get_max_threads reads it back."""
    from tinyknn.config import reset_config

    monkeypatch.setenv("TINYKNN_CPU_THREADS", "3")     # restored (or removed) when the test ends
    reset_config()
    assert tkfaiss.omp_get_max_threads() == 3
    try:
        rng = np.random.default_rng(5)
        xb, xq = rng.standard_normal((500, 8)).astype(np.float32), rng.standard_normal((7, 8)).astype(np.float32)
        index = tkfaiss.IndexFlatL2(8)
        index.add(xb)
        for threads in (1, 2):
            tkfaiss.omp_set_num_threads(threads)
            assert tkfaiss.omp_get_max_threads() == threads
            D, I = index.search(xq, 4)
            assert_exact(D, I, xb, xq, 4, "l2")
        with pytest.raises(ValueError, match="at least 1; got 0"):
            tkfaiss.omp_set_num_threads(0)
        with pytest.raises(TypeError, match="integer; got float 1.5"):
            tkfaiss.omp_set_num_threads(1.5)
        assert tkfaiss.omp_get_max_threads() == 2
    finally:
        monkeypatch.undo()
        reset_config()
