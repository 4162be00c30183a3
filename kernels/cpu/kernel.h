// The distance kernel: Q queries against P consecutive panels of kPanel database rows each (see
// database.h), all Q x P x kPanel sums in registers. Per dimension it loads each panel's
// kVectorsPerPanel vectors once and broadcasts one element of each query, so every loaded value serves
// Q pairs, and Q x P x kVectorsPerPanel independent sums keep the FMA units busy. The metric's own
// accumulate()/finish() (metrics.cuh) run on whole vectors, one lane per database row; each lane sums
// its row's terms in dimension order (the summation order the accuracy bound assumes), whatever Q and P.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../metrics.cuh"
#include "database.h"
#include "simd.h"

namespace tinyknn {

// Queries per tile: 2 * Q accumulators + 2 panel vectors + a broadcast + a temporary fit the register file.
constexpr int kTileQueries = kLanes == 16 ? 12 : 6;

// Panels per kernel call for a tile of q queries: few queries score several panels at once so that
// enough independent sums are in flight (one query and one panel would wait on the FMA latency).
inline int panels_per_call(int64_t q) { return q == 1 ? 4 : (q == 2 ? 2 : 1); }

template <class Metric>
inline Vec key_of(Vec distance) {
  return Metric::larger_is_better ? -distance : distance;
}

// Offers one vector of keys (rows first_row .. first_row + kLanes - 1, those below n) to a selector.
template <class Selector>
void offer(Selector& best, Vec keys, int64_t first_row, int64_t n) {
  float lanes[kLanes];
  store(lanes, keys);
  const int64_t count = std::min<int64_t>(kLanes, n - first_row);
  for (int64_t l = 0; l < count; ++l) best.push(lanes[l], first_row + l);
}

// Scores queries [0, Q) against the P panels starting at `panels` (panel j at panels + j * dim * kPanel,
// whose first row is first_row + j * kPanel; elements float, or float16 bits widened on load) and
// offers each query's keys to best[i]. The keys never leave the registers unless one beats the
// selector's threshold, which after the first few thousand rows is rare. Rows >= n (the last panel's
// padding) are never offered. Inverse norms are read only for Cosine.
template <class Metric, class Element, class Selector, int Q, int P>
void tile(const float* queries, int64_t dim, const Element* panels, const float* query_inverse_norms,
          const float* panel_inverse_norms, Selector* best, int64_t first_row, int64_t n) {
  constexpr int V = kVectorsPerPanel;
  Vec acc[Q][P * V];
  for (int i = 0; i < Q; ++i) {
    for (int w = 0; w < P * V; ++w) acc[i][w] = Vec{};
  }
#pragma GCC unroll 2  // measured: +10% on the 6-query kernel (fewer loop micro-ops per step)
  for (int64_t d = 0; d < dim; ++d) {
    Vec x[P * V];
    for (int j = 0; j < P; ++j) {
      for (int v = 0; v < V; ++v) x[j * V + v] = load(panels + (j * dim + d) * kPanel + v * kLanes);
    }
    for (int i = 0; i < Q; ++i) {
      const Vec q = broadcast(queries[i * dim + d]);
      for (int w = 0; w < P * V; ++w) acc[i][w] = Metric::accumulate(acc[i][w], q, x[w]);
    }
  }
  for (int i = 0; i < Q; ++i) {
    Vec bar = broadcast(best[i].threshold());
    for (int w = 0; w < P * V; ++w) {
      Vec distance = acc[i][w];
      if (Metric::needs_norms) {  // cosine: the sum times one product of the inverse norms (verify.h's bound)
        distance = distance * (broadcast(query_inverse_norms[i]) * load(panel_inverse_norms + w * kLanes));
      }
      const Vec key = key_of<Metric>(distance);
      if (any_less(key, bar)) {
        offer(best[i], key, first_row + w * kLanes, n);
        bar = broadcast(best[i].threshold());
      }
    }
  }
}

template <class Element, class Selector>
using TileFunction = void (*)(const float*, int64_t, const Element*, const float*, const float*, Selector*,
                              int64_t, int64_t);

// The kernel for q queries (1..kTileQueries) and p panels (1, or panels_per_call(q)).
template <class Metric, class Element, class Selector>
struct Kernels {
  template <int... I>
  static TileFunction<Element, Selector> one_panel(int q, std::integer_sequence<int, I...>) {
    static const TileFunction<Element, Selector> table[] = {&tile<Metric, Element, Selector, I + 1, 1>...};
    return table[q - 1];
  }
  static TileFunction<Element, Selector> get(int q, int p) {
    if (p == 4 && q == 1) return &tile<Metric, Element, Selector, 1, 4>;
    if (p == 2 && q == 2) return &tile<Metric, Element, Selector, 2, 2>;
    return one_panel(q, std::make_integer_sequence<int, kTileQueries>());
  }
};

// Few queries read float16 panels directly (widening each value on load); more queries share one
// float32 copy of each panel, made once per chunk of queries. The bfloat16 and 8-bit panels always go
// through the float32 copy: kernels of their own would add a third of the library's build time.
template <class Storage>
constexpr bool has_direct_kernels() {
  return sizeof(Storage) == sizeof(float) || std::is_same<Storage, half_bits>::value;
}
template <class Storage>
inline bool reads_storage_directly(int64_t nq) {
  return sizeof(Storage) == sizeof(float) || (has_direct_kernels<Storage>() && nq <= 8);
}

}  // namespace tinyknn
