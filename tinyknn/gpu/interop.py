"""CUDA arrays of other frameworks (CuPy, torch, anything with __cuda_array_interface__): where they
live, their row layout, the stream their producer works on, and result arrays of the same kind.

tinyknn never copies such an array to the host: the kernels read it in place (any float dtype, any
row step), ordered after the caller's current stream through events.
"""

from __future__ import annotations

from cuda.bindings import driver

from ..inputs.validate import DeviceArray


def device_ordinal(array: DeviceArray, what: str) -> int:
    """The device that holds `array`'s memory; a TypeError when the pointer is not device memory."""
    attribute = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    err, ordinal = driver.cuPointerGetAttribute(attribute, array.ptr)
    if err:
        raise TypeError(f"{what} claims to be a CUDA array ({array.framework}) but its pointer {array.ptr:#x} "
                        f"is not device memory the driver knows ({err.name})")
    return int(ordinal)


def check_device(array: DeviceArray, ordinal: int, what: str) -> None:
    """Refuse an array on another GPU before any launch."""
    if array.ptr == 0 or array.shape[0] == 0:
        return
    found = device_ordinal(array, what)
    if found != ordinal:
        raise ValueError(f"{what} is on CUDA device {found} but this index lives on device {ordinal}; "
                         f"move the array (e.g. .to('cuda:{ordinal}') or cupy.asarray under Device({ordinal}))")


def row_step(array: DeviceArray, what: str) -> int:
    """Elements from one row to the next. Rows must be contiguous; the step between them may be any."""
    rows, cols = array.shape
    item = array.dtype.itemsize
    if array.strides is None or array.c_contiguous:
        return cols
    step, column = array.strides
    if (cols > 1 and column != item) or step % item or (rows > 1 and step < cols * item):
        raise ValueError(f"{what} must have contiguous rows (strides (row_step >= {cols * item}, {item}) bytes); "
                         f"got strides {array.strides}; pass a contiguous copy")
    return step // item if rows > 1 else cols


def caller_stream(array: DeviceArray) -> int:
    """The stream the caller's framework works on now: tinyknn orders its work after it."""
    if array.framework == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    if array.framework == "torch":
        import torch

        return int(torch.cuda.current_stream(array.obj.device).cuda_stream)
    stream = array.stream          # __cuda_array_interface__ v3: None (no sync needed), 1 legacy, 2 per-thread
    return 0 if stream is None else int(stream)


def empty_results(array: DeviceArray, n_queries: int, k: int, ordinal: int):
    """(distances float32, ids int64) arrays of shape (n_queries, k) in the caller's framework, with
    their device pointers. torch in -> torch out; CuPy (and any other CUDA array) -> CuPy."""
    if array.framework == "torch":
        import torch

        device = array.obj.device
        distances = torch.empty((n_queries, k), dtype=torch.float32, device=device)
        ids = torch.empty((n_queries, k), dtype=torch.int64, device=device)
        return distances, ids, distances.data_ptr(), ids.data_ptr()
    try:
        import cupy
    except ImportError:
        raise TypeError(
            f"results for a {array.framework} CUDA array come back as CuPy arrays, and CuPy is not installed; "
            "pass a CuPy array or a torch tensor"
        ) from None
    with cupy.cuda.Device(ordinal):
        distances = cupy.empty((n_queries, k), dtype=cupy.float32)
        ids = cupy.empty((n_queries, k), dtype=cupy.int64)
    return distances, ids, distances.data.ptr, ids.data.ptr


__all__ = ["caller_stream", "check_device", "device_ordinal", "empty_results", "row_step"]
