// The distance kernel: Q queries against P consecutive panels of kPanel database rows each (see
// database.h), all Q x P x kPanel sums in registers. Per dimension it loads each panel's
// kVectorsPerPanel vectors once and broadcasts one element of each query, so every loaded value serves
// Q pairs, and Q x P x kVectorsPerPanel independent sums keep the FMA units busy. The metric's own
// accumulate()/finish() (metrics.cuh) run on whole vectors, one lane per database row; each lane sums
// its row's terms in dimension order (the summation order the accuracy bound assumes), whatever Q and P.
#pragma once
#include <cstdint>
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

// keys[i * P * kPanel + r]: the key of query i against row r of the P panels starting at `panels`
// (panel j at panels + j * dim * kPanel), whose elements are float or float16 bits (widened on load).
// Inverse norms are read only for Cosine.
template <class Metric, class Element, int Q, int P>
void tile(const float* queries, int64_t dim, const Element* panels, const float* query_inverse_norms,
          const float* panel_inverse_norms, float* keys) {
  constexpr int V = kVectorsPerPanel;
  Vec acc[Q][P * V] = {};
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
    for (int w = 0; w < P * V; ++w) {
      Vec distance = acc[i][w];
      if (Metric::needs_norms) {
        distance = Metric::finish(distance, broadcast(query_inverse_norms[i]), load(panel_inverse_norms + w * kLanes));
      }
      store(keys + i * P * kPanel + w * kLanes, key_of<Metric>(distance));
    }
  }
}

template <class Element>
using TileFunction = void (*)(const float*, int64_t, const Element*, const float*, const float*, float*);

// The kernel for q queries (1..kTileQueries) and p panels (1, or panels_per_call(q)).
template <class Metric, class Element>
struct Kernels {
  template <int... I>
  static TileFunction<Element> one_panel(int q, std::integer_sequence<int, I...>) {
    static const TileFunction<Element> table[] = {&tile<Metric, Element, I + 1, 1>...};
    return table[q - 1];
  }
  static TileFunction<Element> get(int q, int p) {
    if (p == 4 && q == 1) return &tile<Metric, Element, 1, 4>;
    if (p == 2 && q == 2) return &tile<Metric, Element, 2, 2>;
    return one_panel(q, std::make_integer_sequence<int, kTileQueries>());
  }
};

// Few queries read float16 panels directly (widening each value on load); more queries share one
// float32 copy of each panel, made once per chunk of queries.
template <class Storage>
inline bool reads_storage_directly(int64_t nq) {
  return sizeof(Storage) == sizeof(float) || nq <= 8;
}

}  // namespace tinyknn
