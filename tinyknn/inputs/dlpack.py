"""Reading a DLPack capsule's tensor description (pointer, shape, strides, dtype) with ctypes only.

Used for CUDA arrays that export DLPack but not __cuda_array_interface__ (JAX, for one): the GPU
searcher reads them in place like any other CUDA array. No CUDA import here: the capsule is plain
memory laid out as dlpack.h's DLManagedTensor, whose first member is the DLTensor read below.
"""

from __future__ import annotations

import ctypes

import numpy as np

# dlpack.h DLDeviceType: kDLCPU 1, kDLCUDA 2, kDLCUDAHost 3 (pinned host memory), kDLCUDAManaged 13.
DEVICE_KINDS = {1: "cpu", 2: "cuda", 3: "cpu", 13: "cuda"}
# dlpack.h DLDataTypeCode: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBool 6 (kDLBfloat 4 has no NumPy dtype).
_DTYPE_KINDS = {0: "i", 1: "u", 2: "f", 6: "b"}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# Our own prototype, so that no process-wide ctypes.pythonapi setting is changed.
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))


def _dtype(code: int, bits: int, lanes: int) -> np.dtype:
    kind = _DTYPE_KINDS.get(code)
    if kind is None or lanes != 1 or bits % 8 or bits == 0:
        raise TypeError(f"DLPack dtype (code {code}, {bits} bits, {lanes} lanes) has no NumPy equivalent; "
                        "tinyknn reads float16, float32 and float64")
    return np.dtype(bool) if kind == "b" else np.dtype(f"{kind}{bits // 8}")


def capsule_of(x):
    """x.__dlpack__() asked to order the producer's work before the legacy default stream (1), and
    the stream the consumer must then wait on (None where the producer takes no stream argument)."""
    try:
        return x.__dlpack__(stream=1), 1
    except TypeError:
        return x.__dlpack__(), None


def describe(x):
    """The fields of an arrays.DeviceArray for a DLPack exporter; the capsule is kept alive with it."""
    capsule, stream = capsule_of(x)
    if not _capsule_valid(capsule, b"dltensor"):
        raise TypeError(f"{type(x).__name__}.__dlpack__() did not return an unused 'dltensor' capsule")
    tensor = _Tensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    dtype = _dtype(tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    strides = None
    if tensor.strides:
        strides = tuple(int(tensor.strides[i]) * dtype.itemsize for i in range(tensor.ndim))   # elements -> bytes
    return dict(
        obj=x, framework=type(x).__module__.split(".")[0], ptr=int(tensor.data or 0) + int(tensor.byte_offset),
        shape=shape, dtype=dtype, strides=strides, stream=stream, readonly=False, keepalive=capsule,
    )
