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
// (2-core AMD EPYC, AVX2, both cores, 1M x 128 float32; bench/NOTES_INDEX_OPS.md). Only their ratios matter.
constexpr double kGatherByteNs = 0.1;       // a byte of a panel that holds an allowed row, gathered and screened
constexpr double kScreenElementNs = 0.01;   // a (query, row, dimension) of the gathered rows' float32 screen
constexpr double kRowLineNs = 8.0;          // a cache line of an allowed row of the copy, read and widened
constexpr double kExactElementNs = 0.1;     // a (query, row, dimension) of float64 distance
constexpr double kBuildByteNs = 0.4;        // a byte of the database, copied into the row copy (1M x 128
                                            // float32: 160 ms; 660 ms where the memory is touched first)

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

constexpr int64_t kDirectAhead = 16;  // rows: each row's lines are prefetched while the row this many before is widened

// rows[0 .. count) (count <= kPanel) of `copy` widened into `panel` (dim x kPanel floats), lanes count ..
// kPanel - 1 zero; every line of rows[r + kDirectAhead] is prefetched as row r is read, for r + kDirectAhead
// < available. A scattered row is a few lines of its own: prefetched a row at a time, their misses overlap
// (measured, 10,000 random rows of 1M x 128 float32 not in cache: 0.72 ms against 2.6 with no prefetch or
// with a whole group's rows prefetched at once).
template <class Storage>
void widen_rows(const RowCopy<Storage>& copy, const int64_t* rows, int64_t count, int64_t available, float* panel) {
  const int64_t dim = copy.dim(), bytes = copy.row_bytes();
  for (int64_t r = 0; r < count; ++r) {
    if (r + kDirectAhead < available) {
      const char* ahead = reinterpret_cast<const char*>(copy.row(rows[r + kDirectAhead]));
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
    }
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
