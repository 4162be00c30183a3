// One task's work: a list of queries against a range of panels, into one TopK per query.
//
// Cache blocking: the task's queries (at most kChunkBytes of them) stay in L2 while the panels stream
// past once; each panel (converted to float32 once if stored as float16) stays in L1 while every tile
// of kTileQueries queries is scored against it.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "database.h"
#include "kernel.h"
#include "select.h"

namespace tinyknn {

constexpr int64_t kChunkBytes = 256 * 1024;  // the queries one task keeps in L2

constexpr int64_t kMinSlicePanels = 64;    // a task's share of the database is at least this

// Queries per task: as many as fit kChunkBytes, whole tiles of `tile` queries, at least one tile.
inline int64_t chunk_queries(int64_t dim, int64_t tile) {
  const int64_t fit = kChunkBytes / (dim * (int64_t)sizeof(float));
  return std::max<int64_t>(tile, fit / tile * tile);
}

struct Plan {
  int64_t chunk, chunks, slices;
};

// How a search of nq queries, scored `tile` queries at a time, splits into tasks: about four per
// thread, taken from a shared counter, so a thread that starts late (another process on its core)
// takes fewer. Tasks split the queries into chunks of at most chunk_queries (what stays in L2) and at
// least 8 tiles (below that a chunk's compute no longer hides the database stream it reads); where
// that leaves too few chunks, the database is cut into slices of at least kMinSlicePanels panels, each
// slice keeping its own k best, merged at the end.
inline Plan make_plan(int64_t nq, int64_t dim, int64_t panels, int threads, int64_t tile) {
  const int64_t min_chunk = 8 * tile;
  const int64_t tasks = 4 * (int64_t)threads;
  const int64_t per_task = (nq + tasks - 1) / tasks;
  const int64_t rounded = (per_task + tile - 1) / tile * tile;
  const int64_t chunk = std::min(std::max(rounded, min_chunk), std::max(chunk_queries(dim, tile), min_chunk));
  const int64_t chunks = (nq + chunk - 1) / chunk;
  int64_t slices = 1;
  if (chunks < tasks) {
    slices = std::min<int64_t>((tasks + chunks - 1) / chunks, std::max<int64_t>(1, panels / kMinSlicePanels));
  }
  return Plan{chunk, chunks, slices};
}

// Per-thread buffers, grown on demand and reused by later searches (no allocation per call).
struct Scratch {
  std::vector<float> panel;
  std::vector<Candidate> candidates, merged;
  std::vector<TopK> best;
  // the caller thread's, for the first passes (sketch_search.h, winograd_search.h) and the merge of slices
  std::vector<float> prepared;
  std::vector<SketchBound> bounds;
  std::vector<SlackTopK> slack;
  std::vector<std::vector<Candidate>> kept;
  std::vector<Candidate> final_entries;
  // the Winograd pass's (winograd_search.h): a centred block of a panel, the sums carried between
  // blocks, the caller's centred queries, and where padding queries keep nothing
  std::vector<float, CacheAligned<float>> centred, partial;  // partial: sums carried between dim blocks
  std::vector<float> centred_queries;
  std::vector<Candidate> rejected;
  // the rescoring's (rescore.h): pairs query by query, bucketed by panel, and one tile's queries
  std::vector<RescoredPair> pairs;
  std::vector<int64_t> pair_offsets, panel_offsets, pairs_by_panel, pair_order;
  std::vector<float> tile_queries;

  static Scratch& of_this_thread() {
    static thread_local Scratch scratch;
    return scratch;
  }

  // TopKs for nq queries, started for k.
  TopK* start(int64_t nq, int64_t k) {
    if ((int64_t)best.size() < nq) best.resize(nq);
    const int64_t room = TopK::capacity(k);
    if ((int64_t)candidates.size() < nq * room) candidates.resize(nq * room);
    for (int64_t i = 0; i < nq; ++i) best[i].start(k, candidates.data() + i * room);
    return best.data();
  }
};

// `count` consecutive panels as float32: in place for float storage, else converted into scratch.
inline const float* panels_as_float(const float* panels, int64_t, std::vector<float>&, int64_t) { return panels; }
template <class Narrow>
inline const float* panels_as_float(const Narrow* panels, int64_t count, std::vector<float>& scratch, int64_t dim) {
  if ((int64_t)scratch.size() < count * dim * kPanel) scratch.resize(count * dim * kPanel);
  convert(panels, scratch.data(), count * dim * kPanel);
  return scratch.data();
}

// The panel loop of scan(): `view(panels, count)` gives the Element pointer the kernels read.
template <class Metric, class Element, class Storage, class Selector, class View>
void scan_panels(const Panels<Storage>& table, const float* inverse_norms, const float* queries,
                 const float* query_norms, int64_t nq, int64_t panel_begin, int64_t panel_end, Selector* best,
                 View view) {
  const int64_t dim = table.dim(), n = table.rows();
  const int group = panels_per_call(nq);
  for (int64_t p = panel_begin; p < panel_end;) {
    const int count = panel_end - p >= group && table.contiguous_from(p) >= group ? group : 1;
    const Element* panels = view(table.panel(p), count);
    const float* panel_norms = Metric::needs_norms ? inverse_norms + p * kPanel : nullptr;
    for (int64_t first = 0; first < nq; first += kTileQueries) {
      const int q_count = (int)std::min<int64_t>(kTileQueries, nq - first);
      Kernels<Metric, Element, Selector>::get(q_count, count)(queries + first * dim, dim, panels,
                                                              query_norms ? query_norms + first : nullptr,
                                                              panel_norms, best + first, p * kPanel, n);
    }
    p += count;
  }
}

// Scores queries [0, nq) (row-major, dim floats each) against panels [panel_begin, panel_end) of
// `table` into one selector per query. `inverse_norms` (kPanel per panel) and `query_norms` (one per
// query: verify.h's prepare_screen_query) are read only for Cosine.
template <class Metric, class Storage, class Selector>
void scan(const Panels<Storage>& table, const float* inverse_norms, const float* queries, const float* query_norms,
          int64_t nq, int64_t panel_begin, int64_t panel_end, Selector* best, Scratch& scratch) {
  const int64_t dim = table.dim();
  if constexpr (has_direct_kernels<Storage>()) {
    if (reads_storage_directly<Storage>(nq)) {
      scan_panels<Metric, Storage>(table, inverse_norms, queries, query_norms, nq, panel_begin, panel_end, best,
                                   [](const Storage* panels, int64_t) { return panels; });
      return;
    }
  }
  {
    scan_panels<Metric, float>(table, inverse_norms, queries, query_norms, nq, panel_begin, panel_end, best,
                               [&](const Storage* panels, int64_t count) {
                                 return panels_as_float(panels, count, scratch.panel, dim);
                               });
  }
}

}  // namespace tinyknn
