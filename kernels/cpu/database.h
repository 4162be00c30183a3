// The database as the library stores it: in panels of kPanel rows, each panel dimension-major
// (element d of its kPanel rows side by side), so one SIMD load reads one dimension of many rows and
// the scan vectorises over rows for any dim. Elements keep the storage type (float, or float16 bits).
// Also kept: the caller's int64 id of every row and, for cosine, every row's inverse norm (computed
// once here). The last panel is zero-padded; its padding rows are never reported.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../metrics.cuh"
#include "errors.h"
#include "simd.h"

namespace tinyknn {

constexpr int kVectorsPerPanel = 2;
constexpr int kPanel = kVectorsPerPanel * kLanes;  // rows per panel

template <class Storage>
class Database {
 public:
  explicit Database(int64_t dim) : dim_(dim) {}

  int64_t dim() const { return dim_; }
  int64_t size() const { return (int64_t)ids_.size(); }
  int64_t panels() const { return (size() + kPanel - 1) / kPanel; }
  const Storage* panel(int64_t p) const { return elements_.data() + p * dim_ * kPanel; }
  const int64_t* ids() const { return ids_.data(); }
  // kPanel entries per panel (0 for padding rows).
  const float* inverse_norms() const { return inverse_norms_.data(); }

  void add(const Storage* vectors, int64_t n, const int64_t* ids, bool with_norms) {
    const int64_t first = size(), total = first + n;
    const int64_t total_panels = (total + kPanel - 1) / kPanel;
    elements_.resize(total_panels * dim_ * kPanel, Storage(0));
    if (with_norms) inverse_norms_.resize(total_panels * kPanel, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = first + i;
      Storage* slot = elements_.data() + (row / kPanel) * dim_ * kPanel + row % kPanel;
      const Storage* x = vectors + i * dim_;
      for (int64_t d = 0; d < dim_; ++d) slot[d * kPanel] = x[d];
      if (with_norms) inverse_norms_[row] = inverse_norm(squared_norm(x));
    }
    ids_.insert(ids_.end(), ids, ids + n);
  }

  void reset() {
    elements_.clear();
    ids_.clear();
    inverse_norms_.clear();
  }

  // The first n rows back in row order.
  void export_to(int64_t n, Storage* vectors, int64_t* ids) const {
    for (int64_t row = 0; row < n; ++row) {
      const Storage* slot = elements_.data() + (row / kPanel) * dim_ * kPanel + row % kPanel;
      for (int64_t d = 0; d < dim_; ++d) vectors[row * dim_ + d] = slot[d * kPanel];
    }
    std::copy(ids_.begin(), ids_.begin() + n, ids);
  }

 private:
  float squared_norm(const Storage* x) const {
    float sum = 0.0f;
    for (int64_t d = 0; d < dim_; ++d) sum = InnerProduct::accumulate(sum, to_float(x[d]), to_float(x[d]));
    return sum;
  }

  int64_t dim_;
  std::vector<Storage> elements_;
  std::vector<int64_t> ids_;
  std::vector<float> inverse_norms_;
};

}  // namespace tinyknn
