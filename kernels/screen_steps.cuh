// tinyknn: the steps around the tensor-core screen (screen.cuh) that make a search of it: the queries
// rounded to the screen's element type with their error terms, the rows' terms (and a float32 index's
// 16-bit shadow), the threshold from the threshold mode's upper bounds, and the exact verification of
// the survivors (a search's k best, or a range search's hits). Part of the GPU kernel templates; see
// tinyknn/gpu/screen.py for the order (range search: tinyknn/gpu/range_screen.py).
#pragma once
#include "screen.cuh"
#include "range.cuh"
#include "verify.cuh"

namespace tinyknn {

// The screen's element types as stored values (what its rows hold, 16 bytes a chunk like every row).
template <class E> struct ScreenStorage;
template <> struct ScreenStorage<ScreenF16> { typedef half_bits type; };
template <> struct ScreenStorage<ScreenBF16> { typedef bf16_bits type; };
template <> struct ScreenStorage<ScreenS8> { typedef signed char type; };
template <> struct ScreenStorage<ScreenU8> { typedef unsigned char type; };

TINYKNN_D void round_to(half_bits& out, float v) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(v)); }
TINYKNN_D void round_to(bf16_bits& out, float v) { asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"(v)); }
TINYKNN_D void round_to(signed char& out, float v) { out = (signed char)(int)fminf(fmaxf(rintf(v), -128.0f), 127.0f); }
TINYKNN_D void round_to(unsigned char& out, float v) { out = (unsigned char)(int)fminf(fmaxf(rintf(v), 0.0f), 255.0f); }

// The mma error model of screen.cuh: 16-bit inputs accumulate with truncation (gamma per instruction),
// 8-bit ones exactly. UNIT / TINY: the 16-bit type's rounding, relative and absolute (a shadow's rows).
template <class E> struct ScreenRounding {
  static constexpr bool exact = false;
  static constexpr double unit = 4.8828125e-04, tiny = 2.9802322387695312e-08;   // float16: 2^-11, 2^-25
};
template <> struct ScreenRounding<ScreenBF16> {
  static constexpr bool exact = false;
  static constexpr double unit = 3.90625e-03, tiny = 1.1754943508222875e-38;     // bfloat16: 2^-8, 2^-126
};
template <> struct ScreenRounding<ScreenS8> {
  static constexpr bool exact = true;
  static constexpr double unit = 0.0, tiny = 0.0;
};
template <> struct ScreenRounding<ScreenU8> : ScreenRounding<ScreenS8> {};

// Rounding up / down of a double to float32.
TINYKNN_D float up_f32(double v) { return __double2float_ru(v); }
TINYKNN_D float down_f32(double v) { return __double2float_rd(v); }

// One warp per query: q~ = the float32 query rounded to E (zero padded to screen_bytes), and the error terms
// of screen.cuh's bound, e_q and f_q (rounded up): |key - screened key| <= e_q r_x + f_q for every row.
// n_mma: mma instructions per dot product; shadow: the rows are a float32 index's 16-bit copy. A query the
// type cannot hold (an 8-bit index's query that is not an integer in range) gets e_q = +inf: every row then
// survives, the survivors overflow and the query is searched by the other kernels.
template <class E>
__global__ void __launch_bounds__(256, 1)
screen_queries_kernel(const float* __restrict__ queries, int n_queries, int query_stride, int dim,
                      typename ScreenStorage<E>::type* __restrict__ out, int out_stride, int n_mma, int shadow,
                      int normalize, double key_scale, float* __restrict__ err_scale, float* __restrict__ err_offset) {
  typedef typename ScreenStorage<E>::type S;
  typedef ScreenRounding<E> R;
  const int lane = threadIdx.x & 31;
  const int q = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (q >= n_queries) return;
  const float* query = queries + (long long)q * query_stride;
  double scale_by = 1.0;                  // cosine: the screen compares q / |q| with the rows' unit shadows
  if (normalize) {
    double squares = 0.0;
    for (int e = lane; e < dim; e += 32) squares += (double)query[e] * (double)query[e];
    for (int offset = 16; offset > 0; offset /= 2) squares += __shfl_xor_sync(FULL_WARP, squares, offset);
    scale_by = squares > 0.0 ? 1.0 / sqrt(squares) : 0.0;
  }
  double diff = 0.0, rounded = 0.0, norm = 0.0;
  for (int e = lane; e < out_stride; e += 32) {
    const double v = e < dim ? (double)query[e] * scale_by : 0.0;
    S r;
    round_to(r, (float)v);
    out[(long long)q * out_stride + e] = r;
    const double w = (double)to_float(r), d = v - w;
    diff += d * d;
    rounded += w * w;
    norm += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    diff += __shfl_xor_sync(FULL_WARP, diff, offset);
    rounded += __shfl_xor_sync(FULL_WARP, rounded, offset);
    norm += __shfl_xor_sync(FULL_WARP, norm, offset);
  }
  if (lane != 0) return;
  const double slack = 1.0 + 4.0 * dim * 1.1102230246251565e-16;
  const double gamma = R::exact ? 0.0 : n_mma * 3.814697265625e-06 * (1.0 + n_mma * 3.814697265625e-06);  // 2^-18
  double e = sqrt(diff * slack) * slack + gamma * sqrt(rounded * slack) * slack;
  double f = R::exact ? 0.0 : (dim + n_mma) * 1.1754943508222875e-38;                                      // 2^-126
  if (shadow) {
    e += R::unit * sqrt(norm * slack) * slack;
    f += R::tiny * sqrt((double)dim) * sqrt(norm * slack) * slack;
  }
  if (normalize) e += 1e-12;              // the float64 normalisations of the query and the rows
  const bool representable = (!R::exact || diff == 0.0) && !(normalize && scale_by == 0.0);
  const double scale = key_scale * (1.0 + 9.5367431640625e-07);                                            // 2^-20
  err_scale[q] = representable ? up_f32(e * scale) : __int_as_float(0x7f800000);
  err_offset[q] = up_f32(f * scale);
}

// One warp per row of [first, last): the rows' terms of the bound, |x|^2 rounded down (sq_lo) and up (sq_hi)
// and r_x >= max(|x|, |x~|) rounded up, from float64 sums of the stored values; with a shadow (T != S), the
// row rounded to the 16-bit type into `shadow` (status |= 1 if a value does not fit it).
template <class T, class E>
__global__ void __launch_bounds__(256, 1)
screen_rows_kernel(const T* __restrict__ data, int row_stride, long long first, long long last, int dim,
                   typename ScreenStorage<E>::type* __restrict__ shadow, int shadow_stride, int normalize,
                   float* __restrict__ sq_lo, float* __restrict__ sq_hi, float* __restrict__ r_x,
                   int* __restrict__ status) {
  typedef typename ScreenStorage<E>::type S;
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  const int width = shadow != nullptr && shadow_stride > row_stride ? shadow_stride : row_stride;
  for (long long row = first + (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5); row < last; row += warps) {
    double sum = 0.0, shadow_sum = 0.0;
    for (int e = lane; e < row_stride; e += 32) {
      const double x = (double)to_float(data[row * row_stride + e]);
      sum += x * x;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_WARP, sum, offset);
    const double scale_by = normalize ? (sum > 0.0 ? 1.0 / sqrt(sum) : 0.0) : 1.0;   // cosine: unit rows
    bool bad = false;
    if (shadow != nullptr) {
      for (int e = lane; e < width; e += 32) {
        if (e >= shadow_stride) continue;
        const double x = e < row_stride ? (double)to_float(data[row * row_stride + e]) * scale_by : 0.0;
        S r;
        round_to(r, (float)x);
        shadow[row * shadow_stride + e] = r;
        const float w = to_float(r);
        bad |= !(fabsf(w) <= 65504.0f);
        shadow_sum += (double)w * (double)w;
      }
      for (int offset = 16; offset > 0; offset /= 2) shadow_sum += __shfl_xor_sync(FULL_WARP, shadow_sum, offset);
    }
    bad = __any_sync(FULL_WARP, bad);
    if (lane == 0) {
      const double slack = dim * 2.220446049250313e-16;
      const double exact_sum = normalize ? (sum > 0.0 ? 1.0 : 0.0) : sum;      // |x / |x||^2
      sq_lo[row] = down_f32(exact_sum * (1.0 - slack));
      sq_hi[row] = up_f32(exact_sum * (1.0 + slack));
      r_x[row] = up_f32(sqrt(fmax(exact_sum, shadow_sum) * (1.0 + slack)) * (1.0 + 8.881784197001252e-16) +
                        (normalize ? 1e-12 : 0.0));
      if (bad) atomicOr(status, 1);
    }
  }
}

// One block per query: the K-th smallest of its `per_query` upper bounds (the threshold mode's output over
// every row tile of the sample, KT <= K per tile, per_query >= K) is an upper bound of its true K-th key:
// threshold[q] (bounds of K distinct rows are all within it).
template <int K>
__global__ void __launch_bounds__(256, 1)
threshold_kernel(const float* __restrict__ upper, int per_query, float* __restrict__ threshold) {
  __shared__ unsigned histogram[260];
  int ties;
  const unsigned bits = block_select(upper + (long long)blockIdx.x * per_query, per_query, K, histogram, ties);
  if (threadIdx.x == 0) threshold[blockIdx.x] = from_ordered_bits(bits);
}

// One block per query: the survivors' contract distances (exact.cuh), sorted by (key, id), the K first written as
// verify_kernel writes them. Every row whose key is within the threshold survived and the threshold is at
// least the true K-th key, so these are the answer; status[q] = 1 when the survivors overflowed CAP (the
// query is searched by the other kernels). A launch answers the queries with ABOVE < count <= UPTO and holds
// UPTO survivors in shared memory (20 bytes each): a first launch with UPTO well below CAP holds several
// blocks an SM for the usual few hundred survivors, a second (ABOVE = the first's UPTO, UPTO = CAP) takes
// the rest and the overflowed; every query's status is written by exactly one of them.
template <class Metric, class T, int K, int CAP, int WARPS, int ABOVE, int UPTO>
__global__ void __launch_bounds__(WARPS * 32, UPTO < CAP ? 4 : 1)
verify_survivors_kernel(const int* __restrict__ survivors, const int* __restrict__ counts, const long long* __restrict__ ids,
                        const T* __restrict__ data, const float* __restrict__ queries, int row_stride, int dim,
                        float* __restrict__ out_distances, long long* __restrict__ out_ids, int* __restrict__ status) {
  static_assert(UPTO <= CAP && ABOVE < UPTO && (UPTO & (UPTO - 1)) == 0, "verify_survivors_kernel: tiers");
  extern __shared__ float4 shared_space[];
  unsigned long long* keys = reinterpret_cast<unsigned long long*>(shared_space);
  long long* row_ids = reinterpret_cast<long long*>(keys + UPTO);
  int* positions = reinterpret_cast<int*>(row_ids + UPTO);
  __shared__ double query_qq;
  require_dynamic_smem(UPTO * 20);
  const long long q = blockIdx.x;
  const int count = counts[q];
  if (count > CAP) {
    if (UPTO == CAP && threadIdx.x == 0) status[q] = 1;
    return;
  }
  if (count <= ABOVE || count > UPTO) return;     // the other launch's query
  const float* query = queries + q * row_stride;
  if (threadIdx.x == 0) query_qq = Metric::needs_norms ? exact_squares(query, dim) : 0.0;
  __syncthreads();
  int sort = 2;
  while (sort < count) sort *= 2;
  for (int i = threadIdx.x; i < sort; i += WARPS * 32) {
    unsigned long long key = EMPTY_KEY64;
    long long id = EMPTY_ID;
    if (i < count) {
      const int position = survivors[q * CAP + i];
      key = ordered_bits64(exact_key<Metric>(
          exact_distance_by_chunks<Metric>(query, data + (long long)position * row_stride, dim, query_qq)));
      id = __ldg(ids + position);
    }
    keys[i] = key;
    row_ids[i] = id;
    positions[i] = 0;
  }
  __syncthreads();
  block_sort_exact(keys, row_ids, positions, sort);
  for (int j = threadIdx.x; j < K; j += WARPS * 32) {
    const bool real = j < sort && keys[j] != EMPTY_KEY64;
    const double key = real ? from_ordered_bits64(keys[j]) : 0.0;
    out_distances[q * K + j] = real ? __double2float_rn(Metric::larger_is_better ? -key : key)
                                    : from_key<Metric>(positive_infinity());
    out_ids[q * K + j] = real ? row_ids[j] : -1;
  }
  if (threadIdx.x == 0) status[q] = 0;
}


// Range search's step 4 (tinyknn/gpu/range_screen.py): the screen ran with the query's
// radius as its threshold (in key units, rounded so that every row strictly inside the radius survives), so
// the rows strictly inside are among its survivors. Each survivor's contract distance (exact.cuh, as
// range_kernel computes it) is a hit when its key is strictly inside: key < radius_key (l2: distance <
// radius; ip, cosine: similarity > radius, key = -similarity). Hits go to range_kernel's pool (range.cuh's
// pool_hit; select.cuh groups and sorts it), hits[q] counting the query's. The survivor lists are
// survivor_capacity apart, the screen's capacity argument (a runtime value: the host screens overflowed queries
// again with room for all their survivors). A query whose survivors overflowed (counts[q] > survivor_capacity)
// is skipped, hits[q] = 0: the host screens it again or searches it with range_kernel. Grid (queries, blocks a
// query): a few queries screened again with thousands of survivors each are spread over many blocks (the hits'
// order in the pool does not matter: the host sorts each query's).
template <class Metric, class T>
__global__ void __launch_bounds__(256, 1)
range_survivors_kernel(const int* __restrict__ survivors, const int* __restrict__ counts, int survivor_capacity,
                       const long long* __restrict__ ids, const T* __restrict__ data, const float* __restrict__ queries,
                       int row_stride, int dim, double radius_key, long long capacity, double* __restrict__ out_keys,
                       long long* __restrict__ out_ids, int* __restrict__ pool_queries, unsigned* __restrict__ hits,
                       unsigned long long* __restrict__ total) {
  __shared__ double query_qq;
  const int q = blockIdx.x;
  const int count = counts[q];
  if (count > survivor_capacity) return;
  const float* query = queries + (long long)q * row_stride;
  if (threadIdx.x == 0) query_qq = Metric::needs_norms ? exact_squares(query, dim) : 0.0;
  __syncthreads();
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < count; i += gridDim.y * blockDim.x) {
    const int position = survivors[(long long)q * survivor_capacity + i];
    const double key = exact_key<Metric>(
        exact_distance_by_chunks<Metric>(query, data + (long long)position * row_stride, dim, query_qq));
    if (key < radius_key) pool_hit(key, ids + position, q, capacity, out_keys, out_ids, pool_queries, hits + q, total);
  }
}

}  // namespace tinyknn
