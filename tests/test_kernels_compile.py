"""Every kernel a search of the default manifest launches compiles for sm_90 (the H100/H200 we ship for)
with a 0-byte stack frame and no spills (ptxas report), plus the large-k kernels outside the manifest; for
sm_80 every kernel that does not depend on the dim and a third of the (metric, dtype, dim, k) combinations
for those that do (every metric, dtype, dim and k value and every pair of them still appears): the sm_80
pass alone took 227 s of a 14-minute CI run on two cores.

Kernels are compiled many per NVRTC program (one name expression each, reports per function) and
programs in parallel threads (nvrtcCompileProgram releases the GIL), so the ~550 distinct kernels of
an arch take a couple of minutes on two cores. No GPU needed.
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


def _cover(combinations: list[tuple]) -> list[tuple]:
    """A third of the combinations: those whose value indices sum to 0 mod 3 (every value, every pair)."""
    axes = [sorted({c[i] for c in combinations}, key=str) for i in range(4)]
    return [c for c in combinations if sum(axes[i].index(c[i]) for i in range(4)) % 3 == 0]


def _names(arch: str) -> list[str]:
    combinations = list(read_manifest(default_manifest_path()).combinations)
    combinations = (_cover(combinations) if arch == "sm_80" else combinations) + EXTRA
    specs = [spec for combination in combinations for spec in render.specs_for_search(*combination, arch)]
    return sorted({render.name_expression(spec) for spec in specs})


def _compile(names: list[str], arch: str):
    rendered = render.RenderedSource(render.kernel_source(), tuple(names), render.OPTIONS)
    return compile_cubin(rendered, arch).reports


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_manifest_kernels_need_no_local_memory(arch):
    names = _names(arch)
    assert len(names) > 200            # the manifest is the full default one (a third of its dims on sm_80)
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


def test_the_sm_80_cover_keeps_every_value_pair():
    import itertools

    combinations = list(read_manifest(default_manifest_path()).combinations)
    cover = _cover(combinations)
    assert len(cover) * 3 == len(combinations)
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in cover} == {(c[i], c[j]) for c in combinations}
