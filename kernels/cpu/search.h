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
#include "scan.h"
#include "select.h"
#include "simd.h"
#include "tinyknn_cpu.h"

namespace tinyknn {

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

  // Step 4 of the ladder: cache blocking (scan.h): chunks of queries stay in L2 while the panels
  // stream past once per chunk, each panel in L1 while all tiles of the chunk use it.
  void search(const float* queries, int64_t nq, int64_t k, int, float* distances, int64_t* ids) override {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    const int64_t dim = db_.dim(), chunk = chunk_queries(dim);
    Scratch& scratch = Scratch::of_this_thread();
    for (int64_t first = 0; first < nq; first += chunk) {
      const int64_t count = std::min(chunk, nq - first);
      TopK* best = scratch.start(count, k);
      scan<Metric>(db_, queries + first * dim, count, 0, db_.panels(), best, scratch);
      for (int64_t i = 0; i < count; ++i) best[i].finish<Metric>(db_.ids(), distances + (first + i) * k, ids + (first + i) * k);
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
  return std::string(simd_description()) + ", " + f16_description() + "; panels, register-blocked tiles, cache-blocked query chunks, bounded selection";
}

}  // namespace tinyknn
