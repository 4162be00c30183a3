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

namespace tinyknn {

struct Candidate {
  float key;
  int64_t position;
  bool operator<(const Candidate& other) const {
    return key < other.key || (key == other.key && position < other.position);
  }
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
  }

  float threshold() const { return threshold_; }

  void push(float key, int64_t position) {
    if (key < threshold_) {
      entries_[size_++] = Candidate{key, position};
      if (size_ == 2 * k_) shrink();
    }
  }

  // The keys of `count` consecutive positions from first_position (count <= kPanel; keys has room for
  // kPanel): one vector comparison rejects a whole panel when none of its keys beats the threshold.
  void push_panel(const float* keys, int count, int64_t first_position) {
    const Vec bar = broadcast(threshold_);
    bool any = false;
    for (int v = 0; v < kVectorsPerPanel; ++v) {
      const auto below = load(keys + v * kLanes) < bar;
      for (int l = 0; l < kLanes; ++l) any |= below[l] != 0;
    }
    if (!any) return;
    for (int r = 0; r < count; ++r) push(keys[r], first_position + r);
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
    std::nth_element(entries_, entries_ + (k_ - 1), entries_ + size_);
    threshold_ = entries_[k_ - 1].key;
    size_ = k_;
  }

  int64_t k_ = 0, size_ = 0;
  float threshold_ = 0.0f;
  Candidate* entries_ = nullptr;
};

}  // namespace tinyknn
