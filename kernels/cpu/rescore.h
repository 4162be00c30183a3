// The end of a search through a first pass (sketch_search.h, winograd_search.h), for one query: the
// rows each slice's pass kept, cut to those under the bound's threshold, then scored exactly, panel by
// panel, by the full scan's own kernel and summation order, so the answer is bit for bit the full
// scan's (the proof that no row of that answer is missing is in sketch_search.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "database.h"
#include "kernel.h"
#include "scan.h"
#include "select.h"
#include "sketch.h"

namespace tinyknn {

// parts[s * stride] for s < slices are the query's kept rows (keys of the first pass). Writes k
// distances and ids; returns false, having written nothing, when more than `limit` candidates remain.
inline bool answer_from_candidates(const Database<float>& db, const float* query, int64_t k, const SketchBound& bound,
                                   const std::vector<Candidate>* parts, int64_t slices, int64_t stride, int64_t limit,
                                   Scratch& scratch, float* distances, int64_t* ids) {
  std::vector<Candidate>& candidates = scratch.gathered;
  candidates.clear();
  for (int64_t s = 0; s < slices; ++s) candidates.insert(candidates.end(), parts[s * stride].begin(), parts[s * stride].end());
  if ((int64_t)candidates.size() >= k) {
    std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end());
    const float bar = bound.threshold(candidates[k - 1].key);
    candidates.erase(std::partition(candidates.begin(), candidates.end(), [bar](const Candidate& c) { return c.key < bar; }),
                     candidates.end());
  }
  if ((int64_t)candidates.size() > limit) return false;
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) { return a.position < b.position; });
  scratch.final_entries.resize(TopK::capacity(k));
  TopK best;
  best.start(k, scratch.final_entries.data());
  for (size_t c = 0; c < candidates.size();) {
    const int64_t panel = candidates[c].position / kPanel;
    PanelKeys exact;
    exact.first_row = panel * kPanel;
    tile<L2, float, PanelKeys, 1, 1>(query, db.dim(), db.panel(panel), nullptr, nullptr, &exact, exact.first_row,
                                     db.size());
    for (; c < candidates.size() && candidates[c].position / kPanel == panel; ++c) {
      best.push(exact.key[candidates[c].position - exact.first_row], candidates[c].position);
    }
  }
  best.finish<L2>(db.ids(), distances, ids);
  return true;
}

}  // namespace tinyknn
