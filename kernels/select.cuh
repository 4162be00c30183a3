// tinyknn: many exact (float64 key, id) pairs selected and sorted on the device, for k beyond the selection
// kernels and for range search (tinyknn/gpu/ranges.py). Part of the GPU kernel templates; see search.cuh.
//
// k beyond the lists: range_kernel writes every row's contract key (keys[q * n + row]), select_kernel finds
// each query's k best by (key, id) with a radix select over the keys' ordered bits (then over the ids of the
// keys tied with the k-th) and gathers them; segment_sort_kernel sorts them and writes float32 distances and
// ids. Range search: range_kernel appends its hits to one pool (key, id, query) and counts them per query;
// scatter_kernel moves them into per-query segments; segment_sort_kernel sorts each segment and writes it at
// the query's place in the CSR output. No host selection or sorting, and every pass reads the keys once.
#pragma once
#include "verify.cuh"

namespace tinyknn {

// Ordered bits of a contract key (-0.0 counts as +0.0, as the float64 comparison does) and of an id.
TINYKNN_D unsigned long long key_order(double key) { return ordered_bits64(key == 0.0 ? 0.0 : key); }
TINYKNN_D unsigned long long id_order(long long id) { return (unsigned long long)id ^ 0x8000000000000000ull; }

constexpr int SELECT_THREADS = 1024;
constexpr int SORT_THREADS = 512;

// The `rank`-th smallest (1-based, rank <= how many entries are in) 64-bit value of the entries i < n whose
// value(i, bits) returns true, 8 bits a pass from the top (as topk.cuh's block_select). `ties`: how many
// entries equal to it are among the rank smallest; `equal`: how many entries equal it in all. histogram:
// 256 + 2 unsigned ints of shared memory. Every thread of the block calls it; ends with a __syncthreads().
template <class Value>
TINYKNN_D unsigned long long block_select64(long long n, unsigned rank, Value value, unsigned* histogram,
                                            unsigned& ties, unsigned& equal) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long prefix = 0;
  unsigned remaining = rank;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
    __syncthreads();
    const unsigned long long high = shift == 56 ? 0ull : ~0ull << (shift + 8);
    for (long long base = (long long)warp * 32; base < n; base += blockDim.x) {
      const long long i = base + lane;
      unsigned digit = 256;   // no bin: outside the entries, not in, or not under the prefix
      unsigned long long bits;
      if (i < n && value(i, bits) && (bits & high) == prefix) digit = (unsigned)(bits >> shift) & 255u;
      const unsigned peers = __match_any_sync(FULL_WARP, digit);
      if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&histogram[digit], (unsigned)__popc(peers));
    }
    __syncthreads();
    if (warp == 0) find_digit(histogram, remaining);
    __syncthreads();
    prefix |= (unsigned long long)histogram[256] << shift;
    remaining -= histogram[257];
    equal = histogram[histogram[256]];
    __syncthreads();   // every thread has read them before the next pass clears the bins
  }
  ties = remaining;
  return prefix;
}

// grid (n_queries), SELECT_THREADS threads. keys[q * n + row]: query q's contract key of row `row`; ids: the
// rows' ids. The `take` (<= n, <= segment) best of each query by (key, id) go, in no order, to
// out_keys / out_ids [q * segment, q * segment + take); segment_sort_kernel orders them.
__global__ void __launch_bounds__(SELECT_THREADS, 1)
select_kernel(const double* __restrict__ keys, const long long* __restrict__ ids, long long n, int take,
              long long segment, double* __restrict__ out_keys, long long* __restrict__ out_ids) {
  __shared__ unsigned histogram[258];
  __shared__ unsigned taken;
  const double* mine = keys + (long long)blockIdx.x * n;
  unsigned long long kth_key = ~0ull, kth_id = ~0ull;   // take == n: every entry
  if (take < n) {
    unsigned ties, equal;
    kth_key = block_select64(n, (unsigned)take, [&](long long i, unsigned long long& bits) {
      bits = key_order(mine[i]);
      return true;
    }, histogram, ties, equal);
    if (ties < equal) {      // keys tied with the k-th: the smaller ids first
      unsigned id_ties, id_equal;
      kth_id = block_select64(n, ties, [&](long long i, unsigned long long& bits) {
        if (key_order(mine[i]) != kth_key) return false;
        bits = id_order(__ldg(ids + i));
        return true;
      }, histogram, id_ties, id_equal);
    }
  }
  if (threadIdx.x == 0) taken = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double* to_keys = out_keys + (long long)blockIdx.x * segment;
  long long* to_ids = out_ids + (long long)blockIdx.x * segment;
  for (long long base = (long long)warp * 32; base < n; base += blockDim.x) {
    const long long i = base + lane;
    bool in = false;
    double key = 0.0;
    if (i < n) {
      key = mine[i];
      const unsigned long long bits = key_order(key);
      in = bits < kth_key || (bits == kth_key && id_order(__ldg(ids + i)) <= kth_id);
    }
    const unsigned mask = __ballot_sync(FULL_WARP, in);
    unsigned first = 0;
    if (lane == 0 && mask) first = atomicAdd(&taken, (unsigned)__popc(mask));
    first = __shfl_sync(FULL_WARP, first, 0);
    const unsigned slot = first + __popc(mask & ((1u << lane) - 1));
    if (in && slot < (unsigned)take) {
      to_keys[slot] = key;
      to_ids[slot] = __ldg(ids + i);
    }
  }
}

// grid (1 + total / 256 blocks, capped), 256 threads. Pool entry i (i < total) of query queries[i] goes to
// the next free place of that query's segment [segments[q], segments[q + 1]) (cursors zeroed before).
__global__ void __launch_bounds__(256)
scatter_kernel(const double* __restrict__ pool_keys, const long long* __restrict__ pool_ids,
               const int* __restrict__ pool_queries, long long total, const long long* __restrict__ segments,
               unsigned* __restrict__ cursors, double* __restrict__ out_keys, long long* __restrict__ out_ids) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int q = pool_queries[i];
    const long long slot = segments[q] + atomicAdd(cursors + q, 1u);
    out_keys[slot] = pool_keys[i];
    out_ids[slot] = pool_ids[i];
  }
}

// grid (n_segments), SORT_THREADS threads. Segment s is [segments[s], segments[s + 1]) of keys / ids, a power
// of two long, its first counts[s] entries real (the rest are filled here with (+inf, the largest id)). It is
// sorted in place by (key, id), ascending (a bitonic network in global memory: the block's own stores are
// visible to it after each __syncthreads), and its counts[s] entries written from out_offsets[s] on: the
// float32 distance (the key, negated where larger is better) and the id.
__global__ void __launch_bounds__(SORT_THREADS)
segment_sort_kernel(double* keys, long long* ids, const long long* __restrict__ segments,
                    const unsigned* __restrict__ counts, const long long* __restrict__ out_offsets, int larger,
                    float* __restrict__ out_distances, long long* __restrict__ out_ids) {
  const long long start = segments[blockIdx.x];
  const int size = (int)(segments[blockIdx.x + 1] - start), count = (int)counts[blockIdx.x];
  double* k = keys + start;
  long long* id = ids + start;
  for (int i = count + threadIdx.x; i < size; i += blockDim.x) {
    k[i] = __longlong_as_double(0x7ff0000000000000ll);   // +inf
    id[i] = EMPTY_ID;
  }
  __syncthreads();
  for (int width = 2; width <= size; width *= 2) {
    for (int stride = width / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < size / 2; i += blockDim.x) {
        const int low = 2 * i - (i & (stride - 1)), high = low + stride;
        const bool ascending = (low & width) == 0;
        const double a = k[low], b = k[high];
        const long long ia = id[low], ib = id[high];
        const bool out_of_order = a > b || (a == b && ia > ib);
        if (out_of_order == ascending) {
          k[low] = b;
          k[high] = a;
          id[low] = ib;
          id[high] = ia;
        }
      }
      __syncthreads();
    }
  }
  const long long out = out_offsets[blockIdx.x];
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    out_distances[out + i] = (float)(larger ? -k[i] : k[i]);
    out_ids[out + i] = id[i];
  }
}

}  // namespace tinyknn
