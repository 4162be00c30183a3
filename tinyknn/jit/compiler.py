"""NVRTC: a rendered source and an explicit arch -> Cubin (ELF bytes, lowered names, ptxas report).

Straight to cubin for the named `sm_XX`, never PTX: PTX from a newer NVRTC fails to load on an older
driver, a cubin does not. The ptxas report (`--ptxas-options=-v`) is read from the program log, per
kernel, because it is the only place NVRTC says whether a kernel spilled or needs a stack frame.

cuda.bindings.nvrtc is used directly rather than cuda.core's Program: the renderer hands over NVRTC
options as plain strings, which cuda.core's ProgramOptions cannot carry, and the bindings' API is the
same on NVRTC 13.0 (GPU machine) and 13.5 (CI). nvrtcCompileProgram releases the GIL, so threads can
compile in parallel. NVRTC is imported lazily: `import tinyknn.jit.compiler` loads nothing.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Protocol

from ..errors import CompileError, TinyKnnError
from ..spec import parse_arch

PTXAS_VERBOSE = "--ptxas-options=-v"
NO_NVRTC_CACHE = "--no-cache"   # NVRTC (12.9 on) may answer from its own compile cache, where ptxas does not run
                                # and so reports nothing; tinyknn caches cubins itself (jit/cache.py)
_ELF_MAGIC = b"\x7fELF"
_log = logging.getLogger("tinyknn.jit")


class RenderedLike(Protocol):
    """What compile_cubin needs from tinyknn.jit.cuda_source.RenderedSource (duck-typed)."""

    source: str
    name_expressions: tuple[str, ...]
    options: tuple[str, ...]


@dataclass(frozen=True)
class KernelReport:
    """What ptxas said about one kernel: the numbers that tell a fast kernel from a spilling one."""

    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    constant_bytes: int = 0
    wgmma_serialized: bool = False     # ptxas serialized its wgmma.mma_async (C7518): correct, but slow

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


@dataclass(frozen=True)
class Cubin:
    image: bytes                       # the ELF cubin, loadable by cuModuleLoadData
    lowered_names: dict[str, str]      # name expression -> mangled name (cuModuleGetFunction)
    reports: dict[str, KernelReport]   # keyed by name expression (by symbol for unnamed kernels)
    arch: str                          # "sm_90"
    nvrtc_version: tuple[int, int]


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise TinyKnnError(
            f"NVRTC is not available ({exc}); install the GPU extra: pip install \"tinyknn[cuda]\" "
            "(cuda-core[cu13] brings the NVRTC wheel)"
        ) from exc
    return nvrtc


def _check(result, call: str):
    """A cuda.bindings NVRTC return tuple -> its value, or a TinyKnnError naming the call."""
    nvrtc = _nvrtc()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        raise TinyKnnError(f"{call} failed: {err.name} ({text.decode(errors='replace')})")
    return values[0] if len(values) == 1 else tuple(values)


SPILL_FREE_NVRTC = (13, 1)      # every kernel compiles without local memory from this NVRTC on (13.0.48 and
                                # 13.0.88 spill 8 bytes in four sm_80 kernels; 13.1-13.5 none): the cuda extra's floor


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library this process loads (loading it costs ~50-100 ms)."""
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


_ARCH_NAME = re.compile(r"^(?:sm_|compute_)?(\d{2,3})([a-z]?)$")


def normalise_arch(text) -> str:
    """'90', '90a', 'sm_90a', 'compute_90' -> 'sm_90' / 'sm_90a' (NVRTC's -arch spelling); else ValueError."""
    match = _ARCH_NAME.match(str(text).strip().lower())
    if not match:
        raise ValueError(f"arch must look like sm_90, 90, sm_90a or 90a; got {text!r}")
    return f"sm_{match.group(1)}{match.group(2)}"


@functools.lru_cache(maxsize=1)
def supported_arches() -> tuple[str, ...]:
    """The real arches this NVRTC compiles for ("sm_75", ...), as nvrtcGetSupportedArchs lists them."""
    return tuple(f"sm_{number}" for number in _check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


@dataclass(frozen=True)
class _Probe:
    source: str = 'extern "C" __global__ void tinyknn_arch_probe(float* out) { out[threadIdx.x] = 1.0f; }'
    name_expressions: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


@functools.lru_cache(maxsize=None)
def arch_problem(arch: str) -> str | None:
    """None if this NVRTC compiles for `arch` (a one-line kernel, tens of ms); else NVRTC's reason, once,
    so `tinyknn cache warm` can refuse an arch up front instead of failing every kernel."""
    try:
        compile_cubin(_Probe(), arch)
    except CompileError as exc:
        lines = [line.strip() for line in exc.log.splitlines() if line.strip()]
        return lines[0] if lines else "NVRTC refused it"
    return None


def compile_options(rendered: RenderedLike, arch: str) -> tuple[str, ...]:
    """Every option NVRTC gets for `rendered` on `arch`: the cache key hashes exactly this."""
    arch = parse_arch(arch)
    for option in rendered.options:
        if option.startswith(("-arch", "--gpu-architecture")):
            raise ValueError(
                f"rendered options must not name the arch (compile_cubin adds -arch={arch}); got {option!r}"
            )
    return (f"-arch={arch}", *rendered.options, PTXAS_VERBOSE, NO_NVRTC_CACHE)


def compile_cubin(rendered: RenderedLike, arch: str, *, spec=None) -> Cubin:
    """Compile `rendered` for `arch` to a cubin; CompileError (with log and source) if NVRTC refuses."""
    nvrtc = _nvrtc()
    options = compile_options(rendered, arch)
    arch = parse_arch(arch)
    version = nvrtc_version()
    program = _check(nvrtc.nvrtcCreateProgram(rendered.source.encode(), b"tinyknn.cu", 0, [], []),
                     "nvrtcCreateProgram")
    try:
        for expression in rendered.name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(program, expression.encode()), "nvrtcAddNameExpression")
        encoded = [option.encode() for option in options]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        log = _program_log(nvrtc, program)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            what = spec if spec is not None else f"name expressions {list(rendered.name_expressions)}"
            raise CompileError(what, options, log or status.name, rendered.source)
        size = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        image = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(program, image), "nvrtcGetCUBIN")
        lowered = {
            expression: _check(nvrtc.nvrtcGetLoweredName(program, expression.encode()),
                               "nvrtcGetLoweredName").decode()
            for expression in rendered.name_expressions
        }
    finally:
        _check(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")
    if not image.startswith(_ELF_MAGIC):
        raise TinyKnnError(f"NVRTC returned no ELF cubin for {arch} (got {bytes(image[:4])!r})")
    reports = reports_by_name(parse_ptxas_log(log), lowered)
    if missing := [expression for expression in lowered if expression not in reports]:
        _log.warning("NVRTC %d.%d gave no ptxas report for %s on %s: its registers and spills are unknown",
                     *version, missing, arch)
    return Cubin(bytes(image), lowered, reports, arch, version)


def _program_log(nvrtc, program) -> str:
    size = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
    buffer = bytearray(size)
    _check(nvrtc.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
    return buffer.rstrip(b"\0").decode(errors="replace")


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized.*function '([^']+)'")
_SHARED = re.compile(r"(\d+) bytes smem")
_CONSTANT = re.compile(r"(\d+) bytes cmem\[\d+\]")


def parse_ptxas_log(log: str) -> dict[str, KernelReport]:
    """ptxas -v lines -> {symbol: KernelReport} for every entry function (device functions skipped)."""
    fields: dict[str, dict[str, int]] = {}
    serialized = {match.group(1) for match in map(_SERIALIZED.search, log.splitlines()) if match}
    entry = properties = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            entry = match.group(1)
            fields[entry] = {}
        elif match := _PROPERTIES.search(line):
            properties = match.group(1)
        elif (match := _FRAME.search(line)) and properties in fields:
            stack, stores, loads = map(int, match.groups())
            fields[properties].update(stack_bytes=stack, spill_store_bytes=stores, spill_load_bytes=loads)
        elif (match := _REGISTERS.search(line)) and entry in fields:
            fields[entry].update(
                registers=int(match.group(1)),
                shared_bytes=sum(int(n) for n in _SHARED.findall(line)),
                constant_bytes=sum(int(n) for n in _CONSTANT.findall(line)),
            )
    required = ("registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes")
    incomplete = [symbol for symbol, found in fields.items() if any(name not in found for name in required)]
    if incomplete:
        raise TinyKnnError(f"cannot read the ptxas report of {incomplete} from the NVRTC log:\n{log}")
    return {symbol: KernelReport(**{"shared_bytes": 0, **found}, wgmma_serialized=symbol in serialized)
            for symbol, found in fields.items()}


def reports_by_name(by_symbol: dict[str, KernelReport], lowered: dict[str, str]) -> dict[str, KernelReport]:
    """Re-key reports by name expression; kernels no name expression names keep their symbol."""
    expression_of = {symbol: expression for expression, symbol in lowered.items()}
    return {expression_of.get(symbol, symbol): report for symbol, report in by_symbol.items()}
