// tinyknn: the single-query kernel: selection and verify step in one launch. Part of the GPU kernel
// templates; see search.cuh for how a search uses them and tinyknn/jit/render.py for the template arguments.
#pragma once
#include "verify.cuh"

namespace tinyknn {

// ---- a float32 l2 index's float16 shadow: the bound of its keys ------------------------------------
// A float32 l2 index may stream its float16 shadow (the screen's copy, tinyknn/gpu/screen.py: h = x rounded
// to nearest; an index with any |x_i| beyond 65504 has no usable shadow and never comes here): half the bytes.
// The key is then kappa = the float32 evaluation of sum (q_i - h_i)^2 (h_i is exact in float32), n terms.
// 1. KeyBound<L2>'s derivation with h for x: s = |h - q|^2 >= s_lo = (kappa - (2n + 4) eta) / (1 + gamma(n + 3)).
// 2. Rounding to float16: |x_i - h_i| <= 2^-11 |x_i| + 2^-25 (relative half-ulp when normal, 2^-25 in the
//    subnormal range; the sum covers both), so |x - h| <= 2^-11 |x| + 2^-25 sqrt(n) <= delta
//    = 2^-11 sqrt(max |x|^2) + 2^-25 sqrt(n) (max |x|^2 from row_stats, rounded up at ingest).
// 3. Triangle inequality: |x - q| >= |h - q| - |x - h| >= sqrt(s_lo) - delta, so the true key
//    |x - q|^2 >= max(0, sqrt(s_lo) - delta)^2, and the float64 contract key is within gamma64(n + 3) of it.
// Every double operation below is rounded outwards by a relative 1e-15 (a few ulps). Rows outside the lists
// have kappa >= the KL-th list key A, and the bound is increasing in kappa: the verify step's proof holds with
// lowest(A). n: the float32 row stride the verify step passes; the shadow's stride is at most n + 7 (zeros).
struct ShadowKeyBound {
  static constexpr bool uses_qq = false;
  static TINYKNN_D double lowest(float key32, int n, double, double max_xx, double) {
    const int terms = n + 8;
    const double s_lo = ((double)key32 - (2.0 * terms + 4.0) * Bounds::eta) / (1.0 + Bounds::gamma(terms + 3));
    if (!(s_lo > 0.0)) return 0.0;
    const double delta = (4.8828125e-04 * sqrt(max_xx) + 2.9802322387695312e-08 * sqrt((double)terms)) * (1.0 + 1e-15);
    const double r = sqrt(s_lo) * (1.0 - 1e-15) - delta;
    if (!(r > 0.0)) return 0.0;
    return r * r * (1.0 - 1e-15) * (1.0 - Bounds::gamma64(terms + 3));
  }
};

// ---- single: one query, grid (n_slices), WARPS warps per block --------------------------------------
// Each block streams its slice (at most RMAX rows) once: G lanes share a row (CPL 16-byte loads each, UNROLL
// rows at a time) and write its float32 key to shared memory; no candidate lists are kept while streaming (their insertions
// were most of the scan kernel's time on one query). The block then gathers its slice's KL best keys
// (gather_best: a radix select over the slice's keys in shared memory) and writes them as the slice's
// list, exactly what scan_kernel writes. The last block to finish (a counter in bounds[0] that wraps to
// zero at the last arrival) runs the verify step over all the slices' lists (copied to shared memory when
// they fit in CMAX entries; their KL best gathered by the lists' minima, merge.cuh's bounded_gather, in the
// BOUNDED_SHARED bytes after them): one launch instead of two.
// S: the element type streamed from `scan_rows` (T itself, or float16 for a float32 index's shadow with
// Bound = ShadowKeyBound); the verify step reads the stored rows `data` (T) at the lists' positions.
// LISTED: the search reads only the rows named by `listed_rows` (sorted int32 positions of a filter's allowed
// rows, n_data of them): the slices split the list, each row is loaded where the list names it, and the lists
// hold those positions, so the verify step reads the stored rows as it does unfiltered. A row the list does
// not name is never loaded. Without LISTED, `listed_rows` is unused and the kernel is the unfiltered one.
// GT (a knob): the slices share a bound as scan_kernel's do (topk.cuh's publish_bound, in arrivals[1]): a slice
// that selects its list in full publishes its KL-th key; a slice that finds one published when its rows are
// streamed lists only its keys under it (the KL best of those; fewer, padded, where fewer are), with no
// minima and no select. Rows left out are above a bound that KL listed keys are under, so above the KL-th
// list key the verify step's proof starts from. The last block zeroes arrivals[1] for the next launch.
template <class Metric, class Bound, class T, class S, int DIM, int K, int KL, int G, int WARPS, int RMAX, int UNROLL,
          int CMAX, int SMEM, bool LISTED = false, int STAGE = 0, bool GT = false>
__global__ void __launch_bounds__(WARPS * 32, 1)
single_kernel(const T* __restrict__ data, const S* __restrict__ scan_rows, const float* __restrict__ data_inv_norms,
              long long n_data, long long rows_per_slice, const float* __restrict__ queries,
              const long long* __restrict__ ids, float* out_keys, int* out_positions,
              float* __restrict__ out_distances, long long* __restrict__ out_ids, unsigned* arrivals,
              const unsigned* __restrict__ row_stats, int* __restrict__ status, double* __restrict__ threshold,
              int dim, const int* __restrict__ listed_rows) {
  using Layout = RowLayout<S, DIM>;                             // the streamed rows
  constexpr int STORED_STRIDE = RowLayout<T, DIM>::STRIDE;    // the stored rows (verify)
  static_assert(is_pow2(G) && G <= 32, "G (lanes per row) must be a power of two <= 32");
  constexpr int CPL = (Layout::CHUNKS + G - 1) / G;            // chunks per lane
  constexpr int QROW = G * CPL * Layout::PER_CHUNK;           // floats of the query row in shared memory
  constexpr int SORT = next_pow2(KL);
  constexpr int QUERY_BYTES = align16(QROW * 4) + 16;
  // the slice's layout, then bounded_gather's scratch for its list
  constexpr int SLICE_BYTES = align16(QUERY_BYTES + RMAX * 8 + SORT * 8 + MERGE_SHARED_FIXED) + BOUNDED_SHARED;
  // + the lists, copied, and bounded_gather's scratch
  constexpr int VERIFY_BYTES = align16(verify_shared_bytes<KL>()) + CMAX * 8 + BOUNDED_SHARED;
  // STAGE >= 1: the verify step's rows staged in shared memory after the verify step's own (verify.cuh), its
  // chain loading STAGE chunks a step (AHEAD)
  constexpr int STAGED_BYTES =
      STAGE ? align16(verify_shared_bytes<KL>()) + staged_bytes<KL>(STORED_STRIDE * (int)sizeof(T), DIM) : 0;
  constexpr int NEED_LISTS = SLICE_BYTES > VERIFY_BYTES ? SLICE_BYTES : VERIFY_BYTES;
  constexpr int NEED = NEED_LISTS > STAGED_BYTES ? NEED_LISTS : STAGED_BYTES;
  static_assert(SMEM >= NEED, "single_kernel: SMEM is smaller than its shared memory layout");
  static_assert(KL <= RMAX, "single_kernel: a slice must be able to hold a whole list");
  static_assert(STAGE >= 0 && STAGE <= 16, "single_kernel: STAGE is 0 (no staging) or the chain's chunks a step");
  extern __shared__ float4 shared_space[];
  float* query_s = reinterpret_cast<float*>(shared_space);
  float* query_inv = query_s + align16(QROW * 4) / 4;
  float* row_keys = query_s + QUERY_BYTES / 4;
  int* row_positions = reinterpret_cast<int*>(row_keys + RMAX);
  float* sort_keys = reinterpret_cast<float*>(row_positions + RMAX);
  int* sort_positions = reinterpret_cast<int*>(sort_keys + SORT);
  unsigned* histogram = reinterpret_cast<unsigned*>(sort_positions + SORT);
  unsigned long long* slice_scratch = reinterpret_cast<unsigned long long*>(
      reinterpret_cast<char*>(shared_space) + align16(QUERY_BYTES + RMAX * 8 + SORT * 8 + MERGE_SHARED_FIXED));
  __shared__ unsigned last_block;
  __shared__ float slice_bound;       // GT: the bound another slice published, the same in every thread
  require_dynamic_smem(NEED);

  TINYKNN_PHASE(0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < QROW; i += WARPS * 32) query_s[i] = i < dim ? queries[i] : 0.0f;
  __syncthreads();
  if constexpr (Metric::needs_norms) {
    if (warp == 0) {
      const float inv = warp_inverse_norm(query_s, QROW, lane);
      if (lane == 0) query_inv[0] = inv;
    }
    __syncthreads();
  }
  const float query_inv_q = Metric::needs_norms ? query_inv[0] : 1.0f;
  TINYKNN_PHASE(1);

  const long long begin = (long long)blockIdx.x * rows_per_slice;
  const long long end = begin + rows_per_slice < n_data ? begin + rows_per_slice : n_data;
  const int count = (int)(end - begin);     // <= RMAX: the plan sizes the slices
  constexpr int ROWS_PER_STEP = 32 / G;
  const int part = lane % G;
  // UNROLL rows per lane per step, all their loads issued before any arithmetic (more bytes in flight).
  for (int base = (int)begin + warp * ROWS_PER_STEP; base < (int)end; base += UNROLL * WARPS * ROWS_PER_STEP) {
    uint4 raw[UNROLL][CPL];
    float data_inv[UNROLL];
    int at[UNROLL];     // the stored row: the slice's row itself, or where the list names it
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int row = base + u * WARPS * ROWS_PER_STEP + lane / G;
      at[u] = row;
      if constexpr (LISTED) at[u] = row < end ? __ldg(listed_rows + row) : 0;
      load_row_chunks<S, DIM, G, CPL>(scan_rows, at[u], row < end, part, raw[u]);
      data_inv[u] = 1.0f;
      if constexpr (Metric::needs_norms) data_inv[u] = row < end ? __ldg(data_inv_norms + at[u]) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int row = base + u * WARPS * ROWS_PER_STEP + lane / G;
      float even = 0.0f, odd = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        accumulate_chunk<Metric, S>(even, odd, raw[u][i], query_s + (part + i * G) * Layout::PER_CHUNK);
      }
      const float sum = sum_over_lanes<G>(even + odd);
      if (row < end && part == 0) {
        row_keys[row - begin] = to_key<Metric>(Metric::finish(sum, query_inv_q, data_inv[u]));
        row_positions[row - begin] = at[u];
      }
    }
  }
  __syncthreads();
  TINYKNN_PHASE(2);

  // The slice's list: its KL best (padded with (+inf, -1) where the slice has fewer rows), bounded by the
  // minima of its keys in groups of SLICE_GROUP (bounded_gather), else by gather_best's radix select; GT: its
  // keys under another slice's published bound where there is one (see above).
  float* list_keys = out_keys + (long long)blockIdx.x * KL;
  int* list_positions = out_positions + (long long)blockIdx.x * KL;
  if (count > KL) {
    unsigned slice_kth;
    bool under = false;     // GT: listed under another slice's bound
    if constexpr (GT) {
      if (threadIdx.x == 0) slice_bound = read_bound(arrivals + 1);
      __syncthreads();
      if (slice_bound < positive_infinity()) {
        under = bounded_gather<KL, SORT, SLICE_GROUP, true>(row_keys, row_positions, count, slice_scratch, sort_keys,
                                                            sort_positions, slice_kth, slice_bound);
        if (!under) __syncthreads();    // every thread has read the failed attempt's counter
      }
    }
    if (!under && !bounded_gather<KL, SORT, SLICE_GROUP>(row_keys, row_positions, count, slice_scratch, sort_keys,
                                                         sort_positions, slice_kth)) {
      slice_kth = gather_best<KL, SORT>(row_keys, row_positions, count, sort_keys, sort_positions, histogram,
                                        histogram + 258);
    }
    if constexpr (GT) {
      if (threadIdx.x == 0) publish_bound(arrivals + 1, from_ordered_bits(slice_kth));
    }
    for (int j = threadIdx.x; j < KL; j += WARPS * 32) {
      list_keys[j] = sort_keys[j];
      list_positions[j] = sort_positions[j];
    }
  } else {
    for (int j = threadIdx.x; j < KL; j += WARPS * 32) {
      list_keys[j] = j < count ? row_keys[j] : positive_infinity();
      list_positions[j] = j < count ? row_positions[j] : -1;
    }
  }

  TINYKNN_PHASE(3);
  // The last block to arrive verifies (the lists of the others are visible after their fence).
  __threadfence();
  __syncthreads();
  // atomicInc wraps to 0 at the last arrival: the counter is ready for the next launch (graph replays too).
  if (threadIdx.x == 0) last_block = atomicInc(arrivals, gridDim.x - 1) == gridDim.x - 1 ? 1u : 0u;
  __syncthreads();
  TINYKNN_PHASE(4);
  if (!last_block) return;
  __threadfence();
  if constexpr (GT) {
    if (threadIdx.x == 0) atomicExch(arrivals + 1, 0u);   // every slice has published: none yet, for the next launch
  }
  // The lists into shared memory when they fit (gather_best reads them once per radix pass), else in place.
  const int total = gridDim.x * KL;
  const float* keys = out_keys;
  const int* positions = out_positions;
  if (total <= CMAX) {
    float* copied_keys = reinterpret_cast<float*>(shared_space) + align16(verify_shared_bytes<KL>()) / 4;
    int* copied_positions = reinterpret_cast<int*>(copied_keys + CMAX);
    for (int i = threadIdx.x; i < total; i += WARPS * 32) {
      copied_keys[i] = __ldcg(out_keys + i);
      copied_positions[i] = __ldcg(out_positions + i);
    }
    __syncthreads();
    keys = copied_keys;
    positions = copied_positions;
  }
  TINYKNN_PHASE(5);
  unsigned long long* bounded_scratch = reinterpret_cast<unsigned long long*>(
      reinterpret_cast<char*>(shared_space) + align16(verify_shared_bytes<KL>()) + CMAX * 8);
  char* stage_space = STAGE ? reinterpret_cast<char*>(shared_space) + align16(verify_shared_bytes<KL>()) : nullptr;
  verify_query<Metric, Bound, T, K, KL, WARPS, STAGE ? STAGE : 1>(0, keys, positions, gridDim.x, ids, out_distances,
                                                                 out_ids, arrivals, data, queries, STORED_STRIDE, dim,
                                                                 row_stats, status, threshold, shared_space,
                                                                 bounded_scratch, stage_space);
}

}  // namespace tinyknn
