// tinyknn: the exactness contract's float64 distance, one definition for the CPU library and the GPU kernels.
//
// The contract (README "Exactness"): a search returns the ids an exhaustive float64 search returns, ordered
// nearest first, equal float64 distances broken by the smaller id, and those float64 distances rounded to
// float32. "Float64 distance" is defined here, operation by operation, so that the CPU, the GPU and the
// NumPy oracle (tests/reference.py) compute the same bits:
//   - the stored element widened exactly to double, the float32 query element widened exactly to double;
//   - l2: s = 0; for d = 0 .. dim-1 in order: diff = q_d - x_d (rounded), s = s + diff * diff (the product
//     rounded, then the sum rounded: never fused into an FMA, never reordered);
//   - ip: s = s + q_d * x_d in the same order (the products of float32 and 16-bit or 8-bit values are exact
//     in double, so fusing would not change them, but the rule is the same);
//   - cosine: dot / (sqrt(qq) * sqrt(xx)) with dot, qq = sum q_d^2 and xx = sum x_d^2 summed as ip, and 0
//     when either qq or xx is 0;
//   - the result + 0.0, so a -0.0 never appears (it would order and round like +0.0 but differ in its bits).
// Every operation is IEEE-754 round-to-nearest-even: __dadd_rn/__dmul_rn/__dsqrt_rn/__ddiv_rn on the device
// (never contracted), and on the host plain operations whose products pass through an empty asm barrier so
// that -ffp-contract=fast cannot fuse them (GCC and Clang do not reassociate without -ffast-math).
#pragma once
#include "metrics.cuh"

#if !TINYKNN_DEVICE
#include <cmath>
#endif

namespace tinyknn {

TINYKNN_HD double exact_add(double a, double b) {
#if TINYKNN_DEVICE
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

TINYKNN_HD double exact_mul(double a, double b) {
#if TINYKNN_DEVICE
  return __dmul_rn(a, b);
#else
  double product = a * b;
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(product));   // the product is materialised: no FMA with the following addition
#elif defined(__aarch64__)
  __asm__("" : "+w"(product));
#else
  volatile double materialised = product;
  product = materialised;
#endif
  return product;
#endif
}

TINYKNN_HD double exact_div(double a, double b) {
#if TINYKNN_DEVICE
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

TINYKNN_HD double exact_sqrt(double a) {
#if TINYKNN_DEVICE
  return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// A stored element widened exactly to double (every storage type fits).
TINYKNN_HD double widen(float x) { return (double)x; }
TINYKNN_HD double widen(half_bits x) { return (double)half_to_float(x); }
TINYKNN_HD double widen(bf16_bits x) { return (double)bf16_to_float(x); }
TINYKNN_HD double widen(signed char x) { return (double)x; }
TINYKNN_HD double widen(unsigned char x) { return (double)x; }

// The contract's distances as a step per coordinate (in order d = 0, 1, ...) and a finish, so that a
// kernel may load rows its own way (the GPU verify step reads 16-byte chunks) and still perform exactly
// these operations in this order. `a`, `b`: the running sums (l2 and ip use `a`; cosine: a = dot, b = xx).
template <class Metric> struct Exact;
template <class Metric, class T>
TINYKNN_HD double exact_distance(const float* query, const T* row, int dim, double qq);

// Exact<Metric>::distance(query, row, dim, qq) is exact_distance<Metric> (below).
template <class Metric> struct ExactDistance {
  template <class T> static TINYKNN_HD double distance(const float* q, const T* x, int dim, double qq) {
    return exact_distance<Metric>(q, x, dim, qq);
  }
};
// step_wide: the same step with the query element already widened to double (the same bits: widening is exact).
template <> struct Exact<L2> : ExactDistance<L2> {
  static TINYKNN_HD void step(double& a, double& b, float q, double x) { step_wide(a, b, (double)q, x); }
  static TINYKNN_HD void step_wide(double& a, double&, double q, double x) {
    const double diff = q - x;
    a = exact_add(a, exact_mul(diff, diff));
  }
  static TINYKNN_HD double finish(double a, double, double) { return a + 0.0; }
};
template <> struct Exact<InnerProduct> : ExactDistance<InnerProduct> {
  static TINYKNN_HD void step(double& a, double& b, float q, double x) { step_wide(a, b, (double)q, x); }
  static TINYKNN_HD void step_wide(double& a, double&, double q, double x) { a = exact_add(a, exact_mul(q, x)); }
  static TINYKNN_HD double finish(double a, double, double) { return a + 0.0; }
};
template <> struct Exact<Cosine> : ExactDistance<Cosine> {
  static TINYKNN_HD void step(double& dot, double& xx, float q, double x) { step_wide(dot, xx, (double)q, x); }
  static TINYKNN_HD void step_wide(double& dot, double& xx, double q, double x) {
    dot = exact_add(dot, exact_mul(q, x));
    xx = exact_add(xx, exact_mul(x, x));
  }
  // qq: the query's sum of squares (exact_squares), computed once per query by the caller.
  static TINYKNN_HD double finish(double dot, double xx, double qq) {
    if (qq == 0.0 || xx == 0.0) return 0.0;
    return exact_div(dot, exact_mul(exact_sqrt(qq), exact_sqrt(xx))) + 0.0;
  }
};

// The contract's distance of one float32 query (`dim` elements) and one stored row.
template <class Metric, class T>
TINYKNN_HD double exact_distance(const float* query, const T* row, int dim, double qq) {
  double a = 0.0, b = 0.0;
  for (int d = 0; d < dim; ++d) Exact<Metric>::step(a, b, query[d], widen(row[d]));
  return Exact<Metric>::finish(a, b, qq);
}

template <class T>
TINYKNN_HD double exact_l2(const float* query, const T* row, int dim) { return exact_distance<L2>(query, row, dim, 0.0); }

template <class T>
TINYKNN_HD double exact_ip(const float* query, const T* row, int dim) {
  return exact_distance<InnerProduct>(query, row, dim, 0.0);
}

template <class T>
TINYKNN_HD double exact_cosine(const float* query, const T* row, int dim, double qq) {
  return exact_distance<Cosine>(query, row, dim, qq);
}

TINYKNN_HD double exact_squares(const float* query, int dim) {
  double sum = 0.0;
  for (int d = 0; d < dim; ++d) sum = exact_add(sum, exact_mul((double)query[d], (double)query[d]));
  return sum;
}

// The order key of a contract distance (smaller is nearer).
template <class Metric> TINYKNN_HD double exact_key(double distance) {
  return Metric::larger_is_better ? -distance : distance;
}

}  // namespace tinyknn
