"""Every kernel a search of the default manifest launches compiles with a 0-byte stack frame and no spills
(ptxas report), for sm_90 (the H100/H200 we ship for) and sm_80, plus the large-k kernels outside the
manifest. Per arch: every kernel that does not depend on the dim, and a third of the (metric, dtype, dim, k)
combinations for those that do (every value and every pair of values still appears), a different third for
each arch, so the two together compile two thirds of the dim-dependent kernels. The filtered (LISTED)
variants of the selection kernels, which differ from the others only in how a row is found, compile in
each arch's third, on sm_80 the tiled kernel's only (with all of them the check took ~600 kernels an
arch). The Hopper screen (sm_90a only) compiles in a handful of variants: each element type, both tiles,
both 8-bit conversions, both metrics' epilogues, and its per-tile bound.

The kernels go through tinyknn's own cubin cache (the user's cache folder, as at run time), whose entries
keep each kernel's ptxas report under a key of its rendered source, options, arch and NVRTC version: a
kernel is compiled once per machine and source, about a second each on two cores (~340 per arch), and a
later run reads the same report back. A changed kernel, option or NVRTC is a new key, compiled again. No GPU
needed.
"""

from __future__ import annotations

import os

import pytest

from tinyknn.jit import cuda_source, render, render_single, search_kernels
from tinyknn.config import get_config
from tinyknn.jit.cache import CubinCache
from tinyknn.jit.compiler import compile_cubin
from tinyknn.jit.manifest import default_manifest_path, read_manifest
from tinyknn.jit.warm import warm_specs

pytestmark = pytest.mark.nvrtc

EXTRA = [(m, t, d, k) for m in ("l2", "ip", "cosine") for t in ("float32", "float16") for d in (3, 130)
         for k in (1000, 2048)]


THIRDS = {"sm_90": 0, "sm_80": 1}   # which third of the dim-dependent combinations each arch compiles
LISTED_ARCH = "sm_90"                # the filtered (LISTED) selection kernels: their third on this arch only


def _cover(combinations: list[tuple], third: int = 0) -> list[tuple]:
    """A third of the combinations: those whose value indices sum to `third` mod 3 (every value, every pair)."""
    axes = [sorted({c[i] for c in combinations}, key=str) for i in range(4)]
    return [c for c in combinations if sum(axes[i].index(c[i]) for i in range(4)) % 3 == third]


def _specs(arch: str) -> list:
    combinations = list(read_manifest(default_manifest_path()).combinations)
    covered = set(_cover(combinations, THIRDS[arch]))
    dims = sorted({c[2] for c in combinations})

    def specs(metric, dtype, dim, k) -> dict:
        return {cuda_source.name_expression(spec): spec
                for spec in search_kernels.specs_for_search(metric, dtype, dim, k, arch)}

    found: dict = {}
    for metric, dtype, dim, k in combinations:
        these = specs(metric, dtype, dim, k)
        if (metric, dtype, dim, k) not in covered:    # only the kernels another dim would launch as well
            other = specs(metric, dtype, dims[0] if dim != dims[0] else dims[1], k)
            these = {name: spec for name, spec in these.items() if name in other}
        found.update(these)
    for combination in EXTRA:
        found.update({name: spec for name, spec in specs(*combination).items() if not spec.param("listed", 0)})
    if arch != LISTED_ARCH:      # elsewhere only the tiled kernel's (the one whose registers ran out on sm_80)
        found = {name: spec for name, spec in found.items() if not spec.param("listed", 0) or spec.variant == "tiled"}
    return [found[name] for name in sorted(found)]


def _names(arch: str) -> list[str]:
    return [cuda_source.name_expression(spec) for spec in _specs(arch)]


@pytest.fixture(scope="module")
def kernel_cache():
    """The user's cubin cache (TINYKNN_CACHE_DIR, else the platform's cache folder), as a search uses it."""
    return CubinCache(get_config().cache_dir / "cubins")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_manifest_kernels_need_no_local_memory(arch, kernel_cache, spill_free_nvrtc):
    specs = _specs(arch)
    assert len(specs) > 200            # the manifest is the full default one
    outcomes = warm_specs(kernel_cache, specs, jobs=max(1, os.cpu_count() or 1))
    failed = [o for o in outcomes if o.status == "failed"]
    assert not failed, "\n".join(f"{o.spec}: {o.error}" for o in failed)
    reports = {}
    for spec in specs:
        cubin = kernel_cache.get(spec)
        name = cuda_source.name_expression(spec)
        assert name in cubin.reports, (name, sorted(cubin.reports))
        reports[name] = cubin.reports[name]
    bad = {name: r for name, r in reports.items()
           if r.stack_bytes or r.spill_store_bytes or r.spill_load_bytes}
    assert not bad, "\n".join(f"{name}: {r}" for name, r in sorted(bad.items()))
    assert max(r.registers for r in reports.values()) <= 255


STAGED = [("l2", "float32", 768, 10, True), ("l2", "float16", 768, 10, False), ("cosine", "bfloat16", 96, 100, False),
          ("ip", "uint8", 130, 32, False)]


def test_the_staged_verify_step_needs_no_local_memory(kernel_cache):
    """The single-query kernel with its verify step's rows staged in shared memory (stage=1; 4, the default, and
    8: its chain loading that many chunks a step), its listed variant and the shared-bound knob: compiled, no
    spills, and the shared memory it asks for within a block's."""
    specs = [render_single.single_spec(metric, dtype, dim, k, "sm_90", shadow=shadow, stage=stage, **listed)
             for metric, dtype, dim, k, shadow in STAGED for listed in ({}, {"listed": True}) for stage in (1, 4, 8)]
    specs += [render_single.single_spec(metric, dtype, dim, k, "sm_90", shadow=shadow, shared_bound=True, **listed)
              for metric, dtype, dim, k, shadow in STAGED for listed in ({}, {"listed": True})]   # the GT knob
    outcomes = warm_specs(kernel_cache, specs, jobs=max(1, os.cpu_count() or 1))
    assert not [o for o in outcomes if o.status == "failed"], [o.error for o in outcomes]
    for spec in specs:
        report = kernel_cache.get(spec).reports[cuda_source.name_expression(spec)]
        assert (report.stack_bytes, report.spill_store_bytes, report.spill_load_bytes) == (0, 0, 0), (spec, report)
        assert spec.param("smem") <= render_single.SINGLE_STAGE_MAX_SMEM


HOPPER = [("l2", "float16", 768), ("ip", "bfloat16", 128), ("l2", "uint8", 128), ("ip", "int8", 2048)]


def test_hopper_screen_needs_no_local_memory(kernel_cache, monkeypatch):
    from tinyknn.jit import render_screen

    specs = [spec for combination in HOPPER for spec in search_kernels.hopper_specs(*combination, "sm_90a")]
    assert {(s.param("bn"), s.param("exact", 0)) for s in specs if s.variant == "screen_hopper"} == \
        {(128, 0), (256, 1), (256, 0)}
    grouped = [render_screen.hopper_spec(metric, dtype, stride, "sm_90a", epi_group=group)
               for metric, dtype, stride in HOPPER[2:] for group in (1, 8)]
    assert {s.param("eg") for s in grouped} == {1, 8}                  # the probes' epilogues
    keyed = [render_screen.hopper_spec(metric, dtype, 128, "sm_90a") for metric in ("l2", "ip")
             for dtype in ("uint8", "int8")]
    assert {s.param("ik") for s in keyed} == {1}                      # the default integer keys
    monkeypatch.setattr(render_screen, "HOPPER_INT_KEYS", False)      # and the float keys they replace
    keyed += [render_screen.hopper_spec(metric, dtype, 128, "sm_90a") for metric in ("l2", "ip")
              for dtype in ("uint8", "int8")]
    assert {s.param("ik", 0) for s in keyed} == {0, 1}
    monkeypatch.setattr(render_screen, "HOPPER_INT_KEYS", True)       # l2's keyed kernels without the producer's bias
    monkeypatch.setattr(render_screen, "HOPPER_PRODUCER_BIAS", False)
    unbiased = [render_screen.hopper_spec("l2", dtype, 128, "sm_90a") for dtype in ("uint8", "int8")]
    assert [s.param("pb", 0) for s in keyed[:2]] == [1, 1] and [s.param("pb", 0) for s in unbiased] == [0, 0]
    keyed += unbiased
    monkeypatch.setattr(render_screen, "HOPPER_PRODUCER_BIAS", True)
    monkeypatch.setattr(render_screen, "HOPPER_CONSUMERS", 3)         # the probes' three consumer warpgroups
    three = [render_screen.hopper_spec(metric, dtype, 128, "sm_90a", keep=keep) for metric, dtype in
             (("l2", "uint8"), ("ip", "int8")) for keep in (0, 1)]
    assert [s.param("cw", 2) for s in three] == [3, 2, 3, 2]
    monkeypatch.setattr(render_screen, "HOPPER_CONSUMERS", 2)         # and the halves' overlap
    monkeypatch.setattr(render_screen, "HOPPER_OVERLAP_HALVES", True)
    three += [render_screen.hopper_spec(metric, dtype, stride, "sm_90a") for metric, dtype, stride in
              (("l2", "uint8", 128), ("ip", "int8", 128), ("l2", "int8", 128), ("l2", "uint8", 200),
               ("l2", "float16", 128), ("ip", "bfloat16", 64))]
    assert [s.param("xo", 0) for s in three[4:]] == [1, 1, 1, 2, 2, 1]   # XO: the rows' k-blocks
    monkeypatch.setattr(render_screen, "HOPPER_LEAN_TILES", True)     # lean tiles: with XO, two and three consumers
    three += [render_screen.hopper_spec(metric, dtype, 128, "sm_90a") for metric, dtype in
              (("l2", "uint8"), ("l2", "float16"))]
    monkeypatch.setattr(render_screen, "HOPPER_OVERLAP_HALVES", False)
    three += [render_screen.hopper_spec("l2", "float16", 128, "sm_90a", small=True)]
    monkeypatch.setattr(render_screen, "HOPPER_CONSUMERS", 3)
    three += [render_screen.hopper_spec(metric, dtype, 128, "sm_90a") for metric, dtype in
              (("l2", "uint8"), ("ip", "int8"))]
    assert [(s.param("lt"), s.param("xo", 0), s.param("cw", 2)) for s in three[10:]] == \
        [(1, 1, 2), (1, 2, 2), (1, 0, 2), (1, 0, 3), (1, 0, 3)]
    monkeypatch.setattr(render_screen, "HOPPER_HALF_KEYS", True)      # half keys: three consumers, two, XO, small
    half = [render_screen.hopper_spec("l2", dtype, 128, "sm_90a") for dtype in ("uint8", "int8")]
    half += [render_screen.hopper_spec("l2", "uint8", 128, "sm_90a", small=True)]
    monkeypatch.setattr(render_screen, "HOPPER_CONSUMERS", 2)
    half += [render_screen.hopper_spec("l2", "uint8", 128, "sm_90a")]
    monkeypatch.setattr(render_screen, "HOPPER_OVERLAP_HALVES", True)
    half += [render_screen.hopper_spec("l2", "uint8", 128, "sm_90a")]
    assert [(s.param("hk"), s.param("cw", 2), s.param("xo", 0)) for s in half] == \
        [(1, 3, 0), (1, 3, 0), (1, 2, 0), (1, 2, 0), (1, 2, 1)]
    three += half
    specs += grouped + keyed + three
    outcomes = warm_specs(kernel_cache, specs, jobs=max(1, os.cpu_count() or 1))
    assert not [o for o in outcomes if o.status == "failed"], [o.error for o in outcomes]
    for spec in specs:
        report = kernel_cache.get(spec).reports[cuda_source.name_expression(spec)]
        assert (report.stack_bytes, report.spill_store_bytes, report.spill_load_bytes) == (0, 0, 0), (spec, report)
        if spec.variant == "screen_hopper":   # __launch_bounds__(384, 1): the consumers raise theirs (setmaxnreg)
            assert not report.wgmma_serialized, spec    # ptxas kept the products asynchronous (no C7518)
            consumers = spec.param("cw", 2)    # 512 threads: 128 registers, none raised
            assert report.registers <= (168 if consumers == 2 else 128)
            assert spec.param("smem") == render_screen.hopper_smem(spec.param("bn"), spec.param("mw"),
                                                                   spec.param("stages"), consumers)


def test_a_compile_error_names_the_spec_and_log():
    from tinyknn.errors import CompileError

    from tinyknn.spec import KernelSpec

    good = render.scan_spec("l2", "float32", 64, 10, "sm_90")
    spec = KernelSpec("l2", "float32", 64, 10, "scan", "sm_90", tuple({**dict(good.params), "lanes": 3}.items()))
    with pytest.raises(CompileError, match="lanes per row") as caught:
        compile_cubin(cuda_source.render_source(spec), "sm_90", spec=spec)
    assert "lanes=3" in str(caught.value)


@pytest.mark.parametrize("third", [0, 1, 2])
def test_each_third_keeps_every_value_pair(third):
    import itertools

    combinations = list(read_manifest(default_manifest_path()).combinations)
    cover = _cover(combinations, third)
    assert len(cover) * 3 == len(combinations)
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in cover} == {(c[i], c[j]) for c in combinations}


def test_the_two_arches_compile_different_thirds_and_every_dim_free_kernel():
    """A kernel launched for several dims does not depend on the dim: each arch compiles every one of those."""
    combinations = list(read_manifest(default_manifest_path()).combinations)
    assert len(set(THIRDS.values())) == len(THIRDS)
    dims_of: dict[str, set] = {}
    for combination in combinations:
        for spec in search_kernels.specs_for_search(*combination, "sm_90"):
            dims_of.setdefault(cuda_source.name_expression(spec), set()).add(combination[2])
    chosen = set(_names("sm_90"))
    dim_free = {name for name, dims in dims_of.items() if len(dims) > 1}
    assert dim_free and dim_free <= chosen and len(chosen) < len(dims_of)
