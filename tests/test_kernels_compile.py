"""Every kernel a search of the default manifest launches compiles with a 0-byte stack frame and no spills
(ptxas report), for sm_90 (the H100/H200 we ship for) and sm_80, plus the large-k kernels outside the
manifest. Per arch: every kernel that does not depend on the dim, and a third of the (metric, dtype, dim, k)
combinations for those that do (every value and every pair of values still appears), a different third for
each arch, so the two together compile two thirds of the dim-dependent kernels: all of them on both arches
took 6.5 of a 14-minute CI run on two cores, for kernels that differ by a compile-time dim.

Kernels are compiled many per NVRTC program (one name expression each, reports per function) and
programs in parallel threads (nvrtcCompileProgram releases the GIL). No GPU needed.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from tinyknn.jit import render
from tinyknn.jit.compiler import compile_cubin
from tinyknn.jit.manifest import default_manifest_path, read_manifest

pytestmark = pytest.mark.nvrtc

PROGRAM_SIZE = 24          # name expressions per NVRTC program
EXTRA = [(m, t, d, k) for m in ("l2", "ip", "cosine") for t in ("float32", "float16") for d in (3, 130)
         for k in (1000, 2048)]


THIRDS = {"sm_90": 0, "sm_80": 1}   # which third of the dim-dependent combinations each arch compiles


def _cover(combinations: list[tuple], third: int = 0) -> list[tuple]:
    """A third of the combinations: those whose value indices sum to `third` mod 3 (every value, every pair)."""
    axes = [sorted({c[i] for c in combinations}, key=str) for i in range(4)]
    return [c for c in combinations if sum(axes[i].index(c[i]) for i in range(4)) % 3 == third]


def _names(arch: str) -> list[str]:
    combinations = list(read_manifest(default_manifest_path()).combinations)
    covered = set(_cover(combinations, THIRDS[arch]))
    dims = sorted({c[2] for c in combinations})

    def names(metric, dtype, dim, k) -> set[str]:
        return {render.name_expression(spec) for spec in render.specs_for_search(metric, dtype, dim, k, arch)}

    found: set[str] = set()
    for metric, dtype, dim, k in combinations:
        these = names(metric, dtype, dim, k)
        if (metric, dtype, dim, k) not in covered:    # only the kernels another dim would launch as well
            these &= names(metric, dtype, dims[0] if dim != dims[0] else dims[1], k)
        found |= these
    for combination in EXTRA:
        found |= names(*combination)
    return sorted(found)


def _compile(names: list[str], arch: str):
    rendered = render.RenderedSource(render.kernel_source(), tuple(names), render.OPTIONS)
    return compile_cubin(rendered, arch).reports


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_manifest_kernels_need_no_local_memory(arch):
    names = _names(arch)
    assert len(names) > 200            # the manifest is the full default one
    programs = [names[i:i + PROGRAM_SIZE] for i in range(0, len(names), PROGRAM_SIZE)]
    with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
        reports = {}
        for found in pool.map(lambda program: _compile(program, arch), programs):
            reports.update(found)
    assert set(names) <= set(reports)
    bad = {name: r for name, r in reports.items()
           if r.stack_bytes or r.spill_store_bytes or r.spill_load_bytes}
    assert not bad, "\n".join(f"{name}: {r}" for name, r in sorted(bad.items()))
    assert max(r.registers for r in reports.values()) <= 255


def test_a_compile_error_names_the_spec_and_log():
    from tinyknn.errors import CompileError

    from tinyknn.spec import KernelSpec

    good = render.scan_spec("l2", "float32", 64, 10, "sm_90")
    spec = KernelSpec("l2", "float32", 64, 10, "scan", "sm_90", tuple({**dict(good.params), "lanes": 3}.items()))
    with pytest.raises(CompileError, match="lanes per row") as caught:
        compile_cubin(render.render_source(spec), "sm_90", spec=spec)
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
        for spec in render.specs_for_search(*combination, "sm_90"):
            dims_of.setdefault(render.name_expression(spec), set()).add(combination[2])
    chosen = set(_names("sm_90"))
    dim_free = {name for name, dims in dims_of.items() if len(dims) > 1}
    assert dim_free and dim_free <= chosen and len(chosen) < len(dims_of)
