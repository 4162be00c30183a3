"""NVRTC compiles for explicit arches (no GPU needed): cubin bytes, lowered names, the ptxas report.

The toy kernels here (and `toy_render`, which the cache and CLI tests import) are templated on
(dim, k) like tinyknn's own, but small, so a compile takes a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tinyknn.errors import CompileError, TinyKnnError
from tinyknn.jit.compiler import KernelReport, compile_cubin, compile_options, nvrtc_version, parse_ptxas_log
from tinyknn.spec import KernelSpec


@dataclass(frozen=True)
class ToySource:
    """A RenderedSource look-alike: compile_cubin takes any object with these three fields."""

    source: str
    name_expressions: tuple[str, ...]
    options: tuple[str, ...] = ("-std=c++17",)


TOY_SOURCE = r"""
template <int D, int K> __global__ void toy(const float* __restrict__ x, float* out, int n) {
  float best[K];
  for (int i = 0; i < K; ++i) best[i] = 1e30f;
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int d = 0; d < D; ++d) { float v = x[r * D + d]; s += v * v; }
    for (int i = K - 1; i >= 0; --i) { if (s < best[i]) { float t = best[i]; best[i] = s; s = t; } }
  }
  for (int i = 0; i < K; ++i) out[i] = best[i];
}
// a run-time index into a local array: lives in local memory, so ptxas reports a stack frame
template <int K> __global__ void local_list(const float* x, float* out, int n) {
  float list[K] = {};
  for (int i = 0; i < n; ++i) list[(i * 7 + threadIdx.x) % K] += x[i];
  out[threadIdx.x] = list[threadIdx.x % K];
}
extern "C" __global__ void staged(float* out) {
  __shared__ float tile[64];
  tile[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = tile[63 - threadIdx.x];
}
"""


def toy_render(spec: KernelSpec) -> ToySource:
    """spec -> a one-kernel toy source: what the cache and the CLI tests use instead of render.py."""
    return ToySource(TOY_SOURCE, (f"toy<{spec.dim}, {spec.k}>",))


def toy_spec(dim: int = 128, k: int = 10, arch: str = "sm_90", metric: str = "l2") -> KernelSpec:
    return KernelSpec(metric, "float32", dim, k, "scan", arch)


@pytest.mark.nvrtc
def test_cubin_for_each_name_expression_with_its_report():
    rendered = ToySource(TOY_SOURCE, ("toy<128, 10>", "toy<64, 1>", "local_list<32>"))
    cubin = compile_cubin(rendered, "sm_90")
    assert cubin.image[:4] == b"\x7fELF"
    assert cubin.arch == "sm_90"
    assert cubin.nvrtc_version == nvrtc_version()
    assert cubin.lowered_names == {
        "toy<128, 10>": "_Z3toyILi128ELi10EEvPKfPfi",
        "toy<64, 1>": "_Z3toyILi64ELi1EEvPKfPfi",
        "local_list<32>": "_Z10local_listILi32EEvPKfPfi",
    }
    # every entry function is reported: the named ones under their name expression, others by symbol
    assert set(cubin.reports) == {"toy<128, 10>", "toy<64, 1>", "local_list<32>", "staged"}
    toy = cubin.reports["toy<128, 10>"]
    assert toy.registers > 0 and toy.stack_bytes == 0 and toy.spill_bytes == 0
    assert cubin.reports["local_list<32>"].stack_bytes >= 32 * 4, "a dynamically indexed list needs a stack frame"
    assert cubin.reports["staged"].shared_bytes == 64 * 4


@pytest.mark.nvrtc
def test_each_arch_gets_its_own_machine_code():
    rendered = ToySource(TOY_SOURCE, ("toy<96, 32>",))
    sm80, sm90 = compile_cubin(rendered, "sm_80"), compile_cubin(rendered, "90")
    assert (sm80.arch, sm90.arch) == ("sm_80", "sm_90")
    assert sm80.image != sm90.image


@pytest.mark.nvrtc
def test_register_limit_shows_up_as_spills():
    rendered = ToySource(TOY_SOURCE, ("toy<256, 100>",), ("-std=c++17", "--maxrregcount=24"))
    report = compile_cubin(rendered, "sm_90").reports["toy<256, 100>"]
    assert report.registers <= 24
    assert report.spill_store_bytes > 0 and report.spill_load_bytes > 0


@pytest.mark.nvrtc
def test_compile_error_shows_spec_options_log_and_source():
    spec = toy_spec()
    broken = ToySource(TOY_SOURCE + "\n__global__ void broken(float* o) { o[0] = undeclared_name; }\n", ("toy<8, 1>",))
    with pytest.raises(CompileError) as caught:
        compile_cubin(broken, "sm_80", spec=spec)
    error = caught.value
    assert error.spec == spec and str(spec) in str(error)
    assert "-arch=sm_80" in error.options and "--ptxas-options=-v" in error.options
    assert "undeclared_name" in error.log and "error" in error.log
    assert error.source == broken.source
    assert "undeclared_name" in error.dump().splitlines()[-1]


def test_options_name_the_arch_once_and_ask_for_the_report():
    # --no-cache: NVRTC's own compile cache answers without running ptxas, so without a report (seen with
    # NVRTC 13.0 on a machine with a driver, where every second compile of a source reported nothing)
    assert compile_options(ToySource("", ()), "compute_90") == ("-arch=sm_90", "-std=c++17", "--ptxas-options=-v",
                                                                "--no-cache")
    with pytest.raises(ValueError, match="must not name the arch"):
        compile_options(ToySource("", (), ("-arch=sm_70",)), "sm_90")
    with pytest.raises(ValueError, match="arch must look like"):
        compile_cubin(ToySource(TOY_SOURCE, ("toy<8, 1>",)), "volta")


@pytest.mark.nvrtc
def test_the_same_source_compiled_twice_reports_both_times():
    toy = ToySource(TOY_SOURCE, ("toy<8, 1>",))
    first, second = compile_cubin(toy, "sm_80"), compile_cubin(toy, "sm_80")
    assert first.reports["toy<8, 1>"].registers > 0
    assert second.reports == first.reports


@pytest.mark.nvrtc
def test_a_kernel_without_a_report_is_said_in_the_log(monkeypatch, caplog):
    import tinyknn.jit.compiler as compiler

    monkeypatch.setattr(compiler, "parse_ptxas_log", lambda log: {})     # as when NVRTC's cache answered
    with caplog.at_level("WARNING", logger="tinyknn.jit"):
        cubin = compile_cubin(ToySource(TOY_SOURCE, ("toy<8, 1>",)), "sm_80")
    assert cubin.reports == {} and cubin.image.startswith(b"\x7fELF")
    assert "no ptxas report for ['toy<8, 1>'] on sm_80" in caplog.text


@pytest.mark.nvrtc
def test_nvrtc_version_is_a_pair_of_ints():
    major, minor = nvrtc_version()
    assert isinstance(major, int) and isinstance(minor, int) and major >= 12


SM80_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z4scanILi128ELi100EEvPKfPfi' for 'sm_80'
ptxas info    : Function properties for _Z4scanILi128ELi100EEvPKfPfi
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 239 registers, used 1 barriers, 512 bytes smem, 372 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Function properties for helper
ptxas         .     64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'plain' for 'sm_80'
ptxas info    : Function properties for plain
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, 360 bytes cmem[0]
"""


def test_parse_ptxas_log_reads_entries_and_skips_device_functions():
    reports = parse_ptxas_log(SM80_LOG)
    assert reports == {
        "_Z4scanILi128ELi100EEvPKfPfi": KernelReport(239, 16, 8, 12, 512, 380),
        "plain": KernelReport(12, 0, 0, 0, 0, 360),
    }


def test_parse_ptxas_log_flags_serialized_wgmma():
    """ptxas's C7518 (its wgmma.mma_async serialized: correct, but the overlap gone; NVRTC's log carries it, seen on
    a Hopper screen variant with a wgmma behind a branch) is kept on that kernel only."""
    log = SM80_LOG + ("ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are "
                      "serialized due to program dependence on compiler-inserted WG.DP in divergent path in the "
                      "function 'plain'\n")
    reports = parse_ptxas_log(log)
    assert reports["plain"].wgmma_serialized and not reports["_Z4scanILi128ELi100EEvPKfPfi"].wgmma_serialized
    assert reports["plain"] == KernelReport(12, 0, 0, 0, 0, 360, wgmma_serialized=True)


def test_parse_ptxas_log_refuses_a_report_it_cannot_read():
    with pytest.raises(TinyKnnError, match="cannot read the ptxas report"):
        parse_ptxas_log("ptxas info    : Compiling entry function 'k' for 'sm_90'\n")
