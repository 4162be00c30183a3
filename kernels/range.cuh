// tinyknn: range search, every row within a radius of each query, under the exactness contract. Part of the
// GPU kernel templates; see search.cuh and tinyknn/gpu/ranges.py.
#pragma once
#include "verify.cuh"

namespace tinyknn {

// A hit of query q (its contract key; the row's user id at `id`) into the pool: the next of `capacity`
// entries (keys, ids, queries) through *total, which keeps counting past the capacity so the host can tell
// and search again with more room; query_hits (the query's counter) counts it too. range_kernel's and
// range_survivors_kernel's.
TINYKNN_D void pool_hit(double key, const long long* __restrict__ id, int q, long long capacity,
                        double* __restrict__ out_keys, long long* __restrict__ out_ids, int* __restrict__ pool_queries,
                        unsigned* query_hits, unsigned long long* total) {
  const unsigned long long slot = atomicAdd(total, 1ull);
  atomicAdd(query_hits, 1u);
  if (slot < (unsigned long long)capacity) {
    out_keys[slot] = key;
    out_ids[slot] = __ldg(id);
    pool_queries[slot] = q;
  }
}

// grid (row blocks, ceil(n_queries / QB)), 256 threads, QB * row_stride floats of dynamic shared memory.
// Each thread takes rows in turn and computes their float32 keys for the block's QB queries (the scan's
// arithmetic, each row read once per QB queries); a row whose float32 key could still be inside the radius
// (KeyBound::lowest < radius_key) gets its contract float64 distance (exact.cuh), and is a hit when that key
// is strictly inside: key < radius_key (l2: distance < radius; ip, cosine: similarity > radius, key =
// -similarity). Two ways out (select.cuh takes it from there):
// - a pool (pool_queries given): a hit goes into it (pool_hit); counts[q] counts the query's hits;
// - every row (pool_queries null, radius_key +inf): row r's key for query q goes to out_keys[q * n_data + r].
template <class Metric, class T, int QB>
__global__ void __launch_bounds__(256, 1)
range_kernel(const T* __restrict__ data, const float* __restrict__ inv_norms, const long long* __restrict__ ids,
             long long n_data, int row_stride, int dim, const float* __restrict__ queries, int n_queries,
             double radius_key, const unsigned* __restrict__ row_stats, long long capacity, double* __restrict__ out_keys,
             long long* __restrict__ out_ids, int* __restrict__ pool_queries, unsigned* __restrict__ counts,
             unsigned long long* __restrict__ total) {
  extern __shared__ float4 shared_space[];
  float* query_s = reinterpret_cast<float*>(shared_space);   // [QB][row_stride]
  __shared__ double query_qq[QB];
  __shared__ float query_inv[QB];
  const int q0 = blockIdx.y * QB;
  require_dynamic_smem(QB * row_stride * 4);
  for (int i = threadIdx.x; i < QB * row_stride; i += blockDim.x) {
    const int j = i / row_stride;
    query_s[i] = q0 + j < n_queries ? queries[(long long)(q0 + j) * row_stride + i % row_stride] : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < QB) {
    const float* q = query_s + threadIdx.x * row_stride;
    query_qq[threadIdx.x] = exact_squares(q, dim);
    float sum = 0.0f;
    for (int d = 0; d < row_stride; ++d) sum += q[d] * q[d];
    query_inv[threadIdx.x] = inverse_norm(sum);
  }
  __syncthreads();
  const double max_xx = stats_max_xx(row_stats), min_xx = stats_min_xx(row_stats);
  constexpr int N = Chunk<T>::N;
  const int chunks = row_stride / N;
  for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < n_data;
       row += (long long)gridDim.x * blockDim.x) {
    const uint4* stored = reinterpret_cast<const uint4*>(data + row * row_stride);
    float sums[QB];
#pragma unroll
    for (int j = 0; j < QB; ++j) sums[j] = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      float x[N];
      Chunk<T>::unpack(__ldg(stored + c), x);
#pragma unroll
      for (int j = 0; j < QB; ++j) {
#pragma unroll
        for (int e = 0; e < N; ++e) sums[j] = Metric::accumulate(sums[j], query_s[j * row_stride + c * N + e], x[e]);
      }
    }
    const float inv_x = Metric::needs_norms ? __ldg(inv_norms + row) : 0.0f;
#pragma unroll
    for (int j = 0; j < QB; ++j) {
      if (q0 + j >= n_queries) continue;
      const float key32 = to_key<Metric>(Metric::finish(sums[j], query_inv[j], inv_x));
      if (pool_queries != nullptr &&
          !(KeyBound<Metric>::lowest(key32, row_stride, query_qq[j], max_xx, min_xx) < radius_key)) continue;
      const float* query = queries + (long long)(q0 + j) * row_stride;
      const double key = exact_key<Metric>(exact_distance_by_chunks<Metric>(query, data + row * row_stride, dim,
                                                                            query_qq[j]));
      if (pool_queries == nullptr) {
        out_keys[(long long)(q0 + j) * n_data + row] = key;
      } else if (key < radius_key) {
        pool_hit(key, ids + row, q0 + j, capacity, out_keys, out_ids, pool_queries, counts + q0 + j, total);
      }
    }
  }
}

}  // namespace tinyknn
