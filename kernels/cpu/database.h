// The database as the library stores it.
//
// Panels<Storage>: rows in panels of kPanel rows, each panel dimension-major (element d of its kPanel
// rows side by side), so one SIMD load reads one dimension of many rows and the scan vectorises over
// rows for any dim. Elements keep the storage type (float, or float16 bits); the last panel is
// zero-padded and its padding rows are never reported.
// Database<Storage>: the panels plus the caller's int64 id of every row and, for cosine, every row's
// inverse norm (computed once, at add).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "../metrics.cuh"
#include "errors.h"
#include "simd.h"

namespace tinyknn {

// std::allocator with 64-byte alignment: SIMD loads of a panel never straddle two cache lines.
template <class T>
struct CacheAligned {
  typedef T value_type;
  CacheAligned() = default;
  template <class U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};

constexpr int kVectorsPerPanel = 2;
constexpr int kPanel = kVectorsPerPanel * kLanes;  // rows per panel

template <class Storage>
class Panels {
 public:
  explicit Panels(int64_t dim) : dim_(dim) {}

  int64_t dim() const { return dim_; }
  int64_t rows() const { return rows_; }
  int64_t count() const { return (rows_ + kPanel - 1) / kPanel; }
  const Storage* panel(int64_t p) const { return elements_.data() + p * dim_ * kPanel; }

  // Appends n rows; row i's element d is element(i, d).
  template <class Element>
  void append(int64_t n, Element element) {
    const int64_t total_panels = (rows_ + n + kPanel - 1) / kPanel;
    elements_.resize(total_panels * dim_ * kPanel, Storage(0));
    for (int64_t i = 0; i < n; ++i, ++rows_) {
      Storage* slot = elements_.data() + (rows_ / kPanel) * dim_ * kPanel + rows_ % kPanel;
      for (int64_t d = 0; d < dim_; ++d) slot[d * kPanel] = element(i, d);
    }
  }

  Storage at(int64_t row, int64_t d) const {
    return elements_[(row / kPanel) * dim_ * kPanel + d * kPanel + row % kPanel];
  }

  void clear() {
    elements_.clear();
    rows_ = 0;
  }

 private:
  int64_t dim_, rows_ = 0;
  std::vector<Storage, CacheAligned<Storage>> elements_;
};

template <class Storage>
class Database {
 public:
  explicit Database(int64_t dim) : panels_(dim) {}

  int64_t dim() const { return panels_.dim(); }
  int64_t size() const { return panels_.rows(); }
  int64_t panels() const { return panels_.count(); }
  const Storage* panel(int64_t p) const { return panels_.panel(p); }
  const Panels<Storage>& table() const { return panels_; }
  const int64_t* ids() const { return ids_.data(); }
  // kPanel entries per panel (0 for padding rows).
  const float* inverse_norms() const { return inverse_norms_.data(); }

  void add(const Storage* vectors, int64_t n, const int64_t* ids, bool with_norms) {
    const int64_t dim = this->dim(), first = size();
    panels_.append(n, [&](int64_t i, int64_t d) { return vectors[i * dim + d]; });
    ids_.insert(ids_.end(), ids, ids + n);
    if (with_norms) {
      inverse_norms_.resize(panels() * kPanel, 0.0f);
      for (int64_t i = 0; i < n; ++i) inverse_norms_[first + i] = inverse_norm(squared_norm(vectors + i * dim));
    }
  }

  void reset() {
    panels_.clear();
    ids_.clear();
    inverse_norms_.clear();
  }

  // The first n rows back in row order.
  void export_to(int64_t n, Storage* vectors, int64_t* ids) const {
    for (int64_t row = 0; row < n; ++row) {
      for (int64_t d = 0; d < dim(); ++d) vectors[row * dim() + d] = panels_.at(row, d);
    }
    std::copy(ids_.begin(), ids_.begin() + n, ids);
  }

 private:
  float squared_norm(const Storage* x) const {
    float sum = 0.0f;
    for (int64_t d = 0; d < dim(); ++d) sum = InnerProduct::accumulate(sum, to_float(x[d]), to_float(x[d]));
    return sum;
  }

  Panels<Storage> panels_;
  std::vector<int64_t> ids_;
  std::vector<float> inverse_norms_;
};

}  // namespace tinyknn
