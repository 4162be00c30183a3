"""The renderer: one self-contained source, name expressions per spec, the plans' parameters (no NVRTC)."""

from __future__ import annotations

import re

import pytest

from tinyknn.jit import cuda_source, render, render_single, search_kernels
from tinyknn.spec import KernelSpec


def test_source_is_self_contained():
    source = cuda_source.kernel_source()
    assert '#include "' not in source
    assert not re.search(r"#\s*pragma\s+once", source)
    for header in ("common.cuh", "metrics.cuh", "distance.cuh", "topk.cuh", "search.cuh"):
        assert source.count(f"// ---- kernels/{header} ----") == 1, header
    # dependency order: what a header defines comes before the code of the header that includes it
    markers = ("float positive_infinity()", "struct L2 {", "struct RowLayout {", "class WarpLists {", "scan_kernel(")
    positions = [source.index(marker) for marker in markers]
    assert positions == sorted(positions)


def test_render_source_names_the_instantiation():
    spec = render.scan_spec("cosine", "float16", 130, 37, "sm_90")
    rendered = cuda_source.render_source(spec)
    assert rendered.source == cuda_source.kernel_source()        # only the name expression differs per spec
    (name,) = rendered.name_expressions
    p = dict(spec.params)
    assert name == (f"tinyknn::scan_kernel<tinyknn::Cosine, tinyknn::half_bits, 130, {render.list_length(37)}, "
                    f"{p['qb']}, {p['lanes']}, "
                    f"{p['warps']}, {p['smem']}>")
    assert "-std=c++17" in rendered.options
    assert not any(o.startswith("-arch") for o in rendered.options)


def test_dim_independent_kernels_share_one_name():
    a = render.tiled_spec("l2", "float32", 64, 10, "sm_90")
    b = render.tiled_spec("l2", "float32", 1536, 10, "sm_90")
    assert a != b and cuda_source.name_expression(a) == cuda_source.name_expression(b)
    assert cuda_source.name_expression(render.norms_spec("float16", 3, "sm_90")) == "tinyknn::ingest_kernel<tinyknn::half_bits>"
    verify = render.verify_spec(render.scan_spec("ip", "float32", 64, 10, "sm_80"))
    assert verify == render.verify_spec(render.scan_spec("ip", "float32", 1536, 10, "sm_80"))
    assert cuda_source.name_expression(verify).startswith(
        "tinyknn::verify_kernel<tinyknn::InnerProduct, tinyknn::KeyBound<tinyknn::InnerProduct>, float, 10, 12,")
    filtered = render.verify_spec(render.tiled_spec("l2", "float16", 64, 10, "sm_80"))
    assert "tinyknn::FilterKeyBound, tinyknn::half_bits" in cuda_source.name_expression(filtered)
    assert cuda_source.name_expression(render.band_spec("cosine", "float16", "sm_80")) == \
        "tinyknn::band_kernel<tinyknn::Cosine, tinyknn::half_bits>"


@pytest.mark.parametrize("dim,dtype,expected", [
    (1, "float32", (1, 4)), (3, "float32", (1, 4)), (128, "float32", (32, 128)), (130, "float32", (33, 132)),
    (1, "float16", (1, 8)), (130, "float16", (17, 136)), (1536, "float16", (192, 1536)),
])
def test_row_layout_pads_to_16_bytes(dim, dtype, expected):
    assert render.row_layout(dim, dtype) == expected


def test_specs_for_search_cover_every_plan():
    specs = search_kernels.specs_for_search("cosine", "float16", 96, 10, "sm_90")
    variants = [s.variant for s in specs]
    assert variants.count("norms") == 2                    # database (float16) and CUDA queries (float32)
    assert {"scan", "tiled", "verify", "band"} <= set(variants)
    big = search_kernels.specs_for_search("l2", "float32", 96, 2048, "90")
    assert "tiled" not in [s.variant for s in big]          # k beyond the tiled kernel: scan only
    assert all(s.arch == "sm_90" for s in big)
    assert all(isinstance(s, KernelSpec) for s in big)


def test_small_batches_get_small_tiled_blocks():
    """A batch smaller than the default block of queries gets the smallest block that holds it, and
    specs_for_search lists every block size a search may pick (so cache warm compiles them)."""
    def block(k, n):
        return render.tiled_spec("l2", "float32", 768, k, "sm_90", n_queries=n).param("bq")

    assert [block(10, n) for n in (1, 9, 16, 17, 32, 33, 1000)] == [16, 16, 16, 32, 32, 64, 64]
    assert [block(100, n) for n in (9, 16, 17, 1000)] == [16, 16, 32, 32]     # k = 100's default is 32
    assert render.tiled_spec("l2", "float32", 768, 10, "sm_90", n_queries=9, bq=64).param("bq") == 64
    listed = search_kernels.specs_for_search("l2", "float32", 768, 10, "sm_90")
    blocks = {(s.param("bq"), s.param("filter", 0)) for s in listed if s.variant == "tiled"}
    assert blocks == {(bq, f) for bq in (16, 32, 64) for f in (0, 1)}
    for metric in ("l2", "ip", "cosine"):          # whatever a batch picks, cache warm compiles it
        for k in (1, 10, 100, 256):
            listed = set(search_kernels.specs_for_search(metric, "float16", 96, k, "sm_90"))
            for n in range(1, 70):
                for exact in (False, True):
                    assert render.tiled_spec(metric, "float16", 96, k, "sm_90", exact=exact, n_queries=n) in listed
                if n > 1 or k > render_single.SINGLE_MAX_K:        # one query: single_kernel
                    assert render.scan_spec(metric, "float16", 96, k, "sm_90", n_queries=n) in listed
                else:
                    assert render_single.single_spec(metric, "float16", 96, k, "sm_90") in listed
    wide = render.tiled_spec("l2", "float32", 768, 10, "sm_90", n_queries=10, warps=32)   # 16 % 32 != 0
    assert wide.param("bq") % wide.param("warps") == 0


def test_listed_kernels_are_their_own_specs_and_cache_warm_lists_them():
    """A filtered search that reads a position list in place launches the LISTED instantiations (one more
    template argument, `true`); the unfiltered specs and their name expressions are what they were; the verify
    step after them is the unfiltered one; specs_for_search lists every listed kernel a search may pick."""
    plain = render_single.single_spec("l2", "float32", 128, 10, "sm_90", shadow=True, stage=0)
    listed = render_single.single_spec("l2", "float32", 128, 10, "sm_90", shadow=True, listed=True, stage=0)
    assert "listed" not in dict(plain.params) and listed.param("listed") == 1
    assert cuda_source.name_expression(listed) == cuda_source.name_expression(plain)[:-1] + ", true>"
    staged, staged_listed = (render_single.single_spec("l2", "float32", 128, 10, "sm_90", shadow=True, **listing)
                             for listing in ({}, {"listed": True}))
    ahead = render_single.SINGLE_STAGE_AHEAD
    assert cuda_source.name_expression(staged).endswith(f", false, {ahead}>")
    assert cuda_source.name_expression(staged_listed) == \
        cuda_source.name_expression(staged)[:-len(f", false, {ahead}>")] + f", true, {ahead}>"
    for make in (lambda **kw: render.scan_spec("ip", "float16", 96, 10, "sm_90", n_queries=3, **kw),
                 lambda **kw: render.tiled_spec("l2", "int8", 96, 10, "sm_90", n_queries=1000, **kw)):
        assert cuda_source.name_expression(make(listed=True)) == cuda_source.name_expression(make())[:-1] + ", true>"
        assert render.verify_spec(make(listed=True)) == render.verify_spec(make())
    every = set(search_kernels.specs_for_search("cosine", "float16", 96, 10, "sm_90"))
    assert set(search_kernels.listed_specs("cosine", "float16", 96, 10, "sm_90")) <= every
    for n in range(1, 70):
        assert render.tiled_spec("cosine", "float16", 96, 10, "sm_90", n_queries=n, listed=True) in every
        if n > 1:
            assert render.scan_spec("cosine", "float16", 96, 10, "sm_90", n_queries=n, listed=True) in every
    beyond = set(search_kernels.specs_for_search("l2", "float32", 96, 200, "sm_90"))
    assert render.scan_spec("l2", "float32", 96, 200, "sm_90", n_queries=1, listed=True) in beyond


def test_one_query_gets_a_scan_block_of_one():
    def block(n):
        return render.scan_spec("l2", "float32", 128, 10, "sm_90", n_queries=n).param("qb")

    assert [block(1), block(2), block(8), block(None)] == [1, 8, 8, 8]
    listed = search_kernels.specs_for_search("ip", "float16", 128, 10, "sm_90")
    assert {s.param("qb") for s in listed if s.variant == "scan"} == {8}       # one query: single_kernel
    singles = [s for s in listed if s.variant == "single" and not s.param("listed", 0)]
    assert [s.k for s in singles] == [10, 10] and [s.param("gt", 0) for s in singles] == [0, 1]  # shared bound
    beyond = search_kernels.specs_for_search("ip", "float16", 128, render_single.SINGLE_MAX_K + 1, "sm_90")
    assert 1 in {s.param("qb") for s in beyond if s.variant == "scan"}
    assert not [s for s in beyond if s.variant == "single"]


@pytest.mark.parametrize("bad,match", [
    (("L1", "float32", 8, 1, "sm_90"), "metric must be one of"),
    (("l2", "int4", 8, 1, "sm_90"), "dtype must be one of"),
    (("l2", "float32", 0, 1, "sm_90"), "dim must be between"),
    (("l2", "float32", 8, 4096, "sm_90"), "k must be between"),
    (("l2", "float32", 8, 1, "ampere"), "arch must look like"),
])
def test_specs_for_search_refuse_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        search_kernels.specs_for_search(*bad)


@pytest.mark.parametrize("k", [1, 10, 32, 33, 100, 256, 1000, 2048])
@pytest.mark.parametrize("dim,dtype", [(1, "float32"), (130, "float16"), (1536, "float32")])
def test_parameters_are_consistent(k, dim, dtype):
    scan = dict(render.scan_spec("l2", dtype, dim, k, "sm_90").params)
    kp = render.padded_k(render.list_length(k))
    assert scan["kl"] == render.list_length(k) > k
    assert scan["lanes"] in (1, 2, 4, 8, 16, 32)
    assert scan["qb"] >= 1 and (scan["qb"] * kp <= render.REGISTER_LIST_SLOTS or scan["qb"] == 1)
    assert scan["smem"] >= scan["warps"] * scan["qb"] * kp * 8
    assert scan["smem"] <= 227 * 1024                        # what an H100/H200 block may opt in to
    verify = dict(render.verify_spec(render.scan_spec("l2", dtype, dim, k, "sm_90")).params)
    assert verify["kl"] == render.list_length(k) and verify["smem"] <= 227 * 1024
    if k <= render_single.SINGLE_MAX_K:
        single = dict(render_single.single_spec("l2", dtype, dim, k, "sm_90").params)
        sort_slots = 1 << (single["kl"] - 1).bit_length()
        assert single["rmax"] % (single["warps"] * 32 // single["lanes"]) == 0 and single["rmax"] >= single["kl"]
        assert single["smem"] >= max(single["rmax"] * 8 + sort_slots * 8, sort_slots * 24)
        assert single["smem"] <= 227 * 1024
    if k <= render.TILED_MAX_K:
        tiled = dict(render.tiled_spec("l2", dtype, dim, k, "sm_90").params)
        assert tiled["bq"] % tiled["warps"] == 0 and tiled["bn"] % 128 == 0
        assert tiled["smem"] <= 100 * 1024


def test_include_cycles_and_missing_headers_are_reported(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\n')
    (tmp_path / "b.cuh").write_text('#include "a.cuh"\n')
    (tmp_path / "c.cuh").write_text('#include "missing.cuh"\n')
    monkeypatch.setattr(cuda_source, "kernels_dir", lambda: tmp_path)
    cuda_source.kernel_source.cache_clear()
    try:
        with pytest.raises(ValueError, match="includes itself"):
            cuda_source.kernel_source("a.cuh")
        with pytest.raises(FileNotFoundError, match="missing.cuh"):
            cuda_source.kernel_source("c.cuh")
    finally:
        cuda_source.kernel_source.cache_clear()


def test_one_query_on_a_float32_l2_index_may_stream_its_float16_shadow():
    """The shadow variant: float16 rows streamed, float32 rows verified under ShadowKeyBound, a wider margin;
    listed for warm-up beside the float32 stream, for float32 l2 only."""
    shadow = render_single.single_spec("l2", "float32", 100, 10, "sm_90", shadow=True)
    plain = render_single.single_spec("l2", "float32", 100, 10, "sm_90")
    name = cuda_source.name_expression(shadow)
    assert "ShadowKeyBound, float, tinyknn::half_bits, 100," in name
    assert "half_bits" not in cuda_source.name_expression(plain)
    assert shadow.param("kl") == 10 + render_single.SINGLE_SHADOW_MARGIN > plain.param("kl")
    assert shadow.param("shadow") == 1
    assert shadow.param("lanes") <= plain.param("lanes")       # 16-byte chunks of half the bytes
    listed = search_kernels.specs_for_search("l2", "float32", 100, 10, "sm_90")
    singles = [s for s in listed if s.variant == "single" and not s.param("listed", 0) and not s.param("gt", 0)]
    assert [s.param("shadow", 0) for s in singles] == [0, 1]
    for metric, dtype in (("ip", "float32"), ("cosine", "float32"), ("l2", "float16")):
        assert len([s for s in search_kernels.specs_for_search(metric, dtype, 100, 10, "sm_90")
                    if s.variant == "single" and not s.param("listed", 0) and not s.param("gt", 0)]) == 1
    with pytest.raises(ValueError, match="float32 index streams a float16 shadow; got dtype 'float16'"):
        render_single.single_spec("l2", "float16", 100, 10, "sm_90", shadow=True)
    with pytest.raises(ValueError, match="for l2 only; got metric 'ip'"):
        render_single.single_spec("ip", "float32", 100, 10, "sm_90", shadow=True)


@pytest.mark.parametrize("n,rmax,expected_waves", [(1_000_000, 2048, 4), (100_000, 2048, 1), (1_000_000, 8192, 1),
                                                   (300_000, 2048, 2), (1_000_000, None, 1), (2_000_000, None, 2)])
def test_single_query_slices_fill_whole_waves(n, rmax, expected_waves):
    """One block per SM resident (132 SMs): slices of at most rmax rows, rounded up to whole waves (1M rows at
    2,048: 4 waves of 132 blocks of 1,920 rows, not 3.7 waves of 2,045 rows whose last wave costs a whole one).
    The default (rmax None) holds 1M rows in one wave."""
    from tinyknn.gpu import plan

    overrides = {} if rmax is None else {"rmax": rmax}
    spec = render_single.single_spec("l2", "float32", 768, 10, "sm_90", shadow=True, **overrides)
    rmax = spec.param("rmax")
    loaded = plan.LoadedKernel(spec, None, 512, spec.param("smem"), 1)
    slices, rows = plan.split_rows(n, 1, loaded, 132, spec.param("kl"))
    assert rows <= rmax and slices * rows >= n and (slices - 1) * rows < n
    assert (expected_waves - 1) * 132 < slices <= expected_waves * 132


@pytest.mark.parametrize("dtype,dim,lanes", [("float16", 128, 4), ("float32", 64, 4), ("uint8", 256, 4),
                                             ("float16", 64, 1), ("uint8", 128, 1), ("float32", 128, 4),
                                             ("float16", 768, 16), ("float32", 768, 32)])
def test_single_query_rows_of_16_chunks_or_more_take_4_lanes_at_least(dtype, dim, lanes):
    """The single-query kernel splits a row of 16 to 31 16-byte chunks over 4 lanes, where the scan takes 2
    (SINGLE_MIN_LANES); shorter rows and longer ones keep the scan's lanes."""
    assert render_single.single_spec("l2", dtype, dim, 10, "sm_90").param("lanes") == lanes
    scan = render.scan_spec("l2", dtype, dim, 10, "sm_90").param("lanes")
    assert lanes == (max(scan, render_single.SINGLE_MIN_LANES) if render.row_layout(dim, dtype)[0] >= 16 else scan)


def test_the_staged_verify_step_sizes_its_shared_memory():
    """stage=1 (the verify step's candidates' rows staged in shared memory): the block's shared memory covers the
    verify step's own, the query in float64 and KL rows of an odd count of words; stage=0 specs' names stay as
    they were; a stage that cannot fit is refused with the sizes."""
    plain = render_single.single_spec("l2", "float32", 768, 10, "sm_90", shadow=True, stage=0)
    staged = render_single.single_spec("l2", "float32", 768, 10, "sm_90", shadow=True, stage=1)
    assert staged.param("stage") == 1 and plain.param("stage", 0) == 0
    kl, row_bytes = staged.param("kl"), render.row_layout(768, "float32")[1] * 4
    need = render.align16(render.verify_params(kl, False)["smem"]) + 768 * 8 + kl * ((row_bytes // 4) | 1) * 4
    assert staged.param("smem") == max(plain.param("smem"), need)
    assert cuda_source.name_expression(staged).endswith(", false, 1>")
    assert cuda_source.name_expression(plain).endswith(f", {plain.param('smem')}>")
    listed = render_single.single_spec("l2", "float32", 768, 10, "sm_90", shadow=True, stage=1, listed=True)
    assert cuda_source.name_expression(listed).endswith(", true, 1>")
    ahead = render_single.single_spec("l2", "float32", 768, 10, "sm_90", shadow=True, stage=8)
    assert cuda_source.name_expression(ahead).endswith(", false, 8>") and ahead.param("smem") == staged.param("smem")
    with pytest.raises(ValueError, match="stage is 0 .* up to 16; got 17"):
        render_single.single_spec("l2", "float32", 768, 10, "sm_90", stage=17)
    with pytest.raises(ValueError, match=r"stage=1 needs \d+ bytes of shared memory for 136 rows of 16384 bytes"):
        render_single.single_spec("l2", "float32", 4096, 128, "sm_90", stage=1)


def test_the_shared_bound_knob_names_its_own_kernel():
    """shared_bound (single.cuh's GT, a knob): the spec carries gt = 1 and the instantiation one more template
    argument, after LISTED and STAGE (0 where unstaged); the default specs are as they were."""
    plain = render_single.single_spec("l2", "float16", 768, 10, "sm_90")
    shared = render_single.single_spec("l2", "float16", 768, 10, "sm_90", shared_bound=True)
    assert "gt" not in dict(plain.params) and shared.param("gt") == 1 and shared != plain
    assert dict(shared.params) == {**dict(plain.params), "gt": 1}
    assert cuda_source.name_expression(shared) == cuda_source.name_expression(plain)[:-1] + ", true>"
    unstaged = render_single.single_spec("ip", "uint8", 256, 100, "sm_89", shared_bound=True)
    assert cuda_source.name_expression(unstaged).endswith(", false, 0, true>")
    listed = render_single.single_spec("l2", "float32", 128, 10, "sm_90", shadow=True, listed=True, shared_bound=True)
    assert cuda_source.name_expression(listed).endswith(f", true, {render_single.SINGLE_STAGE_AHEAD}, true>")


@pytest.mark.parametrize("arch,dtype,dim,k,staged", [("sm_90", "float32", 768, 10, True),
                                                     ("sm_90a", "float16", 768, 10, True),
                                                     ("sm_90", "uint8", 128, 100, True),
                                                     ("sm_90", "float32", 768, 128, False),
                                                     ("sm_90", "float32", 4096, 128, False),
                                                     ("sm_80", "float32", 768, 10, False),
                                                     ("sm_89", "float16", 128, 10, False)])
def test_the_verify_step_stages_its_rows_by_default_on_hopper_where_they_fit(arch, dtype, dim, k, staged):
    """Unless told, the single-query kernel stages its verify step's rows on SINGLE_STAGE_ARCHS where they fit
    SINGLE_STAGE_MAX_SMEM (no error where they do not), its chain loading SINGLE_STAGE_AHEAD chunks a step, and
    elsewhere keeps the unstaged kernel, whose spec is the one stage=0 names."""
    shadow = dtype == "float32"
    spec = render_single.single_spec("l2", dtype, dim, k, arch, shadow=shadow)
    assert spec.param("stage", 0) == (render_single.SINGLE_STAGE_AHEAD if staged else 0)
    assert spec == render_single.single_spec("l2", dtype, dim, k, arch, shadow=shadow,
                                      stage=render_single.SINGLE_STAGE_AHEAD if staged else 0)
    assert spec.param("smem") <= render_single.SINGLE_STAGE_MAX_SMEM


def test_a_small_database_gets_fewer_single_query_blocks():
    """One query on 20,000 rows: slices of at least plan.SINGLE_MIN_SLICE_ROWS (40 blocks, not 132 of 160 rows);
    100k rows still fill the 132 SMs; a forced slice count is kept."""
    from tinyknn.gpu import plan

    spec = render_single.single_spec("l2", "float32", 128, 10, "sm_90", shadow=True)
    loaded = plan.LoadedKernel(spec, None, 512, spec.param("smem"), 1)
    assert plan.split_rows(20_000, 1, loaded, 132, spec.param("kl"))[0] == 20_000 // plan.SINGLE_MIN_SLICE_ROWS + 1
    assert plan.split_rows(100_000, 1, loaded, 132, spec.param("kl"))[0] == 131    # rows rounded to steps of 256
    assert plan.split_rows(20_000, 1, loaded, 132, spec.param("kl"), slices=79)[0] == 79


def test_one_query_shares_its_slices_bound_past_the_streamed_bytes():
    """single_shares_bound: on Hopper only, from SINGLE_SHARED_BOUND_BYTES streamed (a float32 l2 index streams
    its float16 shadow, half its bytes); specs_for_search lists both kernels, plain and listed."""
    limit = render_single.SINGLE_SHARED_BOUND_BYTES
    rows = -(-limit // (768 * 2))
    assert render_single.single_shares_bound("sm_90", "float16", 768, rows)
    assert not render_single.single_shares_bound("sm_90", "float16", 768, rows - 1)
    assert not render_single.single_shares_bound("sm_80", "float16", 768, 10 * rows)
    assert render_single.single_shares_bound("sm_90a", "float32", 768, rows, shadow=True)     # float16 rows
    assert not render_single.single_shares_bound("sm_90a", "float32", 768, rows - 1, shadow=True)
    assert render_single.single_shares_bound("sm_90a", "float32", 768, -(-rows // 2))        # its own, twice the bytes
    assert not render_single.single_shares_bound("sm_90a", "float32", 768, -(-rows // 2) - 1)
    padded = render.row_layout(100, "float16")[1] * 2                                  # 100 dims stored as 104
    assert padded > 200 and render_single.single_shares_bound("sm_90", "float16", 100, -(-limit // padded))
    assert not render_single.single_shares_bound("sm_90", "float16", 100, -(-limit // padded) - 1)
    for arch in ("sm_90", "sm_90a"):
        every = set(search_kernels.specs_for_search("l2", "float32", 768, 10, arch))
        for listed in (False, True):
            for shadow in (False, True):
                for shared in (False, True):
                    knobs = {"shadow": shadow, "shared_bound": shared, **({"listed": True} if listed else {})}
                    assert render_single.single_spec("l2", "float32", 768, 10, arch, **knobs) in every
    assert not [s for s in search_kernels.specs_for_search("l2", "float32", 768, 10, "sm_80") if s.param("gt", 0)]


def test_the_kernel_a_search_runs_takes_the_shared_bound_by_its_rows_unless_told():
    """single_spec_over: single_spec with single_shares_bound's answer for the rows searched (the float16
    shadow's bytes where it streams the shadow); an override naming shared_bound wins."""
    rows = -(-render_single.SINGLE_SHARED_BOUND_BYTES // (768 * 2))
    assert render_single.single_spec_over(rows, "l2", "float32", 768, 10, "sm_90", shadow=True).param("gt") == 1
    assert render_single.single_spec_over(rows - 1, "l2", "float32", 768, 10, "sm_90", shadow=True).param("gt", 0) == 0
    assert render_single.single_spec_over(rows, "l2", "float16", 768, 10, "sm_80").param("gt", 0) == 0
    told = render_single.single_spec_over(rows, "l2", "float16", 768, 10, "sm_90", shared_bound=False, listed=True)
    assert told == render_single.single_spec("l2", "float16", 768, 10, "sm_90", listed=True)
