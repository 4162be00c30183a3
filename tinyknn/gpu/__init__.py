"""Everything that needs a CUDA driver, through cuda.bindings.driver; nothing touches it at import.

device    has_gpu(), DeviceInfo, the primary context, error checking
memory    DeviceBuffer, PinnedBuffer, Stream, Event
launcher  loaded cubins, kernels, pre-packed launches (the only cuLaunchKernel), graph replay
searcher  GpuSearcher (the search plan)
"""

from .device import has_gpu, why_no_gpu

__all__ = ["has_gpu", "why_no_gpu"]
