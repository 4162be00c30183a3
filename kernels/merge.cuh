// tinyknn: gathering a query's best candidates from its per-slice lists (used by verify.cuh). Part of the GPU
// kernel templates; see search.cuh for how a search uses them.
#pragma once
#include "topk.cuh"

namespace tinyknn {

// ---- gathering: one block per query ------------------------------------------------------------
// The query's n_lists lists of K hold n_lists * K candidates (empty entries are (+inf, -1)). A radix
// select finds the K-th smallest key and the K winners are gathered (ties at the K-th key taken in any
// order). No serial insertion: the cost is a few passes over the candidates, whatever K.
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

}  // namespace tinyknn
