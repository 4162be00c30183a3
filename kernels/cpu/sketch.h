// A float16 sketch of a float32 l2 database, for searches of a few queries, which are bound by memory
// bandwidth: the sketch is half the bytes of the database, so a first pass over it costs about half.
//
// Each row x is kept as r = f16((x - c) * 2^-s): c is a per-dimension centre (the mean of the first
// batch added), 2^-s a power of two that puts the largest |x - c| of that batch near 2^14 (exact
// scaling; later rows that do not fit are clamped, which only widens their error). Working in the
// scaled residual space keeps data far from the origin precise. What is rounded away is measured,
// not assumed: e_max = max over rows of ||(x - c) 2^-s - r|| (computed in double, rounded up), and
// for a query q' = fl32(q - c) 2^-s, delta = ||(q - c) 2^-s - q'||. So, with rho = e_max + delta,
// the true scaled distance satisfies |sqrt(D) - sqrt(D')| <= rho where D' = ||q' - r||^2, and the
// float32 sum D~ of D' is within a relative gamma = 2 (dim + 2) 2^-24 (twice the classical bound for
// sums of non-negative terms) plus an absolute eta = dim 2^-149 for terms that underflow (a subnormal
// result of an FMA is off by at most 2^-150; the exact scan's sums get the same, scaled by 2^-2s).
// That assumes subnormals are kept: a process that flushes them to zero (FTZ/DAZ, e.g. after
// torch.set_flush_denormal(True)) can lose up to 2^-126 per term instead.
//
// SketchBound::threshold(kappa), where kappa is the k-th smallest D~, is a bound T such that every row
// that a full float32 scan could return has D~ <= T (see the proof in sketch_search.h). The rows under
// T are then scored by the same kernel as the full scan, so the screen is the full scan's (verify.h then
// settles the float64 answer).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common.cuh"
#include "database.h"
#include "simd.h"

namespace tinyknn {

// float -> float16 bits, round to nearest even, for |f| <= 65504 (callers clamp).
inline half_bits float_to_half(float f) {
#if defined(__F16C__)
  return (half_bits)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#endif
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const float magnitude = std::fabs(f);
  if (magnitude < 6.103515625e-05f) {  // below float16's smallest normal: a multiple of 2^-24
    return (half_bits)(sign | (std::uint32_t)std::nearbyint(magnitude * 16777216.0f));
  }
  const std::uint32_t rest = bits & 0x1fffu;
  std::uint32_t half = ((((bits >> 23) & 0xffu) - 112u) << 10) | ((bits >> 13) & 0x3ffu);
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // a carry moves into the exponent
  return (half_bits)(sign | half);
}

inline float half_value(half_bits h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// gamma_n: a relative bound on the float32 rounding of a sum of n non-negative terms, doubled.
inline double sum_error(int64_t terms) { return 2.0 * (double)(terms + 2) * std::ldexp(1.0, -24); }

// How far a first pass's key K (the sketch's D~, or the Winograd key of winograd.h) can be from D', the
// squared distance between the rounded query and row it works on: (1 - gamma) D' - eta_pass <= K + shift
// <= (1 + gamma) D' + eta_pass; and how far D' can be from the truth: |sqrt(D) - sqrt(D')| <= rho.
struct SketchBound {
  double gamma;        // relative error of the first pass's keys (the sketch's float32 sums)
  double gamma_exact;  // relative error of the exact scan's float32 sums
  double rho;          // e_max + delta, scaled
  double eta;          // absolute error of the exact scan's sums where terms underflow, scaled
  double eta_pass;     // absolute error of the first pass's keys (underflow; Winograd's cancellation)
  double shift;        // what the first pass leaves out of its keys (0 for the sketch, beta for Winograd)

  // Every row the exact scan could return has K <= threshold(k-th smallest K seen).
  float threshold(float kappa) const {
    if (!std::isfinite(kappa)) return positive_infinity();
    const double lowest = std::max(0.0, ((double)kappa + shift + eta_pass) / (1.0 - gamma));
    const double upper = std::pow(std::sqrt(lowest) + rho, 2.0);
    const double widened = (upper * (1.0 + gamma_exact) + 2.0 * eta) / (1.0 - gamma_exact);
    const double bound =
        ((1.0 + gamma) * std::pow(std::sqrt(widened) + rho, 2.0) + eta_pass) * (1.0 + 1e-9) + 1e-300 - shift;
    return bound >= 3.0e38 ? positive_infinity() : std::nextafter((float)bound, positive_infinity());
  }
};

class Sketch {
 public:
  explicit Sketch(int64_t dim) : residuals_(dim), center_(dim, 0.0f) {}

  const Panels<half_bits>& residuals() const { return residuals_; }
  int64_t dim() const { return residuals_.dim(); }

  // What an add of n rows needs, allocated (may throw; the sketch is unchanged), then the add itself
  // (cannot throw): with Database's reserve/commit, an add that fails changes nothing.
  struct Growth {
    Panels<half_bits>::Growth residuals;
    std::vector<half_bits> row;
    std::vector<float> centre;
    std::vector<double> sums;  // the first batch's per-dimension sums
  };
  Growth reserve(int64_t n) {
    Growth growth{residuals_.reserve(n), std::vector<half_bits>(dim()), std::vector<float>(), std::vector<double>()};
    if (residuals_.rows() == 0) {
      growth.centre.resize(dim());
      growth.sums.resize(dim());
    }
    return growth;
  }

  void commit(const float* vectors, int64_t n, Growth& growth) noexcept {
    if (n == 0) return;
    if (residuals_.rows() == 0) {
      error_max_ = centred_error_max_ = centred_norm_max_ = 0.0;
      choose_frame(vectors, n, growth.centre.data(), growth.sums.data());
      center_.swap(growth.centre);
    }
    const int64_t dim = this->dim();
    const double scale = std::ldexp(1.0, -exponent_);  // a power of two: multiplying by it is exact
    std::vector<half_bits>& row = growth.row;
    for (int64_t i = 0; i < n; ++i) {
      double error = 0.0, centred_error = 0.0, centred_norm = 0.0;
      for (int64_t d = 0; d < dim; ++d) {
        const double exact = ((double)vectors[i * dim + d] - (double)center_[d]) * scale;
        row[d] = float_to_half((float)std::max(-65504.0, std::min(65504.0, exact)));
        const double gap = exact - (double)half_value(row[d]);
        error += gap * gap;
        const float centred = vectors[i * dim + d] - center_[d];  // what winograd.h's centre_panel computes
        const double centred_gap = (double)vectors[i * dim + d] - (double)center_[d] - (double)centred;
        centred_error += centred_gap * centred_gap;
        centred_norm += (double)centred * (double)centred;
      }
      error_max_ = std::max(error_max_, std::sqrt(error) * (1.0 + 1e-9) + 1e-300);
      centred_error_max_ = std::max(centred_error_max_, std::sqrt(centred_error) * (1.0 + 1e-9) + 1e-300);
      centred_norm_max_ = std::max(centred_norm_max_, std::sqrt(centred_norm) * (1.0 + 1e-9));
      residuals_.append(1, [&](int64_t, int64_t d) { return row[d]; }, growth.residuals);
    }
  }

  // The sketch of rows rows[0 .. n) of `source`: its frame and error maxima (bounds for the subset too), the
  // residual rows gathered into this sketch's reused blocks by `run(pieces, fn(piece))`.
  template <class Run>
  void assign_rows(const Sketch& source, const int64_t* rows, int64_t n, Run run) {
    residuals_.empty();
    auto growth = residuals_.reserve(n);
    center_ = source.center_;
    exponent_ = source.exponent_;
    error_max_ = source.error_max_;
    centred_error_max_ = source.centred_error_max_;
    centred_norm_max_ = source.centred_norm_max_;
    residuals_.resize_for_gather(n, growth);
    residuals_.gather_all(source.residuals_, rows, n, run);
  }

  // Row `from`'s residuals over row `to`'s (remove's swap; the error maxima stay bounds).
  void move_row(int64_t from, int64_t to) noexcept { residuals_.copy_row(from, to); }

  // Keeps rows [0, n); the error maxima stay those of the rows once held (bounds, still honest).
  void truncate(int64_t n) noexcept { residuals_.truncate(n); }

  void clear() noexcept { residuals_.clear(); }

  const float* centre() const { return center_.data(); }

  // What the Winograd pass (winograd.h), which works on y = fl(x - c) in float32, needs to know of the
  // rows: the largest ||fl(x - c) - (x - c)|| and the largest ||fl(x - c)||, both rounded up.
  double centred_error_max() const { return centred_error_max_; }
  double centred_norm_max() const { return centred_norm_max_; }

  // q' for one query into `out` (dim floats), and the bound for it; false when q' could overflow the
  // float32 sums (a query far outside the data's scale): then the caller scans exactly.
  bool prepare(const float* query, float* out, SketchBound* bound) const {
    const int64_t dim = this->dim();
    const float scale = std::ldexp(1.0f, -exponent_);  // 2^-100 .. 2^100: a normal float
    double error = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      out[d] = (query[d] - center_[d]) * scale;  // rounded once, in the subtraction (then underflow, if any)
      if (!(std::fabs(out[d]) <= 1.0e15f)) return false;
      const double gap = ((double)query[d] - (double)center_[d]) * (double)scale - (double)out[d];
      error += gap * gap;
    }
    bound->gamma = sum_error(dim);
    bound->gamma_exact = sum_error(dim);
    bound->rho = error_max_ + std::sqrt(error) * (1.0 + 1e-9) + 1e-300;
    bound->eta = std::ldexp((double)dim, -149 - 2 * exponent_);
    bound->eta_pass = std::ldexp((double)dim, -149);
    bound->shift = 0.0;
    return std::isfinite(bound->rho);
  }

 private:
  // The centre (the batch's mean) and the power of two that puts its largest |x - c| near 2^14.
  void choose_frame(const float* vectors, int64_t n, float* center, double* sums) noexcept {
    const int64_t dim = this->dim();
    std::fill(sums, sums + dim, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < dim; ++d) sums[d] += vectors[i * dim + d];
    }
    for (int64_t d = 0; d < dim; ++d) center[d] = (float)(sums[d] / (double)n);
    double largest = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < dim; ++d) largest = std::max(largest, std::fabs((double)vectors[i * dim + d] - center[d]));
    }
    exponent_ = largest > 0.0 ? std::max(-100, std::min(100, std::ilogb(largest) + 1 - 14)) : 0;
  }

  Panels<half_bits> residuals_;
  std::vector<float> center_;
  int exponent_ = 0;        // residuals are (x - c) * 2^-exponent_
  double error_max_ = 0.0;  // max over rows of ||(x - c) 2^-s - r||, rounded up
  double centred_error_max_ = 0.0;  // max over rows of ||fl(x - c) - (x - c)||, rounded up
  double centred_norm_max_ = 0.0;   // max over rows of ||fl(x - c)||, rounded up
};

}  // namespace tinyknn
