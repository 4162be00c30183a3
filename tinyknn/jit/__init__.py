"""Run-time compilation: render a KernelSpec, compile it with NVRTC, cache the cubin. Needs no GPU.

Submodules are imported where used (render, compiler, cache, manifest): importing this package
loads neither NVRTC nor the kernel sources.
"""
