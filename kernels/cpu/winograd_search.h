// The many-query l2 search of a float32 database through the Winograd pass (winograd.h): the same
// answer as the full scan, for about 3/4 of its arithmetic.
//
// 1. Tasks of (query chunk, database slice), planned as for the full scan (scan.h): each panel is
//    moved to the sketch's centre once per chunk, then scored against the chunk's queries, kPairQueries
//    at a time, into one SlackTopK per query, which keeps every row whose key is below
//    threshold(k-th smallest key so far) (the bound is winograd.h's prepare_winograd_query).
// 2. Per query, the rows its slices kept are cut to the final threshold and scored exactly (rescore.h).
//
// The keys' error bound is absolute and grows with the largest row norm around the centre, so data
// that the centre describes poorly (far outliers) leaves too many candidates: the search then hands
// over to the full scan, as the sketch does.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "database.h"
#include "pool.h"
#include "rescore.h"
#include "scan.h"
#include "select.h"
#include "sketch.h"
#include "winograd.h"

namespace tinyknn {

constexpr int64_t kWinogradMinQueries = 16;  // fewer queries are bound by memory bandwidth (measured: 9-12 lose)
constexpr int64_t kWinogradMinPanels = 256;  // small databases are scanned exactly
// Fewer dims save too little arithmetic to pay for the pass's selection (which keeps more rows than
// the full scan's) and rescoring, and low-dimensional data packs so densely that the keys' absolute
// error bound keeps too many candidates (dim 1: more than 68 for k = 1). Measured on 100k rows, 1,000
// queries: dim 16-24 1.01-1.16x the full scan, dim 32-48 0.89-0.91x at k = 10 but 1.05x at k = 100,
// dim 64 and more 0.78-0.93x; hence dim >= 32 and dim >= k / 2.
constexpr int64_t kWinogradMinDim = 32;

// Dims per block of a panel (a multiple of kGroup): the centred block, 12 KB, stays in L1 while every
// tile of the chunk runs on it (a whole panel of 784 dims, 50 KB, would not).
constexpr int64_t kDimBlock = 192;

// Queries per block: the candidates kept for a block (and the thread-local buffers that hold them, which
// later searches reuse) stay bounded however many queries a search has.
constexpr int64_t kWinogradBlockQueries = 4096;

// Whether a search of nq queries for k neighbours in dim dimensions goes through the Winograd pass.
inline bool winograd_pays(int64_t nq, int64_t k, int64_t dim, int64_t panels) {
  return nq >= kWinogradMinQueries && dim >= kWinogradMinDim && 2 * dim >= k && panels >= kWinogradMinPanels &&
         k * 16 <= panels;
}

// One block of at most kWinogradBlockQueries queries: steps 1 and 2 above.
inline bool winograd_block(const Database<float>& db, const Sketch& sketch, const float* queries, int64_t nq,
                           int64_t k, int threads, Candidate* best, double* float64) {
  constexpr int64_t Q = kPairQueries;
  const int64_t dim = db.dim(), panels = db.panels(), n = db.size();
  const int64_t limit = std::max<int64_t>(4 * k + 64, panels / 16);
  Scratch& caller = Scratch::of_this_thread();
  const int64_t padded = (nq + Q - 1) / Q * Q;  // the last tile's missing queries are zeros nobody reads
  std::vector<float>& centred = caller.centred_queries;  // row-major, then interleaved into `prepared`
  centred.resize(nq * dim);
  caller.bounds.resize(nq);
  for (int64_t i = 0; i < nq; ++i) {
    if (!prepare_winograd_query(sketch, queries + i * dim, centred.data() + i * dim, &caller.bounds[i])) return false;
  }
  caller.prepared.resize(padded * dim);
  interleave_queries(centred.data(), nq, dim, caller.prepared.data());
  const Plan plan = make_plan(nq, dim, panels, threads, Q);
  if ((int64_t)caller.kept.size() < plan.slices * nq) caller.kept.resize(plan.slices * nq);
  std::atomic<bool> gave_up{false};
  ThreadPool::shared().run((int)(plan.chunks * plan.slices), threads, [&](int task) {
    const int64_t chunk = task / plan.slices, slice = task % plan.slices;
    const int64_t first = chunk * plan.chunk, count = std::min(plan.chunk, nq - first);
    const int64_t tiles = (count + Q - 1) / Q * Q;
    Scratch& scratch = Scratch::of_this_thread();
    if ((int64_t)scratch.slack.size() < tiles) scratch.slack.resize(tiles);
    for (int64_t i = 0; i < tiles; ++i) {
      if (i < count) {
        scratch.slack[i].start(k, limit, &caller.bounds[first + i], &caller.kept[slice * nq + first + i]);
      } else {
        scratch.slack[i].start(k, limit, &caller.bounds[first], &scratch.rejected);
        scratch.slack[i].reject_all();
      }
    }
    const int64_t blocks = (dim + kDimBlock - 1) / kDimBlock;
    scratch.centred.resize(std::min(dim, kDimBlock) * kPanel);
    scratch.partial.resize(blocks > 1 ? tiles * kPanel : 0);
    float* const y = scratch.centred.data();
    float alpha[kPanel];
    const float* const p = caller.prepared.data() + first * dim;
    const int64_t panel_end = panels * (slice + 1) / plan.slices;
    for (int64_t panel = panels * slice / plan.slices; panel < panel_end; ++panel) {
      if (gave_up.load(std::memory_order_relaxed)) return;
      // the next panel comes from DRAM while this one's tiles run (centring alone would wait for it)
      const float* const next = db.panel(std::min(panel + 1, panel_end - 1));
      const int64_t bytes = dim * kPanel * (int64_t)sizeof(float), parts = blocks * (tiles / Q);
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t begin = block * kDimBlock, end = std::min(dim, begin + kDimBlock);
        centre_panel(db.panel(panel), sketch.centre(), begin, end, y, alpha);
        for (int64_t t = 0; t < tiles; t += Q) {
          prefetch_part(next, bytes, block * (tiles / Q) + t / Q, parts);
          winograd_tile(p + t * dim, dim, begin, end, y, alpha, scratch.partial.data() + t * kPanel,
                        scratch.slack.data() + t, panel * kPanel, n);
        }
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      scratch.slack[i].compact();
      if (scratch.slack[i].overflowed()) gave_up = true;
    }
  });
  if (gave_up) return false;

  return rescore_candidates(db, queries, nq, k, caller.bounds.data(), caller.kept.data(), plan.slices, limit, threads,
                            best, float64);
}

// Writes each query's k best rows by the full scan's float32 key (k candidates each, sorted) into best, and
// their float64 distances into float64.
// Returns false, having written nothing that the caller keeps, when the pass cannot answer: a query far
// outside the data's scale, or more candidates than it pays to rescore. The caller then scans exactly.
inline bool winograd_search(const Database<float>& db, const Sketch& sketch, const float* queries, int64_t nq,
                            int64_t k, int threads, Candidate* best, double* float64) {
  const int64_t dim = db.dim();
  for (int64_t first = 0; first < nq; first += kWinogradBlockQueries) {
    const int64_t count = std::min(kWinogradBlockQueries, nq - first);
    if (!winograd_block(db, sketch, queries + first * dim, count, k, threads, best + first * k, float64 + first * k)) {
      return false;
    }
  }
  return true;
}

}  // namespace tinyknn
