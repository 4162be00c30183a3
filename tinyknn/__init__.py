"""tinyknn: exact k-nearest-neighbour search, specialised per (metric, dtype, dim, k) at run time."""

import logging as _logging

from .errors import CompileError, CpuLibraryError, CudaError, TinyKnnError
from ._version import __version__
from .index import Index
from .groundtruth import groundtruth, recall   # the functions; the package stays importable by its full name

# Events go to loggers under "tinyknn" (tinyknn.jit.cache, tinyknn.cpu.library, ...); silent unless the
# application configures logging.
_logging.getLogger("tinyknn").addHandler(_logging.NullHandler())

__all__ = ["Index", "groundtruth", "recall", "TinyKnnError", "CompileError", "CudaError", "CpuLibraryError", "__version__"]
