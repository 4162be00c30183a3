// Selection of the k smallest keys (keys: smaller is better, see metrics.cuh) from a stream of
// (key, position) pairs, for k chosen at run time.
//
// A buffer of 2k entries collects every key below the current threshold; when it is full, nth_element
// keeps its k best and the threshold becomes the k-th best key. Each key costs one comparison, and a
// key that gets in costs amortised O(1): far cheaper than sorting all n keys, and than a heap when
// most keys fail the threshold test (they do, after the first few thousand rows).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../metrics.cuh"
#include "database.h"
#include "simd.h"
#include "sketch.h"

namespace tinyknn {

struct Candidate {
  float key;
  int64_t position;
  bool operator<(const Candidate& other) const {
    return key < other.key || (key == other.key && position < other.position);
  }
};

// One (query, row) pair of a first pass's answer, its full-scan key once rescored, and its float64
// distance (exact.cuh; rescore.h computes it while the row's panel is in cache).
struct RescoredPair {
  int64_t position, query;
  float exact;
  double float64;
};

class TopK {
 public:
  // `storage` must hold capacity(k) entries and outlive this object.
  static int64_t capacity(int64_t k) { return 2 * k; }

  void start(int64_t k, Candidate* storage) {
    k_ = k;
    entries_ = storage;
    size_ = 0;
    threshold_ = positive_infinity();
    spill_ = nullptr;
  }

  // Range mode (range.h): keeps every key below `bar`, no selection; whenever the `room` entries of storage
  // fill up they are moved to `spill` (so the scan kernels serve range search with no kernels of its own).
  void start_below(float bar, int64_t room, Candidate* storage, std::vector<Candidate>* spill) {
    start(room / 2, storage);
    threshold_ = bar;
    spill_ = spill;
  }
  // Range mode: what storage still holds, moved to the spill list.
  void flush() {
    spill_->insert(spill_->end(), entries_, entries_ + size_);
    size_ = 0;
  }

  float threshold() const { return threshold_; }

  void push(float key, int64_t position) {
    if (key < threshold_) {
      entries_[size_++] = Candidate{key, position};
      if (size_ == 2 * k_) shrink();
    }
  }

  // The k best, nearest first, as candidates (padded with key +inf, position -1): one slice's
  // contribution to a merge.
  void extract(Candidate* out) {
    const int64_t take = std::min(k_, size_);
    std::partial_sort(entries_, entries_ + take, entries_ + size_);
    for (int64_t j = 0; j < k_; ++j) out[j] = j < take ? entries_[j] : Candidate{positive_infinity(), -1};
  }

  // The k best, nearest first: distances (reported, not keys) and the caller's ids; padded past size.
  template <class Metric>
  void finish(const int64_t* ids, float* distances, int64_t* out_ids) {
    const int64_t take = std::min(k_, size_);
    std::partial_sort(entries_, entries_ + take, entries_ + size_);
    for (int64_t j = 0; j < k_; ++j) {
      distances[j] = from_key<Metric>(j < take ? entries_[j].key : positive_infinity());
      out_ids[j] = j < take ? ids[entries_[j].position] : -1;
    }
  }

 private:
  void shrink() {
    if (spill_ != nullptr) return flush();
    std::nth_element(entries_, entries_ + (k_ - 1), entries_ + size_);
    threshold_ = entries_[k_ - 1].key;
    size_ = k_;
  }

  int64_t k_ = 0, size_ = 0;
  float threshold_ = 0.0f;
  Candidate* entries_ = nullptr;
  std::vector<Candidate>* spill_ = nullptr;
};

// Records every key offered (its threshold lets all through): the exact keys of one panel's rows.
struct PanelKeys {
  float key[kPanel];
  int64_t first_row;
  float threshold() const { return positive_infinity(); }
  void push(float value, int64_t position) { key[position - first_row] = value; }
};

// Keeps every (key, position) whose key is below bound.threshold(k-th smallest key so far): the
// candidates of the sketch pass (sketch.h), usually a few more than k. The buffer grows as needed;
// past `limit` entries the selector gives up (overflowed()) and rejects everything after.
class SlackTopK {
 public:
  void start(int64_t k, int64_t limit, const SketchBound* bound, std::vector<Candidate>* entries) {
    k_ = k;
    limit_ = limit;
    bound_ = bound;
    entries_ = entries;
    entries_->clear();
    capacity_ = 2 * k;
    threshold_ = positive_infinity();
    overflowed_ = false;
  }

  float threshold() const { return threshold_; }
  bool overflowed() const { return overflowed_; }
  // Keeps nothing from now on (a tile's padding query).
  void reject_all() { threshold_ = -positive_infinity(); }
  std::vector<Candidate>& entries() { return *entries_; }

  void push(float key, int64_t position) {
    if (key < threshold_) {
      entries_->push_back(Candidate{key, position});
      if ((int64_t)entries_->size() >= capacity_) compact();
    }
  }

  // Lowers the threshold to bound(k-th smallest key) and drops what is no longer below it.
  void compact() {
    std::vector<Candidate>& entries = *entries_;
    if ((int64_t)entries.size() >= k_) {
      std::nth_element(entries.begin(), entries.begin() + (k_ - 1), entries.end());
      threshold_ = std::min(threshold_, bound_->threshold(entries[k_ - 1].key));
      const float bar = threshold_;
      entries.erase(std::partition(entries.begin(), entries.end(), [bar](const Candidate& c) { return c.key < bar; }),
                    entries.end());
    }
    capacity_ = std::max<int64_t>(capacity_, 2 * (int64_t)entries.size());
    if ((int64_t)entries.size() > limit_) {
      overflowed_ = true;
      threshold_ = -positive_infinity();
    }
  }

 private:
  int64_t k_ = 0, limit_ = 0, capacity_ = 0;
  const SketchBound* bound_ = nullptr;
  std::vector<Candidate>* entries_ = nullptr;
  float threshold_ = 0.0f;
  bool overflowed_ = false;
};

}  // namespace tinyknn
