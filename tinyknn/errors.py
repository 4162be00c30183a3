"""The exceptions tinyknn raises beyond ValueError/TypeError for bad input."""

from __future__ import annotations


class TinyKnnError(RuntimeError):
    """Base class of tinyknn's own failures (bad input raises ValueError or TypeError instead)."""


class CompileError(TinyKnnError):
    """NVRTC rejected a kernel source: carries the spec, the options, the log and the source."""

    def __init__(self, spec, options, log: str, source: str):
        self.spec = spec
        self.options = list(options)
        self.log = log
        self.source = source
        super().__init__(
            f"NVRTC could not compile {spec}\noptions: {' '.join(self.options)}\n--- NVRTC log ---\n{log.strip()}"
        )

    def dump(self) -> str:
        """The full source that failed, with line numbers, for a bug report."""
        return "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(self.source.splitlines()))


class CudaError(TinyKnnError):
    """A CUDA driver call failed: names the call, the CUDA error and, for launches, the configuration."""

    def __init__(self, call: str, error_name: str, error_string: str = "", launch: str | None = None):
        self.call = call
        self.error_name = error_name
        self.error_string = error_string
        self.launch = launch
        message = f"{call} failed: {error_name}"
        if error_string:
            message += f" ({error_string})"
        if launch:
            message += f"; launch {launch}"
        super().__init__(message)


class CpuLibraryError(TinyKnnError):
    """The C++ CPU library could not be built, loaded, or reported a failure."""
