// Range search under the exactness contract: every row whose float64 distance (kernels/exact.cuh) is
// strictly inside the radius (l2: d < radius; ip, cosine: d > radius), each query's hits ordered by
// (float64 key, id), distances reported as float32(d).
//
// The float32 scan kernel (kernel.h) screens: verify.h's ScreenBound says that a row whose float32 key f is
// >= K has float64 key >= lower(K), so with the bar T = the smallest float with lower(T) >= the radius' key
// no row with f >= T can be a hit; the rows below the bar get their float64 distances (panel by panel,
// exhaustive.h's exact_panel, where a panel holds several) and the float64 comparison decides. Cosine over
// an index holding rows of norm below ~2^-126 has no bound: every row is decided in float64. Queries go in
// blocks of kRangeBlockQueries, so the candidates in memory are bounded by the block, not by a cap on hits.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../exact.cuh"
#include "database.h"
#include "exhaustive.h"
#include "pool.h"
#include "scan.h"
#include "select.h"
#include "verify.h"

namespace tinyknn {

constexpr int64_t kRangeBlockQueries = 256;

// Each query's hits, in query order: counts[i] hits of query i, their distances and ids concatenated.
struct RangeAnswer {
  std::vector<int64_t> counts;
  std::vector<float> distances;
  std::vector<int64_t> ids;
};

// The smallest float32 T (tried upwards from the bound's inverse) with bound.lower(T) >= limit: no row whose
// screen key is >= T has a float64 key below `limit`. +inf when none is found (every row is then a candidate).
inline float screen_bar(const ScreenBound& bound, double limit) {
  const double guess = (limit + bound.c) / bound.b + bound.a;
  if (!(std::fabs(guess) < 3.0e38)) return positive_infinity();
  float bar = (float)guess;
  for (int step = 0; step < 64; ++step) {
    if (bound.lower(bar) >= limit) return bar;
    bar = std::nextafter(bar, positive_infinity());
  }
  return positive_infinity();
}

// The float64 entries of `candidates` (positions, any order) whose key is below `limit`, appended to hits:
// panels holding several candidates are computed whole (exact_panel), lone rows one by one.
template <class Metric, class Storage>
void decide(const Database<Storage>& db, const float* q, double qq, std::vector<Candidate>& candidates, double limit,
            std::vector<ExactEntry>& hits) {
  VerifyScratch& scratch = VerifyScratch::of_this_thread();
  Storage* buffer = scratch.row(db, db.dim());
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) { return a.position < b.position; });
  double exact[kPanel];
  const int64_t* ids = db.ids();
  for (std::size_t j = 0; j < candidates.size();) {
    const int64_t panel = candidates[j].position / kPanel;
    std::size_t end = j;
    while (end < candidates.size() && candidates[end].position / kPanel == panel) ++end;
    const bool whole = end - j >= 2;
    if (whole) exact_panel<Metric>(db.panel(panel), db.dim(), q, qq, exact);
    for (; j < end; ++j) {
      const int64_t position = candidates[j].position;
      const ExactEntry entry = whole ? ExactEntry{exact_key<Metric>(exact[position % kPanel]), ids[position],
                                                  exact[position % kPanel]}
                                     : exact_entry<Metric>(db, position, q, qq, buffer);
      if (entry.key < limit) hits.push_back(entry);
    }
  }
}

// Every row's float64 entry below `limit` (no screen can be proven: cosine over rows of tiny norm).
template <class Metric, class Storage>
void decide_all(const Database<Storage>& db, const float* q, double qq, double limit, std::vector<ExactEntry>& hits) {
  double exact[kPanel];
  const int64_t n = db.size();
  for (int64_t p = 0; p < db.panels(); ++p) {
    exact_panel<Metric>(db.panel(p), db.dim(), q, qq, exact);
    for (int64_t l = 0; l < std::min<int64_t>(kPanel, n - p * kPanel); ++l) {
      const double key = exact_key<Metric>(exact[l]);
      if (key < limit) hits.push_back(ExactEntry{key, db.ids()[p * kPanel + l], exact[l]});
    }
  }
}

// Per-thread buffers of a range search's block (the caller's: prepared queries and bars; the slices' kept rows).
struct RangeScratch {
  std::vector<float> queries, norms, bars;
  std::vector<ScreenBound> bounds;
  std::vector<std::vector<Candidate>> kept;   // (slice, query) -> rows below the bar
  std::vector<std::vector<ExactEntry>> hits;  // query -> its hits
  std::vector<TopK> selectors;     // in range mode (TopK::start_below)
  std::vector<Candidate> room;
  static RangeScratch& of_this_thread() {
    static thread_local RangeScratch scratch;
    return scratch;
  }
};

// One block of queries (at most kRangeBlockQueries) appended to out.
template <class Metric, class Storage>
void range_block(const Database<Storage>& db, const float* queries, int64_t nq, double radius, int threads,
                 RangeAnswer& out) {
  const int64_t dim = db.dim();
  const double limit = Metric::larger_is_better ? -radius : radius;
  const bool exhaustive = Metric::needs_norms && db.tiny_rows() > 0;
  RangeScratch& caller = RangeScratch::of_this_thread();
  caller.queries.resize(nq * dim);
  caller.norms.resize(nq);
  caller.bounds.resize(nq);
  caller.bars.resize(nq);
  for (int64_t i = 0; i < nq; ++i) {
    prepare_screen_query<Metric>(queries + i * dim, dim, db.largest_norm(), caller.queries.data() + i * dim,
                                 &caller.norms[i], &caller.bounds[i]);
    caller.bars[i] = screen_bar(caller.bounds[i], limit);
  }
  const Plan plan = make_plan(nq, dim, db.panels(), threads, kTileQueries);
  if ((int64_t)caller.kept.size() < plan.slices * nq) caller.kept.resize(plan.slices * nq);
  for (int64_t j = 0; j < plan.slices * nq; ++j) caller.kept[j].clear();
  if (!exhaustive) {
    ThreadPool::shared().run((int)(plan.chunks * plan.slices), threads, [&](int task) {
      const int64_t chunk = task / plan.slices, slice = task % plan.slices;
      const int64_t first = chunk * plan.chunk, count = std::min(plan.chunk, nq - first);
      RangeScratch& mine = RangeScratch::of_this_thread();
      constexpr int64_t kRoom = 512;
      mine.selectors.resize(count);
      mine.room.resize(count * kRoom);
      for (int64_t i = 0; i < count; ++i) {
        mine.selectors[i].start_below(caller.bars[first + i], kRoom, mine.room.data() + i * kRoom,
                                      &caller.kept[slice * nq + first + i]);
      }
      // float32 panels only (narrower storage converted per panel): one kernel family per metric for this selector
      std::vector<float>& converted = Scratch::of_this_thread().panel;
      scan_panels<Metric, float>(db.table(), db.inverse_norms(), caller.queries.data() + first * dim,
                                 caller.norms.data() + first, count, db.panels() * slice / plan.slices,
                                 db.panels() * (slice + 1) / plan.slices, mine.selectors.data(),
                                 [&](const Storage* panels, int64_t n_panels) {
                                   return panels_as_float(panels, n_panels, converted, dim);
                                 });
      for (int64_t i = 0; i < count; ++i) mine.selectors[i].flush();
    });
  }
  if ((int64_t)caller.hits.size() < nq) caller.hits.resize(nq);
  ThreadPool::shared().run((int)nq, threads, [&](int i) {
    const float* q = queries + i * dim;
    const double qq = Metric::needs_norms ? exact_squares(q, (int)dim) : 0.0;
    std::vector<ExactEntry>& hits = caller.hits[i];
    hits.clear();
    if (exhaustive) {
      decide_all<Metric>(db, q, qq, limit, hits);
    } else {
      std::vector<Candidate>& all = caller.kept[i];  // slice 0's, with the other slices' appended
      for (int64_t s = 1; s < plan.slices; ++s) {
        all.insert(all.end(), caller.kept[s * nq + i].begin(), caller.kept[s * nq + i].end());
      }
      decide<Metric>(db, q, qq, all, limit, hits);
    }
    std::sort(hits.begin(), hits.end());
  });
  for (int64_t i = 0; i < nq; ++i) {
    out.counts.push_back((int64_t)caller.hits[i].size());
    for (const ExactEntry& hit : caller.hits[i]) {
      out.distances.push_back((float)hit.distance);
      out.ids.push_back(hit.id);
    }
  }
}

// Every query's hits (see the top of this file), block by block.
template <class Metric, class Storage>
void range_search(const Database<Storage>& db, const float* queries, int64_t nq, double radius, int threads,
                  RangeAnswer& out) {
  out.counts.reserve(nq);
  for (int64_t first = 0; first < nq; first += kRangeBlockQueries) {
    const int64_t count = std::min(kRangeBlockQueries, nq - first);
    range_block<Metric>(db, queries + first * db.dim(), count, radius, threads, out);
  }
}

}  // namespace tinyknn
