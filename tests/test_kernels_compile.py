"""Every kernel a search of the default manifest launches compiles for sm_80 and sm_90 with a 0-byte
stack frame and no spills (ptxas report), plus the large-k kernels outside the manifest.

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


def _names(arch: str) -> list[str]:
    combinations = list(read_manifest(default_manifest_path()).combinations) + EXTRA
    specs = [spec for combination in combinations for spec in render.specs_for_search(*combination, arch)]
    return sorted({render.name_expression(spec) for spec in specs})


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
