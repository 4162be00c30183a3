// tinyknn: the three metrics as types, shared by the CPU library and the GPU kernels.
//
// A metric says how one coordinate pair accumulates (in float32), how the sum becomes the reported
// distance, and which direction is better. Selection always works on a "key" where smaller is
// better: key = distance for l2, key = -similarity for ip and cosine.
//
// Each formula is written once as a template on the value type T, so the CPU library can run it on
// whole SIMD vectors (GCC/Clang vector extensions, one lane per database row); the float overloads
// are what scalar callers (and the GPU kernels) use, and simply call the template.
//
// Accuracy: l2 sums squared *differences* (never |q|^2 + |x|^2 - 2 q.x), so data far from the origin
// keeps its precision: the relative error of a distance is bounded by about dim * 2^-24. Inputs are
// bounded by |x| <= 2^50 (checked in Python), so no sum overflows float32.
#pragma once
#include "common.cuh"

namespace tinyknn {

struct L2 {
  static constexpr bool larger_is_better = false;
  static constexpr bool needs_norms = false;       // inverse norms of rows and queries (cosine)
  static constexpr bool squared_row_norms = false; // |x|^2 of rows (L2Expanded)
  template <class T> TINYKNN_HD static T accumulate(T sum, T q, T x) {
    const T d = q - x;
    return sum + d * d;
  }
  TINYKNN_HD static float accumulate(float sum, float q, float x) { return accumulate<float>(sum, q, x); }
  // inverse norms are unused for l2
  template <class T> TINYKNN_HD static T finish(T sum, T, T) { return sum; }
  TINYKNN_HD static float finish(float sum, float, float) { return sum; }
};

struct InnerProduct {
  static constexpr bool larger_is_better = true;
  static constexpr bool needs_norms = false;
  static constexpr bool squared_row_norms = false;
  template <class T> TINYKNN_HD static T accumulate(T sum, T q, T x) { return sum + q * x; }
  TINYKNN_HD static float accumulate(float sum, float q, float x) { return accumulate<float>(sum, q, x); }
  template <class T> TINYKNN_HD static T finish(T sum, T, T) { return sum; }
  TINYKNN_HD static float finish(float sum, float, float) { return sum; }
};

// Cosine similarity: the inner product scaled by both inverse norms (database norms are computed once
// at add time, query norms once per search). A zero vector has inverse norm 0, so its similarity with
// anything is 0: defined, finite, and documented.
struct Cosine {
  static constexpr bool larger_is_better = true;
  static constexpr bool needs_norms = true;
  static constexpr bool squared_row_norms = false;
  template <class T> TINYKNN_HD static T accumulate(T sum, T q, T x) { return sum + q * x; }
  TINYKNN_HD static float accumulate(float sum, float q, float x) { return accumulate<float>(sum, q, x); }
  template <class T> TINYKNN_HD static T finish(T sum, T query_inv_norm, T data_inv_norm) {
    return sum * query_inv_norm * data_inv_norm;
  }
  TINYKNN_HD static float finish(float sum, float query_inv_norm, float data_inv_norm) {
    return finish<float>(sum, query_inv_norm, data_inv_norm);
  }
};

// l2 for the GPU's large batches only: a *filter* key |x|^2 - 2 q.x (|q|^2 is the same for every row
// of a query, so it is left out), one FMA per element instead of a subtraction and an FMA. It loses
// precision far from the origin, so it only picks candidates: the rescore kernel (merge.cuh)
// recomputes their distances as sums of squared differences and proves, from a rounding-error bound,
// that no other row can be closer; a query where the proof fails is searched again with L2.
struct L2Expanded {
  static constexpr bool larger_is_better = false;
  static constexpr bool needs_norms = false;
  static constexpr bool squared_row_norms = true;
  TINYKNN_HD static float accumulate(float sum, float q, float x) { return sum + q * x; }
  TINYKNN_HD static float finish(float dot, float, float row_squared_norm) { return row_squared_norm - 2.0f * dot; }
};

// 1 / sqrt(sum of squares), or 0 for a zero vector.
TINYKNN_HD float inverse_norm(float sum_of_squares) {
#if TINYKNN_DEVICE
  return sum_of_squares > 0.0f ? rsqrtf(sum_of_squares) : 0.0f;
#else
  return sum_of_squares > 0.0f ? 1.0f / __builtin_sqrtf(sum_of_squares) : 0.0f;
#endif
}

// Distance <-> selection key (smaller key is better).
template <class Metric> TINYKNN_HD float to_key(float distance) {
  return Metric::larger_is_better ? -distance : distance;
}
template <class Metric> TINYKNN_HD float from_key(float key) {
  return Metric::larger_is_better ? -key : key;
}

}  // namespace tinyknn
