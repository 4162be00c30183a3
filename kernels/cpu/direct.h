// A filtered search of a few queries straight from the row-major copy (row_copy.h): every allowed row's
// float64 distance (kernels/exact.cuh), the k best by (distance, id). No screen and no bound: the answer is
// the contract's by definition, for every metric and storage type.
//
// The allowed rows are split into slices (threads); each slice takes kPanel rows at a time, widens them
// (exactly) into a float32 panel on its stack, dimension-major like the database's, and scores it with the
// exhaustive pass's exact_panel (exhaustive.h: rows as lanes of double vectors, each summed in dimension
// order with no FMA), so every distance is bit for bit Exact<Metric>::distance. The rows of the next group
// are prefetched while one is scored. Each slice keeps each query's k best; the slices are merged.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../exact.cuh"
#include "exhaustive.h"
#include "pool.h"
#include "row_copy.h"
#include "verify.h"

namespace tinyknn {

constexpr int64_t kDirectMaxQueries = 32;       // beyond this the gathered panels' float32 screen always wins
constexpr int64_t kDirectMinSliceRows = 1024;   // a slice (task) holds at least this many allowed rows

// The cost model that picks the direct search or the gather for a filtered search of up to kDirectMaxQueries
// queries, and says when the copy has paid for itself (search.h): nanoseconds of the development machine
// (2-core AMD EPYC, both cores, 1M x 128 float32, allowed rows not in cache; fitted in bench/NOTES_INDEX_OPS.md).
// Only their ratios matter.
constexpr double kGatherByteNs = 0.07;      // a byte of a panel that holds an allowed row, read by the gather
constexpr double kGatheredByteNs = 0.1;     // a byte of a gathered row, written and screened
constexpr double kScreenElementNs = 0.01;   // a (query, row, dimension) of the gathered rows' float32 screen
constexpr double kRowLineNs = 12.0;         // a cache line of an allowed row of the copy, read and widened
constexpr double kExactElementNs = 0.12;    // a (query, row, dimension) of float64 distance
constexpr double kBuildByteNs = 1.0;        // a byte of the database, copied into the row copy (1M x 128
                                            // float32: 160 ms in memory used before, 440-750 ms where the
                                            // pages are touched for the first time)

// Per-thread buffers of the direct search.
struct DirectScratch {
  std::vector<float> panel;                        // kPanel rows, dimension-major
  std::vector<ExactTopK> best;                     // one per query
  std::vector<std::vector<ExactEntry>> parts;      // the caller's: each (slice, query)'s k best, then the merge
  static DirectScratch& of_this_thread() {
    static thread_local DirectScratch scratch;
    return scratch;
  }
};

constexpr int64_t kDirectAhead = 16;  // rows: each row's lines are prefetched while the row this many before is read

typedef float Float8 __attribute__((vector_size(32)));
static_assert(kPanel % 8 == 0, "a panel is whole groups of 8 rows");

// Elements d .. d + 7 of a row, widened exactly to float.
inline Float8 load8(const float* x) {
  Float8 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline Float8 load8(const half_bits* x) {
#if defined(__F16C__)
  return (Float8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
#else
  Float8 v;
  for (int j = 0; j < 8; ++j) v[j] = half_to_float(x[j]);
  return v;
#endif
}
template <class Narrow>
inline Float8 load8(const Narrow* x) {
  Float8 v;
  for (int j = 0; j < 8; ++j) v[j] = to_float(x[j]);
  return v;
}

// Lanes I... of the 16 lanes of a then b. (__builtin_shufflevector is Clang's and GCC 12's; older GCCs have
// __builtin_shuffle with a mask vector, which newer ones keep.)
template <int... I>
inline Float8 shuffle8(Float8 a, Float8 b) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, I...);
#else
  typedef int Int8 __attribute__((vector_size(32)));
  return __builtin_shuffle(a, b, Int8{I...});
#endif
}

// An 8 x 8 transpose in three rounds of two-vector shuffles (unpack, 64-bit pairs, 128-bit halves): v[i] row i's
// 8 elements in, v[j] element j of the 8 rows out.
inline void transpose8(Float8 v[8]) {
  Float8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = shuffle8<0, 8, 1, 9, 4, 12, 5, 13>(v[i], v[i + 1]);
    t[i + 1] = shuffle8<2, 10, 3, 11, 6, 14, 7, 15>(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    for (int h = 0; h < 2; ++h) {
      u[i + 2 * h] = shuffle8<0, 1, 8, 9, 4, 5, 12, 13>(t[i + h], t[i + h + 2]);
      u[i + 2 * h + 1] = shuffle8<2, 3, 10, 11, 6, 7, 14, 15>(t[i + h], t[i + h + 2]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = shuffle8<0, 1, 2, 3, 8, 9, 10, 11>(u[j], u[j + 4]);
    v[j + 4] = shuffle8<4, 5, 6, 7, 12, 13, 14, 15>(u[j], u[j + 4]);
  }
}

// rows[0 .. count) (count <= kPanel) of `copy` widened into `panel` (dim x kPanel floats, dimension-major),
// lanes count .. kPanel - 1 zero: 8 rows x 8 dimensions at a time through transpose8, the rest an element at a
// time. Every line of rows[r + kDirectAhead] is prefetched as row r is read (for r + kDirectAhead < available):
// a scattered row is a few lines of its own, prefetched a row at a time their misses overlap (measured, 10,000
// random rows of 1M x 128 float32 not in cache: 0.72 ms against 2.6 with no prefetch or with a whole group's
// rows prefetched at once).
template <class Storage>
void widen_rows(const RowCopy<Storage>& copy, const int64_t* rows, int64_t count, int64_t available, float* panel) {
  const int64_t dim = copy.dim(), bytes = copy.row_bytes(), whole = count / 8 * 8, body = dim / 8 * 8;
  auto prefetch = [&](int64_t r) {
    if (r + kDirectAhead < available) {
      const char* ahead = reinterpret_cast<const char*>(copy.row(rows[r + kDirectAhead]));
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
    }
  };
  for (int64_t r = 0; r < whole; r += 8) {
    const Storage* x[8];
    for (int i = 0; i < 8; ++i) {
      prefetch(r + i);
      x[i] = copy.row(rows[r + i]);
    }
    for (int64_t d = 0; d < body; d += 8) {
      Float8 v[8];
      for (int i = 0; i < 8; ++i) v[i] = load8(x[i] + d);
      transpose8(v);
      for (int j = 0; j < 8; ++j) std::memcpy(panel + (d + j) * kPanel + r, &v[j], sizeof v[j]);
    }
    for (int i = 0; i < 8; ++i) {
      for (int64_t d = body; d < dim; ++d) panel[d * kPanel + r + i] = to_float(x[i][d]);
    }
  }
  for (int64_t r = whole; r < count; ++r) {
    prefetch(r);
    const Storage* x = copy.row(rows[r]);
    for (int64_t d = 0; d < dim; ++d) panel[d * kPanel + r] = to_float(x[d]);
  }
  for (int64_t r = count; r < kPanel; ++r) {
    for (int64_t d = 0; d < dim; ++d) panel[d * kPanel + r] = 0.0f;
  }
}

// The contract's answer over rows rows[0 .. m) (positions in `copy`, any order; ids[row] their ids) for nq
// queries: k distances and ids per query, padded as write_answer pads.
template <class Metric, class Storage>
void direct_search(const RowCopy<Storage>& copy, const int64_t* ids, const int64_t* rows, int64_t m,
                   const float* queries, int64_t nq, int64_t k, int threads, float* distances, int64_t* out_ids) {
  const int64_t dim = copy.dim();
  const int64_t slices = std::max<int64_t>(1, std::min<int64_t>(4 * (int64_t)threads, m / kDirectMinSliceRows));
  DirectScratch& caller = DirectScratch::of_this_thread();
  if ((int64_t)caller.parts.size() < (slices + 1) * nq) caller.parts.resize((slices + 1) * nq);
  std::vector<double> squares(nq);
  for (int64_t i = 0; i < nq; ++i) squares[i] = Metric::needs_norms ? exact_squares(queries + i * dim, (int)dim) : 0.0;
  std::vector<std::vector<ExactEntry>>& parts = caller.parts;
  ThreadPool::shared().run((int)slices, threads, [&](int slice) {
    DirectScratch& scratch = DirectScratch::of_this_thread();
    scratch.panel.resize(dim * kPanel);
    scratch.best.resize(nq);
    float* panel = scratch.panel.data();
    for (int64_t i = 0; i < nq; ++i) scratch.best[i].start(k, &parts[slice * nq + i]);
    const int64_t begin = m * slice / slices, end = m * (slice + 1) / slices;
    double exact[kPanel];
    for (int64_t first = begin; first < end; first += kPanel) {
      const int64_t count = std::min<int64_t>(kPanel, end - first);
      widen_rows(copy, rows + first, count, end - first, panel);
      for (int64_t i = 0; i < nq; ++i) {
        exact_panel<Metric, float>(panel, dim, queries + i * dim, squares[i], exact);
        for (int64_t r = 0; r < count; ++r) {
          scratch.best[i].push(ExactEntry{exact_key<Metric>(exact[r]), ids[rows[first + r]], exact[r]});
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i) scratch.best[i].finish();
  });
  for (int64_t i = 0; i < nq; ++i) {
    ExactTopK best;
    best.start(k, &parts[slices * nq + i]);
    for (int64_t s = 0; s < slices; ++s) {
      for (const ExactEntry& entry : parts[s * nq + i]) best.push(entry);
    }
    write_answer<Metric>(best.finish(), k, distances + i * k, out_ids + i * k);
  }
}

}  // namespace tinyknn
