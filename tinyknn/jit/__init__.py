"""Run-time compilation: render a KernelSpec, compile it with NVRTC, cache the cubin. Needs no GPU.

Submodules are imported where used (render, render_single and render_screen: the specs; search_kernels: those
a search may launch; cuda_source: their CUDA text; compiler, cache, manifest): importing this package loads
neither NVRTC nor the kernel sources.
"""
