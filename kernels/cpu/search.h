// One index = one (metric, storage type) pair: the database plus the search plan that scans it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "../metrics.cuh"
#include "database.h"
#include "errors.h"
#include "select.h"
#include "simd.h"
#include "tinyknn_cpu.h"

namespace tinyknn {

// The metric's sum over one row, in four independent vector partial sums plus a scalar tail.
template <class Metric>
float row_sum(const float* q, const float* x, int64_t dim) {
  Vec acc[4] = {};
  int64_t d = 0;
  for (; d + 4 * kLanes <= dim; d += 4 * kLanes) {
    for (int u = 0; u < 4; ++u) acc[u] = Metric::accumulate(acc[u], load(q + d + u * kLanes), load(x + d + u * kLanes));
  }
  for (; d + kLanes <= dim; d += kLanes) acc[0] = Metric::accumulate(acc[0], load(q + d), load(x + d));
  float sum = horizontal_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; d < dim; ++d) sum = Metric::accumulate(sum, q[d], x[d]);
  return sum;
}

inline const float* row_as_float(const float* row, float*, int64_t) { return row; }
inline const float* row_as_float(const half_bits* row, float* scratch, int64_t dim) {
  convert(row, scratch, dim);
  return scratch;
}

// What the ABI calls; the template below implements it for each (metric, storage type).
class AnyIndex {
 public:
  virtual ~AnyIndex() = default;
  virtual void add(const void* vectors, int64_t n, const int64_t* ids) = 0;
  virtual void reset() = 0;
  virtual int64_t size() = 0;
  virtual void export_to(int64_t n, void* vectors, int64_t* ids) = 0;
  virtual void search(const float* queries, int64_t nq, int64_t k, int threads, float* distances,
                      int64_t* ids) = 0;
};

template <class Metric, class Storage>
class Index final : public AnyIndex {
 public:
  explicit Index(int64_t dim) : db_(dim) {}

  void add(const void* vectors, int64_t n, const int64_t* ids) override {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    db_.add(static_cast<const Storage*>(vectors), n, ids, Metric::needs_norms);
  }

  void reset() override {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    db_.reset();
  }

  int64_t size() override {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    return db_.size();
  }

  void export_to(int64_t n, void* vectors, int64_t* ids) override {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    require(n <= db_.size(), "cannot export more rows than the index holds");
    db_.export_to(n, static_cast<Storage*>(vectors), ids);
  }

  // Step 2 of the ladder: the distance loop runs over SIMD vectors with four independent partial
  // sums (the compiler cannot reorder one scalar sum itself); one query at a time, rows in order.
  void search(const float* queries, int64_t nq, int64_t k, int, float* distances, int64_t* ids) override {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    const int64_t n = db_.size(), dim = db_.dim();
    std::vector<Candidate> storage(TopK::capacity(k));
    std::vector<float> row(dim);
    TopK best;
    for (int64_t qi = 0; qi < nq; ++qi) {
      const float* q = queries + qi * dim;
      const float q_inverse_norm = Metric::needs_norms ? inverse_norm(row_sum<InnerProduct>(q, q, dim)) : 0.0f;
      best.start(k, storage.data());
      for (int64_t i = 0; i < n; ++i) {
        const float* x = row_as_float(db_.row(i), row.data(), dim);
        const float data_inverse_norm = Metric::needs_norms ? db_.inverse_norms()[i] : 0.0f;
        best.push(to_key<Metric>(Metric::finish(row_sum<Metric>(q, x, dim), q_inverse_norm, data_inverse_norm)), i);
      }
      best.finish<Metric>(db_.ids(), distances + qi * k, ids + qi * k);
    }
  }

 private:
  std::shared_mutex mutex_;  // searches share it; add and reset take it alone
  Database<Storage> db_;
};

inline std::unique_ptr<AnyIndex> make_index(int64_t dim, int metric, int dtype) {
  require(dim >= 1, "dim must be >= 1");
  require(dtype == TK_FLOAT32 || dtype == TK_FLOAT16, "dtype must be TK_FLOAT32 or TK_FLOAT16");
  const bool half = dtype == TK_FLOAT16;
  switch (metric) {
    case TK_L2:
      if (half) return std::unique_ptr<AnyIndex>(new Index<L2, half_bits>(dim));
      return std::unique_ptr<AnyIndex>(new Index<L2, float>(dim));
    case TK_INNER_PRODUCT:
      if (half) return std::unique_ptr<AnyIndex>(new Index<InnerProduct, half_bits>(dim));
      return std::unique_ptr<AnyIndex>(new Index<InnerProduct, float>(dim));
    case TK_COSINE:
      if (half) return std::unique_ptr<AnyIndex>(new Index<Cosine, half_bits>(dim));
      return std::unique_ptr<AnyIndex>(new Index<Cosine, float>(dim));
    default:
      throw InvalidArgument("metric must be TK_L2, TK_INNER_PRODUCT or TK_COSINE");
  }
}

inline std::string build_features() {
  return std::string(simd_description()) + ", " + f16_description() + "; row scan, bounded selection";
}

}  // namespace tinyknn
