"""TMA tensor maps (cuTensorMapEncodeTiled) of the Hopper screen's operands: a row-major matrix of `rows` rows
of `row_bytes` bytes (the rows' padded layout), read in boxes of 128 bytes x `box_rows` rows with the
128-byte swizzle that the kernel's wgmma descriptors expect; elements past a row's bytes or past the last
row read as zeros. The element type only sets the element size (the bits are copied as they are). The
threshold mode's sample is a 3-D map of the same rows: (elements, tile, row of the tile), a tile's rows
`tiles` sampled rows apart, read a whole tile (`box_rows` rows) at a time."""

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
    dims: tuple[int, ...]       # (elements per row, rows) or (elements per row, tiles, rows per tile)
    pitches: tuple[int, ...]    # bytes between consecutive indices of each dimension but the first
    box: tuple[int, ...]        # (elements per box row, rows per box) or (elements, 1, rows per box)


def tensor_map_args(address: int, rows: int, row_bytes: int, element_bytes: int, box_rows: int) -> TensorMapArgs:
    """The arguments of a map over `rows` rows of `row_bytes` bytes at `address`; ValueError where TMA refuses."""
    _check(address, row_bytes, element_bytes, box_rows)
    if not 1 <= rows < 1 << 31:
        raise ValueError(f"a tensor map of the screen holds 1 to 2^31 - 1 rows; got {rows}")
    return TensorMapArgs(element_bytes, address, (row_bytes // element_bytes, rows), (row_bytes,),
                         (BOX_BYTES // element_bytes, box_rows))


def sample_map_args(address: int, tiles: int, step: int, row_bytes: int, element_bytes: int,
                    box_rows: int) -> TensorMapArgs:
    """The threshold mode's sample: `tiles` tiles of `box_rows` rows, row j of tile t being row (t + j tiles) step
    of the matrix at `address` (so every row it names is below tiles x box_rows x step)."""
    _check(address, row_bytes, element_bytes, box_rows)
    if tiles < 1 or step < 1 or tiles * box_rows * step >= 1 << 31:
        raise ValueError(f"a sample of {tiles} tiles of {box_rows} rows, {step} rows apart, is out of the screen's "
                         "range (at least one tile, under 2^31 rows)")
    return TensorMapArgs(element_bytes, address, (row_bytes // element_bytes, tiles, box_rows),
                         (step * row_bytes, tiles * step * row_bytes), (BOX_BYTES // element_bytes, 1, box_rows))


def _check(address: int, row_bytes: int, element_bytes: int, box_rows: int) -> None:
    if element_bytes not in (1, 2):
        raise ValueError(f"the Hopper screen reads 1- or 2-byte elements; got {element_bytes}-byte ones")
    if address % 16 or row_bytes % 16 or row_bytes <= 0:
        raise ValueError(f"a tensor map needs a 16-byte aligned address and row pitch; got address {address:#x}, "
                         f"row_bytes {row_bytes}")
    if not 1 <= box_rows <= MAX_BOX_ROWS:
        raise ValueError(f"a TMA box holds 1 to {MAX_BOX_ROWS} rows; got {box_rows}")


def encode(args: TensorMapArgs):
    """The CUtensorMap of `args` (a cuda.bindings object; `as_bytes` gives its 128 bytes)."""
    from cuda.bindings import driver as cu

    data_type = (cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16 if args.element_bytes == 2
                 else cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8)
    return check(cu.cuTensorMapEncodeTiled(
        data_type, len(args.dims), args.address, [cu.cuuint64_t(d) for d in args.dims],
        [cu.cuuint64_t(p) for p in args.pitches], [cu.cuuint32_t(b) for b in args.box],
        [cu.cuuint32_t(1)] * len(args.dims),
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")


def as_bytes(tensor_map) -> bytes:
    """The 128 bytes of a CUtensorMap, as a kernel parameter takes them."""
    return ctypes.string_at(tensor_map.getPtr(), 128)


__all__ = ["TensorMapArgs", "as_bytes", "encode", "sample_map_args", "tensor_map_args"]
