// The exhaustive float64 pass (verify.h's answer for a query whose screen could not be proven), panel by
// panel: each lane of a vector of doubles is one row, summed in dimension order with exactly exact.cuh's
// operations (every product materialised before its addition: no FMA), so every row's distance is bit for
// bit Exact<Metric>::distance of that row, several rows per instruction.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../exact.cuh"
#include "database.h"
#include "pool.h"
#include "simd.h"
#include "select.h"
#include "verify.h"

namespace tinyknn {

#if defined(__AVX512F__)
constexpr int kDoubleLanes = 8;
#elif defined(__AVX__)
constexpr int kDoubleLanes = 4;
#else
constexpr int kDoubleLanes = 2;
#endif
typedef double DoubleVec __attribute__((vector_size(8 * kDoubleLanes)));
static_assert(kPanel % kDoubleLanes == 0, "a panel is whole vectors of doubles");

// The product as computed, kept from being fused with the addition that follows (as exact_mul does).
inline DoubleVec materialised(DoubleVec v) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(v));
#elif defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile DoubleVec kept = v;
  v = kept;
#endif
  return v;
}

inline DoubleVec widen_lanes(const float* x) {
  DoubleVec v;
  for (int l = 0; l < kDoubleLanes; ++l) v[l] = (double)x[l];
  return v;
}

// Float64 distances (exact.cuh) of query q to the kPanel rows of one panel, into out.
template <class Metric, class Storage>
void exact_panel(const Storage* panel, int64_t dim, const float* q, double qq, double* out) {
  constexpr int C = kPanel / kDoubleLanes;
  DoubleVec sums[C] = {}, squares[C] = {};  // l2: sum of squared differences; ip, cosine: dot (and x x)
  float row[kPanel];
  for (int64_t d = 0; d < dim; ++d) {
    const float* x = row;
    if constexpr (std::is_same<Storage, float>::value) {
      x = panel + d * kPanel;
    } else {
      for (int v = 0; v < kVectorsPerPanel; ++v) store(row + v * kLanes, load(panel + d * kPanel + v * kLanes));  // exact
    }
    const double qd = (double)q[d];
    for (int c = 0; c < C; ++c) {
      const DoubleVec xv = widen_lanes(x + c * kDoubleLanes);
      if constexpr (std::is_same<Metric, L2>::value) {
        const DoubleVec diff = qd - xv;
        sums[c] = sums[c] + materialised(diff * diff);
      } else {
        sums[c] = sums[c] + materialised(qd * xv);
        if constexpr (Metric::needs_norms) squares[c] = squares[c] + materialised(xv * xv);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int l = 0; l < kDoubleLanes; ++l) {
      double distance = sums[c][l] + 0.0;
      if constexpr (Metric::needs_norms) {
        const double xx = squares[c][l];
        distance = qq == 0.0 || xx == 0.0 ? 0.0
                                          : exact_div(sums[c][l], exact_mul(exact_sqrt(qq), exact_sqrt(xx))) + 0.0;
      }
      out[c * kDoubleLanes + l] = distance;
    }
  }
}

// The float64 l2 distances (exact.cuh) of `count` (query, row) pairs whose rows are in one panel (its first
// row first_row), kDoubleLanes pairs at a time (their sums are independent: no waiting on one chain of
// additions), into each pair's float64: what rescore.h computes while the panel is in cache.
inline void exact_pairs(const float* panel, int64_t dim, const float* queries, RescoredPair* pairs,
                        const int64_t* which, int64_t count, int64_t first_row) {
  for (int64_t start = 0; start < count; start += kDoubleLanes) {
    const int m = (int)std::min<int64_t>(kDoubleLanes, count - start);
    const float* q[kDoubleLanes];
    const float* x[kDoubleLanes];
    for (int j = 0; j < kDoubleLanes; ++j) {  // missing lanes repeat the first pair
      const RescoredPair& pair = pairs[which[start + (j < m ? j : 0)]];
      q[j] = queries + pair.query * dim;
      x[j] = panel + (pair.position - first_row);
    }
    DoubleVec sum = {};
    for (int64_t d = 0; d < dim; ++d) {
      DoubleVec qv, xv;
      for (int j = 0; j < kDoubleLanes; ++j) {
        qv[j] = (double)q[j][d];
        xv[j] = (double)x[j][d * kPanel];
      }
      const DoubleVec diff = qv - xv;
      sum = sum + materialised(diff * diff);
    }
    for (int j = 0; j < m; ++j) pairs[which[start + j]].float64 = sum[j] + 0.0;
  }
}

// The float64 distances of panels [begin, end) offered to best.
template <class Metric, class Storage>
void exact_rows(const Database<Storage>& db, const float* q, double qq, int64_t begin, int64_t end, ExactTopK& best) {
  double exact[kPanel];
  const int64_t n = db.size();
  for (int64_t p = begin; p < end; ++p) {
    exact_panel<Metric>(db.panel(p), db.dim(), q, qq, exact);
    for (int64_t l = 0; l < std::min<int64_t>(kPanel, n - p * kPanel); ++l) {
      best.push(ExactEntry{exact_key<Metric>(exact[l]), db.ids()[p * kPanel + l], exact[l]});
    }
  }
}

// Every row's float64 distance: the answer when the screen's could not be proven (on this thread).
template <class Metric, class Storage>
void exhaustive_query(const Database<Storage>& db, const float* q, double qq, int64_t k, float* distances, int64_t* ids) {
  ExactTopK best;
  best.start(k, &VerifyScratch::of_this_thread().entries);
  exact_rows<Metric>(db, q, qq, 0, db.panels(), best);
  write_answer<Metric>(best.finish(), k, distances, ids);
}

// The same on all threads: slices of the database, each its own k best, merged (for a few queries).
template <class Metric, class Storage>
void exhaustive_query_sliced(const Database<Storage>& db, const float* q, double qq, int64_t k, int threads,
                             std::vector<std::vector<ExactEntry>>& parts, float* distances, int64_t* ids) {
  const int64_t slices = std::max<int64_t>(1, std::min<int64_t>(4 * (int64_t)threads, db.panels() / 16));
  if ((int64_t)parts.size() < slices + 1) parts.resize(slices + 1);
  ThreadPool::shared().run((int)slices, threads, [&](int slice) {
    ExactTopK best;
    best.start(k, &parts[slice]);
    exact_rows<Metric>(db, q, qq, db.panels() * slice / slices, db.panels() * (slice + 1) / slices, best);
    best.finish();
  });
  ExactTopK best;
  best.start(k, &parts[slices]);
  for (int64_t s = 0; s < slices; ++s) {
    for (const ExactEntry& entry : parts[s]) best.push(entry);
  }
  write_answer<Metric>(best.finish(), k, distances, ids);
}

}  // namespace tinyknn
