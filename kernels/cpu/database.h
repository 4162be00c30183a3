// The database as the library stores it.
//
// Panels<Storage>: rows in panels of kPanel rows, each panel dimension-major (element d of its kPanel
// rows side by side), so one SIMD load reads one dimension of many rows and the scan vectorises over
// rows for any dim. Elements keep the storage type (float, or float16 bits); the last panel is
// zero-padded and its padding rows are never reported. Panels live in fixed blocks of kBlockPanels'
// multiple (about 64 MiB each, from mmap: pages cost memory once written), allocated as the rows grow: growing never copies what is stored (a
// std::vector doubling would hold the old and the new copy at once), and a group of kGroupPanels
// consecutive panels never straddles two blocks (the kernels read such groups through one pointer).
// Database<Storage>: the panels plus the caller's int64 id of every row and, for cosine, every row's
// inverse norm (from a float64 sum, computed once, at add).
//
// An add is reserve() (every allocation; may throw std::bad_alloc, changes nothing) then commit()
// (cannot throw): an add that fails leaves the database exactly as it was (the strong guarantee).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include <sys/mman.h>

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
constexpr int64_t kGroupPanels = 4;                // the most panels one kernel call reads (kernel.h)
constexpr int64_t kBlockBytes = 64 << 20;          // a block of panels holds about this much

// Grows a std::vector's capacity geometrically before an append of `more`, so that the append itself
// cannot throw (vectors of ids and norms are small next to the panels: their doubling copy is cheap).
template <class Vector>
void reserve_for(Vector& v, std::size_t more) {
  if (v.size() + more > v.capacity()) v.reserve(std::max(v.size() + more, 2 * v.capacity()));
}

// kBytes bytes as one value of the compiler's vector extension (the blend of copy_panel_of_rows).
template <std::size_t kBytes>
struct LineOf {
  typedef unsigned char type __attribute__((vector_size(kBytes)));
};

// Row storage in blocks straight from mmap: zero pages that cost memory only once written (a block of a small
// index stays mostly virtual), page aligned (so 64-byte aligned), each block unmapping its own pages. Panels
// and RowCopy keep their rows in these.
template <class Storage>
struct MappedBlocks {
  struct Free {
    std::size_t bytes;
    void operator()(Storage* p) const { munmap(p, bytes); }
  };
  typedef std::unique_ptr<Storage[], Free> Block;

  // `bytes` rounded up to whole 64 KiB pages (each block of a mapping then starts on a page: munmap needs it).
  static std::size_t rounded(std::size_t bytes) {
    const std::size_t page = 1 << 16;
    return (bytes + page - 1) / page * page;
  }

  // `more` blocks of `bytes` (rounded) appended to `out`, from one mapping, so that the kernel weighs the
  // whole add against the memory it has (block by block, each would pass and the pages would fail later, when
  // written). huge_pages: ask for 2 MiB pages (madvise; a refusal changes nothing). Throws std::bad_alloc.
  static void map(std::size_t bytes, int64_t more, bool huge_pages, std::vector<Block>& out) {
    const std::size_t total = bytes * (std::size_t)more;
    void* region = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) throw std::bad_alloc();
    if (huge_pages) madvise(region, total, MADV_HUGEPAGE);
    out.reserve(out.size() + more);  // (if this throws, the region leaks: only ever on a failing add)
    for (int64_t b = 0; b < more; ++b) {
      out.push_back(Block(reinterpret_cast<Storage*>(static_cast<char*>(region) + b * bytes), Free{bytes}));
    }
  }

  // The blocks of `from` moved to the end of `into` (its capacity reserved beforehand: cannot throw).
  static void adopt(std::vector<Block>& from, std::vector<Block>& into) noexcept {
    for (auto& block : from) into.push_back(std::move(block));
    from.clear();
  }
};

template <class Storage>
class Panels {
 public:
  explicit Panels(int64_t dim)
      : dim_(dim),
        block_panels_(std::max<int64_t>(kGroupPanels, kBlockBytes / (dim * kPanel * (int64_t)sizeof(Storage))
                                                          / kGroupPanels * kGroupPanels)) {}

  int64_t dim() const { return dim_; }
  int64_t rows() const { return rows_; }
  int64_t count() const { return (rows_ + kPanel - 1) / kPanel; }
  // Panel p; panels p .. p + kGroupPanels - 1 of one group (p a multiple of kGroupPanels) are contiguous.
  const Storage* panel(int64_t p) const {
    return blocks_[p / block_panels_].get() + (p % block_panels_) * dim_ * kPanel;
  }
  // How many panels from p on are contiguous in memory (at least 1).
  int64_t contiguous_from(int64_t p) const { return block_panels_ - p % block_panels_; }

  // Blocks for `n` more rows, allocated now (may throw std::bad_alloc); append() then cannot throw.
  struct Growth;
  Growth reserve(int64_t n) {
    Growth growth;
    if (n > ((int64_t)1 << 44) / (dim_ * (int64_t)sizeof(Storage))) throw std::bad_alloc();  // > 16 TiB
    const int64_t panels_needed = (rows_ + n + kPanel - 1) / kPanel;
    const int64_t blocks_needed = (panels_needed + block_panels_ - 1) / block_panels_;
    const int64_t more = blocks_needed - (int64_t)blocks_.size();
    if (more <= 0) return growth;
    Blocks::map(block_bytes(), more, false, growth.blocks);
    blocks_.reserve(blocks_.size() + more);  // so that append() cannot throw (capacity only: nothing changes)
    return growth;
  }

  // Appends n rows into the blocks of `growth` (from reserve(n)); row i's element d is element(i, d).
  template <class Element>
  void append(int64_t n, Element element, Growth& growth) noexcept {
    Blocks::adopt(growth.blocks, blocks_);
    for (int64_t i = 0; i < n; ++i, ++rows_) {
      Storage* slot = slot_of(rows_);
      for (int64_t d = 0; d < dim_; ++d) slot[d * kPanel] = element(i, d);
    }
  }

  // Rows [0, n) of a reused table (its blocks kept: no new pages to fault in), their elements left to
  // gather_rows; padding rows of the last panel are zeroed here. growth: from reserve(n) on an empty table.
  void resize_for_gather(int64_t n, Growth& growth) noexcept {
    for (auto& block : growth.blocks) blocks_.push_back(std::move(block));
    growth.blocks.clear();
    rows_ = n;
    for (int64_t row = n; row < count() * kPanel; ++row) {
      Storage* slot = slot_of(row);
      for (int64_t d = 0; d < dim_; ++d) slot[d * kPanel] = Storage{};
    }
  }

  // Rows rows[first .. first + n) of `source` (same dim) into rows first .. first + n - 1 of this table
  // (first a multiple of kPanel). A whole panel of consecutive rows (a label's rows once the Index has put
  // them together, a contiguous filter) is copied a line per dimension; other rows an element per
  // dimension, each in a cache line of its own (or two per line), the rows kAhead later prefetched so
  // that their lines stream in while this one is copied.
  void gather_rows(const Panels& source, const int64_t* rows, int64_t first, int64_t n) noexcept {
    constexpr int64_t kAhead = 8, kLineElements = 64 / (kPanel * (int64_t)sizeof(Storage));
    constexpr int64_t kStep = kLineElements > 0 ? kLineElements : 1;
    const int64_t end = first + n;
    for (int64_t i = first; i < end; ++i) {
      if (i % kPanel == 0 && i + kPanel <= end && consecutive(rows + i) && copy_panel_of_rows(source, rows[i], i)) {
        i += kPanel - 1;
        continue;
      }
      if (i + kAhead < end) {
        const Storage* ahead = source.slot_of(rows[i + kAhead]);
        for (int64_t d = 0; d < dim_; d += kStep) __builtin_prefetch(ahead + d * kPanel);
      }
      const Storage* from = source.slot_of(rows[i]);
      Storage* slot = slot_of(i);
      for (int64_t d = 0; d < dim_; ++d) slot[d * kPanel] = from[d * kPanel];
    }
  }

  // gather_rows for all n rows, in pieces of whole panels handed to `run(pieces, fn(piece))` (threads).
  template <class Run>
  void gather_all(const Panels& source, const int64_t* rows, int64_t n, Run run) {
    constexpr int64_t kPiece = 64 * kPanel;
    run((int)((n + kPiece - 1) / kPiece), [&](int piece) {
      const int64_t first = piece * kPiece;
      gather_rows(source, rows, first, std::min(kPiece, n - first));
    });
  }

  // No rows, the blocks kept for the next resize_for_gather (a filtered search's reused table).
  void empty() noexcept { rows_ = 0; }

  // Row `from`'s elements over row `to`'s (both < rows()): remove's swap.
  void copy_row(int64_t from, int64_t to) noexcept {
    const Storage* source = slot_of(from);
    Storage* target = slot_of(to);
    for (int64_t d = 0; d < dim_; ++d) target[d * kPanel] = source[d * kPanel];
  }

  Storage at(int64_t row, int64_t d) const { return slot_of(row)[d * kPanel]; }
  void row_to(int64_t row, Storage* out) const {
    const Storage* slot = slot_of(row);
    for (int64_t d = 0; d < dim_; ++d) out[d] = slot[d * kPanel];
  }

  // Keeps rows [0, n): later rows' slots become zero padding, blocks past the last panel are freed.
  void truncate(int64_t n) noexcept {
    if (n >= rows_) return;
    for (int64_t row = n; row < std::min<int64_t>(rows_, (n + kPanel - 1) / kPanel * kPanel); ++row) {
      Storage* slot = slot_of(row);
      for (int64_t d = 0; d < dim_; ++d) slot[d * kPanel] = Storage{};
    }
    rows_ = n;
    const int64_t blocks_needed = (count() + block_panels_ - 1) / block_panels_;
    while ((int64_t)blocks_.size() > blocks_needed) blocks_.pop_back();
  }

  void clear() noexcept { truncate(0); }

 private:
  static bool consecutive(const int64_t* rows) noexcept {
    for (int64_t j = 1; j < kPanel; ++j) {
      if (rows[j] != rows[0] + j) return false;
    }
    return true;
  }

  // Source rows from .. from + kPanel - 1 into this table's panel that starts at row `to`: each dimension's
  // line is the end of one source panel's line and the start of the next panel's. Where the two panels are
  // adjacent in memory (the loads then never leave the two panels), each line is two unaligned whole-line
  // loads and a bitwise blend: 10,000 consecutive rows gather in about half the time of an element at a
  // time (measured: bench/NOTES_INDEX_OPS.md). Else (a block's edge) false, nothing copied: gather_rows
  // then copies those rows one by one.
  bool copy_panel_of_rows(const Panels& source, int64_t from, int64_t to) noexcept {
    const int64_t offset = from % kPanel, keep = kPanel - offset, line = kPanel * (int64_t)sizeof(Storage);
    const Storage* a = source.slot_of(from - offset);
    Storage* out = slot_of(to);
    if (offset == 0) {
      std::memcpy(out, a, (std::size_t)(line * dim_));
      return true;
    }
    const Storage* b = source.slot_of(from + keep);
    if (b != a + dim_ * kPanel) return false;
    typedef typename LineOf<kPanel * sizeof(Storage)>::type Line;
    Line from_head;
    for (int64_t i = 0; i < line; ++i) from_head[i] = i < keep * (int64_t)sizeof(Storage) ? 0xff : 0;
    for (int64_t d = 0; d < dim_; ++d) {
      Line head, tail;
      std::memcpy(&head, a + d * kPanel + offset, line);   // this line's end, then the next line's start
      std::memcpy(&tail, b + d * kPanel - keep, line);     // the line before's end, then this line's start
      const Line both = (head & from_head) | (tail & ~from_head);
      std::memcpy(out + d * kPanel, &both, line);
    }
    return true;
  }

  Storage* slot_of(int64_t row) const {
    const int64_t p = row / kPanel;
    return blocks_[p / block_panels_].get() + (p % block_panels_) * dim_ * kPanel + row % kPanel;
  }

  typedef MappedBlocks<Storage> Blocks;
  typedef typename Blocks::Block Block;

  // A block's panels, in whole pages.
  std::size_t block_bytes() const {
    return Blocks::rounded((std::size_t)(block_panels_ * dim_ * kPanel) * sizeof(Storage));
  }

  int64_t dim_, block_panels_, rows_ = 0;
  std::vector<Block> blocks_;

 public:
  struct Growth {
    std::vector<Block> blocks;
  };
};

// 1 / sqrt(x x) rounded to float32 from a float64 sum, 0 for a zero row, +inf where it does not fit a
// normal float32 (a norm below ~2^-126: such rows make the cosine screen unprovable, see verify.h).
inline float inverse_norm64(double squares) {
  if (squares == 0.0) return 0.0f;
  const double inverse = 1.0 / std::sqrt(squares);
  return inverse < 1.0e38 ? (float)inverse : positive_infinity();
}

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
  // The largest float64 row norm, rounded up (the ip screen's error bound grows with it, verify.h).
  double largest_norm() const { return largest_norm_; }
  // Rows whose inverse norm does not fit a float32 (cosine then verifies every row, verify.h).
  int64_t tiny_rows() const { return tiny_rows_; }
  Storage at(int64_t row, int64_t d) const { return panels_.at(row, d); }
  // Row `row`'s dim elements into out (contiguous), for the float64 verify (verify.h).
  void row_to(int64_t row, Storage* out) const { panels_.row_to(row, out); }

  // What an add of n rows needs, allocated (may throw std::bad_alloc; the database is unchanged).
  struct Growth {
    typename Panels<Storage>::Growth panels;
  };
  Growth reserve(int64_t n, bool with_norms) {
    Growth growth{panels_.reserve(n)};
    reserve_for(ids_, n);  // capacity only: what the database holds is unchanged
    const std::size_t norms_needed = (std::size_t)((size() + n + kPanel - 1) / kPanel * kPanel);
    if (with_norms && norms_needed > inverse_norms_.size()) reserve_for(inverse_norms_, norms_needed - inverse_norms_.size());
    return growth;
  }

  // The add itself, into what reserve(n, with_norms) allocated: cannot throw.
  void commit(const Storage* vectors, int64_t n, const int64_t* ids, bool with_norms, Growth& growth) noexcept {
    const int64_t dim = this->dim(), first = size();
    panels_.append(n, [&](int64_t i, int64_t d) { return vectors[i * dim + d]; }, growth.panels);
    ids_.insert(ids_.end(), ids, ids + n);
    const std::size_t norms_needed = (std::size_t)((first + n + kPanel - 1) / kPanel * kPanel);
    if (with_norms && norms_needed > inverse_norms_.size()) inverse_norms_.resize(norms_needed, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const double squares = squared_norm64(vectors + i * dim, dim);
      // rounded up past the float64 sum's own rounding
      largest_norm_ = std::max(largest_norm_, std::sqrt(squares) * (1.0 + 1e-12 + (double)dim * 1e-15));
      if (with_norms) {
        inverse_norms_[first + i] = inverse_norm64(squares);
        tiny_rows_ += std::isinf(inverse_norms_[first + i]) ? 1 : 0;
      }
    }
  }

  // A database of rows rows[0 .. n) of `source` (in range; sorted for a filtered search, any order for
  // permute_rows), ids and inverse norms copied, the largest norm kept (a bound for the subset too): what a
  // filtered search searches, and a reorder's new table (search.h).
  // The rows are gathered in pieces of whole panels by `run(pieces, fn(piece))` (the caller's threads).
  template <class Run>
  void assign_rows(const Database& source, const int64_t* rows, int64_t n, bool with_norms, Run run) {
    panels_.empty();
    auto growth = panels_.reserve(n);
    ids_.resize(n);
    if (with_norms) inverse_norms_.assign((std::size_t)((n + kPanel - 1) / kPanel * kPanel), 0.0f);
    panels_.resize_for_gather(n, growth);
    panels_.gather_all(source.panels_, rows, n, run);
    for (int64_t i = 0; i < n; ++i) ids_[i] = source.ids_[rows[i]];
    if (with_norms) {
      for (int64_t i = 0; i < n; ++i) inverse_norms_[i] = source.inverse_norms_[rows[i]];
      tiny_rows_ = std::count_if(inverse_norms_.begin(), inverse_norms_.end(), [](float w) { return std::isinf(w); });
    }
    largest_norm_ = source.largest_norm_;
  }

  // Row `from` (its elements, id and inverse norm) over row `to`: remove's swap, then truncate().
  void move_row(int64_t from, int64_t to) noexcept {
    panels_.copy_row(from, to);
    ids_[to] = ids_[from];
    if (!inverse_norms_.empty()) inverse_norms_[to] = inverse_norms_[from];
  }

  // Keeps rows [0, n). The largest norm stays that of the rows once held (a bound, still honest).
  void truncate(int64_t n) {
    if (n >= size()) return;
    panels_.truncate(n);
    ids_.resize(n);
    if (!inverse_norms_.empty()) {
      std::fill(inverse_norms_.begin() + n, inverse_norms_.end(), 0.0f);
      inverse_norms_.resize((n + kPanel - 1) / kPanel * kPanel);
      tiny_rows_ = std::count_if(inverse_norms_.begin(), inverse_norms_.end(), [](float w) { return std::isinf(w); });
    }
    if (n == 0) largest_norm_ = 0.0;
  }

  void reset() { truncate(0); }

  // Bytes of the stored elements (what a reused temporary table keeps between searches).
  int64_t bytes() const { return size() * dim() * (int64_t)sizeof(Storage); }

  // The first n rows back in row order.
  void export_to(int64_t n, Storage* vectors, int64_t* ids) const {
    for (int64_t row = 0; row < n; ++row) {
      for (int64_t d = 0; d < dim(); ++d) vectors[row * dim() + d] = panels_.at(row, d);
    }
    std::copy(ids_.begin(), ids_.begin() + n, ids);
  }

 private:
  static double squared_norm64(const Storage* x, int64_t dim) {
    double sum = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
      const double value = (double)to_float(x[d]);
      sum += value * value;
    }
    return sum;
  }

  Panels<Storage> panels_;
  std::vector<int64_t> ids_;
  std::vector<float> inverse_norms_;
  double largest_norm_ = 0.0;
  int64_t tiny_rows_ = 0;
};

}  // namespace tinyknn
