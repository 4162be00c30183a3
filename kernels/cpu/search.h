// One index = one (metric, storage type) pair: the database plus the search plan that scans it.
//
// Index operations work on row positions: a filtered search gathers the allowed rows into the
// calling thread's temporary index (or, for a few float32 l2 queries, their float16 sketch rows) and
// searches that, so its cost follows the rows allowed; one of a few queries over scattered rows reads them
// from the row-major copy instead, once there is one (row_copy.h, direct.h); remove_rows swap-removes (the
// last rows move into the holes, in the panels, ids, inverse norms, sketch and row copy alike); permute_rows
// copies every row into a new order (the Index's label-partitioned order: a label's rows then gather as one
// run); range_search is range.h's.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>  // std::shared_lock
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../metrics.cuh"
#include "database.h"
#include "direct.h"
#include "errors.h"
#include "exhaustive.h"
#include "gate.h"
#include "pool.h"
#include "range.h"
#include "row_copy.h"
#include "scan.h"
#include "select.h"
#include "simd.h"
#include "sketch_search.h"
#include "winograd_search.h"
#include "tinyknn_cpu.h"
#include "verify.h"

namespace tinyknn {

// How many searches a first pass answered, and how many it handed back to the full scan.
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
  virtual void truncate(int64_t n) = 0;
  virtual void reset() = 0;
  virtual int64_t size() = 0;
  virtual void export_to(int64_t n, void* vectors, int64_t* ids) = 0;
  virtual void search(const float* queries, int64_t nq, int64_t k, int threads, float* distances,
                      int64_t* ids) = 0;
  // The same over rows rows[0 .. m) only (sorted, unique, in range).
  virtual void search_rows(const float* queries, int64_t nq, int64_t k, int threads, const int64_t* rows, int64_t m,
                           float* distances, int64_t* ids) = 0;
  // Removes rows positions[0 .. m) (sorted, unique, in range): the last live rows move into the holes;
  // returns how many moved, their old rows in moved_from and new rows in moved_to (both ascending).
  virtual int64_t remove_rows(const int64_t* positions, int64_t m, int64_t* moved_from, int64_t* moved_to) = 0;
  // Puts the rows in the order order[0 .. n) (n = size, a permutation: new row i is old row order[i]), with
  // `threads` threads; everything is allocated first (the strong guarantee).
  virtual void permute_rows(const int64_t* order, int64_t n, int threads) = 0;
  // Rows positions[0 .. m) (any order, in range) into out, m * dim elements of the storage type.
  virtual void get_rows(const int64_t* positions, int64_t m, void* out) = 0;
  // range.h over every row (rows == nullptr) or rows[0 .. m) (sorted, unique, in range).
  virtual void range_search(const float* queries, int64_t nq, double radius, const int64_t* rows, int64_t m,
                            int threads, RangeAnswer& out) = 0;
  // The row-major copy (row_copy.h): TK_ROW_COPY_OFF drops it and never builds it, TK_ROW_COPY_AUTO (the default)
  // builds it once the filtered searches it would have sped up have lost about its cost, TK_ROW_COPY_ALWAYS
  // builds it now and answers every filtered search of up to kDirectMaxQueries queries from it.
  virtual void set_row_copy(int mode, int threads) = 0;
  // Rows the copy holds (-1: none), filtered searches it answered, times it was built.
  virtual void row_copy_counts(int64_t* rows, int64_t* searches, int64_t* builds) = 0;
  const PassCounts& sketch_counts() const { return sketch_counts_; }
  const PassCounts& winograd_counts() const { return winograd_counts_; }
  // Queries whose screened candidates could not be proven (verify.h) and were searched exhaustively.
  int64_t exact_fallbacks() const { return exact_fallbacks_.load(); }
  // Off: every search screens with the full scan (the reference the first passes are tested against).
  void use_first_passes(bool on) { first_passes_ = on; }

 protected:
  PassCounts sketch_counts_, winograd_counts_;
  std::atomic<int64_t> exact_fallbacks_{0};
  std::atomic<bool> first_passes_{true};
};

// The caller thread's buffers of a search: the queries as the screen sees them, their bounds, and
// the screen's candidates (kept between searches, grown on demand).
struct SearchScratch {
  std::vector<float> screen_queries, screen_norms;
  std::vector<ScreenBound> bounds;
  std::vector<Candidate> screened;
  std::vector<double> screened_float64;  // the candidates' float64 distances, where the screen computed them
  std::vector<char> unproven;             // queries the verify could not prove
  std::vector<int64_t> rest;              // their numbers
  std::vector<std::vector<ExactEntry>> parts;  // an exhaustive pass's slices' best
  static SearchScratch& of_this_thread() {
    static thread_local SearchScratch scratch;
    return scratch;
  }
};

constexpr int64_t kScreenedBytes = 64 << 20;  // a block of queries' candidates holds at most about this

template <class Metric, class Storage>
class Index final : public AnyIndex {
  // float32 l2 indexes keep a float16 sketch for searches of a few queries (sketch_search.h); its centre
  // also serves the Winograd pass of many-query searches (winograd_search.h).
  static constexpr bool kSketched = std::is_same<Metric, L2>::value && std::is_same<Storage, float>::value;

 public:
  // sketched = false: no sketch and no first passes (the temporary index of a filtered search's rows).
  explicit Index(int64_t dim, bool sketched = true)
      : sketched_(kSketched && sketched), db_(dim), sketch_(sketched_ ? dim : 1) {}

  // Strong guarantee: everything is allocated (may throw std::bad_alloc) before anything changes.
  void add(const void* vectors, int64_t n, const int64_t* ids) override {
    std::unique_lock<WriterFirstGate> lock(gate_);
    auto growth = db_.reserve(n, Metric::needs_norms);
    auto sketch_growth = sketch_.reserve(sketched_ ? n : 0);
    RowCopy<Storage>* copy = row_copy_.get();
    auto copy_growth = copy ? copy->reserve(n) : typename RowCopy<Storage>::Growth();
    db_.commit(static_cast<const Storage*>(vectors), n, ids, Metric::needs_norms, growth);
    if constexpr (kSketched) {
      if (sketched_) sketch_.commit(static_cast<const float*>(vectors), n, sketch_growth);
    }
    if (copy) copy->append(static_cast<const Storage*>(vectors), n, copy_growth);
  }

  void truncate(int64_t n) override {
    std::unique_lock<WriterFirstGate> lock(gate_);
    require(n >= 0 && n <= db_.size(), "truncate: n_rows must be in [0, size]");
    db_.truncate(n);
    sketch_.truncate(sketched_ ? n : 0);
    if (n == 0) {
      drop_row_copy();  // a reset starts over: the next rows earn the copy again
    } else if (row_copy_) {
      row_copy_->truncate(n);
    }
  }

  void reset() override { truncate(0); }

  int64_t size() override {
    std::shared_lock<WriterFirstGate> lock(gate_);
    return db_.size();
  }

  void export_to(int64_t n, void* vectors, int64_t* ids) override {
    std::shared_lock<WriterFirstGate> lock(gate_);
    require(n <= db_.size(), "cannot export more rows than the index holds");
    db_.export_to(n, static_cast<Storage*>(vectors), ids);
  }

  // Screens (first passes or the full scan) and verifies (verify.h) blocks of queries whose candidates
  // fit kScreenedBytes.
  void search(const float* queries, int64_t nq, int64_t k, int threads, float* distances,
              int64_t* ids) override {
    if (nq == 0) return;
    std::shared_lock<WriterFirstGate> lock(gate_);
    search_locked(queries, nq, k, threads, distances, ids);
  }

  // A filtered search: the rows gathered into a temporary index (panels, ids, inverse norms; no sketch),
  // searched as a whole, so the cost follows m, not the index's size.
  void search_rows(const float* queries, int64_t nq, int64_t k, int threads, const int64_t* rows, int64_t m,
                   float* distances, int64_t* ids) override {
    if (nq == 0) return;
    std::shared_lock<WriterFirstGate> lock(gate_);
    check_rows(rows, m, "search");
    if (m == db_.size()) return search_locked(queries, nq, k, threads, distances, ids);
    if (search_rows_direct(queries, nq, k, threads, rows, m, distances, ids)) return;
    if constexpr (kSketched) {
      if (search_rows_sketched(queries, nq, k, threads, rows, m, distances, ids)) return;
    }
    Index& subset = gathered(rows, m, threads);
    const int64_t fallbacks = subset.exact_fallbacks_.load();
    subset.search_locked(queries, nq, k, threads, distances, ids);
    exact_fallbacks_ += subset.exact_fallbacks_.load() - fallbacks;
    release_if_large(subset);
  }

  // Swap-remove: O(m dim), nothing allocated (the strong guarantee: it fails only in its checks, first).
  int64_t remove_rows(const int64_t* positions, int64_t m, int64_t* moved_from, int64_t* moved_to) override {
    std::unique_lock<WriterFirstGate> lock(gate_);
    check_rows(positions, m, "remove");
    const int64_t n = db_.size(), n_new = n - m;
    const int64_t holes = std::lower_bound(positions, positions + m, n_new) - positions;
    int64_t moved = 0;
    for (int64_t row = n_new, removed = holes; row < n; ++row) {
      if (removed < m && positions[removed] == row) {
        ++removed;
        continue;
      }
      moved_from[moved] = row;
      moved_to[moved] = positions[moved];
      ++moved;
    }
    RowCopy<Storage>* copy = row_copy_.get();
    for (int64_t j = 0; j < moved; ++j) {
      db_.move_row(moved_from[j], moved_to[j]);
      if (sketched_) sketch_.move_row(moved_from[j], moved_to[j]);
      if (copy) copy->move_row(moved_from[j], moved_to[j]);
    }
    db_.truncate(n_new);
    sketch_.truncate(sketched_ ? n_new : 0);
    if (copy) copy->truncate(n_new);
    return moved;
  }

  // The Index's label-partitioned order (tinyknn/index/layout.py): a fresh copy of every row in the new order,
  // swapped in under the writer gate, so a concurrent search sees the old order or the new one.
  void permute_rows(const int64_t* order, int64_t n, int threads) override {
    std::unique_lock<WriterFirstGate> lock(gate_);
    require(n == db_.size(), "permute: the order must hold every row once");
    std::vector<char> seen((std::size_t)n, 0);
    for (int64_t i = 0; i < n; ++i) {
      require(order[i] >= 0 && order[i] < n && !seen[(std::size_t)order[i]],
              "permute: the order must hold every row position once");
      seen[(std::size_t)order[i]] = 1;
    }
    Database<Storage> rows(db_.dim());
    rows.assign_rows(db_, order, n, Metric::needs_norms, on_threads(threads));
    Sketch sketch(sketched_ ? db_.dim() : 1);
    if (sketched_) sketch.assign_rows(sketch_, order, n, on_threads(threads));
    std::vector<Storage> aside(row_copy_ ? (std::size_t)db_.dim() : 0);  // (allocated before anything changes)
    db_ = std::move(rows);
    if (sketched_) sketch_ = std::move(sketch);
    if (row_copy_) row_copy_->permute(order, seen.data(), aside.data());  // seen: every row, 1
  }

  void set_row_copy(int mode, int threads) override {
    require(mode == TK_ROW_COPY_OFF || mode == TK_ROW_COPY_AUTO || mode == TK_ROW_COPY_ALWAYS,
            "the row copy's mode must be TK_ROW_COPY_OFF, TK_ROW_COPY_AUTO or TK_ROW_COPY_ALWAYS");
    if (mode == TK_ROW_COPY_OFF) {
      std::unique_lock<WriterFirstGate> lock(gate_);
      row_copy_mode_ = mode;
      drop_row_copy();
      return;
    }
    std::shared_lock<WriterFirstGate> lock(gate_);
    row_copy_mode_ = mode;
    if (mode == TK_ROW_COPY_ALWAYS && row_copy_view_.load() == nullptr && build_row_copy(threads) == nullptr) {
      throw std::bad_alloc();
    }
  }

  void row_copy_counts(int64_t* rows, int64_t* searches, int64_t* builds) override {
    std::shared_lock<WriterFirstGate> lock(gate_);
    const RowCopy<Storage>* copy = row_copy_view_.load();
    *rows = copy ? copy->rows() : -1;
    *searches = direct_searches_.load();
    *builds = row_copy_builds_.load();
  }

  void get_rows(const int64_t* positions, int64_t m, void* out) override {
    std::shared_lock<WriterFirstGate> lock(gate_);
    const int64_t n = db_.size(), dim = db_.dim();
    for (int64_t i = 0; i < m; ++i) require(positions[i] >= 0 && positions[i] < n, "get_rows: a position is out of range");
    Storage* rows = static_cast<Storage*>(out);
    for (int64_t i = 0; i < m; ++i) db_.row_to(positions[i], rows + i * dim);
  }

  void range_search(const float* queries, int64_t nq, double radius, const int64_t* rows, int64_t m, int threads,
                    RangeAnswer& out) override {
    std::shared_lock<WriterFirstGate> lock(gate_);
    if (rows == nullptr || (check_rows(rows, m, "range_search"), m == db_.size())) {
      tinyknn::range_search<Metric>(db_, queries, nq, radius, threads, out);
      return;
    }
    Index& subset = gathered(rows, m, threads);
    tinyknn::range_search<Metric>(subset.db_, queries, nq, radius, threads, out);
    release_if_large(subset);
  }

 private:
  // A filtered search of a few queries from the row-major copy (direct.h), where that reads less than the
  // gather would; in TK_ROW_COPY_AUTO the copy is built once the searches it would have sped up have lost
  // about its cost (ski rental: never more than twice the better of the two choices made in hindsight).
  // false: the caller gathers.
  bool search_rows_direct(const float* queries, int64_t nq, int64_t k, int threads, const int64_t* rows, int64_t m,
                          float* distances, int64_t* ids) {
    const int mode = row_copy_mode_.load();
    if (mode == TK_ROW_COPY_OFF || nq > kDirectMaxQueries) return false;
    const RowCopy<Storage>* copy = row_copy_view_.load(std::memory_order_acquire);
    if (mode == TK_ROW_COPY_AUTO) {
      const int64_t gain = gather_cost(rows, m, nq, k) - direct_cost(m, nq);
      if (gain <= 0) return false;
      if (copy == nullptr && row_copy_credit_.fetch_add(gain) + gain < build_cost()) return false;
    }
    if (copy == nullptr && (copy = build_row_copy(threads)) == nullptr) return false;
    direct_search<Metric>(*copy, db_.ids(), rows, m, queries, nq, k, threads, distances, ids);
    ++direct_searches_;
    return true;
  }

  // The cost model's estimates (direct.h), in nanoseconds of the development machine.
  // The gather reads every line of each panel that holds an allowed row (the float16 sketch's, where a
  // few float32 l2 queries go through it, else the panels'), then screens the gathered rows.
  int64_t gather_cost(const int64_t* rows, int64_t m, int64_t nq, int64_t k) const {
    int64_t touched = m > 0;  // (rows sorted: a new panel starts where a row's panel differs from the last's)
    for (int64_t i = 1; i < m; ++i) touched += rows[i] / kPanel != rows[i - 1] / kPanel;
    bool sketch = false;
    if constexpr (kSketched) {
      sketch = sketched_ && first_passes_ && sketch_pays(nq, std::min(m, k + screen_margin(k)), (m + kPanel - 1) / kPanel);
    }
    const double element = sketch ? 2.0 : (double)sizeof(Storage), row = (double)db_.dim() * element;
    return (int64_t)((double)touched * kPanel * row * kGatherByteNs + (double)m * row * kGatheredByteNs +
                     (double)(m * db_.dim() * nq) * kScreenElementNs);
  }
  // The direct search reads each allowed row's lines and computes nq float64 distances a row.
  int64_t direct_cost(int64_t m, int64_t nq) const {
    const double lines = (double)((db_.dim() * (int64_t)sizeof(Storage) + 63) / 64 + 1);
    return (int64_t)((double)m * (lines * kRowLineNs + (double)(db_.dim() * nq) * kExactElementNs));
  }
  // Building the copy reads every panel and writes every row.
  int64_t build_cost() const { return (int64_t)((double)(db_.size() * db_.dim() * (int64_t)sizeof(Storage)) * kBuildByteNs); }

  // The row copy, built from the panels under the shared gate (writers, which keep it in step, are shut out
  // by it; a second builder waits for the first and finds the copy there); nullptr where memory cannot hold
  // it (the credit starts over).
  const RowCopy<Storage>* build_row_copy(int threads) {
    std::lock_guard<std::mutex> building(row_copy_build_);
    if (const RowCopy<Storage>* done = row_copy_view_.load()) return done;
    try {
      std::unique_ptr<RowCopy<Storage>> copy(new RowCopy<Storage>(db_.dim()));
      auto growth = copy->reserve(db_.size());
      copy->assign_from(db_.table(), db_.size(), growth, on_threads(threads));
      publish_row_copy(std::move(copy));
      ++row_copy_builds_;
      return row_copy_view_.load();
    } catch (const std::bad_alloc&) {
      row_copy_credit_ = 0;
      return nullptr;
    }
  }

  void publish_row_copy(std::unique_ptr<RowCopy<Storage>> copy) {
    row_copy_ = std::move(copy);
    row_copy_view_.store(row_copy_.get(), std::memory_order_release);
  }

  // (under the writer gate)
  void drop_row_copy() {
    row_copy_view_.store(nullptr);
    row_copy_.reset();
    row_copy_credit_ = 0;
  }

  // This thread's temporary index of rows[0 .. m) (no sketch), its blocks reused from the thread's last
  // filtered search: a fresh mapping would fault in every page (measured: 1,280 pages of a 10,000-row
  // subset of 128 dims took longer than the search itself).
  Index& gathered(const int64_t* rows, int64_t m, int threads) {
    static thread_local std::unique_ptr<Index> subset;
    if (!subset || subset->db_.dim() != db_.dim()) subset.reset(new Index(db_.dim(), false));
    subset->db_.assign_rows(db_, rows, m, Metric::needs_norms, on_threads(threads));
    return *subset;
  }

  // A few float32 l2 queries over the allowed rows through their float16 sketch rows (gathered: half the
  // bytes of the float32 rows), the candidates rescored and verified against this index's float32 panels;
  // false (the caller then searches the gathered rows) where the sketch does not pay or cannot prove.
  bool search_rows_sketched(const float* queries, int64_t nq, int64_t k, int threads, const int64_t* rows, int64_t m,
                            float* distances, int64_t* ids) {
    const int64_t dim = db_.dim(), kk = std::min(m, k + screen_margin(k));
    if (!sketched_ || !first_passes_ || kk == m || !sketch_pays(nq, kk, (m + kPanel - 1) / kPanel)) return false;
    static thread_local std::unique_ptr<Sketch> subset;
    if (!subset || subset->dim() != dim) subset.reset(new Sketch(dim));
    subset->assign_rows(sketch_, rows, m, on_threads(threads));
    SearchScratch& caller = SearchScratch::of_this_thread();
    caller.screened.resize(nq * kk);
    caller.screened_float64.resize(nq * kk);
    caller.screen_queries.resize(dim);
    const bool screened = sketch_counts_.record(sketch_search(db_, *subset, queries, nq, kk, threads,
                                                              caller.screened.data(), caller.screened_float64.data(), rows));
    bool proven = screened;
    for (int64_t i = 0; proven && i < nq; ++i) {
      float unused;
      ScreenBound bound;
      prepare_screen_query<Metric>(queries + i * dim, dim, db_.largest_norm(), caller.screen_queries.data(), &unused,
                                   &bound);
      proven = verify_query<Metric>(db_, m, queries + i * dim, 0.0, k, kk, caller.screened.data() + i * kk,
                                    caller.screened_float64.data() + i * kk, bound, distances + i * k, ids + i * k);
    }
    if (subset->residuals().rows() * dim * (int64_t)sizeof(half_bits) > kBlockBytes) subset->clear();
    return proven;
  }

  // run(tasks, fn) on the library's pool, `threads` at most.
  static auto on_threads(int threads) {
    return [threads](int tasks, const std::function<void(int)>& fn) { ThreadPool::shared().run(tasks, threads, fn); };
  }

  // A temporary index beyond one block is not kept for later searches (its memory is given back).
  static void release_if_large(Index& subset) {
    if (subset.db_.bytes() > kBlockBytes) subset.db_.reset();
  }

  // rows[0 .. m) sorted, unique, in [0, size).
  void check_rows(const int64_t* rows, int64_t m, const char* what) const {
    const int64_t n = db_.size();
    require(m >= 0 && m <= n, "more row positions than the index has rows");
    for (int64_t i = 0; i < m; ++i) {
      if (rows[i] < 0 || rows[i] >= n || (i > 0 && rows[i] <= rows[i - 1])) {
        throw InvalidArgument(std::string(what) + ": row positions must be sorted, unique and in [0, " +
                              std::to_string(n) + ")");
      }
    }
  }

  void search_locked(const float* queries, int64_t nq, int64_t k, int threads, float* distances, int64_t* ids) {
    const int64_t n = db_.size(), dim = db_.dim();
    if (n == 0) {
      const std::vector<ExactEntry> none;
      for (int64_t i = 0; i < nq; ++i) write_answer<Metric>(none, k, distances + i * k, ids + i * k);
      return;
    }
    const int64_t kk = std::min(n, k + screen_margin(k));
    const int64_t block = std::max<int64_t>(64, kScreenedBytes / (kk * (int64_t)sizeof(Candidate)));
    for (int64_t first = 0; first < nq; first += block) {
      const int64_t count = std::min(block, nq - first);
      search_block(queries + first * dim, count, k, kk, threads, distances + first * k, ids + first * k);
    }
  }

  void search_block(const float* queries, int64_t nq, int64_t k, int64_t kk, int threads, float* distances,
                    int64_t* ids) {
    const int64_t n = db_.size(), dim = db_.dim();
    SearchScratch& caller = SearchScratch::of_this_thread();
    caller.screened.resize(nq * kk);
    Candidate* const screened = caller.screened.data();
    bool known = false;  // whether the screen computed the candidates' float64 distances
    // every row is a candidate, or (cosine over rows of norm below ~2^-126) no screen can be proven
    const bool all_rows = kk == n, exhaustive = !all_rows && Metric::needs_norms && db_.tiny_rows() > 0;
    if (all_rows) {
      for (int64_t i = 0; i < nq; ++i) {
        for (int64_t j = 0; j < kk; ++j) screened[i * kk + j] = Candidate{0.0f, j};
      }
    } else if (!exhaustive) {
      caller.screen_queries.resize(nq * dim);
      caller.screen_norms.resize(nq);
      caller.bounds.resize(nq);
      for (int64_t i = 0; i < nq; ++i) {
        prepare_screen_query<Metric>(queries + i * dim, dim, db_.largest_norm(), caller.screen_queries.data() + i * dim,
                                     &caller.screen_norms[i], &caller.bounds[i]);
      }
      caller.screened_float64.resize(nq * kk);
      known = screen(caller.screen_queries.data(), caller.screen_norms.data(), nq, kk, threads, screened,
                     caller.screened_float64.data());
    }
    // per query: the candidates in float64, proven or searched exhaustively (eight queries per task)
    constexpr int64_t kPerTask = 8;
    const ScreenBound* const bounds = caller.bounds.data();
    const double* const float64 = known ? caller.screened_float64.data() : nullptr;
    auto qq_of = [&](const float* q) { return Metric::needs_norms ? exact_squares(q, (int)dim) : 0.0; };
    std::vector<char>& unproven = caller.unproven;
    unproven.assign(nq, exhaustive ? 1 : 0);
    if (!exhaustive) {
      ThreadPool::shared().run((int)((nq + kPerTask - 1) / kPerTask), threads, [&](int task) {
        for (int64_t i = task * kPerTask; i < std::min(nq, (task + 1) * kPerTask); ++i) {
          const float* q = queries + i * dim;
          unproven[i] = !verify_query<Metric>(db_, n, q, qq_of(q), k, kk, screened + i * kk, float64 ? float64 + i * kk : nullptr,
                                              all_rows ? ScreenBound{} : bounds[i], distances + i * k, ids + i * k);
        }
      });
    }
    // the unproven queries exhaustively: one per task where there are enough, else each over every thread
    std::vector<int64_t>& rest = caller.rest;
    rest.clear();
    for (int64_t i = 0; i < nq; ++i) {
      if (unproven[i]) rest.push_back(i);
    }
    exact_fallbacks_ += (int64_t)rest.size();
    if ((int64_t)rest.size() >= threads) {
      ThreadPool::shared().run((int)rest.size(), threads, [&](int j) {
        const int64_t i = rest[j];
        exhaustive_query<Metric>(db_, queries + i * dim, qq_of(queries + i * dim), k, distances + i * k, ids + i * k);
      });
    } else {
      for (const int64_t i : rest) {
        exhaustive_query_sliced<Metric>(db_, queries + i * dim, qq_of(queries + i * dim), k, threads, caller.parts,
                                        distances + i * k, ids + i * k);
      }
    }
  }

  // Each query's kk best rows by the full scan kernel's float32 key, sorted (TopK::extract), into out;
  // true when their float64 distances are in float64 too (the first passes compute them while rescoring).
  bool screen(const float* queries, const float* query_norms, int64_t nq, int64_t kk, int threads, Candidate* out,
              double* float64) {
    if constexpr (kSketched) {
      if (first_passes_ && sketched_) {
        if (sketch_pays(nq, kk, db_.panels()) &&
            sketch_counts_.record(sketch_search(db_, sketch_, queries, nq, kk, threads, out, float64))) {
          return true;
        }
        if (winograd_pays(nq, kk, db_.dim(), db_.panels()) &&
            winograd_counts_.record(winograd_search(db_, sketch_, queries, nq, kk, threads, out, float64))) {
          return true;
        }
      }
    }
    full_scan(queries, query_norms, nq, kk, threads, out);
    return false;
  }

  // All cores (pool.h): tasks are (query chunk, database slice) pairs, see make_plan.
  void full_scan(const float* queries, const float* query_norms, int64_t nq, int64_t k, int threads, Candidate* out) {
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
      scan<Metric>(db_.table(), db_.inverse_norms(), queries + first * db_.dim(), query_norms + first, count,
                   panel_begin, panel_end, best, scratch);
      for (int64_t i = 0; i < count; ++i) {
        best[i].extract(plan.slices == 1 ? out + (first + i) * k : merged + (slice * nq + first + i) * k);
      }
    });
    if (plan.slices > 1) merge(nq, k, plan.slices, merged, out);
  }

  // Each query's k best over all slices.
  void merge(int64_t nq, int64_t k, int64_t slices, const Candidate* merged, Candidate* out) {
    std::vector<Candidate>& storage = Scratch::of_this_thread().final_entries;
    storage.resize(TopK::capacity(k));
    TopK best;
    for (int64_t i = 0; i < nq; ++i) {
      best.start(k, storage.data());
      for (int64_t s = 0; s < slices; ++s) {
        const Candidate* part = merged + (s * nq + i) * k;
        for (int64_t j = 0; j < k && part[j].position >= 0; ++j) best.push(part[j].key, part[j].position);
      }
      best.extract(out + i * k);
    }
  }

  const bool sketched_;   // whether this index keeps the sketch (and so may use the first passes)
  WriterFirstGate gate_;  // searches share it; add, truncate and reset take it alone, ahead of later searches
  Database<Storage> db_;
  Sketch sketch_;
  // The row-major copy (row_copy.h) once built: row_copy_ owns it and is changed only by writers (under the
  // gate alone) and by the one builder (under the shared gate and row_copy_build_); searches read
  // row_copy_view_.
  std::unique_ptr<RowCopy<Storage>> row_copy_;
  std::atomic<const RowCopy<Storage>*> row_copy_view_{nullptr};
  std::mutex row_copy_build_;
  std::atomic<int> row_copy_mode_{TK_ROW_COPY_AUTO};
  std::atomic<int64_t> row_copy_credit_{0};  // what the gathered searches lost against the copy, estimated (ns)
  std::atomic<int64_t> direct_searches_{0}, row_copy_builds_{0};
};

// The bfloat16, int8 and uint8 indexes (narrow.cpp: a translation unit of their own, compiled beside
// api.cpp's in parallel by tinyknn/cpu/build.py); nullptr for another dtype.
std::unique_ptr<AnyIndex> make_narrow_index(int64_t dim, int metric, int dtype);

template <class Metric>
std::unique_ptr<AnyIndex> make_index_of(int64_t dim, int dtype) {
  switch (dtype) {
    case TK_FLOAT32: return std::unique_ptr<AnyIndex>(new Index<Metric, float>(dim));
    case TK_FLOAT16: return std::unique_ptr<AnyIndex>(new Index<Metric, half_bits>(dim));
    default: return nullptr;
  }
}

inline std::unique_ptr<AnyIndex> make_index(int64_t dim, int metric, int dtype) {
  require(dim >= 1, "dim must be >= 1");
  require(metric == TK_L2 || metric == TK_INNER_PRODUCT || metric == TK_COSINE,
          "metric must be TK_L2, TK_INNER_PRODUCT or TK_COSINE");
  std::unique_ptr<AnyIndex> index = metric == TK_L2               ? make_index_of<L2>(dim, dtype)
                                    : metric == TK_INNER_PRODUCT ? make_index_of<InnerProduct>(dim, dtype)
                                                                 : make_index_of<Cosine>(dim, dtype);
  if (!index) index = make_narrow_index(dim, metric, dtype);
  require(index != nullptr, "dtype must be TK_FLOAT32, TK_FLOAT16, TK_BFLOAT16, TK_INT8 or TK_UINT8");
  return index;
}

inline std::string build_features() {
  return std::string(simd_description()) + ", " + f16_description() + "; panels, register-blocked tiles, cache-blocked query chunks, bounded selection, threads; float32 l2 "
         "first passes: a float16 sketch (few queries), Winograd pairs (many queries); float64 verify";
}

}  // namespace tinyknn
