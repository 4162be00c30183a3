"""tinyknn: exact k-nearest-neighbour search, specialised per (metric, dtype, dim, k) at run time."""

from .errors import CompileError, CpuLibraryError, CudaError, TinyKnnError
from .index import Index

__version__ = "0.1.0"

__all__ = ["Index", "TinyKnnError", "CompileError", "CudaError", "CpuLibraryError", "__version__"]
