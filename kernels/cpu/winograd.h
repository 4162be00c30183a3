// The first pass of many-query float32 l2 searches: Winograd's inner-product pairing, which spends
// fewer multiplications per coordinate than the exact kernel (kernel.h).
//
// The exact kernel pays, per coordinate of each (query, row) pair, a subtraction and an FMA; the FMA
// pipes (two on a Zen 3 or Skylake core, against two for additions) are the limit. Winograd (1968):
// for a pair of coordinates (a, b),
//     (y_a + p_b)(y_b + p_a) = p_a y_a + p_b y_b + y_a y_b + p_a p_b,
// so one multiplication serves two coordinates once the row's y_a y_b and the query's p_a p_b are
// known. Groups of three coordinates (one pair and one plain product p_e y_e) take two additions and
// two FMAs per row per group instead of three subtractions and three FMAs: the additions and the
// multiplications then load both kinds of pipes about evenly (measured on Zen 3: ~50 G coordinate
// pairs/s per core against ~41 for the exact kernel).
//
// Here y = fl(x - c) and p = fl(q - c) are the row and the query moved by the sketch's centre c (so
// data far from the origin keeps its precision), and per row lane
//     key = alpha - 2 S,   S = sum over groups of (y_a + p_b)(y_b + p_a) + p_e y_e,
//     alpha = sum over groups of (y_a + y_b)^2 + y_e^2   (plus y_d^2 for the dims left over),
// so that key + beta = ||p - y||^2 with beta the query's own constant (the same sums over p). The keys
// are cancellation-prone, so they only choose candidates: winograd_search.h bounds their error and
// rescores every candidate with the exact kernel.
#pragma once
#include <cmath>
#include <cstdint>

#include "database.h"
#include "kernel.h"
#include "simd.h"
#include "sketch.h"

namespace tinyknn {

// Queries per tile: 2 Q accumulators + 4 row vectors + 2 broadcasts + 2 temporaries = 16 registers
// with AVX2 (32 with AVX-512).
constexpr int kPairQueries = kLanes == 16 ? 8 : 4;
constexpr int kGroup = 3;  // coordinates per group: one Winograd pair and one plain product

// Keeps a vector in a register at this point: GCC otherwise re-reads panel values from memory inside
// the query loop (measured: half the speed, the loads then outnumber the arithmetic).
inline void keep_in_register(Vec& v) {
#if TK_LANES != TK_NATIVE_LANES
  (void)v;  // a forced width is no one register
#elif defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// Part `part` of `parts` of the `bytes` from `p` on, into L2 without waiting: the next panel, asked
// for a share at a time between the tiles that run on this one (all of it at once would fill the
// miss buffers and stall).
inline void prefetch_part(const void* p, int64_t bytes, int64_t part, int64_t parts) {
  const char* const first = static_cast<const char*>(p);
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t line = lines * part / parts; line < lines * (part + 1) / parts; ++line) {
    __builtin_prefetch(first + line * 64, 0, 2);
  }
}

// Dims [begin, end) of one panel moved to the centre: y = fl(x - c), (end - begin) * kPanel floats in
// panel layout (y[0] is dim `begin`), and their share of alpha (kPanel floats), the row constant above,
// summed in the pass's own grouping: added to alpha, or written over it for the first block.
inline void centre_panel(const float* panel, const float* centre, int64_t begin, int64_t end, float* y, float* alpha) {
  constexpr int V = kVectorsPerPanel;
  Vec pairs[V] = {}, plains[V] = {};  // independent sums: the additions' latency would otherwise be the limit
  auto centred = [&](int64_t d, int v) {
    const Vec value = load(panel + d * kPanel + v * kLanes) - broadcast(centre[d]);
    store(y + (d - begin) * kPanel + v * kLanes, value);
    return value;
  };
  int64_t d = begin;
  for (; d + kGroup <= end; d += kGroup) {
    for (int v = 0; v < V; ++v) {
      const Vec pair = centred(d, v) + centred(d + 1, v), plain = centred(d + 2, v);
      pairs[v] += pair * pair;
      plains[v] += plain * plain;
    }
  }
  for (; d < end; ++d) {
    for (int v = 0; v < V; ++v) {
      const Vec plain = centred(d, v);
      plains[v] += plain * plain;
    }
  }
  for (int v = 0; v < V; ++v) {
    const Vec earlier = begin == 0 ? Vec{} : load(alpha + v * kLanes);
    store(alpha + v * kLanes, earlier + (pairs[v] + plains[v]));
  }
}

// The same constant for a query, in double (it shifts every key of the query alike, so only the bound
// needs it).
inline double query_constant(const float* p, int64_t dim) {
  double sum = 0.0;
  int64_t d = 0;
  for (; d + kGroup <= dim; d += kGroup) {
    const double pair = (double)p[d] + (double)p[d + 1];
    sum += pair * pair + (double)p[d + 2] * (double)p[d + 2];
  }
  for (; d < dim; ++d) sum += (double)p[d] * (double)p[d];
  return sum;
}

// p = fl(q - c) into `out` (dim floats) and the bound on its keys (sketch.h's SketchBound: gamma = 0,
// shift = beta). With R the largest ||y|| over the rows, the float32 sums alpha, S and alpha - 2 S
// (each at most dim + 2 roundings, on terms whose magnitudes add up to at most 2 R^2, R^2 + ||p||^2 and
// 4 R^2 + 2 ||p||^2: |y_a y_b| <= (y_a^2 + y_b^2) / 2 and (u + v)^2 <= 2 u^2 + 2 v^2) put key + beta
// within sum_error(dim + 12) (4 R^2 + 2 ||p||^2) of D' = ||p - y||^2, plus 8 dim 2^-149 for products
// that underflow (an addition whose result is subnormal is exact) and dim 2^-52 beta for beta's double
// sums. rho is the rounding of the centring, measured for the rows at add (sketch.h) and here for the
// query. Like the sketch's, the bound assumes subnormals are kept (no FTZ/DAZ). False when the query is
// far outside the data's scale: the caller then scans exactly.
inline bool prepare_winograd_query(const Sketch& sketch, const float* query, float* out, SketchBound* bound) {
  const int64_t dim = sketch.dim();
  const float* centre = sketch.centre();
  double error = 0.0, norm = 0.0;
  for (int64_t d = 0; d < dim; ++d) {
    out[d] = query[d] - centre[d];
    const double gap = (double)query[d] - (double)centre[d] - (double)out[d];
    error += gap * gap;
    norm += (double)out[d] * (double)out[d];
  }
  const double largest = sketch.centred_norm_max() * sketch.centred_norm_max();
  bound->gamma = 0.0;
  bound->gamma_exact = sum_error(dim);
  // 2^-40 (R + ||p||) covers the double rounding of the measured gaps
  bound->rho = sketch.centred_error_max() + std::sqrt(error) * (1.0 + 1e-9) +
               std::ldexp(sketch.centred_norm_max() + std::sqrt(norm), -40) + 1e-300;
  bound->eta = std::ldexp((double)dim, -149);
  bound->shift = query_constant(out, dim);
  bound->eta_pass = sum_error(dim + 12) * (4.0 * largest + 2.0 * norm) + std::ldexp(8.0 * (double)dim, -149) +
                    std::ldexp(bound->shift * (double)dim, -52);
  return bound->eta_pass < 1.0e30 && bound->rho < 1.0e15;  // also false for NaN
}

// Queries [0, nq) (row-major, dim floats each) into tiles of kPairQueries interleaved by dimension:
// tile t's value (d, i) at out[(t * dim + d) * kPairQueries + i]; a last tile's missing queries are zeros.
inline void interleave_queries(const float* queries, int64_t nq, int64_t dim, float* out) {
  constexpr int64_t Q = kPairQueries;
  for (int64_t t = 0; t * Q < nq; ++t) {
    for (int64_t d = 0; d < dim; ++d) {
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t query = t * Q + i;
        out[(t * dim + d) * Q + i] = query < nq ? queries[query * dim + d] : 0.0f;
      }
    }
  }
}

// Keys of kPairQueries queries against one centred panel, offered to best[i] where they beat its
// threshold (as kernel.h's tile does). Rows >= n are never offered. The queries come interleaved,
// p[d * kPairQueries + i] (see interleave_queries), so that one pointer reaches them all.
// A panel of many dims is scored a block of dims [begin, end) at a time (its centred block stays in
// L1): the sums carry over in `partial` (kPairQueries * kPanel floats) between blocks, unchanged, and
// the keys are made after the last block.
template <class Selector>
void winograd_tile(const float* p, int64_t dim, int64_t begin, int64_t end, const float* y, const float* alpha,
                   float* partial, Selector* best, int64_t first_row, int64_t n) {
  constexpr int Q = kPairQueries, V = kVectorsPerPanel;
  // (every loop over queries and vectors unrolled: GCC then keeps acc in registers instead of storing
  // it to the stack on every group, measured)
  Vec acc[Q][V];
  #pragma GCC unroll 16
  for (int i = 0; i < Q; ++i) {
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) acc[i][v] = begin == 0 ? Vec{} : load(partial + (i * V + v) * kLanes);
  }
  y -= begin * kPanel;  // so that y + d * kPanel is dim d
  int64_t d = begin;
  for (; d + kGroup <= end; d += kGroup) {
    const int64_t a = d, b = d + 1, e = d + 2;
    Vec ya[V], yb[V];
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      ya[v] = load(y + a * kPanel + v * kLanes);
      yb[v] = load(y + b * kPanel + v * kLanes);
      keep_in_register(ya[v]);
      keep_in_register(yb[v]);
    }
    #pragma GCC unroll 16
    for (int i = 0; i < Q; ++i) {
      const Vec pa = broadcast(p[a * Q + i]), pb = broadcast(p[b * Q + i]);
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) acc[i][v] += (ya[v] + pb) * (yb[v] + pa);
    }
    Vec ye[V];
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      ye[v] = load(y + e * kPanel + v * kLanes);
      keep_in_register(ye[v]);
    }
    #pragma GCC unroll 16
    for (int i = 0; i < Q; ++i) {
      const Vec pe = broadcast(p[e * Q + i]);
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) acc[i][v] += pe * ye[v];
    }
    #pragma GCC unroll 16
    for (int i = 0; i < Q; ++i) {
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) keep_in_register(acc[i][v]);
    }
  }
  for (; d < end; ++d) {
    #pragma GCC unroll 16
    for (int i = 0; i < Q; ++i) {
      const Vec pd = broadcast(p[d * Q + i]);
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) acc[i][v] += pd * load(y + d * kPanel + v * kLanes);
    }
  }
  if (end < dim) {
    #pragma GCC unroll 16
    for (int i = 0; i < Q; ++i) {
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) store(partial + (i * V + v) * kLanes, acc[i][v]);
    }
    return;
  }
  const Vec minus_two = broadcast(-2.0f);
  #pragma GCC unroll 16
  for (int i = 0; i < Q; ++i) {
    Vec bar = broadcast(best[i].threshold());
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const Vec key = acc[i][v] * minus_two + load(alpha + v * kLanes);
      if (any_less(key, bar)) {
        offer(best[i], key, first_row + v * kLanes, n);
        bar = broadcast(best[i].threshold());
      }
    }
  }
}

}  // namespace tinyknn
