"""TMA tensor maps (cuTensorMapEncodeTiled) of the Hopper screen's operands: a row-major matrix of `rows` rows
of `row_bytes` bytes (the rows' padded layout), read in boxes of 128 bytes x `box_rows` rows with the
128-byte swizzle that the kernel's wgmma descriptors expect; elements past a row's bytes or past the last
row read as zeros. The element type only sets the element size (the bits are copied as they are)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .device import check

BOX_BYTES = 128                 # one k-block: the 128-byte swizzle's row
MAX_BOX_ROWS = 256


@dataclass(frozen=True)
class TensorMapArgs:
    """What cuTensorMapEncodeTiled gets (innermost dimension first)."""

    element_bytes: int          # 1 or 2
    address: int
    dims: tuple[int, int]       # (elements per row, rows)
    row_pitch: int              # bytes between rows
    box: tuple[int, int]        # (elements per box row, rows per box)


def tensor_map_args(address: int, rows: int, row_bytes: int, element_bytes: int, box_rows: int) -> TensorMapArgs:
    """The arguments of a map over `rows` rows of `row_bytes` bytes at `address`; ValueError where TMA refuses."""
    if element_bytes not in (1, 2):
        raise ValueError(f"the Hopper screen reads 1- or 2-byte elements; got {element_bytes}-byte ones")
    if address % 16 or row_bytes % 16 or row_bytes <= 0:
        raise ValueError(f"a tensor map needs a 16-byte aligned address and row pitch; got address {address:#x}, "
                         f"row_bytes {row_bytes}")
    if not 1 <= rows < 1 << 31:
        raise ValueError(f"a tensor map of the screen holds 1 to 2^31 - 1 rows; got {rows}")
    if not 1 <= box_rows <= MAX_BOX_ROWS:
        raise ValueError(f"a TMA box holds 1 to {MAX_BOX_ROWS} rows; got {box_rows}")
    return TensorMapArgs(element_bytes, address, (row_bytes // element_bytes, rows), row_bytes,
                         (BOX_BYTES // element_bytes, box_rows))


def encode(args: TensorMapArgs):
    """The CUtensorMap of `args` (a cuda.bindings object; `as_bytes` gives its 128 bytes)."""
    from cuda.bindings import driver as cu

    data_type = (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16 if args.element_bytes == 2
                 else cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8)
    return check(cu.cuTensorMapEncodeTiled(
        data_type, 2, args.address, [cu.cuuint64_t(d) for d in args.dims], [cu.cuuint64_t(args.row_pitch)],
        [cu.cuuint32_t(b) for b in args.box], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")


def as_bytes(tensor_map) -> bytes:
    """The 128 bytes of a CUtensorMap, as a kernel parameter takes them."""
    return ctypes.string_at(tensor_map.getPtr(), 128)


__all__ = ["TensorMapArgs", "as_bytes", "encode", "tensor_map_args"]
