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

template <class Metric, int K, int WARPS, int SMEM>
__global__ void __launch_bounds__(WARPS * 32, 1)
merge_kernel(const float* __restrict__ keys, const int* __restrict__ positions, int n_lists,
             const long long* __restrict__ ids, float* __restrict__ out_distances, long long* __restrict__ out_ids) {
  constexpr int THREADS = WARPS * 32;
  constexpr int SORT = next_pow2(K < 2 ? 2 : K);
  constexpr int NEED = SORT * 8 + (256 + 4) * 4;
  static_assert(SMEM >= NEED, "merge_kernel: SMEM is smaller than its shared memory layout");
  extern __shared__ float4 shared_space[];
  float* sort_keys = reinterpret_cast<float*>(shared_space);
  int* sort_positions = reinterpret_cast<int*>(sort_keys + SORT);
  unsigned* histogram = reinterpret_cast<unsigned*>(sort_positions + SORT);   // 256 bins + 2 results
  unsigned* taken = histogram + 258;                                           // [0] below, [1] ties
  require_dynamic_smem(NEED);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long q = blockIdx.x;
  const long long total = (long long)n_lists * K;
  const float* my_keys = keys + q * total;
  const int* my_positions = positions + q * total;

  int ties;
  const unsigned kth = block_select(my_keys, total, K, histogram, ties);
  if (threadIdx.x < 2) taken[threadIdx.x] = 0;
  for (int i = K + threadIdx.x; i < SORT; i += THREADS) {
    sort_keys[i] = positive_infinity();
    sort_positions[i] = -1;
  }
  __syncthreads();
  // Gather: keys below the K-th go to [0, K - ties), keys equal to it to [K - ties, K) while room lasts.
  const unsigned lanes_below = (1u << lane) - 1;
  for (long long base = (long long)warp * 32; base < total; base += THREADS) {
    const long long i = base + lane;
    const unsigned u = i < total ? ordered_bits(my_keys[i]) : 0xffffffffu;
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
      sort_keys[slot] = my_keys[i];
      sort_positions[slot] = my_positions[i];
    }
  }
  __syncthreads();
  block_sort(sort_keys, sort_positions, SORT);
  for (int j = threadIdx.x; j < K; j += THREADS) {
    const int position = sort_positions[j];
    out_distances[q * K + j] = from_key<Metric>(sort_keys[j]);
    out_ids[q * K + j] = position >= 0 ? ids[position] : -1;
  }
}

}  // namespace tinyknn
