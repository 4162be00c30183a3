// tinyknn: the ingest kernel: any float rows -> the padded storage layout. Part of the GPU kernel templates; see search.cuh for how a search
// uses them and tinyknn/jit/render.py for the template arguments.
#pragma once
#include "topk.cuh"

namespace tinyknn {

// ---- ingest: any rows -> the padded storage layout (+ inverse norms, + a bad-value flag) ----
// Conversions round to nearest (float64 -> float16 directly; -> bfloat16 through float32, as the host
// side converts too); 8-bit storage takes integer values only (checked), stored exactly.
TINYKNN_D void store_as(float& out, double value) { out = (float)value; }
TINYKNN_D void store_as(half_bits& out, double value) { asm("cvt.rn.f16.f64 %0, %1;" : "=h"(out) : "d"(value)); }
TINYKNN_D void store_as(bf16_bits& out, double value) {
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"((float)value));
}
TINYKNN_D void store_as(signed char& out, double value) { out = (signed char)(int)value; }
TINYKNN_D void store_as(unsigned char& out, double value) { out = (unsigned char)(int)value; }

// The values a stored element may take (same rule as tinyknn/inputs/validate.py): float16's and 8-bit integers'
// ranges, else |x| <= 2^50 so that float32 sums of squares cannot overflow; 8-bit types take integers only.
template <class T> struct StorageLimit {
  static constexpr double low = -1125899906842624.0, high = 1125899906842624.0;
  static constexpr bool integer = false;
};
template <> struct StorageLimit<half_bits> {
  static constexpr double low = -65504.0, high = 65504.0;
  static constexpr bool integer = false;
};
template <> struct StorageLimit<signed char> {
  static constexpr double low = -128.0, high = 127.0;
  static constexpr bool integer = true;
};
template <> struct StorageLimit<unsigned char> {
  static constexpr double low = 0.0, high = 255.0;
  static constexpr bool integer = true;
};

// Source element kinds (tinyknn/gpu/searcher.py SOURCE_KINDS): the element read as a double, exactly.
TINYKNN_D double read_source(const void* src, int kind, long long at) {
  switch (kind) {
    case 0: return static_cast<const double*>(src)[at];
    case 1: return static_cast<const float*>(src)[at];
    case 2: return half_to_float(static_cast<const half_bits*>(src)[at]);
    case 3: return bf16_to_float(static_cast<const bf16_bits*>(src)[at]);
    case 4: return static_cast<const signed char*>(src)[at];
    default: return static_cast<const unsigned char*>(src)[at];
  }
}

template <class T> TINYKNN_D bool storable(double value) {
  const bool in_range = value >= StorageLimit<T>::low && value <= StorageLimit<T>::high;   // NaN fails
  return in_range && (!StorageLimit<T>::integer || value == (double)(long long)value);
}

// One warp per row. src holds n_rows rows of dim elements of kind src_kind (read_source),
// src_row_stride elements apart. dst gets dst_row_stride (>= dim) elements per row, zero padded.
// status |= 1 when a value is NaN, infinite or beyond StorageLimit. norms may be null; it gets
// 1 / |x| (cosine: from the float64 sum of squares, so tiny rows keep their norm; at most FLT_MAX) or,
// with `squared`, the float32 |x|^2 (l2's filter key). row_stats (if not null: the database, never
// queries) collects what verify.cuh's bounds need: [0] the largest |x|^2 rounded up, [1] ~ the smallest
// non-zero |x|^2 rounded down, both as float bits of float64 sums (non-negative floats order like their
// bits: atomicMax works; 0 means none yet).
// Not on the search path, so dim is a run-time value: one kernel per storage type serves every dim.
template <class T>
__global__ void __launch_bounds__(256)
ingest_kernel(const void* __restrict__ src, int src_kind, long long src_row_stride, long long n_rows, int dim,
              T* __restrict__ dst, int dst_row_stride, float* __restrict__ norms, int squared,
              unsigned* __restrict__ row_stats, int* __restrict__ status) {
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < n_rows; row += warps) {
    float sum_of_squares = 0.0f;
    double wide_sum = 0.0;
    bool bad = false;
    for (int e = lane; e < dst_row_stride; e += 32) {
      T out;
      store_as(out, 0.0);
      if (e < dim) {
        const double value = read_source(src, src_kind, row * src_row_stride + e);
        bad |= !storable<T>(value);
        store_as(out, value);
      }
      dst[row * dst_row_stride + e] = out;
      const float stored = to_float(out);
      sum_of_squares += stored * stored;
      wide_sum += (double)stored * (double)stored;
    }
    sum_of_squares = sum_over_lanes<32>(sum_of_squares);
    for (int offset = 16; offset > 0; offset /= 2) wide_sum += __shfl_xor_sync(FULL_WARP, wide_sum, offset);
    if (lane == 0 && norms != nullptr) {
      const float inverse = wide_sum > 0.0 ? __double2float_rn(fmin(1.0 / sqrt(wide_sum), 3.4028234663852886e38)) : 0.0f;
      norms[row] = squared ? sum_of_squares : inverse;
    }
    // A bad row fails the whole add; only an over-estimate of the maximum may stay behind, never NaN.
    const bool any_bad = __any_sync(FULL_WARP, bad);
    if (lane == 0 && row_stats != nullptr && !any_bad) {
      atomicMax(row_stats, __float_as_uint(__double2float_ru(wide_sum * (1.0 + 1e-12))));
      if (wide_sum > 0.0) atomicMax(row_stats + 1, ~__float_as_uint(__double2float_rd(wide_sum * (1.0 - 1e-12))));
    }
    if (any_bad && lane == 0) atomicOr(status, 1);
  }
}

}  // namespace tinyknn
