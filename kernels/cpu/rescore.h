// The end of a search through a first pass (sketch_search.h, winograd_search.h): the rows each query's
// slices kept are cut to those under the bound's threshold, then scored by the full scan's own float32
// kernel and summation order, so the k' rows kept are bit for bit the full scan's screen (the proof that
// none is missing is in sketch_search.h), and their float64 distances computed on the way (verify.h).
//
// The exact scoring goes panel by panel rather than query by query: the (query, row) pairs are
// bucketed by panel, and each panel is read once (from DRAM, usually) for every query that needs it,
// kTileQueries at a time. Query by query, k = 100 cost ~100 panel reads per query, each scored by a
// one-query tile that waits on its FMAs' latency.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "database.h"
#include "exhaustive.h"
#include "kernel.h"
#include "pool.h"
#include "scan.h"
#include "select.h"
#include "sketch.h"

namespace tinyknn {

// kept[s * nq + i] for s < slices are query i's rows from slice s (keys of the first pass; the lists
// are consumed). Writes each query's k best (full scan keys, sorted by (key, position), padded as
// TopK::extract pads) into out[i * k ..] and their float64 distances into float64[i * k ..]; returns
// false, the outputs then meaning nothing, when some query keeps more than `limit` candidates.
inline bool rescore_candidates(const Database<float>& db, const float* queries, int64_t nq, int64_t k,
                               const SketchBound* bounds, std::vector<Candidate>* kept, int64_t slices, int64_t limit,
                               int threads, Candidate* out, double* float64) {
  const int64_t dim = db.dim(), panels = db.panels(), n = db.size();
  ThreadPool& pool = ThreadPool::shared();
  // fn(i) for every query, on the pool's threads, eight queries per task
  auto for_each_query = [&](const auto& fn) {
    constexpr int64_t kQueriesPerTask = 8;
    pool.run((int)((nq + kQueriesPerTask - 1) / kQueriesPerTask), threads, [&](int task) {
      for (int64_t i = task * kQueriesPerTask; i < std::min(nq, (task + 1) * kQueriesPerTask); ++i) fn(i);
    });
  };

  // 1. Per query: its slices' rows, cut to those under the final threshold (into slice 0's list).
  std::atomic<bool> too_many{false};
  for_each_query([&](int64_t i) {
    std::vector<Candidate>& rows = kept[i];
    for (int64_t s = 1; s < slices; ++s) rows.insert(rows.end(), kept[s * nq + i].begin(), kept[s * nq + i].end());
    if ((int64_t)rows.size() >= k) {
      std::nth_element(rows.begin(), rows.begin() + (k - 1), rows.end());
      const float bar = bounds[i].threshold(rows[k - 1].key);
      rows.erase(std::partition(rows.begin(), rows.end(), [bar](const Candidate& c) { return c.key < bar; }), rows.end());
    }
    if ((int64_t)rows.size() > limit) too_many = true;
    // in row order, as the full scan meets them: of rows tied at the k-th distance, both keep the first
    std::sort(rows.begin(), rows.end(), [](const Candidate& a, const Candidate& b) { return a.position < b.position; });
  });
  if (too_many) return false;

  // 2. The pairs query by query (first[i] .. first[i + 1]), and their indices bucketed by panel, in
  //    query order within a panel (a counting sort).
  Scratch& caller = Scratch::of_this_thread();
  std::vector<int64_t>& first = caller.pair_offsets;
  first.assign(nq + 1, 0);
  for (int64_t i = 0; i < nq; ++i) first[i + 1] = first[i] + (int64_t)kept[i].size();
  std::vector<RescoredPair>& pairs = caller.pairs;
  pairs.resize(first[nq]);
  std::vector<int64_t>& panel_first = caller.panel_offsets;
  panel_first.assign(panels + 1, 0);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t j = 0; j < (int64_t)kept[i].size(); ++j) {
      pairs[first[i] + j] = RescoredPair{kept[i][j].position, i, 0.0f, 0.0};
      ++panel_first[kept[i][j].position / kPanel + 1];
    }
  }
  for (int64_t p = 0; p < panels; ++p) panel_first[p + 1] += panel_first[p];
  std::vector<int64_t>& by_panel = caller.pairs_by_panel;
  by_panel.resize(pairs.size());
  {
    std::vector<int64_t> cursor(panel_first.begin(), panel_first.end() - 1);
    for (int64_t j = 0; j < (int64_t)pairs.size(); ++j) by_panel[cursor[pairs[j].position / kPanel]++] = j;
  }

  // 3. Panel by panel: the distinct queries of its pairs, kTileQueries at a time, through the full
  //    scan's kernel (each lane sums its row in dimension order, whatever the tile's shape).
  const int panel_tasks = (int)std::max<int64_t>(1, std::min<int64_t>(4 * (int64_t)threads, panels / kMinSlicePanels));
  pool.run(panel_tasks, threads, [&](int task) {
    Scratch& scratch = Scratch::of_this_thread();
    scratch.tile_queries.resize(kTileQueries * dim);
    PanelKeys keys[kTileQueries];
    int64_t owner[kTileQueries];
    for (int64_t p = panels * task / panel_tasks; p < panels * (task + 1) / panel_tasks; ++p) {
      for (int64_t next = panel_first[p]; next < panel_first[p + 1];) {
        const int64_t tile_first = next;
        // the next up to kTileQueries distinct queries (pairs of one query are adjacent)
        int count = 0;
        int64_t end = next;
        for (; end < panel_first[p + 1]; ++end) {
          const int64_t query = pairs[by_panel[end]].query;
          if (count > 0 && owner[count - 1] == query) continue;
          if (count == kTileQueries) break;
          owner[count] = query;
          std::copy(queries + query * dim, queries + (query + 1) * dim, scratch.tile_queries.data() + count * dim);
          keys[count].first_row = p * kPanel;
          ++count;
        }
        Kernels<L2, float, PanelKeys>::get(count, 1)(scratch.tile_queries.data(), dim, db.panel(p), nullptr, nullptr, keys,
                                                    p * kPanel, n);
        for (int slot = 0; next < end; ++next) {
          RescoredPair& pair = pairs[by_panel[next]];
          while (owner[slot] != pair.query) ++slot;
          pair.exact = keys[slot].key[pair.position - p * kPanel];
        }
        exact_pairs(db.panel(p), dim, queries, pairs.data(), by_panel.data() + tile_first, next - tile_first, p * kPanel);
      }
    }
  });

  // 4. Per query: the k best of its rescored rows, by (key, position) as the full scan's selection orders them.
  for_each_query([&](int64_t i) {
    std::vector<int64_t>& order = Scratch::of_this_thread().pair_order;
    order.resize(first[i + 1] - first[i]);
    for (int64_t j = 0; j < (int64_t)order.size(); ++j) order[j] = first[i] + j;
    const int64_t take = std::min<int64_t>(k, (int64_t)order.size());
    std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int64_t a, int64_t b) {
      return pairs[a].exact < pairs[b].exact || (pairs[a].exact == pairs[b].exact && pairs[a].position < pairs[b].position);
    });
    for (int64_t j = 0; j < k; ++j) {
      out[i * k + j] = j < take ? Candidate{pairs[order[j]].exact, pairs[order[j]].position} : Candidate{positive_infinity(), -1};
      float64[i * k + j] = j < take ? pairs[order[j]].float64 : 0.0;
    }
  });
  return true;
}

}  // namespace tinyknn
