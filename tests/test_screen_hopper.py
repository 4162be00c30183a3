"""The Hopper screen's host rules (no GPU): its specs exist only for sm_90a and pick the tile per element type,
the 8-bit exact conversion only where every dot product stays below 2^24, the tensor maps' arguments, the
shared-memory formula, the padded row terms, and which screen a device runs (TINYKNN_SCREEN)."""

from __future__ import annotations

import pytest

from tinyknn.config import get_config, reset_config
from tinyknn.jit import cuda_source, render, render_screen as rs, search_kernels


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "90", "90a"])
def test_hopper_specs_compile_for_sm_90a_only(arch):
    spec = rs.hopper_spec("l2", "float16", 768, arch)
    assert spec.arch == "sm_90a" and spec.variant == "screen_hopper"
    assert rs.tiles_spec(128, arch).arch == "sm_90a"
    assert cuda_source.render_source(spec).source == cuda_source.kernel_source("screen_hopper.cuh")
    assert "screen_hopper_kernel" not in cuda_source.kernel_source()      # sm_80 / sm_90 sources stay as they were


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100"])
def test_hopper_specs_refuse_other_arches(arch):
    with pytest.raises(ValueError, match=f"compute capability 9.0.*{arch}"):
        rs.hopper_spec("l2", "float16", 768, arch)
    assert rs.hopper_arch(arch) is None
    assert search_kernels.hopper_specs("l2", "float16", 768, arch) == []


@pytest.mark.parametrize("metric,dtype,tile,ip", [
    ("l2", "float16", (128, 2), False), ("ip", "bfloat16", (128, 2), True), ("l2", "float32", (128, 2), False),
    ("cosine", "uint8", (128, 2), True), ("ip", "uint8", (256, 1), True), ("l2", "int8", (256, 1), False),
])
def test_tile_follows_the_element_type(metric, dtype, tile, ip):
    spec = rs.hopper_spec(metric, dtype, 128, "sm_90")
    assert (spec.param("bn"), spec.param("mw")) == tile
    consumers = 3 if tile == (256, 1) else 2           # 8-bit rows of one k-block: three consumer warpgroups
    assert (spec.param("cw", 2), spec.param("stages")) == (consumers, 3 if consumers == 3 else 4)
    assert spec.param("smem") == rs.hopper_smem(*tile, spec.param("stages"), consumers) <= 227 * 1024
    name = cuda_source.name_expression(spec)
    element = rs.SCREEN_ELEMENTS[rs.element_of(metric, dtype)]
    assert name.startswith(f"tinyknn::screen_hopper_kernel<{element}, {'true' if ip else 'false'}, ")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "uint8"])
def test_cosine_screens_a_float16_shadow_of_every_dtype(dtype):
    """Cosine's unit rows fit float16, whose significand bounds the products 8x tighter than bfloat16's: a
    bfloat16 index's cosine screen, its row and query steps and its Hopper kernel all take float16."""
    assert rs.element_of("cosine", dtype) == "float16" and rs.has_shadow("cosine", dtype)
    spec = rs.hopper_spec("cosine", dtype, 128, "sm_90")
    assert cuda_source.name_expression(spec).startswith("tinyknn::screen_hopper_kernel<tinyknn::ScreenF16, true, ")
    rows = rs.step_spec("screen_rows", "cosine", dtype, 0, "sm_90")
    assert cuda_source.name_expression(rows).endswith(", tinyknn::ScreenF16>")
    assert rs.element_of("ip", "bfloat16") == "bfloat16"      # l2 and ip read a bfloat16 index's own rows


@pytest.mark.parametrize("element,stride,exact", [
    ("uint8", 256, True), ("uint8", 257, True), ("uint8", 258, True), ("uint8", 272, False),
    ("int8", 1008, True), ("int8", 1023, True), ("int8", 1024, False),
    ("float16", 16, False), ("bfloat16", 16, False),
])
def test_exact_conversion_only_below_two_to_the_24(element, stride, exact):
    assert rs.exact_conversion(element, stride) is exact
    largest = {"uint8": 255 * 255, "int8": 128 * 128}.get(element)
    if largest is not None:
        assert (largest * stride < 2 ** 24) is exact


@pytest.mark.parametrize("element,stride,ok", [
    ("uint8", 128, True), ("uint8", 129, True), ("uint8", 130, False), ("int8", 511, True), ("int8", 512, False),
    ("float16", 16, False),
])
def test_integer_keys_only_where_every_squared_norm_is_below_two_to_the_23(element, stride, ok):
    assert rs.integer_keys(element, stride) is ok


def test_integer_keys_are_the_default_where_they_apply(monkeypatch):
    """HOPPER_INT_KEYS (on by default): the 8-bit screen where integer_keys allows gets IK = true, its threshold
    mode and the other element types keep their kernels; off, the float keys' kernel (the producer's bias off
    here: it is a further template argument, tested below; two consumers and no lean tiles, whose name ends with
    these)."""
    monkeypatch.setattr(rs, "HOPPER_PRODUCER_BIAS", False)
    monkeypatch.setattr(rs, "HOPPER_CONSUMERS", 2)
    monkeypatch.setattr(rs, "HOPPER_LEAN_TILES", False)
    keyed = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert keyed.param("ik") == 1
    monkeypatch.setattr(rs, "HOPPER_INT_KEYS", False)
    plain = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert plain.param("ik", 0) == 0 and keyed != plain
    monkeypatch.setattr(rs, "HOPPER_INT_KEYS", True)
    assert cuda_source.name_expression(keyed) == cuda_source.name_expression(plain)[:-1] + ", 0, 0, true>"
    assert rs.hopper_spec("l2", "uint8", 256, "sm_90").param("ik", 0) == 0
    assert rs.hopper_spec("l2", "uint8", 128, "sm_90", keep=2).param("ik", 0) == 0
    assert rs.hopper_spec("l2", "float16", 128, "sm_90").param("ik", 0) == 0


def test_the_producer_biases_l2s_bounds_beside_integer_keys(monkeypatch):
    """HOPPER_PRODUCER_BIAS (on by default; screen_hopper.cuh's PB): the keyed l2 screen gets PB = true as its last
    template argument; off, the keyed kernel without it; ip, the float keys and the threshold mode never have it
    (two consumers and no lean tiles, whose name ends with it)."""
    monkeypatch.setattr(rs, "HOPPER_CONSUMERS", 2)
    monkeypatch.setattr(rs, "HOPPER_LEAN_TILES", False)
    biased = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert biased.param("pb") == 1 and biased.param("ik") == 1
    monkeypatch.setattr(rs, "HOPPER_PRODUCER_BIAS", False)
    keyed = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert keyed.param("pb", 0) == 0 and keyed.param("ik") == 1
    assert cuda_source.name_expression(biased) == cuda_source.name_expression(keyed)[:-1] + ", true>"
    monkeypatch.setattr(rs, "HOPPER_PRODUCER_BIAS", True)
    assert rs.hopper_spec("ip", "uint8", 128, "sm_90").param("pb", 0) == 0
    assert rs.hopper_spec("l2", "uint8", 128, "sm_90", keep=1).param("pb", 0) == 0
    monkeypatch.setattr(rs, "HOPPER_INT_KEYS", False)
    assert rs.hopper_spec("l2", "uint8", 128, "sm_90").param("pb", 0) == 0


def test_three_consumer_warpgroups_for_8_bit_rows_of_one_k_block(monkeypatch):
    """HOPPER_CONSUMERS (3; 2 a probe's): the 8-bit screen of one 128-byte k-block gets three consumer warpgroups
    (screen_hopper.cuh's CW): 512 threads, 192-query tiles and 3 stages as its last template argument; the threshold
    mode, the small tile, 16-bit rows and longer rows keep their kernels of two."""
    three = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert three.param("cw") == 3 and three.param("stages") == rs.HOPPER_CONSUMERS_STAGES == 3
    assert rs.hopper_threads(three) == 512 and rs.hopper_tile_queries(three) == 192
    assert three.param("smem") == rs.hopper_smem(256, 1, 3, 3) == 181424 <= 227 * 1024 < rs.hopper_smem(256, 1, 4, 3)
    assert cuda_source.name_expression(three).endswith(", 3, 181424, 0, 0, true, true, 3, 0, true>")   # LT last
    assert rs.hopper_spec("ip", "int8", 100, "sm_90").param("cw") == 3
    others = [rs.hopper_spec("l2", "uint8", 128, "sm_90", keep=1),
              rs.hopper_spec("l2", "uint8", 128, "sm_90", small=True),
              rs.hopper_spec("l2", "float16", 64, "sm_90"), rs.hopper_spec("l2", "uint8", 256, "sm_90")]
    for other in others:
        assert other.param("cw", 2) == 2 and rs.hopper_threads(other) == 384, other
    monkeypatch.setattr(rs, "HOPPER_CONSUMERS", 2)
    plain = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert plain.param("cw", 2) == 2 and rs.hopper_threads(plain) == 384 and rs.hopper_tile_queries(plain) == 128
    assert plain.param("stages") == rs.HOPPER_STAGES == 4


def test_the_halves_overlap_only_as_a_probes_knob_for_rows_of_two_k_blocks(monkeypatch):
    """HOPPER_OVERLAP_HALVES (off; a probe's, screen_hopper.cuh's XO): the screen of rows of one or two 128-byte
    k-blocks (two tiles' k-blocks fit the 4-stage ring) keeps its tile, threads and shared memory and gets its rows'
    k-blocks as XO, its last template argument: 8-bit rows (halves of the rows) and 16-bit ones (halves of the
    queries); not with three consumers, nor for the threshold mode, the small tile or longer rows (no lean tiles
    here: the argument after it)."""
    monkeypatch.setattr(rs, "HOPPER_CONSUMERS", 2)
    monkeypatch.setattr(rs, "HOPPER_LEAN_TILES", False)
    plain = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert plain.param("xo", 0) == 0
    monkeypatch.setattr(rs, "HOPPER_OVERLAP_HALVES", True)
    overlap = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert overlap.param("xo") == 1 and dict(overlap.params) == {**dict(plain.params), "xo": 1}
    assert rs.hopper_threads(overlap) == 384 and rs.hopper_tile_queries(overlap) == 128
    assert cuda_source.name_expression(overlap) == cuda_source.name_expression(plain)[:-1] + ", 2, 1>"
    for (metric, dtype, stride), (k_blocks, bn, mw) in {
            ("l2", "uint8", 200): (2, 256, 1), ("ip", "int8", 256): (2, 256, 1), ("l2", "float16", 64): (1, 128, 2),
            ("l2", "float16", 128): (2, 128, 2), ("ip", "bfloat16", 100): (2, 128, 2),
            ("cosine", "float32", 128): (2, 128, 2)}.items():
        spec = rs.hopper_spec(metric, dtype, stride, "sm_90")
        assert (spec.param("xo"), spec.param("bn"), spec.param("mw")) == (k_blocks, bn, mw), spec
        assert spec.param("stages") == 4 and rs.hopper_threads(spec) == 384
    for other in (rs.hopper_spec("l2", "uint8", 128, "sm_90", keep=1),
                  rs.hopper_spec("l2", "uint8", 128, "sm_90", small=True),
                  rs.hopper_spec("l2", "float16", 128, "sm_90", small=True),
                  rs.hopper_spec("l2", "float16", 129, "sm_90"), rs.hopper_spec("l2", "uint8", 257, "sm_90")):
        assert other.param("xo", 0) == 0, other
    monkeypatch.setattr(rs, "HOPPER_CONSUMERS", 3)
    assert rs.hopper_spec("l2", "uint8", 128, "sm_90").param("xo", 0) == 0
    assert rs.hopper_spec("l2", "float16", 128, "sm_90").param("xo") == 2        # CW = 3 is 8-bit only


def test_lean_tiles_by_default_for_the_screen_alone(monkeypatch):
    """HOPPER_LEAN_TILES (on; screen_hopper.cuh's LT): every screen kernel, with its tile, threads and shared memory,
    gets LT = true as its last template argument; the threshold mode keeps its kernel; off (a probe's), none do."""
    def specs():
        return [rs.hopper_spec(metric, dtype, stride, "sm_90", small=small) for metric, dtype, stride in
                (("l2", "uint8", 128), ("ip", "int8", 200), ("l2", "float16", 128), ("cosine", "float32", 64))
                for small in (False, True)]
    lean = specs()
    assert rs.hopper_spec("l2", "uint8", 128, "sm_90", keep=1).param("lt", 0) == 0
    monkeypatch.setattr(rs, "HOPPER_LEAN_TILES", False)
    for spec, plain in zip(lean, specs()):
        assert dict(spec.params) == {**dict(plain.params), "lt": 1}, (spec, plain)
        name = cuda_source.name_expression(spec)
        assert name.endswith(", true>") and name.count(", ") == 13, name      # LT: the 14th template argument
        assert cuda_source.name_expression(plain).count(", ") < 13, plain
        assert rs.hopper_threads(spec) == rs.hopper_threads(plain)


def test_half_keys_only_as_a_probes_knob_beside_the_producers_bias(monkeypatch):
    """HOPPER_HALF_KEYS (off; a probe's, screen_hopper.cuh's HK): the screen kernels with the producer's biased
    bounds (l2, integer keys) get HK = true as their last template argument, tile and shared memory unchanged;
    ip, the float keys, the threshold mode and a screen without the bias keep their kernels."""
    plain = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    assert plain.param("hk", 0) == 0 and plain.param("pb") == 1
    monkeypatch.setattr(rs, "HOPPER_HALF_KEYS", True)
    for stride, small, consumers in ((128, False, 3), (128, True, 3), (128, False, 2), (200, False, 3)):
        monkeypatch.setattr(rs, "HOPPER_CONSUMERS", consumers)
        before = dict(rs.hopper_spec("l2", "int8", stride, "sm_90", small=small).params)
        before.pop("hk")
        monkeypatch.setattr(rs, "HOPPER_HALF_KEYS", False)
        assert dict(rs.hopper_spec("l2", "int8", stride, "sm_90", small=small).params) == before
        monkeypatch.setattr(rs, "HOPPER_HALF_KEYS", True)
    half = rs.hopper_spec("l2", "uint8", 128, "sm_90")
    name = cuda_source.name_expression(half)
    assert name.endswith(", true, true>") and name.count(", ") == 14, name     # LT, then HK
    for other in (rs.hopper_spec("ip", "uint8", 128, "sm_90"), rs.hopper_spec("l2", "float16", 128, "sm_90"),
                  rs.hopper_spec("l2", "uint8", 256, "sm_90"), rs.hopper_spec("l2", "uint8", 128, "sm_90", keep=1)):
        assert other.param("hk", 0) == 0, other
    monkeypatch.setattr(rs, "HOPPER_PRODUCER_BIAS", False)
    assert rs.hopper_spec("l2", "uint8", 128, "sm_90").param("hk", 0) == 0


def test_the_spec_carries_the_conversion_of_its_stride():
    assert rs.hopper_spec("l2", "uint8", 128, "sm_90").param("exact") == 1
    assert rs.hopper_spec("l2", "uint8", 768, "sm_90").param("exact") == 0
    assert rs.hopper_spec("l2", "float16", 128, "sm_90").param("exact") == 0
    assert "true, 256, 1, 3" in cuda_source.name_expression(rs.hopper_spec("l2", "uint8", 128, "sm_90"))


def test_bound_counts_four_instructions_per_128_byte_block():
    assert [rs.hopper_k_blocks(b) for b in (16, 128, 144, 256, 1536)] == [1, 1, 2, 2, 12]


def test_warm_lists_the_hopper_kernels_for_sm_90a_only():
    on_90a = search_kernels.specs_for_search("l2", "float16", 768, 10, "sm_90a")
    assert {s.variant for s in on_90a} >= {"screen_hopper", "screen_tiles"}
    on_90 = search_kernels.specs_for_search("l2", "float16", 768, 10, "sm_90")
    assert not {s.variant for s in on_90} & {"screen_hopper"}
    assert search_kernels.hopper_specs("l2", "float16", 8, "sm_90a") == []          # dim < 16: never screened
    with pytest.raises(ValueError, match="one entry header"):
        cuda_source.render_many([rs.tiles_spec(128, "sm_90a"), render.rows_spec("sm_90a")])


def test_tensor_map_arguments():
    from tinyknn.gpu.tensor_map import tensor_map_args

    args = tensor_map_args(0x7f0000000100, 1000, 1536, 2, 128)
    assert args.dims == (768, 1000) and args.pitches == (1536,) and args.box == (64, 128)
    assert tensor_map_args(0x1000, 10, 144, 1, 256).box == (128, 256)
    for bad, match in [((0x1008, 10, 144, 1, 256), "16-byte"), ((0x1000, 10, 136, 2, 128), "16-byte"),
                       ((0x1000, 0, 144, 2, 128), "rows"), ((0x1000, 10, 144, 2, 512), "box"),
                       ((0x1000, 10, 144, 4, 128), "1- or 2-byte")]:
        with pytest.raises(ValueError, match=match):
            tensor_map_args(*bad)



def test_sample_map_arguments():
    """Tile t's row j is row (t + j tiles) step: pitches step rows and tiles x step rows."""
    from tinyknn.gpu.tensor_map import sample_map_args

    args = sample_map_args(0x1000, 100, 16, 144, 1, 256)
    assert args.dims == (144, 100, 256) and args.pitches == (16 * 144, 100 * 16 * 144) and args.box == (128, 1, 256)
    with pytest.raises(ValueError, match="out of the screen's range"):
        sample_map_args(0x1000, 1 << 20, 16, 144, 1, 256)
    with pytest.raises(ValueError, match="16-byte"):
        sample_map_args(0x1008, 10, 16, 144, 1, 256)


def test_row_terms_are_padded_to_whole_tiles():
    from tinyknn.gpu.screen import ROW_PAD, padded_rows

    assert ROW_PAD % max(rs.hopper_tile(e)[0] for e in ("float16", "uint8")) == 0
    assert [padded_rows(n) for n in (1, 256, 257, 20000)] == [256, 256, 512, 20224]


@pytest.mark.parametrize("arch,choice,used", [
    ("sm_90", "auto", True), ("sm_90", "wgmma", True), ("sm_90", "mma", False), ("sm_90a", "auto", True),
    ("sm_80", "auto", False), ("sm_89", "mma", False),
])
def test_which_screen_a_device_runs(arch, choice, used):
    from tinyknn.gpu.screen_hopper import use_hopper

    assert use_hopper(arch, choice) is used


def test_asking_for_wgmma_elsewhere_is_an_error():
    from tinyknn.gpu.screen_hopper import use_hopper

    with pytest.raises(ValueError, match="TINYKNN_SCREEN=wgmma.*sm_80"):
        use_hopper("sm_80", "wgmma")


@pytest.mark.parametrize("value,expected", [("", "auto"), ("mma", "mma"), (" WGMMA ", "wgmma"), ("auto", "auto")])
def test_screen_setting(monkeypatch, value, expected):
    monkeypatch.setenv("TINYKNN_SCREEN", value)
    reset_config()
    try:
        assert get_config().screen == expected
    finally:
        monkeypatch.delenv("TINYKNN_SCREEN")
        reset_config()


def test_a_bad_screen_setting_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv("TINYKNN_SCREEN", "tensor")
    reset_config()
    try:
        with pytest.raises(ValueError, match="TINYKNN_SCREEN must be one of auto, mma, wgmma; got 'tensor'"):
            get_config()
    finally:
        monkeypatch.delenv("TINYKNN_SCREEN")
        reset_config()


def test_auto_runs_the_hopper_screen_only_on_batches_where_it_measured_faster():
    from tinyknn.gpu.screen_hopper import hopper_pays

    assert hopper_pays(1000, 1_000_000) and hopper_pays(2048, 10_000_000)
    assert not hopper_pays(100, 1_000_000)        # 1M x 768 x 100: 1.62 ms against 1.40 through mma.sync
    assert not hopper_pays(1000, 100_000)         # 100k x 128 x 1,000: 0.67 against 0.59


def test_small_batches_take_the_small_hopper_tile(monkeypatch):
    """At most 128 queries: one tile of 128 queries x 256 rows (a 256-query tile would be mostly padding), where
    queries x rows reach HOPPER_SMALL_MIN_PRODUCTS; 8-bit indexes' tile of two consumers is that one already (their
    three consumers' tile takes 192 queries)."""
    from tinyknn.gpu.screen_hopper import small_tile_pays

    assert small_tile_pays(100, 1_000_000)        # 1M x 768 float32 x 100: 0.60 ms against 1.11 through mma.sync
    assert small_tile_pays(64, 1_000_000) and small_tile_pays(100, 400_000)
    assert not small_tile_pays(129, 1_000_000) and not small_tile_pays(100, 100_000)
    large = rs.hopper_spec("l2", "float16", 768, "sm_90")
    small = rs.hopper_spec("l2", "float16", 768, "sm_90", small=True)
    assert (large.param("bn"), large.param("mw"), small.param("bn"), small.param("mw")) == (128, 2, 256, 1)
    assert small.param("smem") == rs.hopper_smem(256, 1)
    assert rs.hopper_tile_queries(rs.hopper_spec("ip", "uint8", 128, "sm_90")) == 192
    assert rs.hopper_tile_queries(rs.hopper_spec("ip", "uint8", 128, "sm_90", small=True)) == 128
    monkeypatch.setattr(rs, "HOPPER_CONSUMERS", 2)
    assert rs.hopper_spec("ip", "uint8", 128, "sm_90", small=True) == rs.hopper_spec("ip", "uint8", 128, "sm_90")
    specs = search_kernels.hopper_specs("l2", "float16", 768, "sm_90a")
    assert small in specs and rs.tiles_spec(256, "sm_90a") in specs and rs.sample_spec(256, "sm_90a") in specs
    assert rs.hopper_spec("l2", "float16", 768, "sm_90", keep=2, small=True) in specs
    assert len(specs) == len(set(specs))
    assert (len(search_kernels.hopper_specs("l2", "uint8", 128, "sm_90a"))
            == len(search_kernels.hopper_specs("l2", "float16", 128, "sm_90a")) // 2)
