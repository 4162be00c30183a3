"""The tensor-core screen (kernels/screen.cuh): its templates compile without local memory (nvrtc), its
error bound covers a truncating model of the tensor cores' accumulation (CPU), and on a GPU every row
within the threshold survives (gpu)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

PROBES = Path(__file__).resolve().parent.parent / "bench" / "probes"
sys.path.insert(0, str(PROBES))   # bench/ is not a package

import tc_screen as ts  # noqa: E402

from tinyknn.jit.render_screen import THRESHOLD_KEEP  # noqa: E402  (KT, what a large sample's tiles keep)

DEVICE = "cuda"                    # where the gpu tests put their tensors
SHARED_LIMIT = 227 * 1024          # dynamic shared memory one block may have on sm_80 / sm_90

TILES = [ts.ScreenConfig(), ts.ScreenConfig(stages=3), ts.ScreenConfig(bkb=128, stages=3),
         ts.ScreenConfig(bq=64, warps_q=1), ts.ScreenConfig(bn=256, stages=3), ts.ScreenConfig(ldmatrix=False)]


def _configs():
    configs = []
    for elem in ts.ELEMENTS:
        for metric in ("l2", "ip"):
            configs.append(ts.ScreenConfig(elem=elem, metric=metric))
            configs.append(ts.ScreenConfig(elem=elem, metric=metric, threshold=True, k=10))
            configs.append(ts.ScreenConfig(elem=elem, metric=metric, threshold=True, k=THRESHOLD_KEEP))
    configs += [replace(c, elem="bfloat16") for c in TILES] + TILES
    configs += [ts.ScreenConfig(threshold=True, k=100), ts.ScreenConfig(threshold=True, k=1)]
    return list(dict.fromkeys(configs))


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_screen_kernels_need_no_local_memory(arch, spill_free_nvrtc):
    configs = _configs()
    cubins = ts.compile_screens(configs, arch)
    for config in configs:
        report = cubins[config.name].reports[config.name]
        if config.ldmatrix:    # the shipped kernels; the probe's no-ldmatrix variant only has to compile (NVRTC
            # 13.0 spills 8 bytes of its bfloat16 build for sm_80, 13.5 none)
            assert (report.stack_bytes, report.spill_bytes) == (0, 0), f"{config.label()}: {report}"
        assert report.registers <= 255
        assert config.smem <= SHARED_LIMIT, config.label()


@pytest.mark.nvrtc
def test_screen_kernel_refuses_too_little_shared_memory():
    from tinyknn.errors import CompileError
    from tinyknn.jit import cuda_source
    from tinyknn.jit.compiler import compile_cubin

    config = ts.ScreenConfig()
    name = config.name.replace(f", {config.smem}>", f", {config.smem - 16}>")
    rendered = cuda_source.RenderedSource(cuda_source.kernel_source("screen.cuh"), (name,), cuda_source.OPTIONS)
    with pytest.raises(CompileError, match="SMEM is smaller"):
        compile_cubin(rendered, "sm_90")


# ---- the bound against a model of the tensor cores ----------------------------------------------
def _truncate(v, magnitude):
    """v rounded toward zero to a multiple of 2^(e - 23), where 2^e <= magnitude < 2^(e + 1)."""
    with np.errstate(divide="ignore"):
        quantum = np.where(magnitude > 0, np.exp2(np.floor(np.log2(magnitude)) - 23), 1.0)
    return np.trunc(v / quantum) * quantum


def _truncating_dot(a: np.ndarray, b: np.ndarray, block: int) -> np.ndarray:
    """Row-wise dot products as the tensor cores are modelled: `block` exact products and the fp32
    accumulator aligned to the largest magnitude and truncated to 24 bits there, summed, and the sum
    truncated to 24 significant bits (round toward zero throughout)."""
    c = np.zeros(a.shape[0])
    for s in range(0, a.shape[1], block):
        terms = np.concatenate([c[:, None], a[:, s:s + block] * b[:, s:s + block]], axis=1)   # exact in float64
        aligned = _truncate(terms, np.abs(terms).max(axis=1, keepdims=True)).sum(axis=1)
        c = _truncate(aligned, np.abs(aligned))
    return c


def _to_16bit(v: np.ndarray, elem: str) -> np.ndarray:
    """float32 values rounded to float16 or bfloat16 (nearest even), widened to float64."""
    v = np.asarray(v, np.float32)
    if elem == "float16":
        return v.astype(np.float16).astype(np.float64)
    bits = v.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32).astype(np.float64)


def _rows(rng, n, dim, kind):
    if kind == "normal":
        return rng.standard_normal((n, dim))
    if kind == "scales":                       # components over six decades, signs mixed: alignment losses
        return rng.standard_normal((n, dim)) * 10.0 ** rng.uniform(-3, 3, (n, dim))
    big_first = rng.standard_normal((n, dim)) * 1e-3    # a large accumulator, then tiny products
    big_first[:, :16] *= 1e5
    return big_first


@pytest.mark.parametrize("kind", ["normal", "scales", "big_first"])
@pytest.mark.parametrize("dim", [40, 128, 768])
@pytest.mark.parametrize("elem", ["float16", "bfloat16"])
def test_error_terms_cover_truncating_accumulation(rng, kind, dim, elem):
    pairs = 400
    q = _rows(rng, pairs, dim, kind).astype(np.float32)
    x = _to_16bit(_rows(rng, pairs, dim, kind), elem)        # 16-bit storage, widened
    qs = _to_16bit(q, elem)
    row_bytes = ts.row_bytes_for(dim, elem)
    exact = (q.astype(np.float64) * x).sum(axis=1)
    r_x = ts.round_up_f32(np.linalg.norm(x, axis=1) * (1 + 2.0 ** -40))
    for metric in ("ip", "l2"):
        e, f = ts.error_terms(q, qs, elem, metric, row_bytes, 64)
        dot_bound = (e.astype(np.float64) * r_x + f) / (2.0 if metric == "l2" else 1.0)
        for block in (4, 8, 16):
            err = np.abs(_truncating_dot(qs, x, block) - exact)
            assert (err <= dot_bound).all(), f"{metric} block {block}: worst ratio {np.max(err / dot_bound)}"
    # and the bound is not absurdly loose: within 50x of the query-rounding term alone
    e, _ = ts.error_terms(q, qs, elem, "ip", row_bytes, 64)
    assert np.all(e <= 50 * np.linalg.norm(q - qs, axis=1) + 1e-30)


def test_error_terms_refuse_what_the_screen_cannot_take():
    q = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="same 2-d shape"):
        ts.error_terms(q, q[:1], "float16", "l2", 16, 64)
    with pytest.raises(ValueError, match="outside the float16 range"):
        ts.error_terms(q * 1e5, (q * 1e5).astype(np.float16), "float16", "l2", 16, 64)
    with pytest.raises(ValueError, match="8-bit"):
        ts.error_terms(q, q + 0.5, "uint8", "l2", 16, 64)
    e, f = ts.error_terms(q, q, "uint8", "l2", 16, 64)
    assert not e.any() and not f.any()
    with pytest.raises(ValueError, match="elem must be"):
        ts.ScreenConfig(elem="float32")


# ---- on the GPU -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_screens():
    torch = pytest.importorskip("torch")
    major, minor = torch.cuda.get_device_capability(0)
    configs = [ts.ScreenConfig(elem=e, metric=m, threshold=t, k=k) for e in ("float16", "bfloat16", "uint8")
               for m in ("l2", "ip") for t, k in ((False, 1), (True, 4))]
    cubin = ts.compile_screens(configs, f"sm_{major}{minor}")
    return {c: ts.ScreenLauncher(cubin, c) for c in configs}


def _sync(torch):
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _gpu_data(torch, elem, n, dim, n_q, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if elem == "uint8":
        x = torch.randint(0, 256, (n, dim), generator=g, device=DEVICE, dtype=torch.uint8)
        q = x[torch.randint(0, n, (n_q,), generator=g, device=DEVICE)].clone()
        q[::2] = torch.randint(0, 256, (len(q[::2]), dim), generator=g, device=DEVICE, dtype=torch.uint8)
        return x, q
    half = torch.float16 if elem == "float16" else torch.bfloat16
    x = torch.randn((n // 4, dim), generator=g, device=DEVICE).repeat(4, 1).to(half)   # four copies of each row
    q = torch.randn((n_q, dim), generator=g, device=DEVICE)
    q[::3] = x[:len(q[::3])].float()                                                  # queries on rows: ties
    return x, q


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["l2", "ip"])
@pytest.mark.parametrize("elem", ["float16", "bfloat16", "uint8"])
def test_screen_keeps_every_row_within_the_threshold(gpu_screens, elem, metric):
    import torch

    n, dim, n_q, k, capacity = 4000, 72, 45, 7, 4000
    x, q = _gpu_data(torch, elem, n, dim, n_q, 12)
    qs = q if elem == "uint8" else q.to(x.dtype)
    row_bytes = ts.row_bytes_for(dim, elem)
    xp, qp = ts.padded(x, row_bytes), ts.padded(qs, row_bytes)
    sq_lo, sq_hi, r_x = ts.row_terms(x, x)
    x64, q64 = x.double(), q.double()
    key = (x64 * x64).sum(1)[None, :] - 2 * q64 @ x64.T if metric == "l2" else -(q64 @ x64.T)
    kth = torch.kthvalue(key, k, dim=1).values
    t = torch.from_numpy(ts.round_up_f32((kth + 1e-9 * (1 + kth.abs())).cpu().numpy())).to(DEVICE)
    e, f = (torch.from_numpy(v).to(DEVICE) for v in ts.error_terms(q.float().cpu().numpy(), qs.double().cpu().numpy(),
                                                                   elem, metric, row_bytes, 64))
    norms = sq_lo if metric == "l2" else r_x
    launch = gpu_screens[ts.ScreenConfig(elem=elem, metric=metric)]
    counts = torch.zeros(n_q, dtype=torch.int32, device=DEVICE)
    survivors = torch.full((n_q, capacity), -1, dtype=torch.int32, device=DEVICE)
    launch(xp, n, 1, norms, r_x, qp, row_bytes, t, e, f, counts, survivors, capacity, None, tiles_per_block=1)
    _sync(torch)
    assert int(counts.max()) <= capacity
    one_tile = counts.clone()
    counts.zero_()   # several row tiles per block (the persistent loop, a partial last group): the same survivors
    launch(xp, n, 1, norms, r_x, qp, row_bytes, t, e, f, counts, survivors, capacity, None, tiles_per_block=3)
    _sync(torch)
    assert torch.equal(counts, one_tile)
    for i in range(n_q):
        got = set(survivors[i, :int(counts[i])].tolist())
        assert len(got) == int(counts[i])                                 # each row at most once
        want = set(torch.nonzero(key[i] <= kth[i]).flatten().tolist())
        assert want <= got, f"query {i}: rows {sorted(want - got)[:5]} within the threshold did not survive"
    # an infinite threshold keeps every row exactly once
    counts.zero_()
    launch(xp, n, 1, norms, r_x, qp, row_bytes, torch.full_like(t, float("inf")), e, f, counts, survivors,
           capacity, None)
    _sync(torch)
    assert (counts == n).all()
    assert (torch.sort(survivors[:, :n], dim=1).values == torch.arange(n, device=DEVICE, dtype=torch.int32)).all()

    # threshold mode: per row tile (tile t: rows t, t + tiles, ...), the 4 smallest upper bounds are >= the 4
    # smallest exact keys
    config = ts.ScreenConfig(elem=elem, metric=metric, threshold=True, k=4)
    tiles = -(-n // config.bn)
    upper = torch.empty((n_q, tiles, 4), dtype=torch.float32, device=DEVICE)
    gpu_screens[config](xp, n, 1, sq_hi if metric == "l2" else r_x, r_x, qp, row_bytes, None, e, f, None, None, 0,
                        upper, tiles_per_block=4)
    _sync(torch)
    padded_key = torch.full((n_q, tiles * config.bn), float("inf"), dtype=torch.float64, device=DEVICE)
    padded_key[:, :n] = key
    by_tile = padded_key.view(n_q, config.bn, tiles).transpose(1, 2)     # [query, tile, position]
    smallest = torch.sort(by_tile, dim=2).values[:, :, :4]
    assert (upper.double() >= smallest - 1e-9 * (1 + smallest.abs())).all()
    assert torch.equal(torch.sort(upper, dim=2).values, upper)              # written ascending
    # and within twice the bound of them (the computed key errs by at most the bound each way)
    slack = (2 * (e.double() * float(r_x.max()) + f.double()))[:, None, None] + 1e-6 * (1 + smallest.abs())
    finite = torch.isfinite(smallest)
    assert ((upper.double() - smallest <= slack) | ~finite).all()


def test_the_threshold_sample_keeps_large_k_survivors_within_capacity():
    """k x step (the survivors the sample's threshold lets through, before the bound's band) stays within
    half the capacity; every 16th row from 320,000 rows a neighbour, every 8th below."""
    pytest.importorskip("cuda.bindings")
    from tinyknn.gpu import screen
    from tinyknn.jit import render_screen

    for n in (20_000, 2_000_000, 10_000_000):
        for k in (1, 10, 32, 100, 128):
            default = 16 if n >= screen.SAMPLE_DENSE_BELOW * k else 8
            step = screen.sample_step(n, k)
            assert 1 <= step <= default and (step & (step - 1)) == 0
            assert k * step * screen.SURVIVOR_HEADROOM <= render_screen.SURVIVOR_CAPACITY
            assert step == default or k * 2 * step * screen.SURVIVOR_HEADROOM > render_screen.SURVIVOR_CAPACITY
    assert [screen.sample_step(n, k) for n, k in ((10_000_000, 10), (10_000_000, 100), (1_000_000, 10),
                                                 (100_000, 10), (2_000_000, 128))] == [16, 8, 8, 8, 8]


# ---- fewer bounds per tile (render_screen.threshold_keep), on a NumPy model of the threshold step ------
def test_threshold_keep_rule():
    from tinyknn.jit import render_screen as rs

    for k in range(1, 129):
        assert rs.threshold_keep(k) == min(k, rs.THRESHOLD_KEEP)
        for tiles in (1, k - 1, k, 10 * k):
            kept = rs.threshold_keep(k, tiles)
            if tiles >= k:
                assert kept == min(k, rs.THRESHOLD_KEEP)
            else:                                            # a power of two, 2k bounds kept or all k a tile
                assert kept == k or (kept & (kept - 1) == 0 and tiles * kept >= 2 * k and tiles * kept < 4 * k)
            assert tiles < 1 or tiles * kept >= k            # always k values or more to take the k-th of
    spec = rs.screen_spec("l2", "uint8", 100, "sm_90", threshold=True, sample_tiles=9766)
    assert spec.k == spec.param("kl") == rs.THRESHOLD_KEEP
    assert rs.screen_spec("l2", "uint8", 100, "sm_90", threshold=True, sample_tiles=20).param("kl") == 16
    assert rs.screen_spec("l2", "uint8", 100, "sm_90", threshold=True, sample_tiles=98).param("kl") == 4
    assert rs.threshold_keep(100, 1) == rs.threshold_keep(100, 0) == 100
    assert rs.screen_spec("l2", "uint8", 100, "sm_90", threshold=False).param("kl") == 1
    with pytest.raises(ValueError, match="k must be at least 1; got 0"):
        rs.threshold_keep(0)


def _tile_threshold(upper: np.ndarray, k: int, kept: int, bn: int = 128) -> np.ndarray:
    """Steps 2's T as the kernels compute it: row tile t of the sample holds sample rows t, t + tiles, ...
    (+inf past them), keeps its `kept` smallest upper bounds; T is the k-th smallest of all kept."""
    nq, n_sample = upper.shape
    tiles = -(-n_sample // bn)
    padded = np.full((nq, tiles * bn), np.inf)
    padded[:, :n_sample] = upper
    by_tile = padded.reshape(nq, bn, tiles).transpose(0, 2, 1)          # [query, tile, position]
    smallest = np.sort(by_tile, axis=2)[:, :, :kept].reshape(nq, -1)
    return np.partition(smallest, k - 1, axis=1)[:, k - 1]


def _model_rows(rng, kind: str, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim))
    if kind in ("clustered", "stored_by_cluster"):
        labels = rng.integers(0, 20, n)
        if kind == "stored_by_cluster":                 # a cluster's rows next to each other
            labels = np.sort(labels)
        x = rng.standard_normal((20, dim))[labels] * 3 + x * 0.3
    if kind == "duplicates":                            # each row stored twice, the copies side by side
        x = np.repeat(x[: n // 2], 2, axis=0)
    return x


@pytest.mark.parametrize("n", [140_000, 100_000])
@pytest.mark.parametrize("kind", ["normal", "clustered", "stored_by_cluster", "duplicates"])
def test_fewer_bounds_per_tile_still_bound_the_kth_key(rng, kind, n):
    """Step 8 samples 140,000 rows in 137 tiles (two bounds a tile at k = 100 and 128) and 100,000 rows in 98
    (fewer tiles than k: four a tile, 2k bounds or more in all)."""
    from tinyknn.jit import render_screen as rs

    dim, n_q, step = 24, 40, 8
    x = _model_rows(rng, kind, n, dim)
    q = x[rng.choice(n, n_q)] + 0.1 * rng.standard_normal((n_q, dim))
    key = (x * x).sum(1)[None, :] - 2 * q @ x.T
    sample = key[:, ::step]
    upper = sample + np.abs(sample) * rng.uniform(0, 1e-3, sample.shape)   # any upper bounds of the keys
    tiles = -(-sample.shape[1] // 128)
    for k in (10, 100, 128):
        kth = np.partition(key, k - 1, axis=1)[:, k - 1]
        full = _tile_threshold(upper, k, k)
        kept = rs.threshold_keep(k, tiles)
        assert kept == (min(k, rs.THRESHOLD_KEEP) if tiles >= k else 4)
        best = np.argsort(upper, axis=1, kind="stable")[:, :k] % tiles          # tiles of the sample's k best
        most_in_a_tile = np.array([np.bincount(b).max() for b in best])
        for fewer in sorted(f for f in {1, 2, kept} if tiles * f >= k):     # k bounds or more in all
            t = _tile_threshold(upper, k, fewer)
            assert (t >= kth).all(), f"k {k}, {fewer} per tile: T below the true k-th key"   # the bound
            assert (t >= full).all()                                      # a subset's k-th smallest
            tight = most_in_a_tile <= fewer
            assert np.array_equal(t[tight], full[tight])
        # the survivors (rows within T, before the bound's band) stay near those of keeping k per tile (here
        # the fewest tiles that keep two, 137 for k = 128, and four a tile of 98), clustered or not
        t = _tile_threshold(upper, k, kept)
        survivors, before = (key <= t[:, None]).sum(1), (key <= full[:, None]).sum(1)
        print(f"{kind} k {k}: survivors {before.mean():.0f} -> {survivors.mean():.0f}, most {survivors.max()}")
        assert survivors.mean() <= 1.15 * before.mean(), (kind, k, survivors.mean(), before.mean())
        assert (survivors <= 1.5 * before + 8 * step).all(), (kind, k)    # a missed one costs about step rows
