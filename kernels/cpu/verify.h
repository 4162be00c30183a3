// The exactness contract's last step (README "Exactness", kernels/exact.cuh): every search path (full
// scan, float16 sketch, Winograd pass) only *screens*: it returns each query's k' = k + margin rows
// with the smallest float32 keys (the full scan kernel's keys, kernel.h). This step computes their
// float64 distances as exact.cuh defines them, orders them by (float64 key, user id), and proves that
// no other row can belong: every other row has float32 key >= K', the k'-th kept key (select.h's
// selections keep the k' smallest; the first passes' proofs show the same, sketch_search.h), and
// ScreenBound::lower(K') bounds its float64 key from below. The answer stands when that bound is
// strictly worse than the k-th float64 key (equal keys would go by id, so equal is not enough);
// otherwise the query is answered by an exhaustive float64 pass over every row, and counted.
//
// The bounds (u = 2^-24; gamma = sum_error(dim) = 2 (dim + 2) u bounds a float32 sum of dim terms
// with FMAs or without; eta = dim 2^-148 its absolute error where terms underflow; gamma64, eta64 the
// same for the float64 sums; subnormals kept, no FTZ/DAZ):
//   l2:     the kernel's f satisfies |f - D| <= gamma D + eta (each term (q - x)^2 rounded at most
//           twice, all terms >= 0), and the float64 e >= D (1 - gamma64) - eta64, so
//           e >= (K' - eta) (1 - gamma64) / (1 + gamma) - eta64.
//   ip:     the query is scaled by 2^t (max |q_s| in [2^40, 2^41): no product of a stored value
//           underflows, none overflows under |x| <= 2^50; the order of q.x ignores a positive scale);
//           |S~ - S_s| <= gamma ||q_s|| R + eta with R the largest row norm (Cauchy-Schwarz), so the key
//           -e >= (K' - gamma ||q_s|| R - eta) 2^-t - (gamma64 ||q|| R + eta64).
//   cosine: the query scaled the same way (cosine ignores it); inverse norms from float64 sums,
//           rounded once to float32 (relative error dq <= u + (dim + 8) 2^-52); the kernel's
//           f = fl(S~ fl(w_q w_x)); |cos| <= 1, so |f - cos| <= (1 + eps) theta + eps + 2^-149 with
//           eps = gamma + dim 2^-60 (eta against ||q_s|| ||x|| >= 2^40 2^-126.2) and theta =
//           (1 + dq)^2 (1 + u)^2 - 1; the float64 cosine is within 2 gamma64 + 8 2^-53 of the truth.
//           Rows whose inverse norm does not fit a float32 (norm below ~2^-126) void the bound: an
//           index holding any answers every cosine query exhaustively.
// Each bound is finally lowered by 2^-50 of its magnitude for its own double evaluation.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../exact.cuh"
#include "../metrics.cuh"
#include "database.h"
#include "select.h"
#include "sketch.h"

namespace tinyknn {

// Extra rows the screen keeps beyond k (measured: see bench/NOTES_CPU.md "Exactness"); the base can be
// set at build time for that measurement (bench/probes/screen_margin.py).
#ifndef TINYKNN_SCREEN_MARGIN
#define TINYKNN_SCREEN_MARGIN 4
#endif
inline int64_t screen_margin(int64_t k) { return TINYKNN_SCREEN_MARGIN + k / 16; }

// lower(K) = (K - a) b - c: a lower bound on the float64 key of every row whose float32 key is >= K.
struct ScreenBound {
  double a = 0.0, b = 1.0, c = 0.0;
  double lower(float key) const {
    const double value = ((double)key - a) * b - c;
    return value - std::fabs(value) * 0x1p-50 - 0x1p-1070;
  }
};

inline double sum_error64(int64_t terms) { return 2.0 * (double)(terms + 2) * 0x1p-53; }

// Query q (dim floats) as the screen searches it, into `out` (for ip and cosine: scaled by a power of
// two), its float32 inverse norm (cosine), and its bound. R: the database's largest row norm.
template <class Metric>
void prepare_screen_query(const float* q, int64_t dim, double R, float* out, float* inverse_norm, ScreenBound* bound) {
  const double gamma = sum_error(dim), gamma64 = sum_error64(dim);
  const double eta = std::ldexp((double)dim, -148), eta64 = std::ldexp((double)dim, -1070);
  if constexpr (std::is_same<Metric, L2>::value) {
    std::copy(q, q + dim, out);
    *inverse_norm = 0.0f;
    bound->a = eta;
    bound->b = (1.0 - gamma64) / (1.0 + gamma);
    bound->c = eta64;
    return;
  }
  float largest = 0.0f;
  for (int64_t d = 0; d < dim; ++d) largest = std::max(largest, std::fabs(q[d]));
  const int t = largest > 0.0f ? 40 - std::ilogb(largest) : 0;
  double squares = 0.0, scaled_squares = 0.0;
  for (int64_t d = 0; d < dim; ++d) {
    out[d] = std::ldexp(q[d], t);  // exact, unless t < 0 makes an element underflow (bounded below)
    squares += (double)q[d] * (double)q[d];
    scaled_squares += (double)out[d] * (double)out[d];
  }
  const double rounding = 1.0 + (double)(dim + 4) * 0x1p-52;
  const double norm = std::sqrt(squares) * rounding, scaled_norm = std::sqrt(scaled_squares) * rounding;
  const double lost = std::sqrt((double)dim) * 0x1p-149;  // ||q 2^t - q_s|| where elements underflowed
  if constexpr (std::is_same<Metric, InnerProduct>::value) {
    *inverse_norm = 0.0f;
    bound->a = gamma * scaled_norm * R + eta + lost * R * (1.0 + gamma);
    bound->b = std::ldexp(1.0, -t);
    bound->c = gamma64 * norm * R + eta64;
  } else {
    *inverse_norm = inverse_norm64(scaled_squares);
    const double u = 0x1p-24, dq = u + (double)(dim + 8) * 0x1p-52;
    const double eps = gamma + std::ldexp((double)dim, -60) + (scaled_norm > 0.0 ? 2.0 * lost / scaled_norm : 0.0);
    const double theta = (1.0 + dq) * (1.0 + dq) * (1.0 + u) * (1.0 + u) - 1.0;
    bound->a = (1.0 + eps) * theta + eps + 0x1p-149;
    bound->b = 1.0;
    bound->c = 2.0 * gamma64 + 8.0 * 0x1p-53;
  }
}

// One row's float64 distance and its place in the contract's order: (key, id), smaller first.
struct ExactEntry {
  double key;
  int64_t id;
  double distance;
  bool operator<(const ExactEntry& other) const { return key < other.key || (key == other.key && id < other.id); }
};

// The k smallest ExactEntries of a stream: a 2k buffer and nth_element, as select.h's TopK.
class ExactTopK {
 public:
  void start(int64_t k, std::vector<ExactEntry>* storage) {
    k_ = k;
    entries_ = storage;
    entries_->clear();
    full_ = false;
  }
  void push(const ExactEntry& entry) {
    if (full_ && !(entry < bar_)) return;
    entries_->push_back(entry);
    if ((int64_t)entries_->size() >= 2 * k_) {
      std::nth_element(entries_->begin(), entries_->begin() + (k_ - 1), entries_->end());
      entries_->resize(k_);
      bar_ = (*entries_)[k_ - 1];
      full_ = true;
    }
  }
  // The k best, in order (fewer when fewer were pushed).
  const std::vector<ExactEntry>& finish() {
    const int64_t take = std::min<int64_t>(k_, (int64_t)entries_->size());
    std::partial_sort(entries_->begin(), entries_->begin() + take, entries_->end());
    entries_->resize(take);
    return *entries_;
  }

 private:
  int64_t k_ = 0;
  std::vector<ExactEntry>* entries_ = nullptr;
  ExactEntry bar_{0.0, 0, 0.0};
  bool full_ = false;
};

// Per-thread buffers of the verify step.
struct VerifyScratch {
  std::vector<float> row_bytes;  // one row of any storage type (none is wider or more aligned than float)
  std::vector<ExactEntry> entries;
  static VerifyScratch& of_this_thread() {
    static thread_local VerifyScratch scratch;
    return scratch;
  }
  template <class Storage>
  Storage* row(const Database<Storage>&, int64_t dim) {
    static_assert(sizeof(Storage) <= sizeof(float) && alignof(Storage) <= alignof(float), "a row fits row_bytes");
    row_bytes.resize(dim);
    return reinterpret_cast<Storage*>(row_bytes.data());
  }
};

template <class Metric, class Storage>
ExactEntry exact_entry(const Database<Storage>& db, int64_t position, const float* q, double qq, Storage* buffer) {
  db.row_to(position, buffer);
  const double distance = Exact<Metric>::distance(q, buffer, (int)db.dim(), qq);
  return ExactEntry{exact_key<Metric>(distance), db.ids()[position], distance};
}

// The contract's answer written out: k distances (float64 rounded to float32) and ids, padded.
template <class Metric>
void write_answer(const std::vector<ExactEntry>& best, int64_t k, float* distances, int64_t* ids) {
  const float pad = Metric::larger_is_better ? -positive_infinity() : positive_infinity();
  for (int64_t j = 0; j < k; ++j) {
    const bool real = j < (int64_t)best.size();
    distances[j] = real ? (float)best[j].distance : pad;
    ids[j] = real ? best[j].id : -1;
  }
}

// The screen's kk candidates of one query (sorted by float32 key; kk = min(k', n)) verified in
// float64 (their distances given in `known` where the screen computed them, else computed here);
// returns false, having written nothing, when they cannot be proven to hold the answer. n: the rows the
// screen chose from (db's, or a filtered search's allowed rows).
template <class Metric, class Storage>
bool verify_query(const Database<Storage>& db, int64_t n, const float* q, double qq, int64_t k, int64_t kk,
                  const Candidate* candidates, const double* known, const ScreenBound& bound, float* distances,
                  int64_t* ids) {
  VerifyScratch& scratch = VerifyScratch::of_this_thread();
  Storage* buffer = scratch.row(db, db.dim());
  std::vector<ExactEntry>& entries = scratch.entries;
  entries.clear();
  for (int64_t j = 0; j < kk; ++j) {
    if (candidates[j].position < 0) return false;  // the screen kept fewer rows than it should have
    const int64_t position = candidates[j].position;
    entries.push_back(known ? ExactEntry{exact_key<Metric>(known[j]), db.ids()[position], known[j]}
                            : exact_entry<Metric>(db, position, q, qq, buffer));
  }
  const int64_t take = std::min(k, kk);
  std::partial_sort(entries.begin(), entries.begin() + take, entries.end());
  if (kk < n && !(bound.lower(candidates[kk - 1].key) > entries[take - 1].key)) return false;
  entries.resize(take);
  write_answer<Metric>(entries, k, distances, ids);
  return true;
}

}  // namespace tinyknn
