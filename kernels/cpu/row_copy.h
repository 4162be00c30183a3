// A row-major copy of the database, for filtered searches of a few queries over scattered rows.
//
// The panels (database.h) put kPanel rows side by side per dimension, so one row's elements lie in every
// cache line of its panel: a search of a random 1 % of 1M rows reads ~15 % of the float16 sketch's panels on
// AVX2 builds (1 - 0.99^16), ~28 % on AVX-512's 32-row panels, to use 1 % of what they hold. Here each row's
// elements are contiguous (dim x the element size, in mmap blocks like the panels'), so a scattered row
// costs its own cache lines only, and direct.h computes the allowed rows' float64 distances from them.
//
// Nothing is stored until a filtered search asks (search.h: built when the filtered searches it would have
// sped up have lost about its cost, or on request); from then on adds, removals, reorders and truncations
// keep it in step with the panels. Memory: the database's elements once more (float32 1M x 128: 512 MiB).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "database.h"

namespace tinyknn {

template <class Storage>
class RowCopy {
 public:
  explicit RowCopy(int64_t dim)
      : dim_(dim), block_rows_(std::max<int64_t>(1, kBlockBytes / (dim * (int64_t)sizeof(Storage)))) {}

  int64_t dim() const { return dim_; }
  int64_t rows() const { return rows_; }
  const Storage* row(int64_t i) const { return blocks_[i / block_rows_].get() + (i % block_rows_) * dim_; }
  // The bytes of one row (what a scattered row costs to read, in whole cache lines or less).
  int64_t row_bytes() const { return dim_ * (int64_t)sizeof(Storage); }

  // Blocks for `n` more rows, allocated now (may throw std::bad_alloc; nothing changes); append() then
  // cannot throw.
  struct Growth;
  Growth reserve(int64_t n) {
    Growth growth;
    if (n > ((int64_t)1 << 44) / row_bytes()) throw std::bad_alloc();
    const int64_t blocks_needed = (rows_ + n + block_rows_ - 1) / block_rows_;
    const int64_t more = blocks_needed - (int64_t)blocks_.size();
    if (more <= 0) return growth;
    // Scattered rows are read a few lines each: with 4 KiB pages nearly every row is a TLB miss. Huge pages
    // (where the kernel grants them on madvise) cover 2 MiB each: 10,000 random rows of 1M x 128 float32, not
    // in cache, 0.72-0.79 ms against 1.2-2.9 ms without (bench/NOTES_INDEX_OPS.md).
    Blocks::map(block_bytes(), more, true, growth.blocks);
    blocks_.reserve(blocks_.size() + more);
    return growth;
  }

  // Rows vectors[0 .. n) (n rows of dim, row-major, an add's input) after the last row.
  void append(const Storage* vectors, int64_t n, Growth& growth) noexcept {
    adopt(growth);
    for (int64_t i = 0; i < n; ++i, ++rows_) std::memcpy(slot(rows_), vectors + i * dim_, (std::size_t)row_bytes());
  }

  // Every row of `panels` (rows [0, n) of it), transposed from its panels, a piece of panels per
  // `run(pieces, fn(piece))` task. growth: from reserve(n) on an empty copy.
  template <class Run>
  void assign_from(const Panels<Storage>& panels, int64_t n, Growth& growth, Run run) noexcept {
    adopt(growth);
    rows_ = n;
    constexpr int64_t kPiece = 64;  // panels per task
    const int64_t count = (n + kPanel - 1) / kPanel;
    run((int)((count + kPiece - 1) / kPiece), [&](int piece) {
      for (int64_t p = piece * kPiece; p < std::min(count, (piece + 1) * kPiece); ++p) {
        const Storage* panel = panels.panel(p);
        const int64_t first = p * kPanel, rows = std::min<int64_t>(kPanel, n - first);
        for (int64_t r = 0; r < rows; ++r) {
          Storage* out = slot(first + r);
          for (int64_t d = 0; d < dim_; ++d) out[d] = panel[d * kPanel + r];
        }
      }
    });
  }

  // The rows in the order order[0 .. n) (n = rows(); new row i is old row order[i]: permute_rows), in place:
  // each cycle of the permutation is followed with its first row set aside in `aside` (dim elements), rows
  // kAhead steps further along the cycle prefetched. pending: n flags, nonzero for every row (cleared here).
  // No second copy of the rows (a reorder already holds two of the panels), no new pages to fault in.
  void permute(const int64_t* order, char* pending, Storage* aside) noexcept {
    constexpr int kAhead = 8;
    const std::size_t bytes = (std::size_t)row_bytes();
    for (int64_t i = 0; i < rows_; ++i) {
      if (!pending[i]) continue;
      pending[i] = 0;
      if (order[i] == i) continue;
      std::memcpy(aside, row(i), bytes);
      int64_t to = i, ahead = i;
      for (int s = 0; s < kAhead && order[ahead] != i; ++s) ahead = order[ahead];
      for (int64_t from = order[to]; from != i; to = from, from = order[from]) {
        if (order[ahead] != i) {
          ahead = order[ahead];
          const char* line = reinterpret_cast<const char*>(row(ahead));
          for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(line + b);
        }
        std::memcpy(slot(to), row(from), bytes);
        pending[from] = 0;
      }
      std::memcpy(slot(to), aside, bytes);
    }
  }

  // Row `from` over row `to` (remove's swap).
  void move_row(int64_t from, int64_t to) noexcept { std::memcpy(slot(to), row(from), (std::size_t)row_bytes()); }

  // Keeps rows [0, n); blocks past the last row are freed.
  void truncate(int64_t n) noexcept {
    if (n >= rows_) return;
    rows_ = n;
    const int64_t blocks_needed = (n + block_rows_ - 1) / block_rows_;
    while ((int64_t)blocks_.size() > blocks_needed) blocks_.pop_back();
  }

 private:
  typedef MappedBlocks<Storage> Blocks;
  typedef typename Blocks::Block Block;

  void adopt(Growth& growth) noexcept { Blocks::adopt(growth.blocks, blocks_); }

  Storage* slot(int64_t i) const { return blocks_[i / block_rows_].get() + (i % block_rows_) * dim_; }

  std::size_t block_bytes() const { return Blocks::rounded((std::size_t)(block_rows_ * row_bytes())); }

  int64_t dim_, block_rows_, rows_ = 0;
  std::vector<Block> blocks_;

 public:
  struct Growth {
    std::vector<Block> blocks;
  };
};

}  // namespace tinyknn
