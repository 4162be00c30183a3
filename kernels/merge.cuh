// tinyknn: the merge kernel (slices of a query -> its k best, sorted). Part of the GPU kernel templates; see search.cuh for how a search
// uses them and tinyknn/jit/render.py for the template arguments.
#pragma once
#include "topk.cuh"

namespace tinyknn {

// ---- merge: one block per query -------------------------------------------------------------
// The query's n_lists lists of K hold n_lists * K candidates (empty entries are (+inf, -1)). A radix
// select finds the K-th smallest key, the K winners are gathered (ties at the K-th key taken in any
// order), sorted nearest first, and written as distances and user ids (ids[position]); empty
// entries become (-1, +inf for l2 / -inf for ip and cosine). No serial insertion: the cost is a few
// passes over the candidates, whatever K.
__host__ __device__ constexpr int next_pow2(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// The K best (key, position) pairs of `total` candidates go to slots [0, K) of sort_keys /
// sort_positions (slots [K, SORT) get (+inf, -1)); returns the ordered bits of the K-th best key.
// Keys below it fill [0, K - ties), keys equal to it [K - ties, K) while room lasts. Every thread of
// the block calls it; ends with a __syncthreads().
template <int K, int SORT>
TINYKNN_D unsigned gather_best(const float* keys, const int* positions, long long total, float* sort_keys,
                               int* sort_positions, unsigned* histogram, unsigned* taken) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, threads = blockDim.x;
  int ties;
  const unsigned kth = block_select(keys, total, K, histogram, ties);
  if (threadIdx.x < 2) taken[threadIdx.x] = 0;
  for (int i = K + threadIdx.x; i < SORT; i += threads) {
    sort_keys[i] = positive_infinity();
    sort_positions[i] = -1;
  }
  __syncthreads();
  const unsigned lanes_below = (1u << lane) - 1;
  for (long long base = (long long)warp * 32; base < total; base += threads) {
    const long long i = base + lane;
    const unsigned u = i < total ? ordered_bits(keys[i]) : 0xffffffffu;
    const bool below = i < total && u < kth, equal = i < total && u == kth;
    const unsigned below_mask = __ballot_sync(FULL_WARP, below), equal_mask = __ballot_sync(FULL_WARP, equal);
    unsigned below_base = 0, equal_base = 0;
    if (lane == 0) {
      if (below_mask) below_base = atomicAdd(&taken[0], (unsigned)__popc(below_mask));
      if (equal_mask) equal_base = atomicAdd(&taken[1], (unsigned)__popc(equal_mask));
    }
    below_base = __shfl_sync(FULL_WARP, below_base, 0);
    equal_base = __shfl_sync(FULL_WARP, equal_base, 0);
    int slot = -1;
    if (below) slot = (int)(below_base + __popc(below_mask & lanes_below));
    if (equal) {
      const int e = (int)(equal_base + __popc(equal_mask & lanes_below));
      if (e < ties) slot = K - ties + e;
    }
    if (slot >= 0) {
      sort_keys[slot] = keys[i];
      sort_positions[slot] = positions[i];
    }
  }
  __syncthreads();
  return kth;
}

constexpr int MERGE_SHARED_FIXED = (256 + 4) * 4;   // radix histogram (256 + 2) and the gather counters (2)

// Both merges end by zeroing the query's cross-slice bound (see read_bound), which the selection
// kernel before them is done with: the next search on the stream starts unpruned without a memset.
template <class Metric, int K, int WARPS, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1)
merge_kernel(const float* __restrict__ keys, const int* __restrict__ positions, int n_lists,
             const long long* __restrict__ ids, float* __restrict__ out_distances, long long* __restrict__ out_ids,
             unsigned* __restrict__ bounds) {
  constexpr int SORT = next_pow2(K < 2 ? 2 : K);
  constexpr int NEED = SORT * 8 + MERGE_SHARED_FIXED;
  static_assert(SMEM >= NEED, "merge_kernel: SMEM is smaller than its shared memory layout");
  extern __shared__ float4 shared_space[];
  float* sort_keys = reinterpret_cast<float*>(shared_space);
  int* sort_positions = reinterpret_cast<int*>(sort_keys + SORT);
  unsigned* histogram = reinterpret_cast<unsigned*>(sort_positions + SORT);   // 256 bins + 2 results
  require_dynamic_smem(NEED);

  const long long q = blockIdx.x;
  const long long total = (long long)n_lists * K;
  gather_best<K, SORT>(keys + q * total, positions + q * total, total, sort_keys, sort_positions, histogram,
                       histogram + 258);
  block_sort(sort_keys, sort_positions, SORT);
  for (int j = threadIdx.x; j < K; j += WARPS * 32) {
    const int position = sort_positions[j];
    out_distances[q * K + j] = from_key<Metric>(sort_keys[j]);
    out_ids[q * K + j] = position >= 0 ? ids[position] : -1;
  }
  if (threadIdx.x == 0) bounds[q] = 0u;
}

// ---- rescore: l2 after the L2Expanded filter, one block per query ----------------------------
// The KL best candidates by filter key (KL > K) get their distances recomputed as sums of squared
// differences, the K nearest are written as merge_kernel writes them, and status[q] says whether
// the answer is proven: 0 when no row outside the KL can be nearer than the K-th distance, else 1
// (the searcher then searches that query again with L2).
//
// The proof. For a query q and a row x (n = row_stride terms, u = 2^-24), the filter's distance
// |q|^2 + key(x) is within E = 2.5 (n + 4) u (|q|^2 + max |x|^2) + (6n + 16) eta of the true one,
// eta = 2^-150 (half the smallest subnormal: the absolute error an operation can add when its result
// underflows; NVRTC keeps subnormals). The dot product's relative part is at most
// gamma_n |q||x| <= gamma_n (|q|^2 + |x|^2) / 2, both squared norms are within gamma_n of their own,
// two more roundings add 2u (|q|^2 + |x|^2) (2.5 (n + 4) u covers 2 gamma_n + 4u for every n this
// library allows), and each of the 3n + 4 operations may add eta, doubled for the dot product. Every
// row outside the KL has a key at least the KL-th key A, so a true distance at least A + |q|^2 - E,
// and a computed one at least that times (1 - 1.1 (n + 4) u) minus (2n + 4) eta (a float32 sum of n
// squared differences). When that is not below the K-th computed distance, no such row could have
// been returned instead.
TINYKNN_D bool filter_proven(float kl_key, float query_squared_norm, float max_row_squared_norm, float kth_distance,
                             int n) {
  if (!(kl_key < positive_infinity())) return true;   // fewer than KL rows: every row was a candidate
  const double u = 5.9604644775390625e-08, eta = 7.006492321624085e-46;   // 2^-24, 2^-150
  const double error = 2.5 * (n + 4) * u * ((double)query_squared_norm + (double)max_row_squared_norm) +
                       (6.0 * n + 16.0) * eta;
  const double lower = ((double)kl_key + (double)query_squared_norm - error) * (1.0 - 1.1 * (n + 4) * u) -
                       (2.0 * n + 4.0) * eta;
  return lower >= (double)kth_distance;
}

template <class T, int K, int KL, int WARPS, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1)
rescore_kernel(const float* __restrict__ keys, const int* __restrict__ positions, int n_lists,
               const long long* __restrict__ ids, float* __restrict__ out_distances, long long* __restrict__ out_ids,
               unsigned* __restrict__ bounds, const T* __restrict__ data, const float* __restrict__ queries, int row_stride,
               const unsigned* __restrict__ norm_max, int* __restrict__ status) {
  static_assert(K < KL, "rescore_kernel: the filter must keep more candidates than it returns");
  constexpr int SORT = next_pow2(KL);
  constexpr int NEED = SORT * 8 + MERGE_SHARED_FIXED + 16;
  static_assert(SMEM >= NEED, "rescore_kernel: SMEM is smaller than its shared memory layout");
  extern __shared__ float4 shared_space[];
  float* sort_keys = reinterpret_cast<float*>(shared_space);
  int* sort_positions = reinterpret_cast<int*>(sort_keys + SORT);
  unsigned* histogram = reinterpret_cast<unsigned*>(sort_positions + SORT);
  float* query_squared_norm = reinterpret_cast<float*>(histogram + 260);
  require_dynamic_smem(NEED);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long q = blockIdx.x;
  const long long total = (long long)n_lists * KL;
  const unsigned kl_bits = gather_best<KL, SORT>(keys + q * total, positions + q * total, total, sort_keys,
                                                 sort_positions, histogram, histogram + 258);
  const float* query = queries + q * row_stride;
  for (int i = warp; i < KL; i += WARPS) {            // one warp per candidate
    const int position = sort_positions[i];
    float sum = positive_infinity();
    if (position >= 0) {
      const T* row = data + (long long)position * row_stride;
      sum = 0.0f;
      for (int e = lane; e < row_stride; e += 32) {
        const float d = query[e] - to_float(row[e]);
        sum += d * d;
      }
      sum = sum_over_lanes<32>(sum);
    }
    if (lane == 0) sort_keys[i] = sum;
  }
  if (warp == WARPS - 1) {
    float sum = 0.0f;
    for (int e = lane; e < row_stride; e += 32) sum += query[e] * query[e];
    sum = sum_over_lanes<32>(sum);
    if (lane == 0) query_squared_norm[0] = sum;
  }
  __syncthreads();
  block_sort(sort_keys, sort_positions, SORT);
  for (int j = threadIdx.x; j < K; j += WARPS * 32) {
    const int position = sort_positions[j];
    out_distances[q * K + j] = sort_keys[j];
    out_ids[q * K + j] = position >= 0 ? ids[position] : -1;
  }
  if (threadIdx.x == 0) {
    const bool proven = filter_proven(from_ordered_bits(kl_bits), query_squared_norm[0],
                                      __uint_as_float(__ldg(norm_max)), sort_keys[K - 1], row_stride);
    status[q] = proven ? 0 : 1;
    bounds[q] = 0u;
  }
}

}  // namespace tinyknn
