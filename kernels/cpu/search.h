// One index = one (metric, storage type) pair: the database plus the search plan that scans it.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../metrics.cuh"
#include "database.h"
#include "errors.h"
#include "pool.h"
#include "scan.h"
#include "select.h"
#include "simd.h"
#include "sketch_search.h"
#include "winograd_search.h"
#include "tinyknn_cpu.h"

namespace tinyknn {

// How many searches a first pass answered, and how many it handed back to the exact scan.
class PassCounts {
 public:
  // Counts one search; returns whether the pass answered it.
  bool record(bool answered) {
    ++(answered ? answered_ : declined_);
    return answered;
  }
  void read(int64_t* answered, int64_t* declined) const {
    *answered = answered_.load();
    *declined = declined_.load();
  }

 private:
  std::atomic<int64_t> answered_{0}, declined_{0};
};

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
  const PassCounts& sketch_counts() const { return sketch_counts_; }
  const PassCounts& winograd_counts() const { return winograd_counts_; }
  // Off: every search is the full exact scan (the reference the first passes are tested against).
  void use_first_passes(bool on) { first_passes_ = on; }

 protected:
  PassCounts sketch_counts_, winograd_counts_;
  std::atomic<bool> first_passes_{true};
};

template <class Metric, class Storage>
class Index final : public AnyIndex {
  // float32 l2 indexes keep a float16 sketch for searches of a few queries (sketch_search.h); its centre
  // also serves the Winograd pass of many-query searches (winograd_search.h).
  static constexpr bool kSketched = std::is_same<Metric, L2>::value && std::is_same<Storage, float>::value;

 public:
  explicit Index(int64_t dim) : db_(dim), sketch_(kSketched ? dim : 1) {}

  void add(const void* vectors, int64_t n, const int64_t* ids) override {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    db_.add(static_cast<const Storage*>(vectors), n, ids, Metric::needs_norms);
    if constexpr (kSketched) sketch_.add(static_cast<const float*>(vectors), n);
  }

  void reset() override {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    db_.reset();
    sketch_.clear();
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

  // All cores (pool.h): tasks are (query chunk, database slice) pairs, see make_plan. Float32 l2
  // searches of a few queries go through the float16 sketch first (sketch_search.h), of more queries
  // through the Winograd pass (winograd_search.h).
  void search(const float* queries, int64_t nq, int64_t k, int threads, float* distances,
              int64_t* ids) override {
    if (nq == 0) return;
    std::shared_lock<std::shared_mutex> lock(mutex_);
    if constexpr (kSketched) {
      if (first_passes_) {
        if (sketch_pays(nq, k, db_.panels()) &&
            sketch_counts_.record(sketch_search(db_, sketch_, queries, nq, k, threads, distances, ids))) {
          return;
        }
        if (winograd_pays(nq, k, db_.dim(), db_.panels()) &&
            winograd_counts_.record(winograd_search(db_, sketch_, queries, nq, k, threads, distances, ids))) {
          return;
        }
      }
    }
    const Plan plan = make_plan(nq, db_.dim(), db_.panels(), threads, kTileQueries);
    Scratch& caller = Scratch::of_this_thread();
    if (plan.slices > 1) caller.merged.resize(plan.slices * nq * k);
    Candidate* merged = caller.merged.data();
    ThreadPool::shared().run((int)(plan.chunks * plan.slices), threads, [&](int task) {
      const int64_t chunk = task / plan.slices, slice = task % plan.slices;
      const int64_t first = chunk * plan.chunk, count = std::min(plan.chunk, nq - first);
      const int64_t panel_begin = db_.panels() * slice / plan.slices;
      const int64_t panel_end = db_.panels() * (slice + 1) / plan.slices;
      Scratch& scratch = Scratch::of_this_thread();
      TopK* best = scratch.start(count, k);
      scan<Metric>(db_.table(), db_.inverse_norms(), queries + first * db_.dim(), count, panel_begin, panel_end,
                   best, scratch);
      for (int64_t i = 0; i < count; ++i) {
        if (plan.slices == 1) {
          best[i].finish<Metric>(db_.ids(), distances + (first + i) * k, ids + (first + i) * k);
        } else {
          best[i].extract(merged + (slice * nq + first + i) * k);
        }
      }
    });
    if (plan.slices > 1) merge(nq, k, plan.slices, merged, distances, ids);
  }

 private:
  // Each query's k best over all slices.
  void merge(int64_t nq, int64_t k, int64_t slices, Candidate* merged, float* distances, int64_t* ids) {
    std::vector<Candidate>& storage = Scratch::of_this_thread().final_entries;
    storage.resize(TopK::capacity(k));
    TopK best;
    for (int64_t i = 0; i < nq; ++i) {
      best.start(k, storage.data());
      for (int64_t s = 0; s < slices; ++s) {
        const Candidate* part = merged + (s * nq + i) * k;
        for (int64_t j = 0; j < k && part[j].position >= 0; ++j) best.push(part[j].key, part[j].position);
      }
      best.finish<Metric>(db_.ids(), distances + i * k, ids + i * k);
    }
  }

  std::shared_mutex mutex_;  // searches share it; add and reset take it alone
  Database<Storage> db_;
  Sketch sketch_;
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
  return std::string(simd_description()) + ", " + f16_description() + "; panels, register-blocked tiles, cache-blocked query chunks, bounded selection, threads; float32 l2 "
         "first passes: a float16 sketch (few queries), Winograd pairs (many queries)";
}

}  // namespace tinyknn
