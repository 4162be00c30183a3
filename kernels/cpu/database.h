// The database as the library stores it: rows contiguous in the storage type (float, or float16 bits),
// the caller's int64 id of every row, and for cosine the inverse norm of every row (computed once here).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../metrics.cuh"
#include "errors.h"

namespace tinyknn {

template <class Storage>
class Database {
 public:
  explicit Database(int64_t dim) : dim_(dim) {}

  int64_t dim() const { return dim_; }
  int64_t size() const { return (int64_t)ids_.size(); }
  const Storage* row(int64_t i) const { return rows_.data() + i * dim_; }
  const int64_t* ids() const { return ids_.data(); }
  const float* inverse_norms() const { return inverse_norms_.data(); }

  void add(const Storage* vectors, int64_t n, const int64_t* ids, bool with_norms) {
    rows_.insert(rows_.end(), vectors, vectors + n * dim_);
    ids_.insert(ids_.end(), ids, ids + n);
    if (with_norms) {
      for (int64_t i = 0; i < n; ++i) inverse_norms_.push_back(inverse_norm(squared_norm(vectors + i * dim_)));
    }
  }

  void reset() {
    rows_.clear();
    ids_.clear();
    inverse_norms_.clear();
  }

  void export_to(int64_t n, Storage* vectors, int64_t* ids) const {
    std::copy(rows_.begin(), rows_.begin() + n * dim_, vectors);
    std::copy(ids_.begin(), ids_.begin() + n, ids);
  }

 private:
  float squared_norm(const Storage* x) const {
    float sum = 0.0f;
    for (int64_t d = 0; d < dim_; ++d) sum = InnerProduct::accumulate(sum, to_float(x[d]), to_float(x[d]));
    return sum;
  }

  int64_t dim_;
  std::vector<Storage> rows_;
  std::vector<int64_t> ids_;
  std::vector<float> inverse_norms_;
};

}  // namespace tinyknn
