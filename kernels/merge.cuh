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

// ---- gathering by the lists' minima (the single-query kernel's last block) -----------------------------
// bounded_gather's shared memory: each list's minimum (BOUNDED_MAX_LISTS at most), the entries under the
// bound (BOUNDED_MAX_FOUND at most) as packed (key, position), and two counters.
constexpr int BOUNDED_MAX_LISTS = 1024, BOUNDED_MAX_FOUND = 512;
// Up to this many lists T is found by ranking each list's minimum against the others (n^2 shared loads, one
// barrier; BOUNDED_MAX_FOUND slots hold them), beyond it by the radix select (four passes, a dozen barriers).
// H200, one-query kernel: the radix select everywhere took its last block's 521 lists (1M x 768) 17 us faster,
// but each slice's list (40-160 minima) and 100k x 128's 131 lists 1.3-3.6 us slower a search
// (bench/NOTES_SINGLE.md).
constexpr int BOUNDED_RANK_LISTS = 256;
static_assert(BOUNDED_RANK_LISTS % 4 == 0 && BOUNDED_RANK_LISTS <= BOUNDED_MAX_FOUND, "the ranked minima fit `found`");
constexpr int BOUNDED_SHARED = 4 * BOUNDED_MAX_LISTS + 8 * BOUNDED_MAX_FOUND + 16;
// A slice's keys in groups of this many for its own list (single.cuh): 768 keys give 64 minima, and a slice
// of at least KL x SLICE_GROUP keys has enough of them.
constexpr int SLICE_GROUP = 12;

// The K best of `total` entries seen as lists of LEN (the last one short), as gather_best leaves them (slots
// [0, K) of sort_keys / sort_positions, here ascending by (key, position); [K, SORT) get (+inf, -1); the
// K-th key's ordered bits in kth), without its four radix passes over every entry: T = the K-th smallest of
// the lists' minima is an upper bound of the K-th smallest key (those K minima are K entries <= T), so the K
// best are among the entries <= T, which are collected and each ranked by (key, position) against the others
// (distinct: positions are, and T finite keeps the padding (+inf, -1) out). The same set as gather_best's up to
// ties at the K-th key (taken here by position). False, with nothing written, where it cannot: more lists
// than BOUNDED_MAX_LISTS or fewer than K, T = +inf, more than BOUNDED_MAX_FOUND entries <= T (then
// gather_best). Every thread of the block calls it; ends with a __syncthreads().
// GIVEN: T is `given` (finite, the same in every thread), an upper bound found elsewhere that need not bound
// these entries' K-th key: no minima, and where fewer than K entries are <= T, the slots after them get
// (+inf, -1) too (the single-query kernel's slices under a bound another slice published; single.cuh).
template <int K, int SORT, int LEN, bool GIVEN = false>
TINYKNN_D bool bounded_gather(const float* keys, const int* positions, int total, unsigned long long* scratch,
                              float* sort_keys, int* sort_positions, unsigned& kth, float given = 0.0f) {
  const int n_lists = (total + LEN - 1) / LEN;
  if (!GIVEN && (n_lists > BOUNDED_MAX_LISTS || n_lists < K)) return false;
  const int threads = blockDim.x;
  float* minima = reinterpret_cast<float*>(scratch);
  unsigned long long* found = scratch + BOUNDED_MAX_LISTS / 2;
  unsigned* counters = reinterpret_cast<unsigned*>(found + BOUNDED_MAX_FOUND);   // [0] found, [1] T's bits
  if (threadIdx.x == 0) counters[0] = 0;
  float bound = given;
  if constexpr (GIVEN) {
    __syncthreads();      // the counter zeroed before any thread counts
  } else {
    for (int l = threadIdx.x; l < n_lists; l += threads) {
      float least = positive_infinity();
#pragma unroll
      for (int j = 0; j < LEN; ++j) least = l * LEN + j < total ? fminf(least, keys[l * LEN + j]) : least;
      minima[l] = least;
    }
    __syncthreads();
    // T: the K-th smallest minimum. Few lists: each minimum ranked against all the others (ties by list); many:
    // topk.cuh's radix select (its histogram in `found`), the same value (up to the sign of a zero, which no
    // comparison below sees).
    if (n_lists <= BOUNDED_RANK_LISTS) {
      // each minimum as one integer, (ordered bits, list), so that a rank is one comparison an entry (in `found`,
      // unused until T is known), the others counted four at a time into independent sums
      for (int l = threadIdx.x; l < (n_lists + 3) / 4 * 4; l += threads) {
        found[l] = l < n_lists ? ((unsigned long long)ordered_bits(minima[l]) << 32) | (unsigned)l : ~0ull;
      }
      __syncthreads();
      for (int l = threadIdx.x; l < n_lists; l += threads) {
        const unsigned long long mine = found[l];
        int r0 = 0, r1 = 0, r2 = 0, r3 = 0;
        for (int o = 0; o < n_lists; o += 4) {
          r0 += found[o] < mine ? 1 : 0;
          r1 += found[o + 1] < mine ? 1 : 0;
          r2 += found[o + 2] < mine ? 1 : 0;
          r3 += found[o + 3] < mine ? 1 : 0;
        }
        if (r0 + r1 + r2 + r3 == K - 1) counters[1] = (unsigned)(mine >> 32);
      }
      __syncthreads();
      bound = from_ordered_bits(counters[1]);
    } else {
      int ties;
      bound = from_ordered_bits(block_select(minima, n_lists, K, reinterpret_cast<unsigned*>(found), ties));
    }
  }
  if (!(bound < positive_infinity())) return false;
  for (int l = threadIdx.x; l < n_lists; l += threads) {
#pragma unroll
    for (int j = 0; j < LEN; ++j) {
      const int at = l * LEN + j;
      const float key = at < total ? keys[at] : positive_infinity();
      if (key <= bound) {
        const unsigned slot = atomicAdd(counters, 1u);
        if (slot < (unsigned)BOUNDED_MAX_FOUND) {
          found[slot] = ((unsigned long long)ordered_bits(key) << 32) | (unsigned)positions[at];
        }
      }
    }
  }
  __syncthreads();
  const int n_found = (int)counters[0];
  if (n_found > BOUNDED_MAX_FOUND) return false;
  for (int i = threadIdx.x; i < n_found; i += threads) {      // at least K unless GIVEN: the K minima
    const unsigned long long mine = found[i];
    int rank = 0;
    for (int o = 0; o < n_found; ++o) rank += found[o] < mine ? 1 : 0;
    if (rank < K) {
      sort_keys[rank] = from_ordered_bits((unsigned)(mine >> 32));
      sort_positions[rank] = (int)(unsigned)mine;
    }
  }
  for (int i = (GIVEN && n_found < K ? n_found : K) + threadIdx.x; i < SORT; i += threads) {
    sort_keys[i] = positive_infinity();
    sort_positions[i] = -1;
  }
  __syncthreads();
  kth = ordered_bits(sort_keys[K - 1]);
  return true;
}

}  // namespace tinyknn
