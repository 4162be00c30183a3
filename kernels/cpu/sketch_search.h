// The few-query l2 search of a float32 database through its float16 sketch (sketch.h): half the
// bytes of a full scan, and the same answer.
//
// 1. Every slice of the sketch is scanned (threads) with one SlackTopK per query, which keeps every
//    row whose sketch distance D~ is below threshold(k-th smallest D~ so far).
// 2. Per query the slices' rows are merged: kappa = the k-th smallest D~ overall, T = threshold(kappa),
//    candidates = rows with D~ < T.
// 3. The candidates are scored exactly: each one's float32 panel through the same kernel, same
//    summation order, as the full scan, so their distances are bit for bit the full scan's.
//
// Why no row of the full scan's answer is lost (scaled space, rho = e_max + delta, eta and eta~ the
// absolute underflow terms of the exact and the sketch sums, see sketch.h): the k rows with the
// smallest D~ (the largest being kappa) have true distance D <= (sqrt((kappa + eta~) / (1 - gamma)) +
// rho)^2 = U, so the full scan's k-th smallest float32 distance is at most U (1 + gamma') + eta. A row z
// in its answer has float32 distance <= U (1 + gamma') + eta, so D(z) <= (U (1 + gamma') + 2 eta) /
// (1 - gamma') = W, so sqrt(D'(z)) <= sqrt(W) + rho, so D~(z) <= (1 + gamma) (sqrt(W) + rho)^2 + eta~ = T.
// Rows dropped earlier were above a larger threshold.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "database.h"
#include "kernel.h"
#include "pool.h"
#include "rescore.h"
#include "scan.h"
#include "select.h"
#include "sketch.h"

namespace tinyknn {

constexpr int64_t kSketchMaxQueries = 8;     // more queries share each panel load: the full scan wins
constexpr int64_t kSketchMinPanels = 256;    // small databases are scanned exactly

// Whether a search of nq queries for k neighbours goes through the sketch.
inline bool sketch_pays(int64_t nq, int64_t k, int64_t panels) {
  return nq <= kSketchMaxQueries && panels >= kSketchMinPanels && k * 16 <= panels;
}

// Writes each query's k best rows by the full scan's float32 key (k candidates each, sorted, as TopK::extract
// writes them) into best, and their float64 distances into float64. Returns false, having written nothing that the caller keeps, when the sketch cannot answer: a query
// far outside the sketch's scale, or more candidates than it pays to rescore (data the sketch
// describes poorly). The caller then scans exactly.
// rows: nullptr (the sketch's rows are db's), or the db row of each of the sketch's rows (a filtered search's
// gathered sketch: the rows it keeps are translated before the rescoring reads db's float32 panels).
inline bool sketch_search(const Database<float>& db, const Sketch& sketch, const float* queries, int64_t nq,
                          int64_t k, int threads, Candidate* best, double* float64, const int64_t* rows = nullptr) {
  const int64_t dim = db.dim(), panels = sketch.residuals().count();
  const int64_t limit = std::max<int64_t>(2 * k, panels / 8);
  Scratch& caller = Scratch::of_this_thread();
  caller.prepared.resize(nq * dim);
  caller.bounds.resize(nq);
  for (int64_t i = 0; i < nq; ++i) {
    if (!sketch.prepare(queries + i * dim, caller.prepared.data() + i * dim, &caller.bounds[i])) return false;
  }
  // Four slices per thread, taken from a shared counter: a thread that starts late takes fewer.
  const int64_t slices = std::max<int64_t>(1, std::min<int64_t>(4 * threads, panels / kMinSlicePanels));
  if ((int64_t)caller.kept.size() < slices * nq) caller.kept.resize(slices * nq);
  std::atomic<bool> gave_up{false};
  ThreadPool::shared().run((int)slices, threads, [&](int slice) {
    Scratch& scratch = Scratch::of_this_thread();
    if ((int64_t)scratch.slack.size() < nq) scratch.slack.resize(nq);
    for (int64_t i = 0; i < nq; ++i) scratch.slack[i].start(k, limit, &caller.bounds[i], &caller.kept[slice * nq + i]);
    scan<L2>(sketch.residuals(), nullptr, caller.prepared.data(), nullptr, nq, panels * slice / slices,
             panels * (slice + 1) / slices, scratch.slack.data(), scratch);
    for (int64_t i = 0; i < nq; ++i) {
      scratch.slack[i].compact();
      if (scratch.slack[i].overflowed()) gave_up = true;
    }
  });
  if (gave_up) return false;
  if (rows != nullptr) {
    for (int64_t j = 0; j < slices * nq; ++j) {
      for (Candidate& c : caller.kept[j]) c.position = rows[c.position];
    }
  }

  return rescore_candidates(db, queries, nq, k, caller.bounds.data(), caller.kept.data(), slices, limit, threads, best,
                            float64);
}

}  // namespace tinyknn
